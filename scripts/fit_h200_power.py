"""Fit the H200 power model (hardware_models/power.py) to the maintainers' measurements; write the preset.

Re-run from the repository root::

    python scripts/fit_h200_power.py            # writes hardware_models/presets/power/h200-sxm-141gb.yaml
    python scripts/fit_h200_power.py --dry-run  # prints only

What is fitted, from what (everything else is predicted, never fitted):

* ``static_w`` and ``clock_w`` from two idle points: deep idle at 345 MHz (env.txt, nvidia-smi -q
  "Average Power Draw 78.43 W", P0, SM 345 MHz) and idle with clocks at 1980 MHz (slope of NVML's
  total-energy counter over the idle stretch before the gpt_184m_b4 run in nvml_samples.csv.gz;
  the energy counter, not power_mw, which lags over a ~1 s window).
* ``sm_w`` (SM dynamic power of a compute-bound kernel at 1980 MHz) by least squares on the
  relative errors of energy per step and average power of the **gpt_184m_b16** run only.
* ``sm_floor`` (0.3), ``mem_w / sm_w`` (0.45), ``copy_w`` (20 W) and the V-f curve (V/Vmax = 0.7 below
  900 MHz, linear to 1 at 1980 MHz) are assumptions, fixed before looking at the other runs; the
  script prints how b4/b8 predictions move with them.

Predicted (not fitted) and printed with errors: gpt_184m_b4 and b8 energy/power, the dataloader
run's gpu_only_step (b8), and the offload run's average power (from measured part times, since the
offload policy is not part of this script).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy.optimize import minimize_scalar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT / "tests" / "data" / "h200"
OUT = ROOT / "hardware_models" / "presets" / "power" / "h200-sxm-141gb.yaml"
SCEN = ROOT / "scenarios" / "h200"

ASSUMED = {"sm_floor": 0.3, "mem_ratio": 0.45, "copy_w": 20.0, "v_min_rel": 0.7, "voltage_knee_mhz": 900.0,
           "host_idle_w_per_core": 1.5, "host_busy_w_per_core": 4.0}
DEEP_IDLE_W = 78.43     # env.txt: Average Power Draw while idle
DEEP_IDLE_MHZ = 345.0   # env.txt: Clocks SM 345 MHz at that moment
F_MAX, FM_MAX = 1980.0, 3201.0


def idle_at_max_clock_w() -> tuple[float, str]:
    """Idle power at 1980 MHz from the energy counter before the first run's load."""
    with gzip.open(DATA / "nvml_samples.csv.gz", "rt") as fh:
        df = pd.read_csv(fh)
    first = df[df.config == df.config.iloc[0]]
    idle = first[(first.util_gpu_pct == 0) & (first.sm_mhz == F_MAX)]
    # stop at the first sample with load
    loaded = first.index[first.util_gpu_pct > 0]
    if len(loaded):
        idle = idle[idle.index < loaded[0]]
    steps = idle[idle.energy_mj.diff() > 0]  # the counter ticks every ~100 ms
    t, e = steps.unix_s.to_numpy(), steps.energy_mj.to_numpy() / 1e3
    slope = float(np.polyfit(t, e, 1)[0])
    return slope, (f"nvml_samples.csv.gz config {first.config.iloc[0]}: energy counter slope over "
                   f"{t[-1] - t[0]:.2f} s of util 0 at {F_MAX:.0f} MHz before the load")


def model_dict(static_w: float, clock_w: float, sm_w: float, a=ASSUMED) -> dict:
    static_w, clock_w, sm_w = float(static_w), float(clock_w), float(sm_w)
    return {
        "name": "NVIDIA H200 SXM 141GB", "max_sm_clock_mhz": F_MAX, "max_mem_clock_mhz": FM_MAX,
        "static_w": static_w, "clock_w": clock_w, "sm_w": sm_w, "sm_floor": a["sm_floor"],
        "mem_w": float(a["mem_ratio"]) * sm_w, "copy_w": a["copy_w"], "v_min_rel": a["v_min_rel"],
        "voltage_knee_mhz": a["voltage_knee_mhz"], "host_idle_w_per_core": a["host_idle_w_per_core"],
        "host_busy_w_per_core": a["host_busy_w_per_core"],
    }


