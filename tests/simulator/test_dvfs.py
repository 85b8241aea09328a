"""DVFS policies end to end: bad input, outputs in the summary and the Perfetto trace, phase plans,
the power limit over any clock policy and the firmware loop that sleeps while the limit cannot bind."""

from __future__ import annotations

import warnings

import pytest
import simpy
import yaml

import simulator.policies.dvfs as dvfs_mod
from simulator import ScenarioError, load_scenario, run_scenario
from simulator.cli import main
from simulator.config.loader import resolve_hardware, scenario_from_dict
from simulator.api import simulate_graph
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind, Phase
from simulator.policies.registry import PolicyError
from simulator.recording.chrome_trace import to_chrome_trace
from tests.conftest import ROOT

B8 = ROOT / "scenarios/h200/gpt_184m_b8.yaml"
B16 = ROOT / "scenarios/h200/gpt_184m_b16.yaml"


def test_unsupported_clock_snaps_with_warning():
    """The snap is said once, by the run's warnings (before, the clock policy also warned, and `simulate run`
    printed the same fact twice)."""
    import warnings

    cfg = load_scenario(B8, overrides=["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1412"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = run_scenario(cfg).summary
    assert s["avg_sm_clock_mhz"] == pytest.approx(1410)
    assert [w for w in s["warnings"] if "1412 MHz is not a supported SM clock" in w] == [
        "dvfs.locked_clocks_mhz 1412 MHz is not a supported SM clock of NVIDIA H200 SXM 141GB: the run uses the "
        "nearest, 1410 MHz (as nvidia-smi -lgc rounds)"]
    assert not [str(w.message) for w in caught if "supported SM clock" in str(w.message)]


def test_power_cap_out_of_range_is_one_line_error():
    cfg = load_scenario(B8, overrides=["dvfs.kind=power_cap", "dvfs.power_limit_w=150 W"])
    with pytest.raises(PolicyError, match=r"^dvfs.power_limit_w 150 W is outside the settable range .*200-700 W$"):
        run_scenario(cfg)


def test_unknown_phase_lists_allowed_phases():
    with pytest.raises(ScenarioError, match="unknown phase.*warmup.*allowed: data, fwd, bwd, opt, other"):
        load_scenario(B8, overrides=["dvfs.kind=phase_plan", "dvfs.phase_clocks_mhz={warmup: 1200}"])


def test_kind_without_its_parameter_is_rejected():
    with pytest.raises(ScenarioError, match="locked_clock needs locked_clocks_mhz"):
        load_scenario(B8, overrides=["dvfs.kind=locked_clock"])


def test_energy_outputs_and_counters_in_summary_and_trace():
    r = run_scenario(load_scenario(B8))
    s = r.summary
    for k in ("energy_j_per_step", "avg_power_w", "energy_per_token_j", "host_energy_j_per_step"):
        assert s[k] > 0
    assert s["energy_per_token_j"] == pytest.approx(s["energy_j_per_step"] / (8 * 1024), rel=1e-6)
    gpu = r.counters[r.counters.scope == "gpu0"]
    assert {"sm_clock_mhz", "power_w"} <= set(gpu.metric)
    names = {e["name"] for e in to_chrome_trace(r.spans, r.counters)["traceEvents"] if e["ph"] == "C"}
    assert {"gpu0.sm_clock_mhz", "gpu0.power_w"} <= names


def test_lower_locked_clock_slower_and_less_power():
    hi = run_scenario(load_scenario(B8, overrides=["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1980"])).summary
    lo = run_scenario(load_scenario(B8, overrides=["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=990"])).summary
    assert lo["step_time_s"] > hi["step_time_s"]
    assert lo["avg_power_w"] < hi["avg_power_w"]


def test_power_cap_holds_average_power_near_the_cap():
    cfg = load_scenario(B8, overrides=["dvfs.kind=power_cap", "dvfs.power_limit_w=400", "run.steps=8"])
    s = run_scenario(cfg).summary
    assert s["avg_power_w"] == pytest.approx(400, rel=0.06)
    assert s["clock_switches"] >= 1 and s["avg_sm_clock_mhz"] < 1980


def test_phase_plan_switches_with_latency_and_costs_time():
    base = run_scenario(load_scenario(B8)).summary
    plan = ["dvfs.kind=phase_plan", "dvfs.phase_clocks_mhz={fwd: 1980, bwd: 1980, opt: 990}"]
    fast = run_scenario(load_scenario(B8, overrides=plan + ["dvfs.clock_switch_latency_s=0.2 ms"])).summary
    assert fast["clock_switches"] >= 2                   # down for opt, up again for the next fwd
    assert fast["step_time_s"] > base["step_time_s"]     # opt runs slower
    # with the default 10 ms latency the ~1 ms optimizer phase is over before its clock arrives,
    # and the next request (back to 1980 MHz for fwd) supersedes it: no switch lands at all
    slow = run_scenario(load_scenario(B8, overrides=plan)).summary
    assert slow["clock_switches"] == 0
    assert slow["step_time_s"] == pytest.approx(base["step_time_s"], rel=1e-9)


# -- power limit over any clock policy; the firmware only evaluates when the limit can bind ----------


def gemms_then_idle(n_gemms: int = 40, idle_s: float = 0.1):
    """``n_gemms`` 8192^3 bf16 GEMMs (~1.6 ms each at 1980 MHz, board power > 700 W) then the GPU idles
    for ``idle_s`` while the host works."""
    b, prev, m = GraphBuilder(), [], 8192
    for i in range(n_gemms):
        prev = [b.add(f"g{i}", OpKind.COMPUTE, "compute", deps=prev, phase=Phase.FWD, cost_class=CostClass.GEMM,
                      shape=(m, m, m), flops=2.0 * m**3, bytes_read=4.0 * m * m, bytes_written=2.0 * m * m)]
    b.add("host_work", OpKind.HOST, "host", deps=prev, phase=Phase.OTHER, fixed_duration_s=idle_s)
    return b.build(samples_per_step=1, tokens_per_step=1)


def run_graph(graph, dvfs: dict | None, steps: int = 3):
    base = yaml.safe_load(B8.read_text())
    cfg = scenario_from_dict({**base, **({"dvfs": dvfs} if dvfs else {})})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return simulate_graph(graph, resolve_hardware(cfg), steps=steps, warmup_steps=1, cfg=cfg)


@pytest.fixture
def runtimes(monkeypatch):
    """The DVFS runtime components the runs of a test create, in order."""
    made, init = [], dvfs_mod.DvfsRuntime.__init__

    def capture(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(dvfs_mod.DvfsRuntime, "__init__", capture)
    return made


def test_power_limit_binds_over_a_locked_clock():
    """nvidia-smi -pl over -lgc: a 300 W limit with the clock locked at 1410 MHz holds ~300 W
    (it ran at 391 W, the limit ignored) and the clock drops below the lock."""
    s = run_scenario(load_scenario(B8, overrides=["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1410",
                                                  "dvfs.power_limit_w=300", "run.steps=8"])).summary
    assert s["power_limit_w"] == 300
    assert s["avg_power_w"] == pytest.approx(300, rel=0.06)
    assert s["avg_sm_clock_mhz"] < 1410 and s["clock_switches"] >= 1


def test_power_limit_range_is_checked_for_every_kind():
    cfg = load_scenario(B8, overrides=["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1410",
                                       "dvfs.power_limit_w=150 W"])
    with pytest.raises(PolicyError, match=r"^dvfs.power_limit_w 150 W is outside the settable range .*200-700 W$"):
        run_scenario(cfg)


def test_clock_returns_to_the_requested_clock_when_power_allows():
    """Locked at 1410 MHz under a 300 W limit: GEMMs throttle the clock, the idle host phase lets it
    climb back, and every step starts at the requested 1410 MHz again, never above it."""
    r = run_graph(gemms_then_idle(), {"kind": "locked_clock", "locked_clocks_mhz": 1410, "power_limit_w": 300})
    c = r.counters[(r.counters.scope == "gpu0") & (r.counters.metric == "sm_clock_mhz")]
    assert c.value.max() == 1410 and c.value.min() < 1300
    for start in r.steps.start_s.iloc[1:]:
        assert c[c.t_s <= start].value.iloc[-1] == 1410


def test_gpu_override_above_the_supported_clocks_is_refused(capsys):
    """A max clock above the supported list used to be accepted; after one throttle the clock stuck at
    the list's top (+21% step time). One line naming the key, exit 2."""
    assert main(["run", str(B16), "--set", "hardware.gpu.overrides.max_sm_clock_mhz=2400"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "hardware.gpu: overrides: max_sm_clock_mhz 2400 MHz must be the highest of supported_sm_clocks_mhz" in err


def test_firmware_sleeps_while_the_limit_cannot_bind(runtimes, monkeypatch):
    """A step with 1,000 s of GPU idle under the default 700 W limit: a 10 ms tick evaluated 300,000
    times over 3 steps; now the firmware evaluates only around the GEMMs (power above 700 W), and the
    events the run processes are bounded by its ops, not by its simulated time."""
    events, step = [0], simpy.Environment.step

    def counted(env):
        events[0] += 1
        return step(env)

    monkeypatch.setattr(simpy.Environment, "step", counted)
    short = run_graph(gemms_then_idle(idle_s=0.1), None)
    n_short, events[0] = events[0], 0
    long = run_graph(gemms_then_idle(idle_s=1000.0), None)
    assert long.steps.end_s.iloc[-1] > 3000
    assert events[0] <= n_short + 50  # a 10 ms tick adds 300,000
    assert runtimes[-1].firmware_ticks < 100
    assert long.summary["clock_switches"] == short.summary["clock_switches"] == 0


@pytest.mark.parametrize("path, over", [
    (B8, []), (B16, []),
    (B8, ["dvfs.kind=power_cap", "dvfs.power_limit_w=400", "run.steps=8"]),
    (B8, ["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1410", "dvfs.power_limit_w=300", "run.steps=8"]),
])
def test_sleeping_firmware_equals_ticking_every_period(monkeypatch, path, over):
    """Energy and power with the sleeping firmware vs evaluating every 10 ms (the old loop): within
    0.01% (the issue allows 0.5%) on the bundled H200 b8/b16 scenarios, capped or not."""
    cfg = load_scenario(path, overrides=over)
    lazy = run_scenario(cfg).summary
    monkeypatch.setattr(dvfs_mod.DvfsRuntime, "_quiet_since", lambda self, t: False)  # never sleeps
    tick = run_scenario(cfg).summary
    for k in ("energy_j_per_step", "avg_power_w", "step_time_s", "avg_sm_clock_mhz"):
        assert lazy[k] == pytest.approx(tick[k], rel=1e-4), k
    assert lazy["clock_switches"] == tick["clock_switches"]


def test_a_snapped_clock_is_in_the_summarys_warnings():
    """1003 MHz is not an H200 clock: the run uses 1005 MHz and says so in ``warnings`` (it was on stderr only)."""
    cfg = load_scenario(B8, ["dvfs.kind=locked_clock", "dvfs.locked_clocks_mhz=1003", "run.steps=2",
                             "run.warmup_steps=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = run_scenario(cfg).summary["warnings"]
    assert any("dvfs.locked_clocks_mhz 1003 MHz is not a supported SM clock" in x and "1005 MHz" in x for x in w)


def test_a_power_limit_the_measured_steps_exceed_is_flagged():
    # 184M b8 under a 250 W cap: over the bundled 4 steps (1 warm-up) the firmware is still stepping the clock
    # down (measured 2026-12-01: 45.40 ms, 297 W average), the settled loop (6 warm-up steps of 12) gives
    # 51.4 ms at 246 W. The short run's figures are of the transient: flagged, not silently reported.
    cap = ["dvfs.kind=power_cap", "dvfs.power_limit_w=250"]
    short = run_scenario(load_scenario(B8, overrides=cap)).summary
    assert short["avg_power_w"] > 250 * (1 + dvfs_mod.HYSTERESIS)
    (note,) = [w for w in short["warnings"] if dvfs_mod.LIMIT_NOT_HELD in w]
    assert "250 W not held" in note and "run.warmup_steps" in note
    settled = run_scenario(load_scenario(B8, overrides=cap + ["run.steps=12", "run.warmup_steps=6"])).summary
    assert settled["avg_power_w"] <= 250 * (1 + dvfs_mod.HYSTERESIS)
    assert not [w for w in settled["warnings"] if dvfs_mod.LIMIT_NOT_HELD in w]
    assert settled["step_time_s"] > short["step_time_s"] * 1.1  # what the short run understated


def test_an_unsettled_power_cap_is_not_ranked_pareto_optimal(capsys):
    """184M b8, caps 400 and 250 W over the bundled 4 steps: the 250 W cap is still settling (its 45.4 ms and
    297 W are of the firmware's transient; test_a_power_limit_the_measured_steps_exceed_is_flagged): settled
    false, not Pareto-optimal (it was: '*' beside its warning), shown '?'; the 400 W cap holds and ranks. With
    12 steps (6 warm-up) both settle and both are on the front (slower and frugal, faster and hungrier)."""
    from simulator.studies.pareto import energy_time_pareto

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = energy_time_pareto(load_scenario(B8), power_caps=[400, 250])
    assert [str(w.message).startswith("power_limit_w 250: ") for w in caught] == [True]
    assert df.settled.tolist() == [True, False] and df.pareto.tolist() == [True, False]
    long = energy_time_pareto(load_scenario(B8, overrides=["run.steps=12", "run.warmup_steps=6"]),
                              power_caps=[400, 250])
    assert long.settled.tolist() == [True, True] and long.pareto.tolist() == [True, True]
    assert main(["pareto", str(B8), "--power-caps", "400,250"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("? = power cap not settled in the measured steps, not ranked)")
    assert out[2].split()[0] == "400" and out[2].endswith("*") and out[3].split()[0] == "250" and out[3].endswith("?")


def test_an_unheld_power_limit_is_flagged_per_rank_class_and_in_pareto(capsys):
    dp8 = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
    over = ["model.num_layers=2", "training.micro_batch_size=1", "run.steps=2", "run.warmup_steps=1",
            "rank_overrides=[{dp_rank: 3, dvfs: {kind: power_cap, power_limit_w: 200}}]"]
    s = run_scenario(load_scenario(dp8, overrides=over)).summary
    assert [w for w in s["warnings"] if w.startswith(f"dp_rank 3: {dvfs_mod.LIMIT_NOT_HELD} 200 W not held")]
    assert main(["pareto", str(B8), "--power-caps", "400,250"]) == 0
    err = capsys.readouterr().err
    assert "power_limit_w 250: dvfs: power limit 250 W not held" in err and "power_limit_w 400:" not in err
