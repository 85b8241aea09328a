"""FSDP1 HYBRID_SHARD whose mesh degenerates says so (it ran without a word): every data-parallel rank in one node
(nothing to replicate: it is FULL_SHARD), or one rank per node (a one-rank shard group, which PyTorch clamps to
NO_SHARD without reducing across the nodes)."""

from __future__ import annotations

import pytest

from simulator.api import fsdp_mesh_of, ineffective_setting_warnings, run_scenario
from simulator.config.loader import load_scenario
from tests.simulator.engine.test_sharding import B16, DGX, SMALL

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NOTE = "fsdp.sharding_strategy HYBRID_SHARD is FULL_SHARD here"


def _cfg(*sets):
    return load_scenario(B16, SMALL + DGX + list(sets))


def test_one_node_hybrid_shard_is_full_shard_and_says_so():
    """One DGX (8 data-parallel ranks): the mesh is (shard 8, replicate 1); step time and peak memory equal
    FULL_SHARD's to the bit, and only the HYBRID_SHARD run carries the note naming the 8 ranks; on two nodes
    (replicated) there is none."""
    hyb, full = _cfg("fsdp={sharding_strategy: HYBRID_SHARD}"), _cfg("fsdp={sharding_strategy: FULL_SHARD}")
    assert fsdp_mesh_of(hyb) == (8, 1)
    a, b = run_scenario(hyb).summary, run_scenario(full).summary
    assert (a["step_time_s"], a["peak_memory_bytes"]) == (b["step_time_s"], b["peak_memory_bytes"])
    notes = [w for w in a["warnings"] if w.startswith(NOTE)]
    assert len(notes) == 1 and "all 8 data-parallel ranks lie in one node" in notes[0]
    assert not any("HYBRID_SHARD" in w for w in b["warnings"])
    # two DGX nodes: shard 8 per node, replicated twice (a real HSDP layout): no note
    cfg = _cfg("hardware.cluster={preset: dgx-h100, nodes: 2}", "fsdp={sharding_strategy: HYBRID_SHARD}")
    assert fsdp_mesh_of(cfg) == (8, 2)
    assert not any("HYBRID_SHARD" in w for w in ineffective_setting_warnings(cfg))


def test_without_reshard_after_forward_it_names_shard_grad_op():
    """``reshard_after_forward: false`` keeps the gathered parameters to backward: the layout it equals is
    SHARD_GRAD_OP's (PyTorch's _HYBRID_SHARD_ZERO2 within the node)."""
    cfg = _cfg("fsdp={sharding_strategy: HYBRID_SHARD, reshard_after_forward: false}")
    notes = [w for w in ineffective_setting_warnings(cfg) if "HYBRID_SHARD" in w]
    assert len(notes) == 1 and "FULL_SHARD with reshard_after_forward false (SHARD_GRAD_OP) here" in notes[0]


def test_one_rank_per_node_names_the_pytorch_clamp():
    """Two DGX nodes with tensor parallel 8: one data-parallel rank per node, a shard group of one rank (mesh 1 x
    2). PyTorch clamps that group to NO_SHARD and never all-reduces across the nodes (pytorch/pytorch#154888): the
    note says so and that the run models the layout meant."""
    cfg = _cfg("hardware.cluster={preset: dgx-h100, nodes: 2}", "parallelism.tensor_model_parallel_size=8",
               "fsdp={sharding_strategy: HYBRID_SHARD}")
    assert fsdp_mesh_of(cfg) == (1, 2)
    notes = [w for w in ineffective_setting_warnings(cfg) if "HYBRID_SHARD" in w]
    assert len(notes) == 1 and notes[0].startswith("fsdp.sharding_strategy HYBRID_SHARD with one data-parallel rank "
                                                   "per node: the shard group is one rank")
    assert "never all-reduces the gradients across the 2 nodes" in notes[0] and "pytorch/pytorch#154888" in notes[0]
