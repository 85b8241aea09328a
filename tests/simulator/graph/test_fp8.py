"""fp8 training (Megatron-LM --fp8-format, Transformer Engine): the blocks' Linear GEMMs at the fp8 rate on
8-bit operands, quantize kernels around them, weights quantized once per step, and bad input."""

from __future__ import annotations

import pathlib

import pytest

from simulator.api import build_graph, run_scenario
from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario, scenario_from_dict
from simulator.graph.ops import CostClass

BASE = {
    "name": "fp8",
    "hardware": {"gpu": "h100-sxm-80gb"},
    "model": {"num_layers": 2, "hidden_size": 4096, "num_attention_heads": 32, "seq_length": 2048, "vocab_size": 32000},
    "training": {"micro_batch_size": 1, "global_batch_size": 2, "precision": "bf16", "fp8": "hybrid"},
    "run": {"steps": 2, "warmup_steps": 1},
}


def _graph(**training):
    return build_graph(scenario_from_dict({**BASE, "training": {**BASE["training"], **training}}))


def test_block_gemms_read_8_bit_operands_and_the_head_stays_bf16():
    g = _graph()
    T, h = 2048, 4096
    qkv = next(op for op in g.ops if op.name == "L0.fwd.qkv.gemm")
    assert qkv.dtype == "fp8" and qkv.bytes_read == T * h + h * 3 * h  # 1 byte per input and weight element
    head = next(op for op in g.ops if op.name == "fwd.lm_head.gemm")
    assert head.dtype == "bf16"
    for name in ("L0.bwd.qkv.dgrad", "L0.bwd.qkv.wgrad"):
        assert next(op for op in g.ops if op.name == name).dtype == "fp8"


def test_weights_are_quantized_once_per_step_and_inputs_every_pass():
    g = _graph()  # 2 micro-batches
    wq = [op for op in g.ops if op.name.endswith("qkv.fp8_quantize_w") and op.layer == 0]
    xq = [op for op in g.ops if op.name.endswith("qkv.fp8_quantize_x") and op.layer == 0]
    assert len(wq) == 1 and len(xq) == 2
    assert wq[0].cost_class == CostClass.CAST and wq[0].bytes_read == 2 * 4096 * 3 * 4096


def test_fp8_is_faster_than_bf16_on_large_gemms():
    bf16 = run_scenario(scenario_from_dict({**BASE, "training": {**BASE["training"], "fp8": None}})).summary
    fp8 = run_scenario(scenario_from_dict(BASE)).summary
    # 0.851 on the fitted h100-sxm-80gb profile: its per-wave GEMM overhead (4.6 us, fitted at 16 bit) is not halved
    # at fp8 (it was 0 in the generic 70% profile); the block GEMMs alone are 1.8x faster
    assert fp8["step_time_s"] < 0.9 * bf16["step_time_s"]


def test_fp8_needs_bf16_a_gpu_with_an_fp8_rate_and_no_zero3():
    with pytest.raises(ScenarioError, match="needs training.precision bf16"):
        scenario_from_dict({**BASE, "training": {**BASE["training"], "precision": "fp16"}})
    bad = {**BASE, "hardware": {"gpu": "a100-sxm4-80gb"}}
    import tempfile, yaml, pathlib

    with tempfile.TemporaryDirectory() as d:
        p = pathlib.Path(d) / "s.yaml"
        p.write_text(yaml.safe_dump(bad))
        with pytest.raises(ScenarioError, match="has no fp8 tensor-core rate"):
            load_scenario(p)


@pytest.mark.parametrize("history", [1, 1024])
def test_delayed_scaling_state_and_updates_by_hand(history):
    """Transformer Engine delayed scaling: 2 layers x 4 fp8 Linears (QKV, proj, fc1, fc2) = 8, each with 3 scaled
    tensors (input, weight, output gradient) holding an fp32 amax history of ``history`` entries plus a scale and
    its inverse: 8 x 3 x (history + 2) x 4 bytes resident; after each of the 2 micro-batches' forward one update
    over the 16 forward tensors, after each backward one over the 8 gradients."""
    g = _graph(fp8_amax_history_len=history)
    meta = [t for t in g.persistent if t.name == "fp8.scaling_meta"]
    assert [t.nbytes for t in meta] == [8 * 3 * (history + 2) * 4]
    ups = [op for op in g.ops if op.name.endswith("fp8.amax_scale_update")]
    assert [(op.phase.value, op.bytes_read) for op in ups] == [("fwd", 16 * (history + 2) * 4),
                                                               ("bwd", 8 * (history + 2) * 4)] * 2


