"""Megatron tensor (+ sequence) parallelism and fp16 loss scaling: hand-worked collective counts and
bytes, parameters per rank, the vocab-parallel cross-entropy, exposed TP communication on a toy
machine, the rank groups of a cluster, and bad input."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest

from hardware_models.collectives import NcclConfig
from simulator.api import simulate_graph
from simulator.config.errors import ScenarioError
from simulator.config.loader import load_scenario, resolve_hardware
from simulator.cost.roofline import RooflineCostModel
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.ops import CostClass, OpKind
from tests.conftest import ROOT, make_hw

MLM20 = ROOT / "scenarios/validation/MLM20-GPT2-8.7B-TP8-8xA100.yaml"
# tiny model: L=2, h=64, a=4, f=256, s=16, b=2 (T = 32 tokens), V=1000
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000, ffn_hidden_size=256,
            micro_batch_size=2, precision="fp16")
BSH2 = 2 * 16 * 64 * 2  # b s h 16-bit activations: 4096 bytes


def _spec(**kw) -> TransformerSpec:
    return TransformerSpec(**{**TINY, **kw})


def _tp_ops(graph):
    return [o for o in graph.ops if o.stream == "comm.tp"]


def _per_layer(graph, layer: int) -> Counter:
    return Counter((o.meta["collective"], o.meta["bytes"]) for o in _tp_ops(graph) if o.layer == layer)


# -- collectives by hand ---------------------------------------------------------------------------
@pytest.mark.parametrize("recompute,n", [("none", 4), ("full", 6)])
def test_tp_all_reduces_per_layer_by_hand(recompute, n):
    # Megatron: 2 forward (after proj, fc2) + 2 backward (qkv, fc1 input gradients); full recompute repeats the 2
    # forward ones: 4 / 6 all-reduces of b s h x 2 bytes per layer per micro-batch, all on group "tp"
    g = build_gpt_step(_spec(tensor_parallel_size=2, recompute=recompute, num_micro_batches=2))
    for layer in (0, 1):
        assert _per_layer(g, layer) == {("all_reduce", BSH2): 2 * n}  # 2 micro-batches
    assert {o.meta["group"] for o in _tp_ops(g)} == {"tp"}
    assert all(o.kind is OpKind.COLLECTIVE for o in _tp_ops(g))


@pytest.mark.parametrize("recompute,n", [("none", 4), ("full", 6)])
def test_sequence_parallel_reduce_scatter_and_all_gather_of_the_same_volume(recompute, n):
    # every all-reduce becomes one reduce-scatter + one all-gather of the same b s h array
    g = build_gpt_step(_spec(tensor_parallel_size=2, sequence_parallel=True, recompute=recompute))
    assert _per_layer(g, 0) == {("reduce_scatter", BSH2): n, ("all_gather", BSH2): n}
    # LayerNorm and residual kernels run on s / t tokens: the residual output is b s h / t x 2 bytes
    res = [o for o in g.ops if o.name == "L0.fwd.residual2"][0]
    assert res.allocs[0].nbytes == BSH2 // 2
    # one all-reduce of the sequence-parallel grads per step: 2 layers x (2 LN x 2h + 2 row biases x h) + ln_f 2h,
    # in fp16 (Megatron's fp16 grad buffer, without --accumulate-allreduce-grads-in-fp32)
    ln = [o for o in _tp_ops(g) if "layernorm_grads" in o.name]
    assert [o.meta["bytes"] for o in ln] == [2 * (2 * (4 * 64 + 2 * 64) + 2 * 64)]


def test_embedding_lm_head_and_vocab_parallel_cross_entropy_collectives():
    # outside the blocks: the embedding output (fwd) and the LM-head input gradient (bwd) all-reduced (b s h x 2 B),
    # the cross-entropy's 3 all-reduces of b s fp32 (logit max, target logit, sum of exp), the found-inf flag and the
    # squared gradient norm (4 B each: Megatron reduces both over the model-parallel group, here the TP group)
    g = build_gpt_step(_spec(tensor_parallel_size=2))
    outside = Counter((o.name, o.meta["bytes"]) for o in _tp_ops(g) if o.layer == -1)
    assert outside == {
        ("fwd.tp.embed.all_reduce", BSH2): 1, ("bwd.tp.lm_head.grad.all_reduce", BSH2): 1,
        ("fwd.tp.ce.logits_max.all_reduce", 4 * 32): 1, ("fwd.tp.ce.predicted_logits.all_reduce", 4 * 32): 1,
        ("fwd.tp.ce.sum_exp_logits.all_reduce", 4 * 32): 1, ("opt.tp.loss_scale.found_inf.all_reduce", 4): 1,
        ("opt.tp.clip_grad.total_norm.all_reduce", 4): 1}
    # the logits are vocab-parallel: V padded to 128 x 2 = 256 -> 1024, 512 rows per rank
    logits = [o for o in g.ops if o.name == "fwd.logits.float"][0]
    assert logits.allocs[0].nbytes == 4 * 32 * 512
    assert build_gpt_step(_spec()).ops and not _tp_ops(build_gpt_step(_spec()))  # tp = 1: none


def test_parameters_per_rank_by_hand():
    # t = 2: per layer (3h^2 + h^2 + 2hf)/2 = 24576 weights, biases 3h/2 + h + f/2 + h = 352, 2 LN x 2h = 256
    # -> 25184; embedding 512 x 64 (V_p = 1024) + position 16 x 64 = 33792; final LN 128
    s = _spec(tensor_parallel_size=2)
    assert s.padded_vocab_size == 1024 and s.vocab_per_rank == 512
    assert s.layer_params == 25184
    assert s.num_parameters == 33792 + 2 * 25184 + 128 == 84288
    g = build_gpt_step(s)
    assert sum(p.numel for p in g.param_groups) == 84288
    pers = {t.name: t.nbytes for t in g.persistent}
    assert pers == {"params.fp16": 2 * 84288, "params.master_fp32": 4 * 84288, "optimizer.exp_avg": 4 * 84288,
                    "optimizer.exp_avg_sq": 4 * 84288}
    # tp = 1 keeps the vocabulary as given (no padding)
    assert _spec().num_parameters == 1000 * 64 + 16 * 64 + 2 * (4 * 64 * 64 + 2 * 64 * 256 + 5 * 64 + 256 + 256) + 128


def test_fp16_loss_scaling_kernels_and_fp16_gemms():
    s = _spec()
    g = build_gpt_step(s)
    gemms = [o for o in g.ops if o.cost_class is CostClass.GEMM]
    assert gemms and {o.dtype for o in gemms} == {"fp16"}
    chk = [o for o in g.ops if o.name == "opt.loss_scale.unscale_check"][0]
    assert (chk.bytes_read, chk.bytes_written) == (4 * s.num_parameters, 4 * s.num_parameters)
    assert [o.name for o in g.ops if o.name.endswith("loss_scale.scale")] == ["bwd.loss_scale.scale"]
    sync = [o for o in g.ops if o.name == "loss_scale.found_inf.item"][0]
    norm = [o for o in g.ops if o.name == "opt.clip_grad.l2norm"][0]  # clip_grad 1.0: the norm, then the adamw
    assert sync.kind is OpKind.SYNC and sync.id in norm.deps
    assert not [o for o in build_gpt_step(_spec(precision="bf16")).ops if "loss_scale" in o.name]
    # GEMMs are priced at the fp16 peak: a GPU with fp16 at twice its bf16 rate halves them
    hw = make_hw()
    fast = dataclasses.replace(hw.gpu, peak_flops_per_s={"bf16": 1e15, "fp16": 2e15, "fp32": 1e14})
    cm, cm2 = RooflineCostModel(hw.gpu, hw.profile), RooflineCostModel(fast, hw.profile)
    assert cm2.split_s(gemms[0])[0] == pytest.approx(cm.split_s(gemms[0])[0] / 2, rel=1e-12)


# -- the engine on a toy machine -------------------------------------------------------------------
class _ToyModel:
    """t = 10 us + bytes / 1 GB/s, no host dispatch."""

    def __init__(self, scale: float = 1.0):
        self.profile = SimpleNamespace(host_dispatch_s=0.0)
        self.scale = scale
        self.calls: list = []

    def price(self, op, group, nbytes, nccl):
        self.calls.append((op, tuple(group), nbytes))
        return SimpleNamespace(time_s=self.scale * (10e-6 + nbytes / 1e9))


def _toy_hw(tp: int, scale: float = 1.0):
    hw = make_hw()
    hw.collectives, hw.tp_group, hw.world_size = _ToyModel(scale), tuple(range(tp)), tp
    hw.nccl = NcclConfig(interference=False)  # the hand-worked times below have no interference
    return hw


def _priced(graph) -> float:
    return sum(10e-6 + o.meta["bytes"] / 1e9 for o in _tp_ops(graph))


@pytest.mark.parametrize("sp", [False, True])
def test_exposed_tp_comm_equals_its_priced_time(sp):
    # nothing overlaps a blocking TP collective: exposed = busy = the sum of the priced times
    g = build_gpt_step(_spec(tensor_parallel_size=2, sequence_parallel=sp, precision="bf16"))
    hw = _toy_hw(2)
    s = simulate_graph(g, hw, steps=1).summary
    assert s["comm_s_by_group"] == {"tp": pytest.approx(_priced(g), rel=1e-9)}
    assert s["exposed_comm_s"] == pytest.approx(_priced(g), rel=1e-9)
    assert {c[1] for c in hw.collectives.calls} == {(0, 1)}  # priced over the tp group


def test_tp2_is_faster_in_compute_and_adds_exactly_the_priced_comm():
    g1, g2 = build_gpt_step(_spec(precision="bf16")), build_gpt_step(_spec(tensor_parallel_size=2, precision="bf16"))
    t1 = simulate_graph(g1, make_hw(), steps=1).summary["step_time_s"]
    free = simulate_graph(g2, _toy_hw(2, scale=0.0), steps=1).summary["step_time_s"]  # comm priced at 0
    t2 = simulate_graph(g2, _toy_hw(2), steps=1).summary["step_time_s"]
    assert free < t1
    assert t2 - free == pytest.approx(_priced(g2), rel=1e-9)


# -- scenarios ---------------------------------------------------------------------------------------
def test_cluster_groups_follow_megatron_rank_order():
    # 2 DGX A100 nodes, tp 4: TP group = ranks 0-3 (inside node 0), DP group = 0, 4, 8, 12 (dp = 16 / 4)
    cfg = load_scenario(MLM20, ["hardware.cluster.nodes=2", "parallelism.tensor_model_parallel_size=4",
                                 "training.global_batch_size=64"])
    assert cfg.parallelism.data_parallel_size == 4
    hw = resolve_hardware(cfg)
    assert hw.tp_group == (0, 1, 2, 3) and hw.dp_group == (0, 4, 8, 12) and hw.world_size == 16


@pytest.mark.parametrize("sets,needle", [
    (["model.num_attention_heads=36", "model.hidden_size=4104"],
     "parallelism.tensor_model_parallel_size: 8 must divide model.num_attention_heads (36"),
    (["model.ffn_hidden_size=16388"], "parallelism.tensor_model_parallel_size: 8 must divide model.ffn_hidden_size"),
    (["parallelism.tensor_model_parallel_size=16", "hardware.cluster.nodes=2"],
     "16 must divide the 8 GPUs per node"),
    (["hardware.cluster=null"], "parallelism.tensor_model_parallel_size: 8 > 1 needs hardware.cluster"),
    (["training.precision=amp_fp32_params"], "needs training.precision bf16 or fp16"),
    (["zero_optimization.stage=1", "zero_optimization.offload_optimizer.device=cpu"], "8 > 1 with zero_optimization offload is not modelled"),
    (["parallelism.pipeline_model_parallel_size=2"], "parallelism.pipeline_model_parallel_size: tp 8 x pp 2 = 16 "
     "must divide the world size 8"),
    (["parallelism.context_parallel_size=2", "model.attention_backend=flash"],  # unfused with cp: a second rule
     "parallelism.context_parallel_size: tp 8 x pp 1 x cp 2 = 16 must "
     "divide the world size 8"),
    (["parallelism.expert_model_parallel_size=2"], "parallelism.expert_model_parallel_size: 2 > 1 needs model.num_experts"),
    (["parallelism.sequence_parallel=true", "model.seq_length=1028"], "parallelism.sequence_parallel: tensor_model"),
    (["parallelism.data_parallel_size=2"], "parallelism.data_parallel_size: 2 does not match"),
])
def test_bad_tp_input_is_one_line(sets, needle):
    with pytest.raises(ScenarioError) as exc:
        load_scenario(MLM20, sets)
    msg = str(exc.value)
    assert "\n" not in msg and needle in msg and str(MLM20) in msg, msg


def test_a_tp_size_breaking_several_rules_is_one_line_per_rule():
    """tp 3: neither the 8 GPUs per node nor the 32 heads nor the 16384 FFN width (one line before: the first)."""
    with pytest.raises(ScenarioError) as exc:
        load_scenario(MLM20, ["parallelism.tensor_model_parallel_size=3"])
    lines = str(exc.value).split("\n")
    assert [line.split(" (")[0].split(": ", 1)[1] for line in lines] == [
        "parallelism.tensor_model_parallel_size: 3 must divide the 8 GPUs per node of hardware.cluster 'dgx-a100'",
        "parallelism.tensor_model_parallel_size: 3 must divide model.num_attention_heads",
        "parallelism.tensor_model_parallel_size: 3 must divide model.ffn_hidden_size"]


@pytest.mark.parametrize("sets,needle", [
    (["model.num_attention_heads=20", "model.hidden_size=4000"],
     "parallelism.tensor_model_parallel_size: 8 must divide model.num_attention_heads (20"),
    (["model.ffn_hidden_size=16388"], "parallelism.tensor_model_parallel_size: 8 must divide model.ffn_hidden_size "
     "(16388"),
])
def test_bad_tp_input_exits_2_from_the_cli(sets, needle):
    r = subprocess.run([sys.executable, "-m", "simulator", "run", str(MLM20), *(a for x in sets for a in ("--set", x))],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("warning")]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_summary_blames_idle_gpu_on_exposed_communication():
    from simulator.cli import _busy_line

    s = {"utilisation": {"compute": 0.78}, "step_time_s": 1.0, "exposed_comm_s": 0.22, "phase_s": {}}
    assert _busy_line(s) == ["GPU busy            78 % of the step  (communication-bound: the GPU waits 220.00 ms/step "
                             "for collectives)"]


def test_summary_num_parameters_is_the_published_unsharded_count():
    """``num_parameters`` in the summary counts the whole model (no TP sharding, no vocabulary padding):
    Llama-3.1-8B 8,030,261,248 (Hugging Face model card); the MLM20 "8B" case 8.67 B (paper_cases.yaml)."""
    from simulator.api import model_num_parameters

    llama = load_scenario(ROOT / "scenarios/h200/llama3_8b_b1.yaml", ["model.num_layers=32"])
    assert model_num_parameters(llama) == 8_030_261_248
    tp8 = load_scenario(ROOT / "scenarios/validation/MLM20-GPT2-8.7B-TP8-8xA100.yaml")
    assert round(model_num_parameters(tp8) / 1e9, 2) == 8.67
