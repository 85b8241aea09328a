"""FSDP2 (``fsdp.version: 2``) gathering fp32 parameters computes in fp32: torchtitan enters no autocast when FSDP is
on (``maybe_enable_amp``), so with ``mixed_precision_param = "float32"`` every GEMM runs on the fp32 gathered weights
at the fp32 rate (``training.precision: fp32``) or, with ``allow_tf32``, the TF32 one (``tf32``), and every
activation is 4 bytes. Worked out by hand on a one-block model over one DGX H100 (8 ranks), and the pairings that
are refused (``simulator/config/sections/fsdp.py`` ``precision_problem``)."""

from __future__ import annotations

import pytest

from hardware_models import presets
from hardware_models.profile import EfficiencyProfile
from simulator.api import build_graph
from simulator.config.loader import scenario_from_dict
from simulator.cost.roofline import RooflineCostModel
from simulator.graph.ops import OpKind, Phase
from tests.conftest import refused_in_one_line

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# 1 block, h 8, f 32, V 16, s 4, b 1 (learned positions, biases, tied): T = 4 tokens; block parameters 872, each
# dimension 0 (8, 32, 24 rows) divides by the 8 ranks, so no padding (tests/simulator/engine/test_fsdp2_hsdp.py)
T, H, F = 4, 8, 32
BASE = {
    "name": "fsdp2-fp32",
    "hardware": {"gpu": "h100-sxm-80gb", "host": "dgx-h100-host", "cluster": {"preset": "dgx-h100", "nodes": 1}},
    "model": {"num_layers": 1, "hidden_size": H, "num_attention_heads": 2, "seq_length": T, "vocab_size": 16,
              "ffn_hidden_size": F, "attention_backend": "unfused"},
    "training": {"micro_batch_size": 1, "precision": "fp32"},
    "parallelism": {},
    "fsdp": {"version": 2, "mixed_precision": "FULL"},
    "run": {"steps": 2, "warmup_steps": 1},
}


def _graph(precision="fp32", **fsdp):
    cfg = scenario_from_dict({**BASE, "training": {**BASE["training"], "precision": precision},
                              "fsdp": {**BASE["fsdp"], **fsdp}})
    return build_graph(cfg), cfg


def _op(g, name):
    return next(o for o in g.ops if o.name == name)


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_gemm_time_is_its_flops_at_the_fp32_or_tf32_peak(precision):
    """On a roofline without a GEMM table (time = 2 m n k / peak), the fc1 GEMM [4, 8] x [8, 32] (2 x 4 x 32 x 8 =
    2,048 FLOPs) takes 2,048 / 66.9e12 s at the H100's fp32 peak and 2,048 / 494.7e12 s at its TF32 peak; under the
    old pricing (autocast bf16 over the gathered fp32 weights) it ran at the bf16 peak, 989.4e12: 14.8x too fast
    for fp32, 2x for TF32."""
    g, _ = _graph(precision)
    gpu = presets.get("gpus", "h100-sxm-80gb")
    bare = EfficiencyProfile(name="peak", gpu="h100-sxm-80gb", gemm={}, attention_efficiency={},
                             memory_bandwidth_bytes_per_s={"elementwise": 1e12})
    fc1 = _op(g, "L0.fwd.fc1.gemm")
    assert fc1.dtype == precision and fc1.flops == 2 * T * F * H == 2048
    peak = {"fp32": 66.9e12, "tf32": 494.7e12}[precision]
    assert gpu.peak(precision) == pytest.approx(peak)
    assert RooflineCostModel(gpu, bare).split_s(fc1)[0] == pytest.approx(2048 / peak)
    # fp32 operands and output: [4, 8] input + [8, 32] weight read, [4, 32] written, 4 bytes each
    assert (fc1.bytes_read, fc1.bytes_written) == (4 * (T * H + H * F), 4 * T * F)
    # the GEMM reads the gathered fp32 weight itself: no autocast cast of weights, inputs or gradients
    assert not any(".cast_" in o.name for o in g.ops)
    assert all(o.dtype in ("fp32", precision) for o in g.ops if o.kind is OpKind.COMPUTE)


