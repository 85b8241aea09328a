"""DeepSpeed ZeRO-3's ``stage3_max_reuse_distance`` (issue 11): a block whose parameters are reused within that many
elements is not released after its forward, so its backward gathers nothing (deepspeedai/DeepSpeed@00a31c99
``deepspeed/runtime/zero/partitioned_param_coordinator.py`` ``__params_to_release``; default 1e9,
``deepspeed/runtime/zero/config.py``). Worked by hand at block granularity."""

from __future__ import annotations

import pytest

from simulator.api import run_scenario, sharding_spec, transformer_spec
from simulator.config.loader import load_scenario
from simulator.graph.builders.sharding import ROOT, zero3_kept_after_forward
from simulator.graph.builders.transformer import build_gpt_step
from tests.conftest import ROOT as REPO

DP8 = REPO / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"  # GPT 1.3B: 24 blocks, h 2048, tied vocab 32768
Z3 = ["zero_optimization.stage=3", "training.precision=bf16", "run.steps=2", "run.warmup_steps=1"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_kept_blocks_by_hand_on_a_toy():
    """4 blocks of 10 elements, a head of 5, max 40: block i is reached in backward after 2 (3 - i) x 10 + 2 x 5
    elements: 10 (i = 3), 30 (i = 2) are below 40, 50 (i = 1) is not. The root (its head reused at once) is kept for
    any positive distance; 0 keeps nothing."""
    assert zero3_kept_after_forward(10, 4, 5, 40) == {3, 2, ROOT}
    assert zero3_kept_after_forward(10, 4, 5, 31) == {3, 2, ROOT}
    assert zero3_kept_after_forward(10, 4, 5, 30) == {3, ROOT}
    assert zero3_kept_after_forward(10, 4, 5, 0) == frozenset()


def test_gpt_1p3b_keeps_its_last_nine_blocks_at_deepspeeds_default():
    """Block: 12 h^2 + 13 h = 50,358,272 elements (h 2048, biases, LayerNorm); the head: the tied token table 32,768
    x 2048 + the final LayerNorm 2 x 2048 = 67,112,960. Block i is kept iff 2 (23 - i) 50,358,272 + 2 x 67,112,960
    < 1e9, i.e. 23 - i <= 8: blocks 15 .. 23. Their backward gathers nothing; blocks 0 .. 14 each gather their
    12 h^2 = 50,331,648 partitioned elements (the 1e5 persistence threshold keeps biases and norms whole) in 16 bits."""
    cfg = load_scenario(DP8, Z3)
    assert sharding_spec(cfg).kept_after_forward == {ROOT, *range(15, 24)}
    g = build_gpt_step(transformer_spec(cfg))
    bwd = {o.name: o.meta["bytes"] for o in g.ops if o.name.endswith(".bwd.param_all_gather")}
    assert sorted(bwd) == sorted(f"L{i}.bwd.param_all_gather" for i in range(15))
    assert set(bwd.values()) == {2 * 12 * 2048 ** 2}
    none = load_scenario(DP8, Z3 + ["zero_optimization.stage3_max_reuse_distance=0"])
    g0 = build_gpt_step(transformer_spec(none))
    assert len([o for o in g0.ops if o.name.endswith(".bwd.param_all_gather")]) == 25  # 24 blocks + the root


def test_kept_blocks_trade_memory_for_the_backward_gathers():
    """Keeping blocks from forward to backward skips their gathers (a shorter step here) and holds them at the turn
    (a higher peak); distance 0 is the every-block-gathered-again schedule."""
    kept = run_scenario(load_scenario(DP8, Z3 + ["model.num_layers=4"])).summary
    none = run_scenario(load_scenario(DP8, Z3 + ["model.num_layers=4",
                                                  "zero_optimization.stage3_max_reuse_distance=0"])).summary
    assert kept["step_time_s"] < none["step_time_s"]
    assert kept["peak_device_memory_bytes"] > none["peak_device_memory_bytes"]


def test_with_parameter_offload_the_distance_is_flagged():
    """With offload_param every block is fetched again (not modelled otherwise): the run says so."""

    cfg = load_scenario(REPO / "scenarios/cluster/gpt_1p3b_dgx_h100_zero3_nvme.yaml", ["run.steps=2"])
    assert sharding_spec(cfg).kept_after_forward == frozenset()
    w = run_scenario(cfg).summary["warnings"]
    assert any(x.startswith("zero_optimization.stage3_max_reuse_distance (1e+09) is not modelled with offload_param")
               for x in w)


def test_a_reuse_boundary_inside_the_blocks_is_flagged_as_decided_per_block():
    """DeepSpeed decides per module, the model per block: when some blocks are kept and some not (GPT 1.3B DP8 at
    the default 1e9: blocks 15-23 of 24, worked by hand in the test above), the run says block 14 may keep part of
    itself; with nothing kept (distance 0) or everything kept it says nothing."""
    import warnings

    from simulator.api import _zero3_partial_reuse_note

    z3 = ["zero_optimization.stage=3", "training.precision=bf16"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        notes = [_zero3_partial_reuse_note(load_scenario(DP8, z3 + extra)) for extra in
                 ([], ["zero_optimization.stage3_max_reuse_distance=0"],
                  ["zero_optimization.stage3_max_reuse_distance=1000000000000"])]
    assert notes[0] is not None and "blocks 15-23 of 24" in notes[0] and "block 14 may keep" in notes[0]
    assert notes[1] is None and notes[2] is None
