"""Separate q / k / v projections (no contiguous copy of V) and torchtitan's ``repeat_kv``
(``simulator/graph/builders/qkv_layout.py``), worked by hand on the tiny GQA Llama of ``test_llama_features``:
h 64, a 8 heads of d 8, g 2 K/V heads (kv width 16), b 2, s 16: T = 32 tokens, bf16."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator import load_scenario
from simulator.api import transformer_spec
from simulator.config.errors import ScenarioError
from simulator.graph.builders.transformer import build_gpt_step
from simulator.graph.ops import Phase
from tests.simulator.graph.test_llama_features import T, spec

ROOT = Path(__file__).resolve().parents[3]
H, KV = 64, 16


def _op(g, name):
    return next(o for o in g.ops if o.name == name)


def _saved(g, layer=0) -> int:
    """Bytes block ``layer``'s forward allocates that its backward reads."""
    bwd = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    return sum(t.nbytes for op in g.ops if op.phase == Phase.FWD and op.layer == layer for t in op.allocs
               if t.name in bwd)


def test_separate_projections_take_v_without_a_copy_by_hand():
    """Megatron's fused QKV with rope copies V contiguous (read and write 2 T kv = 1024 B); separate projections
    do not: the QKV GEMM writes q, k (2 T (h + kv) = 5120 B) and v (1024 B) as two tensors, the flash kernel reads
    the rotated q, k and that v: the same bytes read and saved, one kernel fewer."""
    fused, sep = build_gpt_step(spec()), build_gpt_step(spec(qkv_separate=True))
    v = _op(fused, "L0.fwd.attn.v_contiguous")
    assert (v.bytes_read, v.bytes_written) == (2 * T * KV, 2 * T * KV) == (1024, 1024)
    assert not any(o.name.endswith("v_contiguous") for o in sep.ops)
    assert [t.nbytes for t in _op(sep, "L0.fwd.qkv.gemm").allocs] == [2 * T * (H + KV), 2 * T * KV] == [5120, 1024]
    assert _op(sep, "L0.fwd.attn").bytes_read == _op(fused, "L0.fwd.attn").bytes_read == 2 * T * (H + 2 * KV)
    assert _saved(sep) == _saved(fused)
    assert len(sep.ops) == len(fused.ops) - 2  # one copy per layer


def test_repeat_kv_bytes_and_saved_memory_by_hand():
    """torchtitan's repeat_kv: per layer two copies (k, v) reading 2 T kv = 1024 B and writing 2 T h = 4096 B; the
    flash kernel reads q and 8 heads of K and V, 2 T x 3h = 12288 B (6144 without); backward: the flash kernel
    reads 2 (3 T h + 2 T h) = 20480 B and writes 2 T 3h + 4 T h = 20480 B, then two reductions (4096 B read,
    1024 B written, T (h - kv) = 1536 adds each). Saved: q, k, v at 3 x 4096 B in place of 5120 + 1024 B: 6144 B
    more per layer. The FLOPs of the flash kernels are unchanged."""
    plain, rep = build_gpt_step(spec(qkv_separate=True)), build_gpt_step(spec(qkv_separate=True, repeat_kv=True))
    for x in ("k", "v"):
        c = _op(rep, f"L0.fwd.attn.repeat_kv.{x}")
        assert (c.bytes_read, c.bytes_written) == (1024, 4096)
        r = _op(rep, f"L0.bwd.attn.repeat_kv.{x}.dgrad")
        assert (r.bytes_read, r.bytes_written, r.flops) == (4096, 1024, 1536)
    f0, f1 = _op(plain, "L0.fwd.attn"), _op(rep, "L0.fwd.attn")
    assert (f0.bytes_read, f1.bytes_read) == (6144, 12288) and f0.flops == f1.flops
    b1 = _op(rep, "L0.bwd.attn.dgrad")
    assert (b1.bytes_read, b1.bytes_written) == (20480, 20480) and b1.flops == _op(plain, "L0.bwd.attn.dgrad").flops
    assert _saved(rep) - _saved(plain) == 3 * 4096 - (5120 + 1024) == 6144
    # without grouped K/V (g = a) repeat_kv is the identity: the same graph as without it
    mha = build_gpt_step(spec(num_query_groups=None, qkv_separate=True, repeat_kv=True))
    assert [o.name for o in mha.ops] == [o.name for o in build_gpt_step(spec(num_query_groups=None,
                                                                              qkv_separate=True)).ops]


def test_torchtitan_default_and_refusals():
    """fsdp.version 2 (torchtitan) gives separate projections and repeat_kv unless model.repeat_kv is false;
    Megatron's fused QKV has neither; repeat_kv without rope, or with Megatron's fused QKV, is refused."""
    f = ROOT / "scenarios/h200/llama3_8b_b1.yaml"
    tt = transformer_spec(load_scenario(f, ["fsdp={version: 2}"]))
    assert tt.qkv_separate and tt.repeat_kv
    assert not transformer_spec(load_scenario(f, ["fsdp={version: 2}", "model.repeat_kv=false"])).repeat_kv
    meg = transformer_spec(load_scenario(f))
    assert not meg.qkv_separate and not meg.repeat_kv
    with pytest.raises(ValueError, match="model.repeat_kv is modelled for separate q / k / v projections only"):
        build_gpt_step(spec(repeat_kv=True))
    with pytest.raises(ValueError, match="model.repeat_kv .* position_embedding_type rope only"):
        build_gpt_step(spec(qkv_separate=True, repeat_kv=True, position_embedding="learned_absolute"))
    with pytest.raises(ScenarioError, match="model.repeat_kv is modelled for separate"):
        load_scenario(f, ["model.repeat_kv=true"])
    with pytest.raises(ScenarioError, match=r"model.repeat_kv \(torchtitan's default with fsdp.version 2\)"):
        load_scenario(f, ["fsdp={version: 2}", "model.position_embedding_type=learned_absolute"])