def test_saved_activations_are_four_bytes_by_hand():
    """Block 0's tensors saved for backward, 4 B each (sbh = 32 elements = 128 B): the LayerNorm outputs (QKV and fc1
    inputs) 2 x 128, Q, K and V 3 x 128, the softmax output 4 a s^2 b = 4 x 2 x 16 = 128, the proj input 128, the two
    residual sums (the second LayerNorm's and the final LayerNorm's inputs) 2 x 128, the fc1 output (GELU input)
    4 x 4 x 32 = 512 and the GELU output 512, the two LayerNorms' fp32 mean and rstd 2 x 8 B x 4 tokens = 64: 2,240 B,
    Korthikanti's 64 sbh + 4 a s^2 b without dropout at 4 bytes, plus the statistics. The old pricing (autocast over
    the gathered fp32 weights) saved 2,816 B: 1,280 B of activations with 2-byte GEMM inputs and outputs beside
    autocast's 1,536 B of bf16 weight copies."""
    g, _ = _graph()
    bwd_uses = {u for op in g.ops if op.phase == Phase.BWD for u in op.uses}
    saved = sum(t.nbytes for op in g.ops if op.phase == Phase.FWD and op.layer == 0 and op.kind is OpKind.COMPUTE
                for t in op.allocs if t.name in bwd_uses)
    assert saved == 2 * 128 + 3 * 128 + 128 + 128 + 2 * 128 + 512 + 512 + 64 == 2240


def test_collectives_move_fp32_parameters_and_gradients():
    """All-gathers of the fp32 shards (4 x 872 B a block, a plain copy-in, no cast kernel), reduce-scatters of the fp32
    gradients (FULL: reduce_dtype fp32); {param_dtype: fp32, reduce_dtype: bf16} reduce-scatters 2 x 872 B and casts
    the 109-element shard back to fp32."""
    g, _ = _graph()
    assert _op(g, "L0.fwd.param_all_gather").meta["bytes"] == _op(g, "L0.bwd.param_all_gather").meta["bytes"] == 4 * 872
    cin = _op(g, "L0.fwd.fsdp.all_gather_copy_in")
    assert (cin.bytes_read, cin.bytes_written) == (4 * 109, 4 * 109)
    assert not any(o.name.endswith("all_gather_cast") for o in g.ops)
    assert _op(g, "fsdp.grad_reduce_scatter.0").meta["bytes"] == 4 * 872
    g16, _ = _graph(mixed_precision={"param_dtype": "fp32", "reduce_dtype": "bf16"})
    assert _op(g16, "fsdp.grad_reduce_scatter.0").meta["bytes"] == 2 * 872
    c = _op(g16, "fsdp.grad_cast_fp32.0")
    assert (c.bytes_read, c.bytes_written) == (2 * 109, 4 * 109)


@pytest.mark.parametrize("change,needle", [
    # the pairing the old pricing accepted: autocast bf16 GEMMs where torchtitan computes in fp32
    ({"training": {"micro_batch_size": 1, "precision": "amp_fp32_params"}, "model": {**BASE["model"],
                                                                                    "attention_backend": "flash"}},
     "fsdp.mixed_precision: FULL (param_dtype fp32) with fsdp.version 2 under training.precision amp_fp32_params "
     "(torch.autocast) is not modelled: torchtitan runs fully_shard without autocast"),
    ({"training": {"micro_batch_size": 1, "precision": "amp_fp32_params"}, "model": {**BASE["model"],
                                                                                    "attention_backend": "flash"},
      "fsdp": {"version": 2, "mixed_precision": {"param_dtype": "fp32", "reduce_dtype": "bf16"}}},
     "fsdp.mixed_precision: param_dtype fp32 with fsdp.version 2 under training.precision amp_fp32_params"),
    ({"fsdp": {"version": 2}}, "training.precision: fp32 with fsdp.mixed_precision DEFAULT (param_dtype bf16): "
                               "fully_shard gathers bf16 parameters"),
    ({"fsdp": {"mixed_precision": "FULL"}}, "training.precision: fp32 with fsdp.version 1 (FullyShardedDataParallel) "
                                            "is not modelled"),
    ({"training": {"micro_batch_size": 1, "precision": "bf16"}}, "fsdp: training.precision bf16 is not modelled with "
                                                                 "FSDP"),
])
def test_refused_pairings_one_line_exit_2(tmp_path, capsys, change, needle):
    err = refused_in_one_line(tmp_path, capsys, {**BASE, **change})
    assert needle in err, err
