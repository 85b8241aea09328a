"""Derive the A100 PCIe 80GB power model (hardware_models/power.py) from public A100 data; write the preset.

Re-run from the repository root::

    python scripts/fit_a100_power.py            # writes hardware_models/presets/power/a100-pcie-80gb.yaml
    python scripts/fit_a100_power.py --dry-run  # prints only

What comes from where (nothing is fitted to the Perseus GPT-3 XL validation case, the A100 PCIe run we report):

* **The V-f curve** (``v_min_rel``, ``voltage_knee_mhz``) is fitted to the *shape* of power against locked SM
  clock in the Perseus artifact's A100 **SXM** stage profiles (GPT-3 175B and BLOOM 176B, bf16, forward and
  backward, 1410..855 MHz; tests/data/a100/perseus_a100_sxm_stage_profiles.csv, ml-energy/zeus @38cb3f9
  sosp24_data/emulation/stage_profile/). Per series: the time is fitted as ``a / f + b`` on the clocks at or
  below 1200 MHz; the clocks above the first one whose measured time exceeds that fit by more than
  ``THROTTLED_TOL`` are dropped (the GPU did not hold the requested clock there: at 1410 MHz the stages run
  4.5% slower than ``a / f + b``, a power-throttled top). On the rest, ``P(f) = E / T`` is fitted as
  ``P_s + D * phi(f)`` with ``phi`` the model's clock factor (``GpuPowerModel.clock_factor``), least squares
  on relative errors; ``P_s``/``D`` absorb the unknown number of GPUs the artifact sums over (the stage
  draws ~475 W at 1410 MHz, more than one 400 W A100 SXM), so only ``v_min_rel`` and the knee are kept (the
  median of the four series). The same GA100 die and clocks are in both boards, so the shape carries over.
* **The SM dynamic power scale** (``sm_w``) is the generic rule (``power.generic_power_model``: a fully
  compute-bound kernel at the maximum clock draws 95% of TDP) applied to the **SXM4** board's 400 W, not to
  the PCIe board's 300 W: the PCIe A100 is the same GA100 with the same 108 SMs and 1410 MHz boost (NVIDIA
  A100 datasheet; AnandTech 2020-06-22 "NVIDIA Announces PCIe A100": "the same peak performance as the SXM4
  A100, however with a lower 250 Watt TDP, real-world performance won't be quite as high"), so at the same
  clock and voltage it switches the same capacitance; its lower TDP is a *limit* the firmware enforces by
  lowering the clock. NVIDIA's launch material quotes the 250 W PCIe card at 90% of the SXM4's performance
  (hardwaretimes.com, 2020-06-22): the script prints the model's figure for that (a check, not a fit).
* **Idle** (``static_w``, ``clock_w``): the spec's ``idle_power_w`` (40 W, an ``nvidia-smi`` reading of an idle
  A100 80GB PCIe at P0: simonjj/simple-gpu-test@4609eed README.md) split 70/30 as ``generic_power_model`` does; ``mem_w = 0.45 * sm_w``, ``sm_floor = 0.3``,
  ``copy_w = 20`` W: the generic/H200 assumptions (scripts/fit_h200_power.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy.optimize import least_squares

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hardware_models import presets  # noqa: E402
from hardware_models.power import GpuPowerModel  # noqa: E402

DATA = ROOT / "tests" / "data" / "a100" / "perseus_a100_sxm_stage_profiles.csv"
OUT = ROOT / "hardware_models" / "presets" / "power" / "a100-pcie-80gb.yaml"
PCIE, SXM = "a100-pcie-80gb", "a100-sxm4-80gb"

#: clocks at or below this are taken to hold (power well under the stage's throttled top) for the time fit, MHz
TIME_FIT_MAX_MHZ = 1200.0
#: a clock whose measured time exceeds ``a / f + b`` by more than this did not hold (power-throttled)
THROTTLED_TOL = 0.01
ASSUMED = {"compute_share_of_tdp": 0.95, "static_share_of_idle": 0.7, "mem_ratio": 0.45, "sm_floor": 0.3,
           "copy_w": 20.0, "host_idle_w_per_core": 1.5, "host_busy_w_per_core": 4.0}


def held_clocks(f: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Mask of the clocks the GPU held: at or below the first whose time exceeds the low-clock ``a/f + b`` fit.

    Args:
        f, t: Clocks (MHz) and times (s) of one series, any order, same length.
    """
    low = f <= TIME_FIT_MAX_MHZ
    (a, b), *_ = np.linalg.lstsq(np.c_[1.0 / f[low], np.ones(low.sum())], t[low], rcond=None)
    slow = t > (a / f + b) * (1.0 + THROTTLED_TOL)
    bad = f[slow & ~low]
    return f < bad.min() if len(bad) else np.ones_like(f, dtype=bool)