def simulate(scenario: str, model: dict, extra: list[str] | None = None) -> dict:
    from simulator import load_scenario, run_scenario

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(model, fh)
    cfg = load_scenario(SCEN / f"{scenario}.yaml", overrides=[
        "dvfs.kind=power_cap", "dvfs.power_limit_w=700", f"dvfs.power_model={fh.name}", *(extra or [])])
    s = run_scenario(cfg).summary
    Path(fh.name).unlink()
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    meas = json.loads((DATA / "measurements.json").read_text())

    from hardware_models.power import GpuPowerModel

    idle_max, idle_src = idle_at_max_clock_w()
    probe = GpuPowerModel(name="probe", max_sm_clock_mhz=F_MAX, max_mem_clock_mhz=FM_MAX, static_w=0, clock_w=1,
                          sm_w=0, v_min_rel=ASSUMED["v_min_rel"], voltage_knee_mhz=ASSUMED["voltage_knee_mhz"])
    phi_lo = probe.clock_factor(DEEP_IDLE_MHZ)
    clock_w = (idle_max - DEEP_IDLE_W) / (1.0 - phi_lo)
    static_w = idle_max - clock_w
    print(f"idle: {DEEP_IDLE_W:.1f} W at {DEEP_IDLE_MHZ:.0f} MHz (env.txt), {idle_max:.1f} W at {F_MAX:.0f} MHz "
          f"({idle_src}) -> static_w {static_w:.1f} W, clock_w {clock_w:.1f} W")

    m16 = meas["train"]["gpt_184m_b16"]

    def loss(sm_w: float) -> float:
        s = simulate("gpt_184m_b16", model_dict(static_w, clock_w, sm_w))
        return ((s["energy_j_per_step"] / m16["energy_j_per_step"] - 1) ** 2
                + (s["avg_power_w"] / m16["avg_power_w"] - 1) ** 2)

    res = minimize_scalar(loss, bounds=(50.0, 1200.0), method="bounded", options={"xatol": 0.5})
    sm_w = float(res.x)
    model = model_dict(static_w, clock_w, sm_w)
    print(f"fitted sm_w = {sm_w:.1f} W on gpt_184m_b16 (rms relative error {np.sqrt(res.fun / 2):.3f})")

    rows = []

    def row(name, role, metric, measured, predicted):
        err = predicted / measured - 1
        rows.append({"case": name, "role": role, "metric": metric, "measured": round(measured, 3),
                     "predicted": round(predicted, 3), "error": f"{100 * err:+.1f}%"})
        return err

    for b in ("gpt_184m_b4", "gpt_184m_b8", "gpt_184m_b16"):
        s, m = simulate(b, model), meas["train"][b]
        role = "fitted" if b == "gpt_184m_b16" else "predicted"
        row(b, role, "energy_j_per_step", m["energy_j_per_step"], s["energy_j_per_step"])
        row(b, role, "avg_power_w", m["avg_power_w"], s["avg_power_w"])
        row(b, role, "step_time_s (wall_s/steps)", m["wall_s"] / m["steps"], s["step_time_s"])
    g = meas["dataloader"]["setup"]["gpu_only_step"]
    s8 = simulate("gpt_184m_b8", model)
    row("dataloader gpu_only_step (b8)", "predicted", "energy_j_per_step", g["energy_j_per_step"], s8["energy_j_per_step"])
    row("dataloader gpu_only_step (b8)", "predicted", "avg_power_w", g["avg_power_w"], s8["avg_power_w"])
    # Offload run: GPU busy for the measured fwd+bwd and h2d parts, idle (clocks up) the rest of the step.
    off = meas["offload"]["gpt_184m_b16_offload_overlap"]
    s16 = simulate("gpt_184m_b16", model)
    fb_w = s16["avg_power_w"]
    parts = off["part_median_s"]
    step = off["wall_s"] / off["steps"]
    busy = parts["gpu_fwd_bwd"]
    copy = parts["h2d"]
    e = busy * fb_w + copy * (idle_max + model["copy_w"]) + max(step - busy - copy, 0.0) * idle_max
    row("gpt_184m_b16_offload_overlap", "predicted (measured part times)", "avg_power_w", off["avg_power_w"], e / step)

    table = pd.DataFrame(rows)
    print(table.to_string(index=False))

    print("\nsensitivity of predicted b4/b8 energy error to the assumptions (not used to choose them):")
    for floor in (0.2, 0.3, 0.5):
        for ratio in (0.3, 0.45, 0.6):
            a = {**ASSUMED, "sm_floor": floor, "mem_ratio": ratio}
            r = minimize_scalar(lambda x: (simulate("gpt_184m_b16", model_dict(static_w, clock_w, x, a))["avg_power_w"]
                                           / m16["avg_power_w"] - 1) ** 2,
                                bounds=(50, 1500), method="bounded", options={"xatol": 2})
            md = model_dict(static_w, clock_w, float(r.x), a)
            errs = [simulate(b, md)["energy_j_per_step"] / meas["train"][b]["energy_j_per_step"] - 1
                    for b in ("gpt_184m_b4", "gpt_184m_b8")]
            print(f"  sm_floor {floor:.2f} mem/sm {ratio:.2f}: sm_w {r.x:6.1f}  b4 {100 * errs[0]:+.1f}%  "
                  f"b8 {100 * errs[1]:+.1f}%")

    preset = {
        **{k: round(v, 3) if isinstance(v, float) else v for k, v in model.items()},
        "provenance": {
            "generator": "scripts/fit_h200_power.py",
            "data": "tests/data/h200/measurements.json, env.txt, nvml_samples.csv.gz (maintainers' H200 measurements, 2026-11-29)",
            "fitted": {
                "static_w, clock_w": f"two idle points: {DEEP_IDLE_W} W at {DEEP_IDLE_MHZ:.0f} MHz (env.txt) and "
                                     f"{idle_max:.2f} W at {F_MAX:.0f} MHz ({idle_src})",
                "sm_w": "least squares on energy_j_per_step and avg_power_w of train.gpt_184m_b16 only",
            },
            "assumed": {
                "sm_floor": "share of SM power drawn by any resident kernel (assumed 0.3)",
                "mem_w": "0.45 x sm_w (assumed ratio of a fully memory-bound kernel's memory-system power)",
                "copy_w": "20 W per host<->device copy in flight (assumed)",
                "v_min_rel, voltage_knee_mhz": "V-f curve: V/Vmax 0.7 at and below 900 MHz, linear to 1 at 1980 MHz (assumed)",
                "host_*_w_per_core": "host estimate: ~5.5 W per core at TDP for a 64-core 350 W Xeon, split 1.5 W idle + 4 W busy (assumed)",
            },
            "validation": rows,
        },
    }
    if args.dry_run:
        print(yaml.safe_dump(preset, sort_keys=False)[:800])
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    header = ("# H200 SXM power model (hardware_models/power.py). GENERATED by scripts/fit_h200_power.py; do not edit\n"
              "# by hand, re-run the script. Fitted: idle terms (two idle points) and sm_w (gpt_184m_b16 only).\n")
    OUT.write_text(header + yaml.safe_dump(preset, sort_keys=False))
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