def test_fp8_on_a_profile_without_an_fp8_fit_is_flagged():
    """The fitted H100 profile has bf16/fp16 GEMM fits only: fp8 GEMMs borrow the bf16 fit at the fp8 peak, said so."""
    from simulator.api import resolve_hardware, run_warnings

    cfg = scenario_from_dict(BASE)
    hw = resolve_hardware(cfg)
    assert "fp8" not in hw.profile.gemm and "bf16" in hw.profile.gemm
    w = [x for x in run_warnings(hw, cfg) if x.startswith("training.fp8:")]
    assert len(w) == 1 and "'h100-sxm-80gb' has no fp8 GEMM fit" in w[0] and "(1979 TFLOP/s)" in w[0]
    plain = scenario_from_dict({**BASE, "training": {**BASE["training"], "fp8": None}})
    assert not [x for x in run_warnings(resolve_hardware(plain), plain) if x.startswith("training.fp8:")]


# -- memory: what fp8 saves for backward, and what it adds ------------------------------------------------------------
# Transformer Engine's fp8 Linear (NVIDIA/TransformerEngine@0004dbd transformer_engine/pytorch/module/linear.py,
# _Linear.forward): the input is cast (and transposed) to fp8 and only the fp8 copy is saved for backward (the
# bf16 ``inputmat_no_fp8`` is saved only when wgrad is overridden to high precision), so per Linear of ``in x out``
# over ``T`` tokens the bf16 input saved by the plain Linear (2 T in bytes) becomes an fp8 one (T in). The weight
# goes into the module's cached fp8 workspace, resident for the whole run under Megatron (TELinear passes
# is_first_microbatch): the fp8 weight and, where fp8 GEMMs take only the TN layout (Hopper: compute capability 9.0;
# TE utils.py is_non_tn_fp8_gemm_supported), its transpose, both written by the forward's cast: ``c in out`` bytes
# with c = 2 on an H100 / H200, 1 on a B200 (compute capability 10.0).

def _peak_bytes(fp8: bool, h: int, T: int, gpu: str = "h100-sxm-80gb") -> int:
    spec = {**BASE, "hardware": {"gpu": gpu},
            "model": {"num_layers": 2, "hidden_size": h, "num_attention_heads": 7, "seq_length": T,
                      "vocab_size": 32000},
            # F.cross_entropy's 12 T V logits transient keeps the peak at the LM-head backward, all blocks' saved
            # tensors live (with Megatron's 6 T V it moves to the fp32 embedding gradient, after they are freed)
            "training": {**BASE["training"], "fp8": "hybrid" if fp8 else None, "cross_entropy": "pytorch"}}
    return run_scenario(scenario_from_dict(spec)).summary["peak_memory_allocated_bytes"]


@pytest.mark.parametrize("gpu,copies", [("h100-sxm-80gb", 2), ("b200-180gb", 1)])
@pytest.mark.parametrize("T", [256, 768])
def test_fp8_peak_memory_trade_by_hand(T, gpu, copies):
    """GPT block, hidden ``h`` = 448, 2 layers, peak at the LM-head backward (every block's saved tensors live).
    Per layer, fp8 adds its cached weight workspace: QKV 3h^2 + proj h^2 + fc1 4h^2 + fc2 4h^2 = 12 h^2 elements, at
    ``copies`` bytes each (H100: the fp8 weight and its transpose, 24 h^2 B; B200: the weight only, 12 h^2 B); it
    saves the four Linear inputs (ln1 out, attention out, ln2 out: T h each; gelu out: 4 T h) in fp8 (7 T h bytes)
    instead of bf16 (14 T h): net ``12 c h^2 - 7 T h``. Plus the resident scaling state: 8 Linears x 3 tensors x
    (1 + 2) x 4 B = 288 B. H100, T = 256: 2 x (4,816,896 - 802,816) + 288 = 8,028,448 B more; T = 768:
    2 x (4,816,896 - 2,408,448) + 288 = 4,817,184. B200, T = 768 = 12 h / 7: the two terms cancel exactly and only
    the 288 bytes of scaling state differ (a coincidence, not lost weight copies); T = 256: 3,211,552."""
    h = 448
    delta = _peak_bytes(True, h, T, gpu) - _peak_bytes(False, h, T, gpu)
    assert delta == 2 * (12 * copies * h * h - 7 * T * h) + 8 * 3 * 3 * 4
    assert delta == {(256, 2): 8_028_448, (768, 2): 4_817_184, (256, 1): 3_211_552, (768, 1): 288}[T, copies]