def fit_vf(f: np.ndarray, p: np.ndarray, f_max: float) -> dict:
    """Least-squares fit of ``P = P_s + D * phi(f)`` (relative errors) with ``phi`` from ``GpuPowerModel``.

    Args:
        f, p: Clocks (MHz) and powers (W) of the held clocks of one series.
        f_max: The board's maximum SM clock, MHz (where ``phi = 1``).

    Returns:
        ``{static, dyn, v_min_rel, voltage_knee_mhz, rms}`` (``static``/``dyn`` in the series' own units).
    """
    def phi(x, vmin, knee):
        m = GpuPowerModel(name="fit", max_sm_clock_mhz=f_max, max_mem_clock_mhz=1.0, static_w=0.0, clock_w=0.0,
                          sm_w=0.0, v_min_rel=vmin, voltage_knee_mhz=knee)
        return np.array([m.clock_factor(v) for v in x])

    def res(x):
        ps, d, vmin, knee = x
        return (ps + d * phi(f, vmin, knee) - p) / p

    r = least_squares(res, [0.1 * p.max(), p.max(), 0.7, 1000.0],
                      bounds=([0.0, 0.0, 0.3, float(f.min())], [p.max(), 10 * p.max(), 1.0, f_max - 15.0]))
    ps, d, vmin, knee = r.x
    rms = float(np.sqrt(np.mean(r.fun ** 2)))
    return {"static": ps, "dyn": d, "v_min_rel": vmin, "voltage_knee_mhz": knee, "rms": rms}


def fit_series(df: pd.DataFrame, f_max: float) -> pd.DataFrame:
    """One row per (model, instruction): held clocks and the V-f fit."""
    rows = []
    for (model, ins), g in df.groupby(["model", "instruction"], sort=True):
        f, t, e = (g[c].to_numpy(float) for c in ("frequency", "time", "energy"))
        keep = held_clocks(f, t)
        fit = fit_vf(f[keep], e[keep] / t[keep], f_max)
        rows.append({"model": model, "instruction": ins, "held_max_mhz": float(f[keep].max()),
                     "n": int(keep.sum()), **fit})
    return pd.DataFrame(rows)


def spec(name: str):
    return presets.get("gpus", name)


def model_from(fits: pd.DataFrame) -> tuple[dict, dict]:
    """The PCIe preset mapping and the numbers behind it."""
    pcie, sxm = spec(PCIE), spec(SXM)
    vmin = float(np.median(fits.v_min_rel))
    knee = float(np.median(fits.voltage_knee_mhz))
    idle = float(pcie.idle_power_w)
    static = ASSUMED["static_share_of_idle"] * idle
    sm = ASSUMED["compute_share_of_tdp"] * float(sxm.tdp_w) - idle
    preset = {
        "name": pcie.name,
        "max_sm_clock_mhz": float(pcie.max_sm_clock_mhz),
        "max_mem_clock_mhz": float(pcie.mem_clock_mhz),
        "static_w": round(static, 3),
        "clock_w": round(idle - static, 3),
        "sm_w": round(sm, 3),
        "sm_floor": ASSUMED["sm_floor"],
        "mem_w": round(ASSUMED["mem_ratio"] * sm, 3),
        "copy_w": ASSUMED["copy_w"],
        "v_min_rel": round(vmin, 3),
        "voltage_knee_mhz": round(knee, 1),
        "host_idle_w_per_core": ASSUMED["host_idle_w_per_core"],
        "host_busy_w_per_core": ASSUMED["host_busy_w_per_core"],
    }
    return preset, {"sxm_tdp_w": float(sxm.tdp_w), "pcie_tdp_w": float(pcie.tdp_w), "idle_w": idle}


