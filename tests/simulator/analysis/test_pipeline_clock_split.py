"""A pipeline's idle split (schedule bubble, imbalance) and each stage's clock while computing, on hand-built
spans of 1F1B with p = 2 stages and m = 2 micro-batches, t_f = 1, t_b = 2 (times in units of k, the slowdown):

    stage 0: F1 [0, 1]  F2 [1, 2]  .......  B1 [4, 6]  ...  B2 [7, 9]      idle [2, 4] + [6, 7] = 3
    stage 1: ...  F1 [1, 2]  B1 [2, 4]  F2 [4, 5]  B2 [5, 7]  .......      idle [0, 1] + [7, 9] = 3

Both stages idle (p - 1)(t_f + t_b) = 3 (the textbook 1F1B bubble): a slowdown k of every kernel makes it 3 k and
the imbalance stays 0. The split is measured on the spans as they ran, so a clock that varies over time changes it
only through the kernels' durations; ``compute_clock_mhz`` says at what clock each stage's kernels ran."""

from __future__ import annotations

import pandas as pd
import pytest

from simulator.analysis.pipeline import (combine_stages, combined_steps, compute_clock_mhz, phase_compute_s,
                                         pipeline_bubble_s)

#: (stage, phase, start, end) of the 1F1B schedule above, in units of the slowdown k
ONE_F_ONE_B = [(0, "fwd", 0, 1), (0, "fwd", 1, 2), (0, "bwd", 4, 6), (0, "bwd", 7, 9),
               (1, "fwd", 1, 2), (1, "bwd", 2, 4), (1, "fwd", 4, 5), (1, "bwd", 5, 7)]


def _stage(r: int, k: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows = [(ph, a * k, b * k) for s, ph, a, b in ONE_F_ONE_B if s == r]
    spans = pd.DataFrame(rows, columns=["phase", "start_s", "end_s"]).assign(
        step=0, kind="compute", stream="compute", op_id=range(len(rows)))
    spans["duration_s"] = spans.end_s - spans.start_s
    steps = pd.DataFrame({"step": [0], "start_s": [0.0], "end_s": [9.0 * k], "step_time_s": [9.0 * k],
                          "warmup": [False]})
    return spans, steps


def _clock(levels: list[tuple[float, float]]) -> pd.DataFrame:
    """``(t_s, mhz)`` samples of gpu0's SM clock (each holds until the next)."""
    return pd.DataFrame({"t_s": [t for t, _ in levels], "scope": "gpu0", "metric": "sm_clock_mhz",
                         "value": [v for _, v in levels]})


def _summary(spans, steps, bubble: float) -> dict:
    return {"pipeline_bubble_s": bubble, "peak_device_memory_bytes": 0, "num_ops": len(spans), "exposed_comm_s": 0.0,
            "comm_s_by_group": {}, "phase_compute_s": phase_compute_s(spans, steps), "oom": None,
            "step_time_s": float(steps.step_time_s.iloc[0])}


@pytest.mark.parametrize("k", [1.0, 1.25, 2.0])
def test_a_uniform_slowdown_scales_the_bubble_exactly_and_keeps_the_imbalance_zero(k):
    stages, frames = [], []
    for r in (0, 1):
        spans, steps = _stage(r, k)
        bubble = pipeline_bubble_s(spans, steps)
        assert bubble == pytest.approx(3.0 * k, abs=1e-12)
        # a clock 1/k of 1980 MHz all along (the slowdown of a compute-bound kernel): the stage computed at it
        assert compute_clock_mhz(spans, _clock([(0.0, 1980.0 / k)]), steps) == pytest.approx(1980.0 / k, rel=1e-12)
        stages.append(_summary(spans, steps, bubble))
        frames.append(steps)
    out = combine_stages(stages, combined_steps(frames), layers=[1, 1], schedule="1f1b", virtual=1, micro_batches=2,
                         samples_per_step=2.0, tokens_per_step=2.0, model_flops_per_step=0.0, peak_flops_per_s=1.0,
                         ranks_per_stage=1)
    assert out["pipeline_bubble_s"] == pytest.approx(3.0 * k, abs=1e-12)
    assert [st["pipeline_imbalance_s"] for st in out["pipeline"]["stages"]] == [0.0, 0.0]


def test_compute_clock_weights_the_clock_by_the_stage_compute_time():
    # the clock drops from 1980 to 990 MHz at t = 1.5 on both boards: stage 0 computes [0, 1.5] at 1980 and the rest
    # of its 6 s (4.5 s) at 990: (1.5 x 1980 + 4.5 x 990) / 6 = 1237.5 MHz; stage 1 computes [1, 1.5] at 1980 and
    # 5.5 s at 990: (0.5 x 1980 + 5.5 x 990) / 6 = 1072.5 MHz. The idle time does not count.
    clock = _clock([(0.0, 1980.0), (1.5, 990.0)])
    (s0, steps), (s1, _) = _stage(0, 1.0), _stage(1, 1.0)
    assert compute_clock_mhz(s0, clock, steps) == pytest.approx(1237.5, rel=1e-12)
    assert compute_clock_mhz(s1, clock, steps) == pytest.approx(1072.5, rel=1e-12)
    # the first sample's level holds before it (the boot clock); no clock samples: no figure
    late = _clock([(0.5, 1500.0), (1.5, 990.0)])
    assert compute_clock_mhz(s0, late, steps) == pytest.approx((1.5 * 1500 + 4.5 * 990) / 6, rel=1e-12)
    assert compute_clock_mhz(s0, clock.iloc[:0], steps) is None and compute_clock_mhz(s0, None, steps) is None


def test_each_stage_row_says_at_what_clock_it_computed():
    """PP2 with every board locked at 1410 MHz (nvidia-smi -lgc) but stage 1's at 990 MHz: each stage computed at its
    own locked clock, and ``simulate run``'s stage rows print its compute time and that clock (the imbalance follows
    the compute times, so a clock that differs by stage explains an imbalance that moves under DVFS)."""
    from simulator.api import run_scenario
    from simulator.cli import format_summary
    from simulator.config.loader import scenario_from_dict

    cfg = scenario_from_dict({
        "name": "pp2_clocks", "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}},
        "model": {"num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "seq_length": 256, "vocab_size": 1024},
        "training": {"micro_batch_size": 2, "global_batch_size": 16, "precision": "bf16"},
        "parallelism": {"pipeline_model_parallel_size": 2},
        "dvfs": {"kind": "locked_clock", "locked_clocks_mhz": 1410},
        "rank_overrides": [{"pp_rank": 1, "dvfs": {"kind": "locked_clock", "locked_clocks_mhz": 990}}],
        "run": {"steps": 2, "warmup_steps": 1}})
    s = run_scenario(cfg).summary
    stages = s["pipeline"]["stages"]
    assert [st["compute_clock_mhz"] for st in stages] == [pytest.approx(1410.0, rel=1e-12), pytest.approx(990.0, rel=1e-12)]
    assert "compute_clock_mhz" not in s
    rows = [ln for ln in format_summary(s, "pp2_clocks").splitlines() if ln.startswith("  stage ")]
    for st, row in zip(stages, rows):
        assert f"compute {sum(st['phase_compute_s'].values()) * 1e3:.2f} ms at {st['compute_clock_mhz']:.0f} MHz, " \
               f"bubble {st['pipeline_bubble_s'] * 1e3:.2f} ms" in row