@pytest.mark.parametrize("gpu,copies", [("h100-sxm-80gb", 2), ("b200-180gb", 1)])
def test_the_cached_fp8_weight_workspace_is_resident_and_written_by_the_first_forward(gpu, copies):
    """Each of the 8 block Linears (2 layers x QKV, proj, fc1, fc2) has one persistent workspace of ``copies`` x
    in x out bytes (category ``workspace``), resident across steps; the first micro-batch's forward cast writes
    every copy of it (2 B read, ``copies`` B written per element), no op allocates or frees it, and the GEMMs that
    read it (the forward GEMMs of both micro-batches and the input-gradient GEMMs) wait for that cast."""
    from simulator.engine.memory import category

    g = build_graph(scenario_from_dict({**BASE, "hardware": {"gpu": gpu}}))
    h = 4096
    elems = {"qkv": 3 * h * h, "proj": h * h, "fc1": 4 * h * h, "fc2": 4 * h * h}
    ws = {t.name: t.nbytes for t in g.persistent if t.name.startswith("workspace.fp8_weight.")}
    assert ws == {f"workspace.fp8_weight.L{i}.{n}": copies * e for i in (0, 1) for n, e in elems.items()}
    assert {category(n) for n in ws} == {"workspace"}
    assert not [t for op in g.ops for t in op.allocs if "fp8_weight" in t.name or ".w_fp8" in t.name]
    for i in (0, 1):
        for n, e in elems.items():
            casts = [op for op in g.ops if op.name == f"L{i}.fwd.{n}.fp8_quantize_w"]
            assert [(c.bytes_read, c.bytes_written) for c in casts] == [(2 * e, copies * e)]
            readers = [op for op in g.ops if f"workspace.fp8_weight.L{i}.{n}" in op.uses]
            assert sorted(op.name for op in readers) == sorted([f"L{i}.fwd.{n}.gemm"] * 2 + [f"L{i}.bwd.{n}.dgrad"] * 2)
            assert all(casts[0].id in op.deps for op in readers)


@pytest.mark.parametrize("gpu,copies", [("h200-sxm-141gb", 2), ("b200-180gb", 1)])
def test_llama3_8b_b1_fp8_peak_against_bf16_by_hand(gpu, copies):
    """The bundled llama3_8b_b1 (2 Llama-3.1-8B layers, seq 8192): per layer its fp8 weight elements,
    4096 x (6144 + 4096 + 28672) + 14336 x 4096 = 218,103,808, equal the bytes its fp8-saved inputs spare,
    8192 x (3 x 4096 + 14336) = 218,103,808 B (2 B -> 1 B per element). So on the B200 (one cached copy) fp8 peaks
    only the 288 B of scaling state above bf16; on the H200 the cached transpose adds 218,103,808 B per layer more."""
    h, f, kv, T = 4096, 14336, 1024, 8192
    W = h * (h + 2 * kv + h + 2 * f) + f * h
    assert W == T * (3 * h + f) == 218_103_808
    path = pathlib.Path(__file__).resolve().parents[3] / "scenarios/h200/llama3_8b_b1.yaml"
    sets = [f"hardware.gpu={gpu}", "hardware.profile=null"]
    bf16 = run_scenario(load_scenario(path, sets)).summary["peak_memory_allocated_bytes"]
    fp8 = run_scenario(load_scenario(path, [*sets, "training.fp8=hybrid"])).summary
    assert fp8["peak_memory_allocated_bytes"] - bf16 == 2 * (copies - 1) * W + 2 * 4 * 3 * (1 + 2) * 4
    assert fp8["peak_memory_by_category_bytes"]["workspace"] == 2 * copies * W


def test_fp8_gemm_layout_of_the_fp8_gpu_presets():
    """Every GPU preset with an fp8 rate says whether its fp8 GEMMs are TN-only (Transformer Engine's
    is_non_tn_fp8_gemm_supported by compute capability): H100, H200 (9.0) and the MI300X (ROCm: always) yes,
    B200 (10.0) no."""
    from hardware_models import presets

    fp8 = {n: presets.get("gpus", n) for n in presets.list_presets("gpus")["gpus"]}
    fp8 = {n: g.fp8_gemm_tn_only for n, g in fp8.items() if "fp8" in g.peak_flops_per_s}
    assert fp8 == {"h100-sxm-80gb": True, "h200-sxm-141gb": True, "mi300x-192gb": True, "b200-180gb": False}