def capped_clock(model: GpuPowerModel, cap_w: float, supported, **activity) -> float:
    """Highest supported clock at which ``model.power_w(f, **activity)`` is at most ``cap_w`` (lowest if none)."""
    ok = [f for f in supported if model.power_w(f, **activity) <= cap_w]
    return float(max(ok)) if ok else float(min(supported))


def checks(preset: dict) -> list[str]:
    """Printed predictions of the derived model (no fitting): capped clocks and the 250 W '90%' claim."""
    m = GpuPowerModel(**preset)
    sup = spec(PCIE).supported_sm_clocks_mhz
    f_max = preset["max_sm_clock_mhz"]
    out = [f"compute-bound kernel at {f_max:g} MHz: {m.power_w(f_max, busy=1, compute=1):.1f} W; "
           f"memory-bound: {m.power_w(f_max, busy=1, memory=1):.1f} W; idle {m.idle_power_w(f_max):.1f} W"]
    for cap in (300, 275, 250, 225, 200, 175):
        fc = capped_clock(m, cap, sup, busy=1, compute=1)
        fh = capped_clock(m, cap, sup, busy=1, compute=0.5, memory=0.5)
        out.append(f"cap {cap} W: highest clock holding it, compute-bound {fc:g} MHz ({f_max / fc:.2f}x the "
                   f"compute time), half compute/half memory {fh:g} MHz")
    f250 = capped_clock(m, 250, sup, busy=1, compute=1)
    out.append(f"250 W card (A100 PCIe 40GB TDP) on a compute-bound kernel: {f250:g} MHz = {f250 / f_max:.0%} of "
               f"the SXM4's {f_max:g} MHz (NVIDIA launch material: 90% of the SXM4's performance)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print, do not write the preset")
    args = ap.parse_args(argv)
    df = pd.read_csv(DATA)
    fits = fit_series(df, float(spec(PCIE).max_sm_clock_mhz))
    print(fits.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    preset, info = model_from(fits)
    lines = checks(preset)
    print("\n".join(lines))
    preset["provenance"] = {
        "generator": "scripts/fit_a100_power.py",
        "data": "tests/data/a100/perseus_a100_sxm_stage_profiles.csv (Perseus SOSP'24 artifact, ml-energy/zeus "
                "@38cb3f9 sosp24_data/emulation/stage_profile/{gpt3-175b,bloom}+a100_sxm_bf16.csv, stage 0)",
        "fitted": {
            "v_min_rel, voltage_knee_mhz": "median over the 4 series (GPT-3 175B / BLOOM 176B x forward / backward) "
                                           "of a least-squares fit of P = P_s + D * phi(f) to the A100 SXM stage "
                                           "power at the clocks it held: " + "; ".join(
                f"{r.model} {r.instruction}: {r.v_min_rel:.3f} / {r.voltage_knee_mhz:.0f} MHz (<= "
                f"{r.held_max_mhz:g} MHz, rms {r.rms:.3f})" for r in fits.itertuples()),
        },
        "derived": {
            "sm_w": f"0.95 x the A100 SXM4 TDP {info['sxm_tdp_w']:g} W - idle {info['idle_w']:g} W: the same GA100 "
                    f"die and clocks as the SXM4 board; the PCIe board's {info['pcie_tdp_w']:g} W is a limit "
                    "(power-cap firmware), not the die's demand",
            "static_w, clock_w": f"idle {info['idle_w']:g} W (gpus/{PCIE}.yaml idle_power_w, nvidia-smi on an idle board) split 70/30 "
                                 "as generic_power_model",
        },
        "assumed": {"sm_floor": 0.3, "mem_w": "0.45 x sm_w", "copy_w": "20 W",
                    "host_*_w_per_core": "as the H200 preset (1.5 W idle + 4 W busy per core)"},
        "checks": lines,
    }
    if args.dry_run:
        print(yaml.safe_dump(preset, sort_keys=False)[:1200])
        return 0
    header = ("# A100 PCIe 80GB power model (hardware_models/power.py). GENERATED by scripts/fit_a100_power.py; do "
              "not edit\n# by hand, re-run the script. V-f curve fitted to public A100 SXM clock sweeps; SM power "
              "from the SXM4 TDP (same die).\n")
    OUT.write_text(header + yaml.safe_dump(preset, sort_keys=False, width=120))
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