def test_an_unknown_fp8_gemm_layout_counts_two_copies_and_is_flagged():
    """A GPU given an fp8 rate but no fp8_gemm_tn_only (an A100 with an fp8 override here) counts the workspace at
    2 B per element (the Hopper case) and says so in one warning; the H100 and B200 presets are counted exactly and
    say nothing about it; bf16 runs say nothing."""
    def warn(s):
        return [x for x in s["warnings"] if x.startswith("training.fp8 memory")]

    a100 = {**BASE, "hardware": {"gpu": {"preset": "a100-sxm4-80gb",
                                         "overrides": {"peak_flops_per_s": {"fp8": "624 TFLOP/s"}}}}}
    g = build_graph(scenario_from_dict(a100))
    assert sum(t.nbytes for t in g.persistent if t.name == "workspace.fp8_weight.L0.qkv") == 2 * 3 * 4096 * 4096
    w = warn(run_scenario(scenario_from_dict(a100)).summary)
    assert len(w) == 1 and "does not say whether its fp8 GEMMs take only the TN layout" in w[0]
    for gpu in ("h100-sxm-80gb", "b200-180gb"):
        assert not warn(run_scenario(scenario_from_dict({**BASE, "hardware": {"gpu": gpu}})).summary)
    bf16 = run_scenario(scenario_from_dict({**BASE, "training": {**BASE["training"], "fp8": None}})).summary
    assert not [x for x in bf16["warnings"] if x.startswith("training.fp8")]


def test_a_b200_replica_or_stage_caches_one_fp8_copy_beside_h100s():
    """rank_overrides put a replica (dp_rank 3) or a pipeline stage (pp_rank 1) of a DGX H100 run on a B200: its
    graph caches one fp8 copy per weight element, the H100 ranks two (4 blocks of 12 x 2048^2 = 50,331,648
    Linear weight elements each: 402,653,184 B on an H100, 201,326,592 B on the B200), and the memory estimate
    of a B200 stage counts the same (PP2: 2 blocks per stage, 201,326,592 B on the H100 stage, 100,663,296 B on
    the B200 one)."""
    from simulator.api import rank_classes, resolve_hardware
    from simulator.studies.memory_estimate import estimate_memory

    dgx = {**BASE, "hardware": {"gpu": "h100-sxm-80gb", "cluster": {"preset": "dgx-h100", "nodes": 1}},
           "model": {"num_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 1024,
                     "vocab_size": 1024},
           "training": {"micro_batch_size": 4, "precision": "bf16", "fp8": "hybrid"}}
    E = 12 * 2048 * 2048
    cfg = scenario_from_dict({**dgx, "rank_overrides": [{"dp_rank": 3, "gpu": "b200-180gb"}]})
    got = {c.hw.gpu.name: sum(t.nbytes for t in build_graph(c.cfg, c.pp_rank, c.hw).persistent
                              if t.name.startswith("workspace.fp8_weight."))
           for c in rank_classes(cfg, resolve_hardware(cfg))}
    assert got == {"NVIDIA H100 SXM5 80GB": 2 * 4 * E, "NVIDIA B200 180GB": 4 * E}
    pp = scenario_from_dict({**dgx, "parallelism": {"pipeline_model_parallel_size": 2},
                             "training": {**dgx["training"], "global_batch_size": 64},
                             "rank_overrides": [{"pp_rank": 1, "gpu": "b200-180gb"}]})
    assert [st.by_category_bytes["workspace"] for st in estimate_memory(pp).stages] == [2 * 2 * E, 2 * E]


def test_fp8_under_deepspeed_zero_flags_the_megatron_workspace_caching():
    """DeepSpeed ZeRO-1/2 over data parallelism drives the model instead of Megatron, whose TELinear passes
    is_first_microbatch (what keeps TE's fp8 weight workspace cached): such a run says the caching is assumed;
    plain data parallelism (Megatron's DDP) does not."""
    dp8 = pathlib.Path(__file__).resolve().parents[3] / "scenarios/cluster/gpt_1p3b_dgx_h100_dp8.yaml"
    from simulator.api import resolve_hardware, run_warnings

    def warn(*sets):
        cfg = load_scenario(dp8, ["training.precision=bf16", "training.fp8=hybrid", *sets])
        return [x for x in run_warnings(resolve_hardware(cfg), cfg) if x.startswith("training.fp8 memory")]

    w = warn("zero_optimization.stage=2")
    assert len(w) == 1 and w[0].startswith("training.fp8 memory with DeepSpeed ZeRO-2:")
    assert not warn()
