"""The thin API every study, the CLI and the notebooks call: scenario -> graph -> engine -> summary.

``load_scenario`` validates a scenario; ``run_scenario`` builds its step graph, applies its
policies, runs it on the engine and summarises the records. Touches no files.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import pandas as pd

from hardware_models.gpu import GpuSpec
from hardware_models.machine import Hardware
from hardware_models.power import nearest_clock
from simulator.analysis import metrics
from simulator.analysis.results import SimulationResult
from simulator.analysis.summary import summarize
from simulator.config.loader import load_scenario, resolve_hardware
from simulator.config.sections import torchtitan_ac
from simulator.config.sections.torchtitan_ac import recompute_of
from simulator.config.schema import (ScenarioConfig, attention_alias_note, clip_grad_of, cross_entropy_of,
                                     deepspeed_bf16_optimizer, deepspeed_fp16_optimizer, deepspeed_runs_step)
from simulator.engine.memory import DeviceMemoryOverheads, MemoryPool, default_overheads
from simulator.engine.run import SimulationError, gc_paused, run_graph
from simulator.graph.builders.attention import flash_dropout_note
from simulator.graph.builders.lora import LoraSpec, hf_names as lora_hf_names, trainable_parameters
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.builders.vit import VitShape
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import OpKind, OpRole
from simulator.policies import apply_graph_policies, build_runtime
from simulator.policies.registry import PolicyError, kernels_needed, policies_reuse_key
from simulator.recording.deferred import Deferred, DeferredField
from simulator.recording.recorder import dependencies_frame, dependency_columns, dependency_frame

__all__ = ["RankClass", "SimulationError", "build_graph", "load_scenario", "rank_classes", "run_scenario",
           "simulate_graph", "simulate_ranks", "transformer_spec"]


def transformer_spec(cfg: ScenarioConfig, pipeline_rank: int = 0) -> TransformerSpec:
    """The builder's view of a scenario's model, batch and precision, for pipeline stage ``pipeline_rank``."""
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    dp = p.data_parallel_size or 1
    z, ddp = cfg.zero_optimization, cfg.ddp
    per_step = t.micro_batch_size * dp
    shards = p.data_context_parallel_size  # the gradient reduce group (dp x cp), which ZeRO / FSDP shard over
    gbs = t.global_batch_size or per_step
    vit = vit_shape(cfg)
    fsdp2 = cfg.fsdp is not None and cfg.fsdp.version == 2  # torchtitan's FSDP2 and Llama (separate wq / wk / wv)
    return TransformerSpec(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        seq_length=m.seq_length, vocab_size=vit.num_classes if vit else m.vocab_size,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        micro_batch_size=t.micro_batch_size, num_micro_batches=gbs // per_step,
        tied_embeddings=not m.untie_embeddings_and_output_weights and vit is None, bias=m.add_bias_linear,
        precision=t.precision, optimizer_impl=t.optimizer.impl, clip_grad=clip_grad_of(cfg),
        clip_grad_norm_call=bool(t.clip_grad) and z.stage == 0 and (cfg.fsdp is None or shards == 1),
        accumulate_allreduce_grads_in_fp32=bool(ddp.accumulate_allreduce_grads_in_fp32),
        grad_reduce_in_bf16=ddp.grad_reduce_in_bf16, deepspeed_bf16_optimizer=deepspeed_bf16_optimizer(cfg),
        deepspeed_fp16_optimizer=deepspeed_fp16_optimizer(cfg),
        recompute=recompute_of(cfg)[0], recompute_every=recompute_of(cfg)[1],
        recompute_early_stop=torchtitan_ac.early_stop_of(cfg), data_parallel_size=dp,
        zero_stage=z.stage if shards > 1 else 0,
        ddp_first_bucket_bytes=int(ddp.first_bucket_mb * 2**20), ddp_bucket_cap_bytes=int(ddp.bucket_cap_mb * 2**20),
        overlap_grad_reduce=ddp.overlap_grad_reduce if z.stage == 0 else z.overlap_in(p.pipeline_model_parallel_size),
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        reduce_bucket_elements=z.reduce_bucket_size or 500_000_000,
        zero_ipg_buffers=z.ipg_buffers(p.pipeline_model_parallel_size),
        tensor_parallel_size=p.tensor_model_parallel_size, sequence_parallel=p.sequence_parallel,
        num_query_groups=m.query_groups if m.group_query_attention else None, swiglu=m.swiglu,
        normalization=m.normalization, position_embedding=m.position_embedding_type,
        max_position_embeddings=m.max_position_embeddings, qkv_bias=m.add_qkv_bias,
        sharding=sharding_spec(cfg) if shards > 1 else None,
        pipeline_parallel_size=p.pipeline_model_parallel_size, pipeline_rank=pipeline_rank,
        virtual_pipeline_size=p.chunks_per_rank, pipeline_schedule=p.schedule,
        pipeline_layers=tuple(p.pipeline_layers_per_stage) if p.pipeline_layers_per_stage else None,
        tp_comm_overlap={False: "none", True: "overlap", "fused": "fused"}[p.tp_comm_overlap],
        tp_async_grad_reduce=p.async_tensor_model_parallel_allreduce,
        context_parallel_size=p.context_parallel_size, cp_comm_type=p.cp_comm_type, fp8=t.fp8, fp8_amax_history_len=t.fp8_amax_history_len,
        fp8_param_gather=t.fp8_param_gather,
        fp8_weight_copies=fp8_weight_copies(stage_gpu(cfg, pipeline_rank)) if t.fp8 is not None else 2,
        num_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        expert_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=(p.expert_tensor_parallel_size or p.tensor_model_parallel_size
                                     if m.num_experts else 1),
        moe_shared_expert_gate=m.moe_shared_expert_gate, moe_layer_pattern=_moe_layer_pattern(m),
        moe_grouped_gemm=m.moe_grouped_gemm, moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_router_dtype=m.moe_router_dtype,
        moe_tokens_per_expert=tuple(m.moe_tokens_per_expert) if m.moe_tokens_per_expert is not None else None,
        kv_channels=m.kv_channels, window_size=m.window_size,
        lora=lora_spec(t.lora), causal=vit is None, vit=vit,
        attention_backend=m.attention_kernel, attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout,
        kernels=m.kernels, cross_entropy=cross_entropy_of(cfg),
        qkv_separate=fsdp2 or (t.lora is not None and lora_hf_names(tuple(t.lora.target_modules))),
        repeat_kv=m.repeat_kv if m.repeat_kv is not None else fsdp2,
    )


def stage_gpu(cfg: ScenarioConfig, pipeline_rank: int = 0) -> GpuSpec:
    """The GPU of pipeline stage ``pipeline_rank``: its ``rank_overrides`` ``gpu`` preset, else the scenario's
    (``hardware.gpu`` with its overrides). A replica's ``gpu`` override is applied by ``build_graph`` from its
    rank class's hardware.

    Raises:
        ScenarioError: the hardware presets do not resolve.
    """
    from hardware_models import presets

    name = next((o.gpu for o in cfg.rank_overrides if o.pp_rank == pipeline_rank and o.gpu is not None), None)
    return presets.get("gpus", name) if name is not None else resolve_hardware(cfg).gpu


def fp8_weight_copies(gpu: GpuSpec) -> int:
    """Bytes per element of Transformer Engine's cached fp8 weight workspace on ``gpu`` (``TransformerSpec.
    fp8_weight_copies``): 2 (the fp8 weight and its transpose) where its fp8 GEMMs are TN-only or that is not
    known (``GpuSpec.fp8_gemm_tn_only`` true or None: the larger, flagged by ``run_warnings``), 1 where they are
    not (Blackwell)."""
    return 1 if gpu.fp8_gemm_tn_only is False else 2


def _moe_layer_pattern(m) -> tuple[int, ...] | None:
    """``model.moe_layer_freq`` as one 0/1 per block (Megatron ``moe_layer_freq``: block ``i`` is MoE when ``i % N
    == 0``), ``None`` when every block is MoE (or without experts)."""
    f = m.moe_layer_freq
    pat = tuple(f) if isinstance(f, list) else tuple(int(i % f == 0) for i in range(m.num_layers))
    return None if not m.num_experts or all(pat) else pat


def lora_spec(lo) -> LoraSpec | None:
    """The builder's ``LoraSpec`` of a ``training.lora`` section (None without one)."""
    if lo is None:
        return None
    return LoraSpec(rank=lo.rank, alpha=lo.alpha, target_modules=tuple(lo.target_modules), dropout=lo.dropout)


def vit_shape(cfg: ScenarioConfig) -> VitShape | None:
    """The builder's ``VitShape`` of a scenario with ``model.architecture: vit`` (None for a decoder)."""
    m = cfg.model
    if m.architecture != "vit":
        return None
    return VitShape(m.image_size, m.patch_size, m.num_channels or 3, m.num_classes)


def zero3_head_numel(spec: TransformerSpec) -> int:
    """Elements of the modules between the last block's forward and its backward in DeepSpeed's ZeRO-3 trace: the
    final norm and the LM head's weight (the token table with tied embeddings), ``sharding.root_param_sizes``."""
    from simulator.graph.builders.sharding import root_param_sizes

    return sum(k for n, k in root_param_sizes(spec).items()
               if not n.startswith("wpe") and (spec.tied_embeddings or not n.startswith("wte")))


def sharding_spec(cfg: ScenarioConfig):
    """The builder's ``ShardingSpec`` of a scenario (ZeRO-3, FSDP, Megatron distributed optimizer), or None."""
    from simulator.graph.dtypes import DTYPE_BYTES
    from simulator.graph.builders.sharding import (ShardingSpec, layer_param_sizes, megatron_default_bucket_elements,
                                                   zero3_kept_after_forward, zero3_prefetch_depth)

    # sharded over the gradient reduce group: data x context parallel ranks (Megatron-LM with --context-parallel-size)
    dp = cfg.parallelism.data_context_parallel_size
    z, f, ddp = cfg.zero_optimization, cfg.fsdp, cfg.ddp
    if z.stage == 3:
        spec = transformer_spec(cfg.model_copy(update={"zero_optimization": z.model_copy(update={"stage": 0})}))
        thr = z.stage3_param_persistence_threshold
        unit = sum(k for k in layer_param_sizes(spec).values() if k > thr)
        d = zero3_prefetch_depth(unit, spec.num_layers, z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters)
        kept = frozenset()
        if z.offload_param.device == "none":  # with parameter offload every block is fetched again (run_warnings)
            kept = zero3_kept_after_forward(sum(layer_param_sizes(spec).values()), spec.num_layers,
                                            zero3_head_numel(spec), z.stage3_max_reuse_distance)
        return ShardingSpec("zero3", dp, fwd_prefetch_depth=d, bwd_prefetch="pre", bwd_prefetch_depth=d,
                            reshard_after_forward=True, reshard_root=True, persistence_threshold=thr,
                            kept_after_forward=kept)
    if f is not None:
        param, reduce = f.dtypes
        shard, rep = fsdp_mesh_of(cfg)
        if f.version == 2:
            return fsdp2_sharding_spec(f, shard, rep)
        st = f.sharding_strategy.lower()
        bp = {"BACKWARD_PRE": "pre", "BACKWARD_POST": "post", None: None}[f.backward_prefetch]
        fwd_depth = 1 if (f.limit_all_gathers or f.forward_prefetch) else None
        if st == "no_shard":  # the bf16 copy of every unit (root too) is freed by post_reshard after each pass
            return ShardingSpec("no_shard", dp, fwd_prefetch_depth=fwd_depth, bwd_prefetch=bp, bwd_prefetch_depth=1,
                                reshard_after_forward=True, reshard_root=True, param_bytes=DTYPE_BYTES[param],
                                sharded_param_bytes=4, grad_bytes=DTYPE_BYTES[reduce])
        return ShardingSpec(st, shard, rep, fwd_prefetch_depth=fwd_depth,
                            bwd_prefetch=bp, bwd_prefetch_depth=1, reshard_after_forward=f.reshards, reshard_root=False,
                            param_bytes=DTYPE_BYTES[param], sharded_param_bytes=4, grad_bytes=DTYPE_BYTES[reduce])
    if ddp.use_distributed_optimizer:
        b = ddp.bucket_size if ddp.bucket_size is not None else megatron_default_bucket_elements(
            dp, ddp.overlap_grad_reduce)
        return ShardingSpec("distributed_optimizer", dp, grad_bytes=4, bucket_elements=b,
                            overlap_param_gather=ddp.overlap_param_gather)
    return None


def fsdp_mesh_of(cfg: ScenarioConfig) -> tuple[int, int]:
    """``(shard_size, replicate_size)`` of a scenario's FSDP mesh in ranks of the gradient-reduce group (dp x cp):
    ``config.sections.fsdp.fsdp_mesh`` with the node's ranks (``cfg_node_ranks``)."""
    from simulator.config.sections.fsdp import fsdp_mesh

    p = cfg.parallelism
    return fsdp_mesh(cfg.fsdp, p.data_parallel_size or 1, p.context_parallel_size, len(cfg_node_ranks(cfg)),
                     p.data_parallel_shard_degree, p.data_parallel_replicate_degree)


def fsdp2_sharding_spec(f, shard: int, rep: int):
    """The ``ShardingSpec`` of FSDP2 (``fsdp.version: 2``, ``simulator/graph/builders/fsdp2.py``): HSDP when
    replicated, else FULL_SHARD (SHARD_GRAD_OP with ``reshard_after_forward`` false); per-parameter padding, the
    copy-in / copy-out kernels; forward prefetch 2 units ahead (``fsdp2.FORWARD_PREFETCH_DEPTH``), backward the
    previous unit; an int ``reshard_after_forward`` r (1 < r < shard) keeps each block's 1/r shard after forward and
    all-gathers it over r consecutive shard ranks (``dp_post_forward``) in backward."""
    from simulator.graph.dtypes import DTYPE_BYTES
    from simulator.graph.builders.fsdp2 import FORWARD_PREFETCH_DEPTH
    from simulator.graph.builders.sharding import ShardingSpec

    param, reduce = f.dtypes
    raf = f.reshard_after_forward
    post = raf if isinstance(raf, int) and not isinstance(raf, bool) and 1 < raf < shard else 0
    reshards = f.reshards and (not isinstance(raf, int) or isinstance(raf, bool) or raf > 1)
    st = "hybrid_shard" if rep > 1 else ("full_shard" if reshards else "shard_grad_op")
    return ShardingSpec(st, shard, rep, fwd_prefetch_depth=FORWARD_PREFETCH_DEPTH, bwd_prefetch="pre",
                        bwd_prefetch_depth=1, reshard_after_forward=reshards, reshard_root=False,
                        param_bytes=DTYPE_BYTES[param], sharded_param_bytes=4, grad_bytes=DTYPE_BYTES[reduce],
                        version=2, post_forward_size=post)


def cfg_node_ranks(cfg: ScenarioConfig) -> tuple[int, ...]:
    """Data-parallel ranks of the representative rank's node (HYBRID_SHARD's shard group)."""
    from simulator.config.schema import world_size_of

    c = cfg.hardware.cluster
    world = world_size_of(c) if c is not None else 1
    per_node = (world or 1) // (c.nodes if c is not None else 1)
    tp = cfg.parallelism.tensor_model_parallel_size
    return tuple(range(0, per_node, tp))


def model_num_parameters(cfg: ScenarioConfig) -> int:
    """Parameters of the whole model, unsharded and with the vocabulary as given (no tensor-parallel
    padding): the count a model card publishes (Llama-3.1-8B: 8,030,261,248)."""
    return _whole_model(cfg).num_parameters


def _whole_model(cfg: ScenarioConfig) -> TransformerSpec:
    """The scenario's spec on one rank holding everything (tp 1, ep 1, dp 1, one pipeline stage)."""
    return dataclasses.replace(transformer_spec(cfg), tensor_parallel_size=1, sequence_parallel=False,
                               tp_comm_overlap="none", expert_parallel_size=1, expert_tensor_parallel_size=1,
                               data_parallel_size=1, zero_stage=0,
                               sharding=None, pipeline_parallel_size=1, virtual_pipeline_size=1,
                               pipeline_schedule="1f1b", pipeline_layers=None, context_parallel_size=1)


def megatron_flops_per_s_per_gpu(cfg: ScenarioConfig, summary: dict) -> float | None:
    """Achieved FLOP/s per GPU counted the Megatron-LM papers' way (``metrics.megatron_flops_per_step``:
    Narayanan et al. 2021 eq. 3 with full recompute), the figure they publish as "TFLOP/s per GPU":
    iteration FLOPs / (``step_time_s`` x ``world_size``). None for a model the formula does not
    describe (FFN not 4h, SwiGLU, grouped-query attention; LoRA, which skips the weight gradients the formula
    counts) or a run without a step time."""
    m, t = cfg.model, cfg.training
    gpt_shaped = (m.ffn_hidden_size in (None, 4 * m.hidden_size) and not m.swiglu and not m.group_query_attention
                  and t.lora is None and m.architecture == "decoder")
    if not gpt_shaped or not summary["step_time_s"]:
        return None
    batch = t.global_batch_size or t.micro_batch_size * (cfg.parallelism.data_parallel_size or 1)
    flops = metrics.megatron_flops_per_step(batch, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size,
                                            recompute_of(cfg) == ("full", 1))
    return flops / (summary["step_time_s"] * summary["world_size"])


def build_graph(cfg: ScenarioConfig, pipeline_rank: int = 0, hw: Hardware | None = None) -> OpGraph:
    """The step graph of a scenario's pipeline stage ``pipeline_rank`` (before its policies); inside
    ``reusing_graphs`` a graph built for the same ``TransformerSpec`` earlier is returned again.

    ``hw``: the stage's machine; given, at ``run.fidelity: layer`` with no other graph policy reading kernels
    (``policies.registry.kernels_needed``), the builder stamps repeated layer passes as their blocks
    (``build_gpt_step(blocks=True)``: the graph the layer-fidelity policy makes is the same)."""
    spec = transformer_spec(cfg, pipeline_rank)
    if hw is not None and spec.fp8 is not None:  # the rank class's GPU (a replica's rank_overrides gpu)
        spec = dataclasses.replace(spec, fp8_weight_copies=fp8_weight_copies(hw.gpu))
    blocks = hw is not None and getattr(cfg.run, "fidelity", "kernel") == "layer" and not kernels_needed(cfg)
    how = {"blocks": blocks, "fold_tp": blocks and getattr(hw, "collectives", None) is not None}
    if not _GRAPHS.on:
        return build_gpt_step(spec, **how)
    key = (spec, *how.values())
    graph = _GRAPHS.graphs.pop(key, None)
    if graph is None:
        graph = build_gpt_step(spec, **how)
    _GRAPHS.keep(key, graph)
    return graph


def policy_graph(cfg: ScenarioConfig, pipeline_rank: int, hw: Hardware) -> OpGraph:
    """``build_graph`` of the stage rewritten by the scenario's graph policies (``apply_graph_policies``). Inside
    ``reusing_graphs`` the rewritten graph is kept too, by the built graph and what the policies read
    (``policies_reuse_key``: a sweep's points that differ in clocks or dataloader workers rewrite one graph
    once); when a policy does not say what it reads, or refuses the settings, it is rewritten afresh.

    Raises:
        PolicyError: as ``apply_graph_policies``.
    """
    graph = build_graph(cfg, pipeline_rank, hw)
    try:
        reads = policies_reuse_key(cfg, hw) if _GRAPHS.on else None
    except PolicyError:  # rewritten afresh below: the error apply_graph_policies gives, in its order
        reads = None
    if reads is None:
        return apply_graph_policies(graph, cfg, hw)
    key = ("policies", id(graph), reads)  # the built graph is held by the entry: its id is not reused meanwhile
    held = _GRAPHS.graphs.pop(key, None)
    if held is None or held[0] is not graph:
        held = (graph, apply_graph_policies(graph, cfg, hw))
    _GRAPHS.keep(key, held)
    return held[1]


class _GraphCache:
    """Built step graphs by ``TransformerSpec`` (the builder's whole input: ``build_gpt_step`` is a pure function
    of it, and an ``OpGraph`` is immutable, policies rewrite copies), and graphs rewritten by the policies
    (``policy_graph``: an entry holds the built graph and the rewritten one), least recently used last out, at
    most ``MAX_OPS`` ops in all (a few hundred bytes each). Used only inside ``reusing_graphs``."""

    MAX_OPS = 200_000

    def __init__(self) -> None:
        # (spec, blocks, fold_tp) -> built graph; ("policies", id(built), reads) -> (built, rewritten)
        self.graphs: dict[tuple, OpGraph | tuple[OpGraph, OpGraph]] = {}
        self.on = 0

    def keep(self, key: tuple, graph: OpGraph | tuple[OpGraph, OpGraph]) -> None:
        self.graphs[key] = graph  # most recent last
        total = sum(map(self.ops, self.graphs.values()))
        while total > self.MAX_OPS and self.graphs:
            total -= self.ops(self.graphs.pop(next(iter(self.graphs))))

    @staticmethod
    def ops(entry: OpGraph | tuple[OpGraph, OpGraph]) -> int:
        """Ops an entry holds (a rewritten graph's entry: both graphs, the built one counted again if its own
        entry is still there: the bound errs on the small side)."""
        return len(entry[0]) + len(entry[1]) if isinstance(entry, tuple) else len(entry)


_GRAPHS = _GraphCache()


@contextmanager
def reusing_graphs():
    """Inside the block ``build_graph`` reuses step graphs across runs (a sweep's points that differ only in
    hardware, clocks, dataloader or other settings the builder does not read build one graph, not one each).
    The results are those of fresh builds. The graphs stay cached for the next block in this process;
    ``forget_graphs`` drops them."""
    _GRAPHS.on += 1
    try:
        yield
    finally:
        _GRAPHS.on -= 1


def forget_graphs() -> None:
    """Drop the graphs ``reusing_graphs`` kept."""
    _GRAPHS.graphs.clear()


def simulate_graph(graph: OpGraph, hw: Hardware, steps: int, warmup_steps: int = 0, seed: int = 0,
                   config: dict | None = None, cfg: ScenarioConfig | None = None) -> SimulationResult:
    """Run ``steps`` repetitions of ``graph`` on ``hw`` and summarise.

    Args:
        graph: Step graph.
        hw: Machine specs.
        steps: Steps to simulate (>= 1).
        warmup_steps: Leading steps excluded from the metrics.
        seed: Seed of the run's random generator (stochastic models draw from it).
        config: Resolved config to attach to the result.
        cfg: The scenario, when there is one: runtime components (DVFS, dataloader...) attach from it.

    Raises:
        SimulationError: the engine failed.
    """
    attach = (lambda env, system: build_runtime(cfg, hw, env, system)) if cfg is not None else None
    # CUDA context and allocator reserve: from the scenario's memory section (documented defaults);
    # a bare graph run (no scenario) counts tensors only
    overheads = memory_overheads(cfg) if cfg is not None else DeviceMemoryOverheads()
    with gc_paused():  # the run and its summary (see simulator.engine.run.gc_paused)
        rec, runtime = run_graph(graph, hw, steps, seed, attach, overheads)
        step_df = rec.steps  # this run's own frame: the column added in place (``assign`` would copy it first)
        step_df["warmup"] = step_df["step"].to_numpy() < warmup_steps
        summary = summarize(graph, hw, rec.memory, rec.spans, step_df)
        summary["warnings"] = run_warnings(hw, cfg, host_copy_bytes([graph]))
        if cfg is not None:
            summary.update(scenario_keys(cfg, summary))
        counters = DeferredField.raw(rec, "counters")  # built when read: the components' summaries do not need it
        for comp in runtime.components:
            if hasattr(comp, "summarize"):
                summary.update(comp.summarize(spans=rec.spans, steps=step_df, counters=counters, summary=summary))
        summary["warnings"] += component_warnings(runtime)
        summary.update(metrics.job_energy_per_work(summary))
    # the dependencies frame is built when read (nothing in the run reads it), from its columns (the thunk does not
    # hold the graph)
    return SimulationResult(summary, rec.spans, counters, step_df, config or {}, DeferredField.raw(rec, "launches"),
                            Deferred(partial(dependency_frame, dependency_columns(graph))))


@dataclass(frozen=True)
class RankClass:
    """Ranks that behave identically, simulated by one representative.

    Attributes:
        label: What it stands for (``"pp_rank 2"``, ``"dp_rank 3"``, ``"dp ranks (others)"``; both with
            pipelines and data-parallel classes: ``"pp_rank 2 / dp_rank 3"``).
        pp_rank: Its pipeline stage.
        dp_class: Its data-parallel class (0: the replicas not overridden; one per overridden replica, or
            per replica with ``run.rank_folding: none``).
        hw: Its machine (``Hardware.for_pipeline_rank``, with the overrides' ``slowdown``).
        cfg: Its scenario (an override's ``dvfs`` in place of the scenario's).
        replicas: Data-parallel replicas it stands for.
        shard_group: With FSDP HYBRID_SHARD across nodes: the shard group (node) of its replicas, where they meet
            the other classes of that group at the ``dp_shard`` collectives; None: replicas of groups without an
            overridden replica (they meet nobody there) or no shard groups.
        graph_hw: The machine its step graph is built for: ``hw`` before the overrides' ``slowdown``, which only
            the engine's cost model reads (``simulator.engine.system``), so that a class that differs from its
            stage's others by a slowdown alone shares their built graph (``run_scenario``); None: ``hw``.
    """

    label: str
    pp_rank: int
    dp_class: int
    hw: Hardware
    cfg: ScenarioConfig
    replicas: int
    shard_group: int | None = None
    graph_hw: Hardware | None = None


def rank_classes(cfg: ScenarioConfig, hw: Hardware) -> list[RankClass]:
    """The rank classes of a scenario, stage-major: for every pipeline stage (with its ``rank_overrides``
    entry), the data-parallel classes: one for the replicas not overridden and one per overridden replica
    (``run.rank_folding: none``: one per replica). The slowdowns of a stage and a replica override
    multiply; a dvfs override applies to its ranks."""
    by_pp = {o.pp_rank: o for o in cfg.rank_overrides if o.pp_rank is not None}
    by_dp = {o.dp_rank: o for o in cfg.rank_overrides if o.dp_rank is not None}
    pp, dp = cfg.parallelism.pipeline_model_parallel_size, cfg.parallelism.data_parallel_size or 1
    shard = _hybrid_shard_size(cfg)  # HYBRID_SHARD across nodes: dp ranks per shard group (node), else None
    if cfg.run.rank_folding == "none":
        dp_classes = [(f"dp_rank {j}", 1, by_dp.get(j), j // shard if shard else None) for j in range(dp)]
    elif shard and by_dp:  # the overridden replicas' shard-group peers are their own classes (they wait at the
        # dp_shard collectives); the replicas of the other groups are one class
        hit = sorted({j // shard for j in by_dp})
        rest = dp - shard * len(hit)
        dp_classes = [("dp ranks (others)", rest, None, None)] if rest else []
        for g in hit:
            peers = shard - sum(1 for j in by_dp if j // shard == g)
            if peers:
                dp_classes.append((f"dp ranks (others, shard group {g})", peers, None, g))
        dp_classes += [(f"dp_rank {j}", 1, o, j // shard) for j, o in sorted(by_dp.items())]
    else:
        dp_classes = [("dp ranks (others)" if by_dp else "", dp - len(by_dp), None, None)]
        dp_classes += [(f"dp_rank {j}", 1, o, None) for j, o in sorted(by_dp.items())]
    out = []
    for r in range(pp):
        stage_hw = hw.for_pipeline_rank(r) if pp > 1 else hw
        for c, (dp_label, replicas, o_dp, group) in enumerate(dp_classes):
            overrides = [o for o in (by_pp.get(r), o_dp) if o is not None]
            slow = 1.0
            for o in overrides:
                slow *= o.slowdown
            dvfs = next((o.dvfs for o in overrides if o.dvfs is not None), None)
            gpu = next((o.gpu for o in overrides if o.gpu is not None), None)
            label = " / ".join(x for x in (f"pp_rank {r}" if pp > 1 else "", dp_label) if x) or "all ranks"
            class_hw = stage_hw if gpu is None else other_gpu(stage_hw, gpu)
            out.append(RankClass(label, r, c, dataclasses.replace(class_hw, slowdown=slow) if slow != 1.0 else class_hw,
                                 cfg.model_copy(update={"dvfs": dvfs}) if dvfs is not None else cfg, replicas, group,
                                 class_hw))
    return out


def _hybrid_shard_size(cfg: ScenarioConfig) -> int | None:
    """Data-parallel ranks of one FSDP HYBRID_SHARD shard group (a node's) when the shards are replicated across
    nodes, else None (no shard groups to tell apart)."""
    if cfg.fsdp is None or (cfg.parallelism.data_parallel_size or 1) < 2:
        return None
    sh = sharding_spec(cfg)
    return sh.shard_size if sh.replicate_size > 1 else None


def other_gpu(hw: Hardware, name: str) -> Hardware:
    """``hw`` with the GPU preset ``name`` in place of its GPU (a ``rank_overrides`` ``gpu``): that GPU's spec and
    its shipped efficiency profile (else the generic one, ``loader.default_profile_for``); the host, links and
    collective model stay ``hw``'s. The preset was checked by the schema (``ScenarioConfig._override_gpu_scope``)."""
    from hardware_models import presets
    from simulator.config.loader import default_profile_for

    gpu = presets.get("gpus", name)
    return dataclasses.replace(hw, gpu=gpu, profile=default_profile_for(gpu, name, hw.pcie))


def _meet_across_classes(graph: OpGraph, stage: int, dp_class: int, dp_classes: int, shard_group: int | None = None,
                         shard_parties: int = 0) -> OpGraph:
    """The graph of one rank class among ``dp_classes`` per stage: its data-parallel collectives become
    rendezvous of the stage's classes (a collective starts when the last class's replica arrives, as the NCCL
    collective does), and its pipeline rendezvous (send/recv, cross-stage all-reduces) meet only the same
    class's pipeline (replica ``j`` of stage ``r`` talks to replica ``j`` of stage ``r + 1``); a ``world``
    all-reduce (the distributed optimizer's gradient norm) meets every class of every stage. FSDP HYBRID_SHARD:
    a ``dp_shard`` collective (inside one node) meets only the ``shard_parties`` classes of its ``shard_group``
    (none for a class of the groups without an overridden replica); ``dp_replicate`` ones meet every class. FSDP2's
    ``dp_post_forward`` gathers (a part of a shard group) meet as the shard group's do (approximated: every class of
    that shard group waits, not only those of the part)."""
    if dp_classes == 1:
        return graph
    ops = []
    for op in graph.ops:
        m = op.meta
        if m and "rendezvous" in m and m.get("group") == "world":  # every class of every stage meets there
            op = dataclasses.replace(op, meta={**m, "parties": m["parties"] * dp_classes})
        elif m and "rendezvous" in m:
            op = dataclasses.replace(op, meta={**m, "rendezvous": (*m["rendezvous"], dp_class)})
        elif m and m.get("group") in ("dp_shard", "dp_post_forward") and shard_parties:
            if shard_group is not None and shard_parties > 1:
                op = dataclasses.replace(op, meta={**m, "rendezvous": ("dp_shard", stage, shard_group, op.id),
                                                   "parties": shard_parties})
        elif m and m.get("group") in ("dp", "dp_shard", "dp_replicate", "dp_post_forward", "ep", "tp_ep", "edp", "world"):
            op = dataclasses.replace(op, meta={**m, "rendezvous": ("dp", stage, op.id), "parties": dp_classes})
        ops.append(op)
    return graph.with_changes(ops=tuple(ops))


def _class_runtime(c: RankClass, cfg: ScenarioConfig):
    """``attach(env, system)`` for one rank class: its runtime components; a bad value in an override's own
    ``dvfs`` is reported under ``rank_overrides`` with the class named."""
    def attach(env, system):
        try:
            return build_runtime(c.cfg, system.hw, env, system)
        except PolicyError as exc:
            if c.cfg is cfg:
                raise
            raise PolicyError(f"rank_overrides ({c.label}): {exc}") from None
    return attach


def simulate_ranks(classes: list[RankClass], graphs: list[OpGraph], cfg: ScenarioConfig) -> SimulationResult:
    """Run a scenario's rank classes side by side (``engine.run.run_ranks``) and summarise.

    Pipeline stages: each stage is one representative rank (its TP and DP peers folded), with its own GPU,
    host thread, memory and runtime components (DVFS); the stages meet at their send/recv and cross-stage
    all-reduces; the summary is ``analysis.pipeline.combine_stages``, and the result's spans, counters,
    launches and dependencies are every stage's with a ``pp_rank`` column. Data-parallel classes
    (``rank_overrides`` by ``dp_rank``, ``run.rank_folding: none``): a stage's classes meet at its
    data-parallel collectives, each class's pipeline at its own send/recv; the summary is
    ``combine_classes`` (one stage) or ``combine_stages`` of each stage's first class (its phase compute time the
    mean over the stage's replicas, ``stage_summaries``) plus
    ``rank_classes`` and ``straggler``; the frames carry ``rank_class`` (the simulated rank's index) and
    ``dp_class`` columns. The job's steps are ``combined_steps`` (``step_time_s`` the period of the last rank's
    step ends; ``step_latency_s`` exceeds it by the steps' overlap only); a pipeline's summary adds
    ``pipeline.step_end_spread_s`` (how far the stages' step ends lie apart) and ``pipeline.step_overlap_s``
    (``step_latency_s - step_time_s``).

    Raises:
        SimulationError: the engine failed (a deadlock names the rendezvous).
    """
    from simulator.analysis.pipeline import (add_classes, combine_classes, combine_stages, combined_steps,
                                             compute_clock_mhz, first_op_s, phase_compute_s, pipeline_bubble_s,
                                             stage_idle_split, stage_summaries, step_end_spread_s)
    from simulator.engine.run import run_ranks

    run, p = cfg.run, cfg.parallelism
    pp = p.pipeline_model_parallel_size
    n_dp = len(classes) // pp
    hws = [c.hw for c in classes]
    attach = [_class_runtime(c, cfg) for c in classes]
    with gc_paused():
        runs = run_ranks(graphs, hws, run.steps, run.seed, attach, memory_overheads(cfg))
        parts, frames = [], {"spans": [], "counters": [], "launches": [], "deps": []}
        part_steps, first_ops, notes = [], [], []
        for i, ((rec, runtime), g, h, c) in enumerate(zip(runs, graphs, hws, classes)):
            step_df = rec.steps.assign(warmup=rec.steps.step < run.warmup_steps)
            summ = summarize(g, h, rec.memory, rec.spans, step_df)
            counters = DeferredField.raw(rec, "counters")  # built when read (as ``simulate``): no summary needs it
            for comp in runtime.components:
                if hasattr(comp, "summarize"):
                    summ.update(comp.summarize(spans=rec.spans, steps=step_df, counters=counters, summary=summ))
            notes.append((c.label, component_warnings(runtime)))
            summ["pipeline_bubble_s"] = pipeline_bubble_s(rec.spans, step_df)
            summ["phase_compute_s"] = phase_compute_s(rec.spans, step_df)
            if pp > 1:  # the stage's idle split into waits for other stages and host gaps (labels only)
                summ.update(stage_idle_split(rec.spans, rec.launches, step_df))
                if (mhz := compute_clock_mhz(rec.spans, rec.samples, step_df)) is not None:  # (clock rows alone)
                    summ["compute_clock_mhz"] = mhz  # the clock its compute ran at (DVFS: the stages' clocks differ)
            parts.append(summ)
            part_steps.append(step_df)
            first_ops.append(first_op_s(rec.spans, run.steps))
            cols = {"rank_class": i, "pp_rank": c.pp_rank, "dp_class": c.dp_class}
            if pp == 1:
                del cols["pp_rank"]
            if n_dp == 1:
                cols.pop("dp_class")
                cols.pop("rank_class")
            for key, df in (("spans", rec.spans), ("counters", counters), ("launches", DeferredField.raw(rec, "launches")),
                            ("deps", dependencies_frame(g))):
                frames[key].append((df, cols))
        steps = combined_steps(part_steps, first_ops)
        common = dict(samples_per_step=graphs[0].samples_per_step, tokens_per_step=graphs[0].tokens_per_step,
                      model_flops_per_step=graphs[0].model_flops_per_step, peak_flops_per_s=hws[0].gpu.peak("bf16"))
        labels, replicas = [c.label for c in classes], [c.replicas for c in classes]
        slowdowns = [c.hw.slowdown for c in classes]
        if pp > 1:
            first = [k for k, c in enumerate(classes) if c.dp_class == 0]  # each stage's first class
            models = [graphs[k].model for k in first]
            summary = combine_stages(  # each stage's phase compute time over all its replicas (stage_summaries)
                stage_summaries(parts, [c.pp_rank for c in classes], replicas), steps,
                layers=[m.rank_layers for m in models], schedule=p.schedule, virtual=p.chunks_per_rank,
                micro_batches=models[0].num_micro_batches,
                ranks_per_stage=len(hws[0].dp_group) * len(hws[0].tp_group), **common)
            summary["pipeline"].update(step_end_spread_s=step_end_spread_s(part_steps),
                                       step_overlap_s=summary["step_latency_s"] - summary["step_time_s"])
            for row, k in zip(summary["pipeline"]["stages"], first):
                row["slowdown"] = classes[k].hw.slowdown
                row["gpu"] = classes[k].hw.gpu.name
                row["dvfs"] = classes[k].cfg.dvfs.kind if classes[k].cfg.dvfs is not None else None
                if n_dp > 1:  # the stage's figures are its first data-parallel class's (but phase_compute_s, over
                    # every replica): named (``rank_classes``)
                    row["rank_class"] = classes[k].label.removeprefix(f"pp_rank {classes[k].pp_rank} / ")
            if cfg.rank_overrides and n_dp == 1:  # an overridden stage: the one the others wait for
                stages = summary["pipeline"]["stages"]
                summary["straggler"] = f"pp_rank {min(stages, key=lambda st: st['pipeline_bubble_s'])['pp_rank']}"
            if n_dp > 1:  # data-parallel classes in every stage: the worst memory, every class, the straggler
                add_classes(summary, parts, labels=labels, replicas=replicas, slowdowns=slowdowns,
                            groups=[c.pp_rank for c in classes], gpus_per_replica=len(hws[0].tp_group))
        else:
            summary = combine_classes(parts, steps, labels=labels, replicas=replicas, slowdowns=slowdowns,
                                      gpus_per_replica=len(hws[0].tp_group), **common)
        summary["warnings"] = run_warnings(hws[0], cfg, host_copy_bytes(graphs)) + class_warnings(notes)
        summary.update(scenario_keys(cfg, summary))
        summary.update(metrics.job_energy_per_work(summary))
        # the stages' counters and launches stacked when read (``SimulationResult``'s deferred fields)
        spans, deps = _stacked(frames["spans"]), _stacked(frames["deps"])
        counters, launches = Deferred(partial(_stacked, frames["counters"])), Deferred(partial(_stacked, frames["launches"]))
    return SimulationResult(summary, spans, counters, steps, resolved_config(cfg), launches, deps)


def _stacked(parts: list[tuple]) -> pd.DataFrame:
    """The frames of ``parts`` (each ``(frame, columns)``: a frame or a ``recording.deferred.Deferred`` of one, and
    the columns to add to its rows, ``DataFrame.assign``) one after another, renumbered from 0."""
    return pd.concat([(f.value() if isinstance(f, Deferred) else f).assign(**cols) for f, cols in parts],
                     ignore_index=True)


def resolved_config(cfg: ScenarioConfig) -> dict:
    """The scenario with every value in force, as a JSON-able dict (``SimulationResult.config``, written as
    ``config.resolved.yaml``): ``cfg.model_dump``, which leaves out a ``zero_optimization`` section the scenario
    did not give (``ScenarioConfig._dump_without_unwritten_deepspeed``: its presence decides who runs the step)."""
    return cfg.model_dump(mode="json")


def class_warnings(per_class: list[tuple[str, list[str]]]) -> list[str]:
    """The component warnings of a run's rank classes (``(label, lines)`` each), one line per class prefixed with
    its label; a line every class has (the same words: a power limit equal to the TDP on every stage) once, without
    a label."""
    shared = set(per_class[0][1]).intersection(*(set(w) for _, w in per_class[1:])) if len(per_class) > 1 else set()
    out = [w for w in per_class[0][1] if w in shared] if shared else []
    return out + [f"{label}: {w}" for label, lines in per_class for w in lines if w not in shared]


def component_warnings(runtime) -> list[str]:
    """What a run's runtime components flag about their own figures (``warnings()`` of each component that has
    one, called after its ``summarize``; e.g. ``DvfsRuntime.warnings``: a power limit not held)."""
    return [w for comp in runtime.components if hasattr(comp, "warnings") for w in comp.warnings()]


def data_parallel_strategy(cfg: ScenarioConfig) -> str:
    """How the gradient reduce group (the data x context parallel ranks: context-parallel ranks hold other tokens
    of the same sequences, so their gradients are reduced together) holds the model states: ``DDP``, ``DeepSpeed
    ZeRO-<stage>``, ``DeepSpeed BF16_Optimizer`` (stage 0, bf16 and a pipeline: ``schema.deepspeed_bf16_optimizer``),
    ``DeepSpeed FP16_Optimizer`` (stage 0 with fp16, or bf16 without a pipeline: ``schema.deepspeed_fp16_optimizer``),
    ``FSDP <strategy>`` (HYBRID_SHARD: ``(replicas x shard)``), ``FSDP2 fully_shard (...)``, ``Megatron distributed
    optimizer`` (``none`` when that group is one rank: no gradient reduction)."""
    if cfg.parallelism.data_context_parallel_size == 1:
        return "none"
    if cfg.fsdp is not None and cfg.fsdp.version == 2:
        shard, rep = fsdp_mesh_of(cfg)
        return f"FSDP2 fully_shard ({'HSDP ' + str(rep) + ' x ' if rep > 1 else 'shard '}{shard})"
    if cfg.fsdp is not None:
        shard, rep = fsdp_mesh_of(cfg)
        return f"FSDP {cfg.fsdp.sharding_strategy}" + (f" ({rep} x {shard})" if rep > 1 else "")
    if cfg.ddp.use_distributed_optimizer:
        return "Megatron distributed optimizer"
    if deepspeed_bf16_optimizer(cfg):
        return BF16_OPTIMIZER
    if deepspeed_fp16_optimizer(cfg):
        return FP16_OPTIMIZER
    z = cfg.zero_optimization.stage
    return f"DeepSpeed ZeRO-{z}" if z else "DDP"


#: ``data_parallel_strategy`` of a DeepSpeed pipeline with ZeRO stage 0 and bf16
BF16_OPTIMIZER = "DeepSpeed BF16_Optimizer"
#: ``data_parallel_strategy`` of DeepSpeed with ZeRO stage 0 and fp16, or bf16 without a pipeline
FP16_OPTIMIZER = "DeepSpeed FP16_Optimizer"


def scenario_keys(cfg: ScenarioConfig, summary: dict) -> dict:
    """Summary keys that come from the scenario rather than the records: ``zero_stage``,
    ``data_parallel_strategy``, ``pipeline_parallel_size``, ``num_parameters``, ``megatron_flops_per_s_per_gpu``;
    with experts ``num_active_parameters`` and ``expert_parallel_size``; ``num_trainable_parameters`` (all of them
    without ``training.lora``; with it the adapters' count, as PEFT's ``print_trainable_parameters``)."""
    n_params = model_num_parameters(cfg)
    return {"zero_stage": cfg.zero_optimization.stage, "data_parallel_strategy": data_parallel_strategy(cfg),
            "pipeline_parallel_size": cfg.parallelism.pipeline_model_parallel_size,
            "num_parameters": n_params,
            "num_trainable_parameters": (trainable_parameters(_whole_model(cfg)) if cfg.training.lora is not None
                                         else n_params),
            "megatron_flops_per_s_per_gpu": megatron_flops_per_s_per_gpu(cfg, summary),
            **({"num_active_parameters": _whole_model(cfg).num_active_parameters,  # router + top-k experts
                "expert_parallel_size": cfg.parallelism.expert_model_parallel_size} if cfg.model.num_experts else {})}


def memory_overheads(cfg: ScenarioConfig) -> DeviceMemoryOverheads:
    """The scenario's non-tensor GPU memory (``memory:`` section; documented defaults for unset keys)."""
    m = cfg.memory
    return default_overheads(m.cuda_context_bytes, m.allocator_reserve_fraction)


def _pageable_copies(cfg: ScenarioConfig) -> str:
    """The scenario keys whose host copies are pageable (``pin_memory: false``, DeepSpeed ``cpu_checkpointing``),
    comma-separated, or ``""``."""
    z, keys = cfg.zero_optimization, []
    if z is not None and z.offload_optimizer.device != "none" and not z.offload_optimizer.pin_memory:
        keys.append("zero_optimization.offload_optimizer.pin_memory false")
    if z is not None and z.offload_param.device != "none" and not z.offload_param.pin_memory:
        keys.append("zero_optimization.offload_param.pin_memory false")
    if cfg.activation_checkpointing.cpu_checkpointing:
        keys.append("activation_checkpointing.cpu_checkpointing")
    if cfg.fsdp is not None and cfg.fsdp.offload_params and not cfg.fsdp.offload_pinned:
        keys.append("fsdp.offload_policy.pin_memory false")
    return ", ".join(keys)


def _generic_profile_note(name: str) -> str:
    """The warning for a GPU priced with the generic efficiency profile ``name`` (``generic:<gpu>``)."""
    from hardware_models.presets import list_presets

    fitted = ", ".join(n for n in list_presets("profiles")["profiles"] if not n.endswith("-micro"))
    return (f"generic GPU profile {name!r}: no fitted efficiency profile for this GPU, so GEMM and memory-kernel "
            f"efficiencies are assumed (70% / 80% of peak); comparisons with a GPU that has one ({fitted}) mix "
            "measured and assumed numbers")


def sequence_parallel_regather_note(cfg: ScenarioConfig) -> str:
    """The run warning of ``sequence_parallel`` (tp > 1): what the graph builder does in place of Megatron's backward
    re-gather. Megatron-LM (``LinearWithGradAccumulationAndAsyncCommunication``: ``save_for_backward`` of the
    un-gathered input, all-gathered again in backward beside the input-gradient GEMM) and Korthikanti et al.
    (MLSys 2023, section 4.2.2) keep only the ``s / t`` shard of the qkv and fc1 inputs; where the builder builds the
    blocking column-parallel backward (``TransformerSpec.sp_regathers_inputs`` false: asynchronous backward off,
    amp_fp32_params, fp8, tp_comm_overlap or LoRA) it keeps the gathered ``[s, b, h]`` tensors from forward
    (``transformer.py`` module docstring), so the activation memory is
    high by ``2 w (1 - 1/t) s b h`` bytes per dense layer and micro-batch held (``w``: bytes per element) and the
    2 all-gathers per layer of backward communication are missing.

    Not raised with an ``fsdp`` section (PyTorch 2-D parallelism: DTensor tensor parallelism, as torchtitan runs
    it): there the sequence-parallel input is made ``Replicate`` by ``PrepareModuleInput`` before the attention and
    feed-forward modules (a DTensor redistribute: an all-gather, reduce-scattered in backward), and autograd saves
    that gathered tensor as the input of the ``ColwiseParallel`` wq / wk / wv and w1 / w3 matmuls; nothing is
    re-gathered in backward (pytorch/torchtitan@018740b torchtitan/models/llama3/infra/parallelize.py
    ``apply_tp``), which is what the builder builds."""
    t, cp = cfg.parallelism.tensor_model_parallel_size, cfg.parallelism.context_parallel_size
    m, tr = cfg.model, cfg.training
    w = 4 if tr.precision in ("fp32", "tf32") else 2
    extra = 2 * w * (1 - 1 / t) * tr.micro_batch_size * (m.seq_length // cp) * m.hidden_size
    p = cfg.parallelism
    why = [why for cond, why in ((not p.async_tensor_model_parallel_allreduce,
                                  "parallelism.async_tensor_model_parallel_allreduce false"),
                                 (tr.precision == "amp_fp32_params", "training.precision amp_fp32_params"),
                                 (tr.fp8 is not None, f"training.fp8 {tr.fp8}"),
                                 (p.tp_comm_overlap not in (False, "none"), "parallelism.tp_comm_overlap"),
                                 (tr.lora is not None, "training.lora")) if cond]
    return (f"parallelism.sequence_parallel: Megatron's backward re-gather of the qkv and fc1 inputs is modelled only "
            f"with the asynchronous column-parallel backward, which this run does not build "
            f"({', '.join(why) or 'its settings'}): the gathered [s, b, h] tensors are kept from forward instead of their 1/{t} shards (activation memory "
            f"high by {extra / 1e6:.1f} MB per layer and micro-batch held; 2 all-gathers per layer of backward "
            f"communication missing)")


def _clip_grad_warnings(cfg: ScenarioConfig | None) -> list[str]:
    """The gradient-norm work a scenario's framework does that is not priced. DeepSpeed ZeRO-1/2's step
    (``graph.builders.grad_norm.deepspeed_zero_step``), PyTorch's and FSDP's ``clip_grad_norm_`` and Megatron's
    ``clip_grad_norm`` are priced, as is ZeRO-3's (``deepspeed_zero_step`` with ``stage3``); what is left: DeepSpeed's
    MoE expert groups (deepspeedai/DeepSpeed@02aa38c3 ``deepspeed/runtime/zero/stage_1_and_2.py`` ``scaled_global_norm``:
    each param group's norm all-reduced over dp and mp on its own, then ``_average_expert_grad_norms``: the MoE group's
    once more over the expert-data-parallel group), not told apart from the dense partition because a scenario does
    not say whether its experts are DeepSpeed MoE parameters (Megatron-core experts are not: no MoE param group), ZeRO-3's step norm with optimizer offload (deepspeedai/DeepSpeed
    runtime/zero/stage3.py ``complete_grad_norm_calculation_for_cpu_offload``) and FSDP's cross-stage norm
    all-reduce with pipelines (``_fsdp_clip_grad_norm``), flagged."""
    if cfg is None:
        return []
    z, p = cfg.zero_optimization, cfg.parallelism
    shards = p.data_context_parallel_size
    if z.stage in (1, 2) and shards > 1 and z.offload_optimizer.device == "none" and cfg.model.num_experts:
        return [f"zero_optimization.stage {z.stage} with model.num_experts: if the experts are DeepSpeed MoE "
                "parameters (deepspeed.moe layers, their own optimizer param group), DeepSpeed's step norms that group "
                "on its own (its 4-byte all-reduce over the data-parallel and model-parallel groups) and all-reduces it "
                "once more over the expert-data-parallel group (stage_1_and_2.py _average_expert_grad_norms): those "
                "all-reduces are not priced, the experts' norm kernels are, with the dense partition's (one norm "
                "all-reduce in all)"]
    if cfg.fsdp is not None and cfg.fsdp.offload_params and cfg.training.clip_grad and shards > 1:
        return [f"training.clip_grad {cfg.training.clip_grad} with {cfg.fsdp.offload_key}: clip_grad_norm_ runs over "
                "the CPU gradient shards (the norm and the clip's mul_ on the CPU, the norm's all-reduce over the "
                "CPU process group): not priced (the GPU step's norm kernels are removed with it; the norm's 4-byte "
                "all-reduce is priced as NCCL)"]
    if cfg.fsdp is not None and p.pipeline_model_parallel_size > 1 and cfg.training.clip_grad:
        return [f"training.clip_grad {cfg.training.clip_grad} with fsdp and pipeline_model_parallel_size "
                f"{p.pipeline_model_parallel_size}: clip_grad_norm_'s all-reduce of the norm over the pipeline stages "
                "(torchtitan's pp_mesh) is not priced, nor the stages' wait for each other it adds"]
    if z.stage == 3 and shards > 1 and z.offload_optimizer.device != "none":
        return [f"zero_optimization.stage 3 with offload_optimizer {z.offload_optimizer.device}: DeepSpeed ZeRO-3's "
                "step norm over the offloaded partition (stage3.py complete_grad_norm_calculation_for_cpu_offload) "
                "and its unscale / clip are not priced (without offload they are)"]
    return []


def host_copy_bytes(graphs) -> tuple[float, float]:
    """Bytes ``graphs`` (``OpGraph``) copy between host and GPU (``MEMCPY_H2D`` / ``MEMCPY_D2H``, the only ops the
    ``hardware.pcie`` link's rates price: ``engine.system.COPY_PATHS``): (input-batch copies, ``OpRole.INPUT_COPY``;
    every other copy), bytes per step of the graphs together."""
    kinds, inputs, others = (OpKind.MEMCPY_H2D, OpKind.MEMCPY_D2H), 0.0, 0.0
    for op in (op for g in graphs for op in g.ops if op.kind in kinds):
        if op.role is OpRole.INPUT_COPY:
            inputs += op.bytes_read
        else:
            others += op.bytes_read
    return inputs, others


def _replaced_copy_rates_note(hw: Hardware, copies: tuple[float, float] | None = None) -> list[str]:
    """One line when an explicit ``hardware.pcie`` replaced rates the GPU profile measured
    (``Hardware.pcie_explicit``, or an override of the measured link's bandwidth: ``Hardware.pcie_overridden``).
    ``copies``: the run's ``host_copy_bytes`` (None: not known); with no copy but the input batch's the line says
    the link has no effect on the rest of the run."""
    p, c = hw.profile, hw.copy
    pairs = ((p.h2d_bytes_per_s, c.h2d_bytes_per_s), (p.d2h_bytes_per_s, c.d2h_bytes_per_s))
    measured = [(m, r) for m, r in pairs if m]
    if not (hw.pcie_explicit or hw.pcie_overridden) or all(m == r for m, r in measured):  # a generic profile's rates are the link's own
        return []
    if copies is not None and not copies[1]:
        key = f"hardware.pcie {hw.pcie.name}" if hw.pcie_explicit else "hardware.pcie.overrides"
        return [f"{key}: no effect in this run beyond its input-batch copy ({copies[0] / 1e3:.1f} kB per step): "
                "the link's rates price only host<->GPU copies, and this step makes no other (no optimizer, "
                "parameter or activation offload)"]
    who = (f"hardware.pcie {hw.pcie.name}: its rates replace" if hw.pcie_explicit else
           "hardware.pcie.overrides.bandwidth_bytes_per_s replaces")
    kept = ("" if hw.pcie_explicit else "; the other measured rates are kept (the duplex scaled with the two "
            "directions)")
    return [f"{who} the host copy rates measured in profile {p.name!r}"
            + (f" (over {p.copy_link})" if p.copy_link else "")
            + f": H2D {p.h2d_bytes_per_s / 1e9:.2f} -> {c.h2d_bytes_per_s / 1e9:.2f} GB/s, D2H "
            f"{p.d2h_bytes_per_s / 1e9:.2f} -> {c.d2h_bytes_per_s / 1e9:.2f} GB/s pinned{kept}"]


def _low_precision_shard_note(cfg: ScenarioConfig | None) -> list[str]:
    """FSDP1 with a 16-bit ``param_dtype`` (``ShardingSpec.casts_shards``): its casts of the fp32 shards before each
    all-gather run on the pre-unshard stream (``sharding.PRE_UNSHARD_STREAM``) beside the compute kernels, which the
    engine does not slow for them (its kernel interference is against collectives only). One line, or none."""
    if cfg is None or cfg.fsdp is None or cfg.fsdp.version != 1:
        return []
    spec = transformer_spec(cfg)
    if spec.data_parallel_size < 2 or spec.sharding is None or not spec.sharding.casts_shards:
        return []
    return ["fsdp: each all-gather's cast of the fp32 shard to param_dtype (_use_low_precision_shard, on FSDP's "
            "pre-unshard stream) runs beside the compute kernels without taking SMs or HBM bandwidth from them "
            "(kernel interference is priced against collectives only)"]


def _cpu_adam_default_note(cfg: ScenarioConfig | None) -> list[str]:
    """ZeRO-Offload to the CPU without ``offload_optimizer.cpu_adam_impl``: the default ``torch_foreach`` is priced,
    while DeepSpeed's engine refuses a client optimizer other than its own DeepSpeedCPUAdam under offload unless
    ``zero_force_ds_cpu_optimizer`` is false (microsoft/DeepSpeed deepspeed/runtime/engine.py
    ``_configure_zero_optimizer``'s ``ZeRORuntimeException``). One line, or none."""
    if cfg is None:
        return []
    oo = cfg.zero_optimization.offload_optimizer
    if oo.device != "cpu" or "cpu_adam_impl" in oo.model_fields_set:
        return []
    return [f"zero_optimization.offload_optimizer.cpu_adam_impl not given: {oo.cpu_adam_impl} (torch.optim.AdamW, "
            "foreach) is priced; a DeepSpeed run steps with DeepSpeedCPUAdam unless zero_force_ds_cpu_optimizer is "
            "false (set cpu_adam_impl: deepspeed_cpu_adam for it)"]


def _layer_fidelity_note(hw: Hardware, cfg: ScenarioConfig) -> str:
    """At ``run.fidelity: layer``, the approximations of a block (``simulator.policies.fidelity``) that apply to this
    run, one line; "" at kernel fidelity or where none applies. A clock that moves during the step (a power cap,
    ``dvfs`` or a stage's ``rank_overrides`` dvfs with ``power_limit_w``, or a per-phase clock plan) changes at the next
    block, not the next kernel (measured: the 500 W capped 6.7B interleaved pipeline -1.16 % against kernel fidelity,
    equal to 0.001 % without the cap); collectives beside compute with interference on slow the block's kernels
    evenly over the block."""
    if getattr(cfg.run, "fidelity", "kernel") != "layer":
        return ""
    moving = [d for d in (cfg.dvfs, *(o.dvfs for o in cfg.rank_overrides)) if d is not None and (
        d.kind != "locked_clock" or d.power_limit_w is not None)]
    what = []
    if moving:
        kinds = sorted({"power cap" if d.kind != "phase_plan" else "per-phase clock plan" for d in moving})
        what.append(f"a clock change ({' and '.join(kinds)}) lands at the next block, not the next kernel")
    nccl = hw.nccl
    if hw.collectives is not None and len(hw.dp_group) * len(hw.tp_group) > 1 and (nccl is None or nccl.interference):
        what.append("a collective's interference slows a block's kernels evenly over the whole block")
    if not what:
        return ""
    return (f"run.fidelity layer: each block (a layer's run of kernels) is priced as one op, so {'; '.join(what)} "
            "(run.fidelity kernel prices them kernel by kernel)")


def run_warnings(hw: Hardware, cfg: ScenarioConfig | None, copies: tuple[float, float] | None = None) -> list[str]:
    """One line per thing in this run that is assumed rather than measured, or accepted but not modelled.
    ``copies``: the bytes the run's graphs copy between host and GPU (``host_copy_bytes``; None: not known)."""
    out = []
    if hw.profile.name.startswith("generic:"):
        out.append(_generic_profile_note(hw.profile.name))
    if hw.profile.provenance.get("borrowed_from"):  # a profile partly taken from another GPU's measurements
        b = hw.profile.provenance["borrowed_from"]
        out.append(f"GPU profile {hw.profile.name!r}: {', '.join(b['fields'])} not measured on this GPU, taken from "
                   f"{b['profile']!r} ({b['why']})")
    if cfg is not None and cfg.training.fp8 is not None and "fp8" not in hw.profile.gemm and hw.profile.gemm:
        out.append(f"training.fp8: GPU profile {hw.profile.name!r} has no fp8 GEMM fit, so fp8 GEMMs are priced with its "
                   f"bf16 fit (tile efficiency and wave overhead) at the GPU's fp8 peak "
                   f"({hw.gpu.peak('fp8') / 1e12:.0f} TFLOP/s); no fp8 GEMM was measured on it")
    out += _replaced_copy_rates_note(hw, copies)
    pageable = _pageable_copies(cfg) if cfg is not None else ""
    if pageable and not (hw.copy.pageable_h2d_bytes_per_s and hw.copy.pageable_d2h_bytes_per_s):
        out.append(f"{pageable} copies through pageable host memory, but the PCIe link / profile has no "
                   "pageable rate for this host, so they are priced at the pinned rate (set hardware.pcie overrides "
                   "pageable_h2d_bytes_per_s / pageable_d2h_bytes_per_s, or pin_memory: true)")
    if cfg is not None:
        out += cfg.no_step_effect_notes
    ac = cfg.activation_checkpointing if cfg is not None else None
    if ac is not None and ac.cpu_checkpointing and ac.host_buffers != "reused" and not hw.host_cpu.page_fault_s:
        from hardware_models.host_kernels import DEFAULT_PAGE_FAULT_S

        out.append(f"activation_checkpointing.host_buffers {ac.host_buffers}: host {hw.host_cpu.name!r} has no "
                   f"page_fault_s, so any first-touch faults of its fresh checkpoint buffers are priced at "
                   f"{DEFAULT_PAGE_FAULT_S * 1e6:.2f} us per 4 KiB page, the figure fitted in the measured H200 host's KVM "
                   "guest (set hardware.host overrides page_fault_s, or host_buffers: reused)")
    if hw.launch.source == "generic":
        out.append(f"host {hw.host_cpu.name!r} has no measured dispatch time per op: the generic "
                   f"{hw.launch.per_op_s * 1e6:.0f} us is assumed (set hardware.launch_overhead_s or calibrate the host)")
    if hw.collectives is not None and len(hw.dp_group) * len(hw.tp_group) > 1:
        if cfg is not None and cfg.run.rank_folding == "none":
            out.append(f"run.rank_folding none: every one of the {len(hw.dp_group)} data-parallel replicas is simulated "
                       "(tensor-parallel ranks folded); they meet at the data-parallel collectives; no network "
                       "contention from other jobs")
        elif cfg is not None and any(o.dp_rank is not None for o in cfg.rank_overrides):
            out.append(f"{len(hw.dp_group)} data-parallel x {len(hw.tp_group)} tensor-parallel ranks folded into rank "
                       f"classes by rank_overrides ({len(cfg.rank_overrides)} override(s)); each class is one "
                       "representative, the classes meet at the data-parallel collectives (each class's copy of a "
                       "collective runs beside its own kernels); no network contention from other jobs")
        else:
            out.append(f"{len(hw.dp_group)} data{'- x context' if len(hw.cp_group) > 1 else ''}-parallel x "
                       f"{len(hw.tp_group)} tensor-parallel ranks folded "
                       "symmetrically: one representative rank is simulated and its collectives are priced by the NCCL "
                       "model (no stragglers, no network contention from other jobs)")
        nccl = hw.nccl
        if nccl is None or nccl.interference:
            from simulator.cost.interference import InterferenceFactors

            f = InterferenceFactors.from_profile(hw.collectives.profile, nccl.nchannels if nccl is not None else None)
            out.append(f.describe(hw.gpu.sm_count))
        else:
            out.append("compute/communication interference off (nccl.interference: false): overlapped collectives do "
                       "not slow the kernels beside them (measured: overlapped compute 19% slower on average, up to "
                       "40%; Lee et al. 2025, arXiv 2507.03114), so exposed_comm_s and step_time_s are lower bounds")
    out.extend(_low_precision_shard_note(cfg))
    out.extend(_cpu_adam_default_note(cfg))
    if cfg is not None and (note := _layer_fidelity_note(hw, cfg)):
        out.append(note)
    if cfg is not None and (note := _zero3_partial_reuse_note(cfg)):
        out.append(note)
    if cfg is not None and cfg.zero_optimization.stage == 3 and cfg.zero_optimization.offload_param.device != "none":
        z = cfg.zero_optimization
        out.append(f"zero_optimization.stage3_max_reuse_distance ({z.stage3_max_reuse_distance:.3g}) is not modelled "
                   f"with offload_param {z.offload_param.device}: every block is fetched again for its backward, where "
                   "DeepSpeed keeps a block whose reuse comes within that many parameter elements (the last blocks of "
                   "the forward), so the fetch traffic is an upper bound")
    if cfg is not None and cfg.parallelism.sequence_parallel and cfg.parallelism.tensor_model_parallel_size > 1 and (
            cfg.fsdp is None and not transformer_spec(cfg).sp_regathers_inputs):  # DTensor TP keeps them too
        out.append(sequence_parallel_regather_note(cfg))
    if cfg is not None and cfg.training.precision == "amp_fp32_params" and "bf16" not in hw.gpu.peak_flops_per_s:
        out.append(f"training.precision amp_fp32_params on {hw.gpu.name}, which has no bf16 tensor cores (Volta/Turing), "
                   "stands for torch.autocast(fp16) with a GradScaler: GEMMs at the fp16 rate, same tensor sizes; the "
                   "GradScaler's scale, unscale and inf checks are not charged")
    if cfg is not None and cfg.dataloader is not None and hw.collectives is not None and hw.world_size > 1:
        per_node = hw.collectives.topo.gpus_per_node
        out.append(f"the host is shared by {per_node} ranks per node, which is not modelled: this rank's DataLoader "
                   "workers get every core and all host memory bandwidth, so data_stall_s is a lower bound")
    for o in (cfg.rank_overrides if cfg is not None else ()):
        if o.pp_rank is not None and (o.slowdown != 1.0 or o.dvfs is not None):
            what = [f"slowdown {o.slowdown:g}"] if o.slowdown != 1.0 else []
            what += [f"dvfs {o.dvfs.kind}"] if o.dvfs is not None else []
            out.append(f"rank_overrides: pipeline stage {o.pp_rank} (all its ranks) runs with {' and '.join(what)}")
        if o.gpu is not None:
            who = f"pipeline stage {o.pp_rank}" if o.pp_rank is not None else f"replica {o.dp_rank}"
            out.append(f"rank_overrides: {who} runs on {o.gpu} (its peaks, HBM, memory and power; priced with its shipped or the generic "
                       "efficiency profile); the cluster's links and collective model are the cluster preset's")
            prof = other_gpu(hw, o.gpu).profile.name
            if prof.startswith("generic:") and not any(prof in w for w in out):
                out.append(f"rank_overrides: {who}: " + _generic_profile_note(prof))
    pp = cfg.parallelism.pipeline_model_parallel_size if cfg is not None else 1
    out.extend(_clip_grad_warnings(cfg))
    if cfg is not None:
        from simulator.config.sections.nvme import NVME_ONLY_KEYS, aio_warning, nvme_keys_without_effect

        nvme = any(getattr(cfg.zero_optimization, k).device == "nvme" for k in NVME_ONLY_KEYS)
        aio = aio_warning(cfg.aio, set(cfg.aio.model_fields_set), nvme)
        if aio:
            out.append(aio)
        out.extend(nvme_keys_without_effect(cfg))
    if pp > 1:
        spec = transformer_spec(cfg)
        who = ("every data-parallel replica of each stage" if cfg.run.rank_folding == "none" else
               "one representative rank per rank class and stage")  # (rank_classes)
        out.append(f"{pp} pipeline stages simulated side by side ({who}); their send/recv and "
                   "cross-stage all-reduces are not slowed by the kernels beside them (no interference term) and end at "
                   "the same time on the two stages they join; they share each stage's NVLink port, NIC rail and PCIe link max-min "
                   "fairly with its other collectives and copies")
        if cfg.zero_optimization.stage == 1 and spec.data_parallel_size > 1:
            out.append("zero_optimization.stage 1 with pipeline parallelism: the pipeline is Megatron-LM's (its schedule, "
                       "and stages that end a step on their own after the gradient-norm all-reduce); DeepSpeed's "
                       "pipeline engine also ends every step with a loss broadcast from the last stage over the pipeline "
                       "group (deepspeed/runtime/pipe/engine.py _aggregate_total_loss), which is not modelled")
        if spec.num_micro_batches < pp:
            mbs = f"{spec.num_micro_batches} micro-batch{'es' if spec.num_micro_batches != 1 else ''}"
            out.append(f"{mbs} per step for {pp} pipeline stages: most of the step is pipeline bubble (raise "
                       "training.global_batch_size)")
        if cfg.parallelism.schedule == "zero_bubble_v":
            out.append("pipeline_schedule zero_bubble_v: the handcrafted ZB-V order (Qi et al.; zero bubble when every "
                       "chunk's F, B and W take the same time) is simulated as given; the reference runtime "
                       "(--zero-bubble-v-schedule) reorders the passes by their profiled times, which is not modelled, "
                       "so with unequal chunks (rank 0 holds the embedding and the LM head) its step can be shorter")
        if cfg.parallelism.schedule == "zero_bubble_h2" and spec.pipeline_step_end_sync:
            out.append("pipeline_schedule zero_bubble_h2: ZB-H2's parallelogram (Qi et al.) has no bubble only once "
                       "the step's end is not synchronised across the stages (their optimizer post-validation); here "
                       "every stage joins the gradient-norm (training.clip_grad > 0) or fp16 found-inf all-reduce "
                       "before its optimizer, so every step still fills and drains the pipeline (at equal F, B and W "
                       "times its step equals zero_bubble_h1's); training.clip_grad: 0 with bf16 simulates it without")
    if cfg is not None and cfg.model.num_experts:
        m = cfg.model
        if m.moe_router_dtype is not None:
            out.append(f"model.moe_router_dtype {m.moe_router_dtype}: the routing probabilities and what the dispatcher "
                       f"moves and weighs with them are priced in {m.moe_router_dtype}, but the router GEMM and its "
                       "logits in the model dtype (Megatron's router_gating_linear casts the input and the weight to "
                       f"{m.moe_router_dtype} and multiplies there: a [tokens, hidden] x [hidden, experts] GEMM)")
        if m.moe_tokens_per_expert is None:
            out.append(f"model.num_experts {m.num_experts}: routing is assumed balanced (every expert receives "
                       f"T x {m.moe_router_topk} / {m.num_experts} of each rank's T tokens; not modelled: load "
                       "imbalance (set model.moe_tokens_per_expert), padding to capacity), so expert GEMM and "
                       "all-to-all times are lower bounds")
        elif cfg.parallelism.expert_model_parallel_size > 1:
            from simulator.graph.builders import moe

            spec = transformer_spec(cfg)
            out.append(f"model.moe_tokens_per_expert: every EP rank is simulated with the busiest EP rank's "
                       f"expert load ({moe.load_imbalance(spec, spec.micro_batch_size * spec.seq_length):.3g}x the "
                       "mean): the step follows it, the other ranks' energy is overstated")
        else:
            out.append("model.moe_tokens_per_expert has no effect with expert_model_parallel_size 1: one rank runs "
                       "every expert, so its grouped GEMMs and permutes see the same tokens however they are split")
    if cfg is not None and cfg.training.fp8 is not None and hw.world_size > 1:
        out.append("training.fp8: the amax all-reduce over the tensor x data-parallel group that Transformer Engine "
                   "runs after each micro-batch's forward and backward (a few latency-bound bytes) is not modelled; "
                   "the amax-history update kernels and the scaling state are")
    if cfg is not None and cfg.training.fp8 is not None:
        # Transformer Engine's cached fp8 weight workspace is counted exactly (fp8_weight_copies, persistent:
        # transformer.py _fp8_operands) where the GPU says whether its fp8 GEMMs are TN-only
        from hardware_models import presets

        gpus = [hw.gpu, *(presets.get("gpus", o.gpu) for o in cfg.rank_overrides if o.gpu is not None)]
        for name in dict.fromkeys(g.name for g in gpus if g.fp8_gemm_tn_only is None):
            out.append(f"training.fp8 memory: {name} does not say whether its fp8 GEMMs take only the TN layout "
                       "(GPU field fp8_gemm_tn_only): Transformer Engine's cached fp8 weight workspace is counted "
                       "at 2 B per block Linear weight element (the weight and its transpose, as on Hopper); 1 B "
                       "if they take any layout (Blackwell)")
        shards = cfg.parallelism.data_context_parallel_size
        if cfg.training.fp8_param_gather and shards > 1:
            out.append("training.fp8_param_gather: Megatron-LM keeps the fp8 parameters in a uint8 buffer of their "
                       "own, bucketed apart from the 16-bit ones; here they share the 16-bit parameters' buckets "
                       "(each all-gather's bytes are exact, 1 B per fp8 and 2 B per bf16 element; the bucket "
                       "boundaries, and so the overlap of the gathers and reduce-scatters, are approximate)")
        if cfg.zero_optimization.stage in (1, 2) and shards > 1:  # DeepSpeed drives the model, not Megatron
            out.append(f"training.fp8 memory with DeepSpeed ZeRO-{cfg.zero_optimization.stage}: Transformer "
                       "Engine's fp8 weight workspace is counted cached for the run, as under Megatron's TELinear, "
                       "which passes is_first_microbatch; a model calling TE modules without it (TE's default None) "
                       "re-casts the weights every micro-batch and keeps each one's copy until its backward instead, "
                       "which is not modelled")
    d = cfg.dvfs if cfg is not None else None
    sup = hw.gpu.supported_sm_clocks_mhz
    if d is not None and sup:
        asked = ([("dvfs.locked_clocks_mhz", d.locked_clocks_mhz)] if d.locked_clocks_mhz is not None else []) + [
            (f"dvfs.phase_clocks_mhz.{ph}", mhz) for ph, mhz in d.phase_clocks_mhz.items()]
        for key, mhz in asked:
            near = nearest_clock(mhz, sup)  # what snap_clock runs
            if near != mhz:
                out.append(f"{key} {mhz:g} MHz is not a supported SM clock of {hw.gpu.name}: the run uses the nearest, "
                           f"{near:g} MHz (as nvidia-smi -lgc rounds)")
    z = cfg.zero_optimization if cfg is not None else None
    if z is not None and z.stage == 3 and (cfg.parallelism.data_parallel_size or 1) > 1:
        sh = sharding_spec(cfg)
        if sh.fwd_prefetch_depth == 0:
            from simulator.graph.builders.sharding import layer_param_sizes

            unit = sum(k for k in layer_param_sizes(transformer_spec(cfg)).values()
                       if k > z.stage3_param_persistence_threshold)
            # the keys that stop a one-block prefetch (sharding.zero3_prefetch_depth): the bucket, the live limit
            short = [(f"stage3_prefetch_bucket_size {z.stage3_prefetch_bucket_size:,} elements holds less than one "
                      f"block's {unit:,} parameters", f"stage3_prefetch_bucket_size of at least {unit:,}")
                     ] * (unit > z.stage3_prefetch_bucket_size) + [
                (f"stage3_max_live_parameters {z.stage3_max_live_parameters:,} holds less than two blocks' "
                 f"{2 * unit:,} (the one in use and the one fetched ahead)",
                 f"stage3_max_live_parameters of at least {2 * unit:,}")] * (2 * unit > z.stage3_max_live_parameters)
            out.append(f"zero_optimization.{'; '.join(w for w, _ in short)}: prefetch is modelled a whole block at a "
                       "time, so no block is prefetched and every parameter all-gather is exposed, while DeepSpeed "
                       "prefetches parameter by parameter up to the bucket: exposed_comm_s and step_time_s are upper "
                       f"bounds ({' and '.join(f for _, f in short)} give{'s' * (len(short) == 1)} the other bound)")
    if cfg is not None and cfg.training.lora is not None:
        out.append("training.lora: the first block's input gradient is computed (as with Hugging Face "
                   "enable_input_require_grads; plain autograd would skip it when the embeddings are frozen), at most "
                   f"1/{cfg.model.num_layers} of the input-gradient work; embeddings, norms and the LM head are frozen")
    z = getattr(cfg, "zero_optimization", None)
    dp_many = len(hw.dp_group) > 1
    # where the one data-parallel rank is: one GPU, or tensor / pipeline / context parallelism filling the world
    alone = "on one GPU" if hw.world_size == 1 else "with data_parallel_size 1"
    more = ("set hardware.cluster" if hw.world_size == 1 else
            f"fewer tensor / pipeline / context-parallel ranks of the {hw.world_size} GPUs")
    if cfg is not None and cfg.fsdp is not None and not dp_many:
        out.append(f"fsdp {alone} shards nothing: FSDP partitions model states across data-parallel ranks ({more} "
                   "for data_parallel_size > 1)")
    if (z is not None and not dp_many and z.stage >= 1 and z.offload_optimizer.device == "none"
            and z.offload_param.device == "none"):
        out.append(f"zero_optimization.stage {z.stage} without offload shards nothing {alone}: ZeRO stages only "
                   f"partition model states across data-parallel ranks ({more} for data_parallel_size > 1); "
                   "the step is priced unsharded, without DeepSpeed's ZeRO step norm, fp32 partition copy and unscale "
                   "mul_ (grad_norm.deepspeed_zero_step), which DeepSpeed runs on one GPU too whatever training.clip_grad")
    if (z is not None and z.stage in (1, 2) and z.contiguous_gradients
            and (z.offload_optimizer.device != "none" or not dp_many)):
        where = "with offload_optimizer" if z.offload_optimizer.device != "none" else alone
        out.append(f"zero_optimization.stage {z.stage} {where}: DeepSpeed's IPG gradient buffers "
                   "(contiguous_gradients: reduce_bucket_size elements in the model dtype, two with overlap_comm) are not counted in the GPU "
                   "memory (modelled for data-parallel ZeRO-1/2 without offload)")
    if (z is not None and z.offload_optimizer.device != "none"
            and z.offload_optimizer.cpu_adam_impl == "deepspeed_cpu_adam"):
        # current DeepSpeed's gradient path to the host (stage_1_and_2.py @02aa38c3
        # async_inplace_copy_grad_to_fp32_buffer_from_gpu; stage3.py @ea78ab68 _offload_grad_partition_at_boundary)
        out.append("zero_optimization.offload_optimizer deepspeed_cpu_adam: the gradient-norm pieces (and with fp16 the "
                   "overflow check) DeepSpeed computes on the GPU for each gradient before its copy to the host are not "
                   "priced, nor is the transient fp32 copy of each gradient counted in the GPU memory; step time and peak "
                   "memory are low by that much")
    if cfg is not None and (note := master_dtypes_note(cfg)) is not None:
        out.append(note)
    fsdp_offload = cfg is not None and cfg.fsdp is not None and cfg.fsdp.offload_params
    if dp_many and (fsdp_offload or (z is not None and z.offload_optimizer.device != "none")):
        from simulator.policies.offload_optimizer import cpu_threads, offload_ranks, oversubscribed_threads

        r = offload_ranks(hw)
        n = hw.host_cpu.numa_node
        binding = (f"all {r} ranks bound to NUMA node {n}" if n >= 0 else "ranks bound to nodes in blocks"
                   if hw.host_cpu.bind_cores_to_rank else "ranks not bound: the memory interleaved over the nodes")
        if (note := oversubscribed_threads(hw, r)) is not None:
            out.append(note)
        fsdp2 = fsdp_offload and cfg.fsdp.offload_policy is not None
        what = ("FSDP2 offload_policy" if fsdp2 else "FSDP cpu_offload") if fsdp_offload else "ZeRO-Offload"
        mode = "overlap" if fsdp_offload else z.offload_mode
        dma = ("not modelled: the host DRAM bandwidth the copies' DMA takes, the other ranks' training threads"
               if fsdp_offload else "the copies' DMA shares each rank's host DRAM share with its CPU step "
               "(host.dram); not modelled: the other ranks' training threads")
        t = cpu_threads(hw, mode, r)
        out.append(f"{what} on a cluster: the host is shared by {r} ranks per node, each running its own CPU "
                   f"Adam on its 1/{len(hw.dp_group)} partition with {t} thread{'' if t == 1 else 's'} "
                   f"({_threads_origin(hw)}) and a max-min "
                   f"share of its NUMA node's memory bandwidth ({binding}); host memory is checked for all of the "
                   f"node's ranks; the ranks behind one PCIe switch share its uplink (hardware_models.host_links); "
                   f"{dma}")
        if (note := _launcher_threads_note(hw, r, t, what)) is not None:
            out.append(note)
    if dp_many and fsdp_offload and cfg.fsdp.offload_policy is not None:
        page = ""
        accum = (cfg.training.global_batch_size or 0) > cfg.training.micro_batch_size * (
            cfg.parallelism.data_parallel_size or 1)
        if (not cfg.fsdp.offload_pinned or accum) and not hw.host_cpu.page_fault_s:
            from hardware_models.host_kernels import DEFAULT_PAGE_FAULT_S

            page = (f"; host {hw.host_cpu.name!r} has no page_fault_s, so the first-touch faults of the fresh "
                    f"pageable CPU gradient tensors .to('cpu') allocates are priced at {DEFAULT_PAGE_FAULT_S * 1e6:.2f} "
                    "us per 4 KiB page, the figure fitted in the measured H200 host's KVM guest (set hardware.host "
                    "overrides page_fault_s)")
        out.append("fsdp.offload_policy (FSDP2): each unit's per-parameter H2D copies (FSDPParam.all_gather_inputs), "
                   "param_dtype casts and D2H gradient copies (foreach_reduce) are priced as one copy / one cast per "
                   f"unit: one host launch and one copy latency each, not one per parameter{page}")
    if z is not None and dp_many and z.offload_param.device != "none":
        out.append("offload_param with data_parallel_size > 1: each rank's parameter partition is fetched from host "
                   "memory before every ZeRO-3 all-gather, at the gathers' prefetch (stage3_prefetch_bucket_size, "
                   "stage3_max_live_parameters); offload_param.prefetch_depth does not apply")
    if cfg is not None and cfg.training.optimizer.impl != "fused" and not (cfg.fsdp is not None and cfg.fsdp.offload_params):
        per = "8 per parameter tensor" if cfg.training.optimizer.impl == "single" else "8 per multi-tensor-apply chunk"
        out.append(f"training.optimizer.impl {cfg.training.optimizer.impl}: its eight AdamW passes are priced as one "
                   f"kernel each over the rank's parameters; their kernel launches ({per}) are not counted, so the "
                   "optimizer's host time is a lower bound")
    if cfg is not None and (note := flash_dropout_note(cfg.model.attention_kernel, cfg.model.attention_dropout)):
        out.append(note)
    if cfg is not None and (note := attention_alias_note(cfg.model.attention_backend)):
        out.append(note)
    if cfg is not None and (note := deepspeed_sp_grads_note(cfg)):
        out.append(note)
    if cfg is not None and (note := fsdp2_selective_note(cfg)):
        out.append(note)
    if cfg is not None and (note := fsdp2_ac_note(cfg)):
        out.append(note)
    if cfg is not None and (note := fsdp2_last_block_note(cfg)):
        out.append(note)
    if cfg is not None and (note := _fixed_optimizer_host_note(hw, cfg)):
        out.append(note)
    if cfg is not None and (note := _dataloader_beside_cpu_step_note(hw, cfg)):
        out.append(note)
    if cfg is not None:
        out += ineffective_setting_warnings(cfg)
    return out


#: layers of the model whose traced optimizer step the measured host's fixed optimizer time was fitted on
#: (hardware_models/presets/hosts/h200-measured-host.yaml ``host_phase_fixed_s.opt``:
#: tests/data/h200/trace_gpt_184m_b16.json.gz, the 12-layer GPT of scenarios/h200/gpt_184m_b16.yaml, PyTorch AdamW).
#: Not modelled per tensor: the Python before the step's first op (720.5 us profiled in the fused GPU step, 1138 us in
#: the CPU foreach step of trace_gpt_184m_b16_offload_overlap.json.gz, whose ``_foreach_add_`` runs 148 ``add_``) is
#: mostly ``_init_group``'s loop over the parameter tensors, but both traces step the same
#: ``FIXED_OPT_FIT_TENSORS`` tensors, so its per-tensor and per-step parts cannot be told apart: flagged instead.
FIXED_OPT_FIT_LAYERS = 12
#: parameter tensors of that step (the built graph's ``param_groups``; the offload trace's 148 ``aten::add_``)
FIXED_OPT_FIT_TENSORS = 148


def _fixed_optimizer_host_note(hw: Hardware, cfg: ScenarioConfig) -> str | None:
    """The run warning when the host's fixed optimizer-step time (``host_phase_fixed_s.opt``, mostly PyTorch's Python
    loop over the parameter tensors) is applied to a step unlike the one it was fitted on: another framework's
    optimizer (Megatron-LM's, DeepSpeed ZeRO's, FSDP's) or a model with more than twice or under half the fit's layers
    (its parameter tensors); None where it is not applied or the step is like the fit's."""
    fixed = hw.launch.fixed_by_phase_s.get("opt")
    if not fixed:
        return None
    other = ("Megatron-LM's optimizer step" if transformer_spec(cfg).megatron_optimizer else
             f"DeepSpeed ZeRO-{cfg.zero_optimization.stage}'s step" if cfg.zero_optimization.stage else
             "FSDP's optimizer step" if cfg.fsdp is not None else None)
    layers = cfg.model.num_layers
    if other is None and FIXED_OPT_FIT_LAYERS / 2 <= layers <= 2 * FIXED_OPT_FIT_LAYERS:
        return None
    what = other or f"a {layers}-layer model's parameter tensors"
    return (f"host {hw.host_cpu.name!r}: its fixed optimizer-step host time {fixed * 1e3:.2f} ms (Python work per "
            f"optimizer.step(), fitted on a PyTorch AdamW step of a {FIXED_OPT_FIT_LAYERS}-layer GPT's "
            f"{FIXED_OPT_FIT_TENSORS} parameter tensors, one tensor count only, so not per tensor) is applied unscaled "
            f"to {what}; not re-fitted, so the optimizer phase's host time is an estimate")


def master_dtypes_note(cfg: ScenarioConfig) -> str | None:
    """The run warning for DeepSpeed's low-precision master weights under ZeRO-Offload (``fp16`` / ``bf16``
    sections, ``config.sections.half_precision``), else None: what the pricing takes for granted."""
    from simulator.config.sections.half_precision import master_dtypes

    from hardware_models.host_kernels import adamw_passes
    from simulator.graph.dtypes import DTYPE_BYTES
    from simulator.policies.offload_optimizer import state_bytes_kwargs

    master, states = master_dtypes(cfg)
    if master == "fp32":
        return None
    passes = adamw_passes("deepspeed_cpu_adam", **state_bytes_kwargs(DTYPE_BYTES[master], DTYPE_BYTES[states]))
    streamed = sum(p.read_bytes + p.write_bytes + p.fresh_bytes for p in passes)  # what the CPU step is priced on
    moments = ("bf16 Adam moments: DeepSpeedCPUAdam built with fp32_optimizer_states=False (its optimizer.params), "
               "which DeepSpeed requires here" if states == "bf16" else "fp32 Adam moments")
    return (f"{master} master weights and gradients on the host with {moments}; the CPU step is priced on the bytes "
            f"DeepSpeedCPUAdam streams ({streamed:g} B per parameter), not on its 16-bit "
            "conversions in registers (memory-bound); the gradient partition's norm and (fp16) loss-scale unscale on "
            "the host are not priced, as with fp32 master weights")


def _threads_origin(hw: Hardware) -> str:
    """Where the CPU step's threads per rank on a shared host come from, for the offload-on-a-cluster warning: the
    scenario's ``hardware.host.threads``, else the launcher's ``OMP_NUM_THREADS`` (``_launcher_threads_note``'s
    sources): DeepSpeed's launcher with ``--bind_cores_to_rank`` sets cores / ranks, without it leaves torch's pool on
    every core; torchrun sets 1 per process when ``nproc_per_node`` > 1 and the variable is unset."""
    cpu = hw.host_cpu
    torchrun = "torchrun sets OMP_NUM_THREADS=1 per process instead: hardware.host.threads=1"
    if cpu.threads_used:
        return "hardware.host.threads; at most cores / ranks' worth when oversubscribed"
    if cpu.bind_cores_to_rank:
        return f"cores / ranks, the OMP_NUM_THREADS DeepSpeed's launcher sets with --bind_cores_to_rank; {torchrun}"
    return (f"torch's pool on every core, OMP_NUM_THREADS unset as DeepSpeed's launcher without --bind_cores_to_rank "
            f"leaves it, time-sliced to cores / ranks' worth; {torchrun}")


def _launcher_threads_note(hw: Hardware, ranks: int, threads: int, what: str) -> str | None:
    """The run warning when the CPU step's threads per rank on a shared host are the model's default, else None.

    With ``hardware.host.threads`` unset each of ``ranks`` ranks is priced on ``cores_available // ranks`` threads
    (``policies.offload_optimizer.cpu_threads``), what DeepSpeed's launcher sets with ``--bind_cores_to_rank``
    (``OMP_NUM_THREADS`` = cores per rank, microsoft/DeepSpeed@048b0d50 deepspeed/launcher/launch.py ``main``). The
    launchers' own defaults differ: torchrun sets ``OMP_NUM_THREADS=1`` for every process when ``nproc_per_node`` > 1
    and the variable is unset (pytorch/pytorch@010929fd torch/distributed/run.py ``config_from_args``), and
    DeepSpeed's launcher without the flag leaves it unset, so every rank's OpenMP pool spans all the cores."""
    cpu = hw.host_cpu
    if ranks <= 1 or cpu.threads_used or not cpu.bind_cores_to_rank:  # unbound: oversubscribed_threads says it
        return None
    return (f"hardware.host.threads not set: each rank's {what} CPU step is priced on {cpu.cores_available} "
            f"{cpu.core_noun} / {ranks} ranks = {threads} thread(s), as DeepSpeed's launcher sets with "
            f"--bind_cores_to_rank (OMP_NUM_THREADS={threads}); torchrun sets OMP_NUM_THREADS=1 per process when it is "
            "unset (set hardware.host.threads=1 and bind_cores_to_rank=false for that), and DeepSpeed's launcher without the flag leaves every "
            f"rank's pool on all {cpu.cores_available} (hardware.host.bind_cores_to_rank=false: oversubscribed, priced "
            f"time-sliced at the same {threads}-core share without NUMA locality)")


def _dataloader_beside_cpu_step_note(hw: Hardware, cfg: ScenarioConfig) -> str | None:
    """The run warning when DataLoader worker processes run beside an offloaded CPU optimizer step, else None.

    The workers are simulated on the host's CPU pool (``policies.dataloader.host_cpu_pool``); the CPU step is a host op
    priced by the host roofline on its own threads (``policies.offload_optimizer.cpu_threads``). Neither takes cores
    or DRAM bandwidth from the other, so a worker building a batch while the CPU step runs is not priced against it.
    ``num_workers`` 0 loads on the training thread, serially with the step: nothing to share."""
    dl, z = cfg.dataloader, cfg.zero_optimization
    offload = z is not None and z.offload_optimizer.device != "none"
    fsdp = cfg.fsdp is not None and cfg.fsdp.offload_params
    if dl is None or not dl.num_workers or not (offload or fsdp):
        return None
    from simulator.policies.offload_optimizer import cpu_threads, offload_ranks

    ranks = offload_ranks(hw)
    threads = cpu_threads(hw, "overlap" if fsdp else z.offload_mode, ranks)
    what = ("FSDP cpu offload" if fsdp else "ZeRO-Offload") + (f", {ranks} ranks per host" if ranks > 1 else "")
    return (f"dataloader.num_workers {dl.num_workers} beside the CPU optimizer step ({what}): the workers run on the "
            f"host's {hw.host_cpu.cores} {hw.host_cpu.core_noun}, the CPU step on its own {threads} thread(s), and "
            "neither takes cores or memory bandwidth from the other (not modelled), so where workers build batches "
            "during the CPU step it is a lower bound")


def _zero3_partial_reuse_note(cfg: ScenarioConfig) -> str | None:
    """ZeRO-3's ``stage3_max_reuse_distance`` keeps some blocks gathered from forward to backward and re-gathers the
    rest; it is decided per block here (``sharding.zero3_kept_after_forward``) where DeepSpeed decides per module,
    so the first block re-gathered may in fact keep its last modules: flagged, with that block's size, when the
    boundary falls inside the blocks (some kept, some not). None otherwise."""
    from simulator.graph.builders.sharding import ROOT, layer_param_sizes

    sh = sharding_spec(cfg) if cfg.zero_optimization.stage == 3 else None
    if sh is None or sh.strategy != "zero3":
        return None
    blocks = sorted(k for k in sh.kept_after_forward if k != ROOT)
    n = cfg.model.num_layers // cfg.parallelism.pipeline_model_parallel_size
    if not blocks or len(blocks) >= n:
        return None
    unit = sum(layer_param_sizes(transformer_spec(cfg)).values())
    return (f"zero_optimization.stage3_max_reuse_distance {cfg.zero_optimization.stage3_max_reuse_distance:.3g}: "
            f"blocks {blocks[0]}-{blocks[-1]} of {n} stay gathered from forward to backward, decided per block; "
            f"DeepSpeed decides per module, so block {blocks[0] - 1} may keep its last modules too (up to "
            f"{unit / 1e6:.1f}M parameter elements): its memory and backward all-gather are approximate")


def _dataloader_has_cost(dl) -> bool:
    """Whether a ``dataloader`` section gives its workers anything to do: a sample's CPU cost or read, a storage
    device, or a per-batch collate / pin / hand-off time."""
    c = dl.sample.cost
    return bool(c.mean_s or c.samples_s or dl.sample.read_bytes or dl.storage is not None or dl.collate_overhead_s
                or dl.pin_overhead_s or dl.handoff_s or dl.worker_startup_s)


def ineffective_setting_warnings(cfg: ScenarioConfig) -> list[str]:
    """One line per setting given in the scenario that has no effect on this run (as sequence_parallel at tp 1),
    and one per rank where a stage's and a replica's ``rank_overrides`` slowdowns compound."""
    out = []
    p, z, ddp, f = cfg.parallelism, cfg.zero_optimization, cfg.ddp, cfg.fsdp
    if p.pipeline_model_parallel_size == 1 and p.pipeline_schedule:
        out.append(f"parallelism.pipeline_schedule {p.pipeline_schedule} has no effect with "
                   "pipeline_model_parallel_size 1")
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        out.append("parallelism.sequence_parallel has no effect with tensor_model_parallel_size 1 (Megatron-LM turns "
                   "it off); the run is the same as without it")
    if "cp_comm_type" in p.model_fields_set and p.context_parallel_size == 1:
        out.append(f"parallelism.cp_comm_type {p.cp_comm_type} has no effect with context_parallel_size 1 (no K/V "
                   "exchange); the run is the same as without it")
    out += torchtitan_ac.without_effect(cfg)
    if z.stage == 0 and z.overlap_comm is not None:
        out.append(f"zero_optimization.overlap_comm {str(z.overlap_comm).lower()} has no effect with stage 0 "
                   + (f"({owner[0]}: {owner[1]})" if (owner := _stage0_wrapper(cfg)) else
                      "(DeepSpeed ZeRO off: ddp.overlap_grad_reduce governs the gradient all-reduce)"))
    if z.stage in (1, 2) and "allgather_bucket_size" in z.model_fields_set:
        out.append("zero_optimization.allgather_bucket_size has no effect: DeepSpeed gathers the updated partition "
                   "in one all_gather_into_tensor (deepspeed/runtime/utils.py all_gather_dp_groups); its chunked "
                   "fallback for a torch.distributed without all_gather_into_tensor is not modelled")
    stage3 = sorted(k for k in z.model_fields_set if k.startswith("stage3_"))
    if z.stage < 3 and stage3:
        out.append(f"zero_optimization.{', '.join(stage3)} ha{'s' if len(stage3) == 1 else 've'} no effect with stage "
                   f"{z.stage} (stage-3 parameter partitioning only)")
    pp = p.pipeline_model_parallel_size
    if z.stage in (1, 2) and pp > 1 and z.overlap:
        out.append(f"zero_optimization.overlap_comm true has no effect with pipeline_model_parallel_size {pp}: "
                   "DeepSpeed's engine turns it off for a PipelineModule (deepspeed/runtime/engine.py "
                   "_configure_zero_optimizer), so it is priced off (one IPG buffer, no reduction during backward)")
    if z.stage in (1, 2) and "overlap_grad_reduce" in ddp.model_fields_set and ddp.overlap_grad_reduce != z.overlap_in(pp):
        out.append(f"ddp.overlap_grad_reduce {str(ddp.overlap_grad_reduce).lower()} has no effect with "
                   f"zero_optimization.stage {z.stage}: DeepSpeed's zero_optimization.overlap_comm governs (in force: "
                   f"{str(z.overlap_in(pp)).lower()})")
    if f is not None and f.forward_prefetch and f.limit_all_gathers:
        out.append("fsdp.forward_prefetch true gives the same schedule here as limit_all_gathers alone: both are "
                   "modelled as a forward prefetch of one unit (the next unit's all-gather issued while the current "
                   "one computes, at most two in flight), as the host runs ahead of the GPU; in PyTorch "
                   "forward_prefetch issues it explicitly, which differs only when the host does not run ahead")
    if f is not None and not f.offload_params and not isinstance(f.cpu_offload, bool) and f.cpu_offload.cpu_adam_impl:
        out.append(f"fsdp.cpu_offload.cpu_adam_impl {f.cpu_offload.cpu_adam_impl} has no effect with offload_params "
                   "false (no CPU optimizer step: AdamW runs on the GPU)")
    if "async_tensor_model_parallel_allreduce" in p.model_fields_set and p.tensor_model_parallel_size == 1:
        out.append("parallelism.async_tensor_model_parallel_allreduce has no effect with tensor_model_parallel_size 1 "
                   "(no tensor-parallel gradient reduction)")
    if "cross_entropy" in cfg.training.model_fields_set and vit_shape(cfg) is not None:
        out.append(f"training.cross_entropy {cfg.training.cross_entropy} has no effect on a ViT: its classification "
                   "head's loss is F.cross_entropy over the classes (no vocab-parallel LM head); the run is the same "
                   "as without it")
    out += _hybrid_shard_notes(cfg)
    unread = _single_gpu_keys_without_effect(cfg)
    out += unread
    if not any(line.startswith("ddp.") for line in unread):  # else it named the ddp keys already
        out += _ddp_keys_without_effect(cfg)
    out += _grad_reduce_in_bf16_without_effect(cfg)
    buckets = [f"zero_optimization.{k}" for k in ("reduce_bucket_size", "allgather_bucket_size")
               if k in z.model_fields_set]
    if buckets and z.stage == 0:  # read by the ZeRO optimizers only; the engine's stage-0 all-reduce has its own
        # MEMORY_OPT_ALLREDUCE_SIZE buckets (deepspeedai/DeepSpeed@007cca6a deepspeed/runtime/engine.py
        # _backward_epilogue: self.allreduce_gradients(), its default bucket_size)
        owner = _stage0_wrapper(cfg)
        out.append(f"{', '.join(buckets)} ha{'s' if len(buckets) == 1 else 've'} no effect with stage 0 ("
                   + (f"{owner[0]}: {owner[1]}" if owner else "DeepSpeed ZeRO off: ddp's buckets govern the gradient "
                      "all-reduce") + f"); the run is the same without {'it' if len(buckets) == 1 else 'them'}")
    if "contiguous_gradients" in z.model_fields_set and z.stage not in (1, 2):
        out.append(f"zero_optimization.contiguous_gradients has no effect with stage {z.stage} (the IPG gradient "
                   "buffers are ZeRO-1/2's)")
    ac = cfg.activation_checkpointing
    if ac is not None and "host_buffers" in ac.model_fields_set and not ac.cpu_checkpointing:
        out.append(f"activation_checkpointing.host_buffers {ac.host_buffers} has no effect without cpu_checkpointing "
                   "(no checkpoint buffers in host memory)")
    if (f is not None and f.offload_params and not isinstance(f.cpu_offload, bool) and f.cpu_offload.cpu_adam_impl
            and "impl" in cfg.training.optimizer.model_fields_set):
        out.append(f"training.optimizer.impl {cfg.training.optimizer.impl} has no effect: AdamW runs on the CPU as "
                   f"fsdp.cpu_offload.cpu_adam_impl {f.cpu_offload.cpu_adam_impl}")
    dl = cfg.dataloader
    if dl is not None and dl.remote is None and not _dataloader_has_cost(dl):
        out.append("dataloader: no per-sample or per-batch cost is given (sample.cost, sample.read_bytes, storage and "
                   "the collate / pin / hand-off / start-up times are all 0 or unset): a batch costs only the copy of "
                   "its tensors, so num_workers and prefetch_factor can hardly change the step; give the per-sample "
                   "time your loader measures (dataloader.sample.cost.mean_s) to ask what workers do")
    by_pp = {o.pp_rank: o for o in cfg.rank_overrides if o.pp_rank is not None}
    for o in cfg.rank_overrides:
        if o.dp_rank is not None and o.pp_rank is None and o.slowdown != 1.0:
            for r, q in sorted(by_pp.items()):
                if q.slowdown != 1.0:
                    out.append(f"rank_overrides: pp_rank {r} slowdown {q.slowdown:g} and dp_rank {o.dp_rank} slowdown "
                               f"{o.slowdown:g} compound on pp_rank {r} / dp_rank {o.dp_rank}: its kernels run "
                               f"{q.slowdown:g} x {o.slowdown:g} = {q.slowdown * o.slowdown:.4g}x slower")
    return out


def deepspeed_sp_grads_note(cfg: ScenarioConfig) -> str | None:
    """The run's line for sequence parallelism (``tensor_model_parallel_size`` > 1) under DeepSpeed's engine
    (``schema.deepspeed_runs_step``), else None: Megatron-DeepSpeed all-reduces no sequence-parallel replicated
    gradient over the TP group there, so none is priced and the replicas drift (``TransformerSpec.deepspeed_engine``
    gives the sources)."""
    p = cfg.parallelism
    if not (p.sequence_parallel and p.tensor_model_parallel_size > 1 and deepspeed_runs_step(cfg)):
        return None
    return ("parallelism.sequence_parallel under DeepSpeed's engine: Megatron-DeepSpeed never all-reduces the "
            "LayerNorm / row-parallel-bias gradients over the tensor-parallel group (Megatron's reduce_model_grads "
            "runs only without --deepspeed; Megatron-DeepSpeed issues #170, #223), so no such all-reduce is priced "
            "and those replicated weights drift apart across TP ranks in the real run")


def fsdp2_selective_note(cfg: ScenarioConfig) -> str | None:
    """The run's line for ``training.recompute_granularity: selective`` with ``fsdp.version 2`` (torchtitan's
    FSDP2), else None. The key is Megatron-LM's (the core attention recomputed, its inputs saved), which the run
    prices; torchtitan's ``[activation_checkpoint] mode = "selective"`` is another policy, modelled under its own
    key ``activation_checkpoint`` (``simulator/config/sections/torchtitan_ac.py``, ``graph/builders/op_sac.py``)."""
    f = cfg.fsdp
    if f is None or f.version != 2 or cfg.training.recompute_granularity != "selective":
        return None
    return ("training.recompute_granularity selective with fsdp.version 2 is priced as Megatron-LM's selective "
            "recompute (core attention recomputed), not torchtitan's selective activation checkpointing (its "
            "memory and recompute time differ): for torchtitan's, set activation_checkpoint {mode: selective, "
            "selective_ac_option: op or n} instead")


def fsdp2_ac_note(cfg: ScenarioConfig) -> str | None:
    """The run's line for ``fsdp.version 2`` without an ``activation_checkpoint`` section, else None (and None for
    ``training.recompute_granularity`` selective: ``fsdp2_selective_note``): the activation checkpointing it prices,
    which is ``training.recompute_granularity`` (none when unset), while torchtitan's job config, which the section
    stands for, defaults to mode selective, selective_ac_option "2" (every 2nd block checkpointed;
    ``torchtitan_ac.TorchtitanActivationCheckpoint``'s defaults, pytorch/torchtitan@6404b932
    torchtitan/config/job_config.py ``ActivationCheckpoint``)."""
    f, rg = cfg.fsdp, cfg.training.recompute_granularity
    if f is None or f.version != 2 or cfg.activation_checkpoint is not None or rg == "selective":
        return None
    priced = ("every block checkpointed whole (training.recompute_granularity full, torchtitan's mode full)"
              if rg == "full" else "no activation checkpointing (training.recompute_granularity unset)")
    return (f"fsdp.version 2 without an activation_checkpoint section: priced with {priced}; torchtitan's default "
            "job config checkpoints every 2nd block (mode selective, selective_ac_option '2'): for it, set "
            "activation_checkpoint: {}")


def fsdp2_last_block_note(cfg: ScenarioConfig) -> str | None:
    """The run's line for ``fsdp.version 2`` resharding after forward, else None. torchtitan's ``apply_fsdp``
    leaves its last ``TransformerBlock`` gathered after forward (backward needs it first; pytorch/torchtitan@81c12433
    torchtitan/models/llama3/infra/parallelize.py); the graph (``graph.builders.fsdp2``) reshards every unit alike,
    so it prices one backward all-gather that torchtitan does not run. A plain ``fully_shard`` loop over the blocks
    reshards every one, as priced."""
    f = cfg.fsdp
    r = f.reshard_after_forward if f is not None else None
    if f is None or f.version != 2 or r is False or (type(r) is int and r == 1):  # 1: no resharding
        return None
    return ("fsdp.version 2: every block is resharded after forward and gathered again in backward; torchtitan "
            "keeps its last block gathered after forward, so one backward all-gather is priced that torchtitan "
            "does not run (a plain fully_shard loop reshards every block, as priced)")


def _hybrid_shard_notes(cfg: ScenarioConfig) -> list[str]:
    """FSDP1 ``sharding_strategy: HYBRID_SHARD`` whose mesh (the data-parallel ranks of one node shard, the nodes
    replicate; not given explicitly: ``fsdp_mesh``) degenerates (``ineffective_setting_warnings``). PyTorch's
    HYBRID_SHARD applies FULL_SHARD within a node and replicates parameters across nodes (pytorch/pytorch@acd8c9e
    torch/distributed/fsdp/api.py ``ShardingStrategy``), with one extra collective: the all-reduce of each reduced
    gradient shard over the inter-node group (pytorch/pytorch@3ade90a torch/distributed/fsdp/_runtime_utils.py
    ``_post_backward_hook``: ``allreduce_hook`` on ``_inter_node_state``).

    * Replicate 1 (every rank of the group in one node): the shard group is the whole group, the inter-node
      all-reduce runs over one rank and moves nothing: the layout and the run are FULL_SHARD's (SHARD_GRAD_OP's
      with ``reshard_after_forward`` false).
    * Shard 1 (one data-parallel rank per node): PyTorch clamps a one-rank FSDP group to NO_SHARD and then reduces
      the gradients over that one rank only, so the replicas never synchronize (pytorch/pytorch#154888, not fixed
      in FSDP1; verl-project/verl#7493 reproduces it); the run models the layout meant (the whole model per rank,
      gradients all-reduced across the nodes), which the real job does not run.

    An explicit mesh with replicate degree 1 is refused by the schema instead (``ScenarioConfig._fsdp_degrees``);
    FSDP2 (``version: 2``) takes no strategy: its mesh is given. Returns one line, or none."""
    f, p = cfg.fsdp, cfg.parallelism
    n = p.data_context_parallel_size
    if f is None or f.version != 1 or f.sharding_strategy != "HYBRID_SHARD" or n < 2:
        return []
    shard, rep = fsdp_mesh_of(cfg)
    group = "data- x context-parallel" if p.context_parallel_size > 1 else "data-parallel"
    if rep == 1:
        same = "FULL_SHARD" if f.reshards else "FULL_SHARD with reshard_after_forward false (SHARD_GRAD_OP)"
        return [f"fsdp.sharding_strategy HYBRID_SHARD is {same} here: all {n} {group} ranks lie in one node, so the "
                "shard group (a node's ranks) is the whole group and there is no other node to replicate to "
                "(PyTorch's HYBRID_SHARD shards within a node and replicates across nodes); its inter-node gradient "
                f"all-reduce runs over one rank and moves nothing, so the run is the same as {same}"]
    if shard == 1:
        return [f"fsdp.sharding_strategy HYBRID_SHARD with one {group} rank per node: the shard group is one rank, "
                "which PyTorch's FullyShardedDataParallel turns into NO_SHARD over that one rank, so the real job "
                f"never all-reduces the gradients across the {rep} nodes and the replicas diverge "
                "(pytorch/pytorch#154888, not fixed in FSDP1); this run models the layout meant (the whole model "
                f"on every rank, gradients all-reduced across the {rep} nodes), which that job does not run"]
    return []


def _single_gpu_keys_without_effect(cfg: ScenarioConfig) -> list[str]:
    """The keys the user set (``model_fields_set``) that nothing in this run reads (``ineffective_setting_warnings``):
    ``hardware.host`` threads / numa_node without a CPU optimizer step (they bind and size only the CPU step:
    ``offload_optimizer.cpu_threads``, ``host_kernels``), the ``ddp`` gradient-bucket keys with one data-parallel
    rank (no gradient reduction), any ``nccl`` key with no collective (one GPU), and ``pin_memory`` of an
    offload with device none (no host buffers). When it names ``ddp`` keys, ``_ddp_keys_without_effect``'s lines
    for them would repeat it, so the caller skips those."""
    out, h, z, p = [], cfg.hardware.host, cfg.zero_optimization, cfg.parallelism
    cpu_step = z.offload_optimizer.device != "none" or (cfg.fsdp is not None and cfg.fsdp.offload_params)
    host_keys = [k for k in ("threads", "numa_node") if getattr(h, k, None) is not None]
    if host_keys and not cpu_step:
        out.append(f"hardware.host.{', hardware.host.'.join(host_keys)} ha{'s' if len(host_keys) == 1 else 've'} no "
                   "effect: nothing in this run runs on host threads (they set the CPU optimizer step of "
                   "zero_optimization.offload_optimizer device cpu or fsdp cpu_offload)")
    dp_ranks = p.data_context_parallel_size
    ddp_keys = [k for k in ("bucket_cap_mb", "first_bucket_mb", "overlap_grad_reduce", "bucket_size",
                            "overlap_param_gather") if k in cfg.ddp.model_fields_set]
    if dp_ranks == 1 and ddp_keys:
        out.append(f"ddp.{', ddp.'.join(ddp_keys)} ha{'s' if len(ddp_keys) == 1 else 've'} no effect with "
                   "data_parallel_size 1: there is no data-parallel gradient reduction to bucket or overlap")
    nccl_keys = sorted(cfg.nccl.model_fields_set)
    if nccl_keys and cfg.hardware.cluster is None:
        out.append(f"nccl.{', nccl.'.join(nccl_keys)} ha{'s' if len(nccl_keys) == 1 else 've'} no effect on one GPU "
                   "(no hardware.cluster: no collectives)")
    for key, off in (("offload_optimizer", z.offload_optimizer), ("offload_param", z.offload_param)):
        if "pin_memory" in off.model_fields_set and off.device == "none":
            out.append(f"zero_optimization.{key}.pin_memory has no effect with device none (no host buffers)")
    return out


def _grad_reduce_in_bf16_without_effect(cfg: ScenarioConfig) -> list[str]:
    """``ddp.grad_reduce_in_bf16`` outside bf16, which Megatron-LM does not read, and the
    ``ddp.accumulate_allreduce_grads_in_fp32: true`` it overrides (``ineffective_setting_warnings``); either under
    DeepSpeed's BF16_Optimizer / FP16_Optimizer, which keep no Megatron grad buffer (``_stage0_wrapper``). Source:
    NVIDIA/Megatron-LM@307dcf37 megatron/training/arguments.py ``validate_args`` (only under ``--bf16``:
    ``if args.grad_reduce_in_bf16: args.accumulate_allreduce_grads_in_fp32 = False``)."""
    ddp, prec = cfg.ddp, cfg.training.precision
    keys = [k for k in ("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16") if getattr(ddp, k)]
    if keys and (wrapper := _stage0_wrapper(cfg)):  # DeepSpeed's ZeRO-0 wrappers keep no Megatron grad buffer
        return [f"ddp.{', ddp.'.join(keys)} ha{'s' if len(keys) == 1 else 've'} no effect with {wrapper[0]}: "
                "Megatron-LM's grad buffer is not used (DeepSpeed keeps the .grad in the model dtype, "
                f"training.precision {prec})"]
    if not ddp.grad_reduce_in_bf16:
        return []
    if prec != "bf16":
        buf = "fp16" if prec == "fp16" and not ddp.accumulate_allreduce_grads_in_fp32 else "fp32"
        return [f"ddp.grad_reduce_in_bf16 has no effect with training.precision {prec}: Megatron-LM reads "
                f"--grad-reduce-in-bf16 only under --bf16 (the grad buffer here is {buf})"]
    if ddp.accumulate_allreduce_grads_in_fp32:
        return ["ddp.accumulate_allreduce_grads_in_fp32 true has no effect with ddp.grad_reduce_in_bf16: Megatron-LM's "
                "--grad-reduce-in-bf16 turns it off under --bf16 (the grad buffer here is bf16)"]
    return []


#: how BF16_Optimizer reduces the gradients (graph.builders.bf16_optimizer: deepspeed/runtime/pipe/engine.py
#: ``_exec_reduce_grads`` -> ``allreduce_bucket``)
_BF16_OPT_REDUCE = "one all-reduce of the whole gradient buffer after the last backward, no overlap"
#: how the engine reduces FP16_Optimizer's gradients (graph.builders.fp16_optimizer: deepspeed/runtime/engine.py
#: ``allreduce_gradients`` -> ``buffered_allreduce_fallback``)
_FP16_OPT_REDUCE = ("the engine's all-reduces of 500M-element buckets of the 16-bit .grad after the last backward, "
                    "no overlap")


def _stage0_wrapper(cfg: ScenarioConfig) -> tuple[str, str] | None:
    """``(label, how it reduces the gradients)`` of the DeepSpeed ZeRO-0 optimizer wrapper that runs the scenario
    (``BF16_OPTIMIZER`` / ``FP16_OPTIMIZER``), else None (no DeepSpeed wrapper: PyTorch's or Megatron's DDP)."""
    if deepspeed_bf16_optimizer(cfg):
        return BF16_OPTIMIZER, _BF16_OPT_REDUCE
    if deepspeed_fp16_optimizer(cfg):
        return FP16_OPTIMIZER, _FP16_OPT_REDUCE
    return None


def _ddp_keys_without_effect(cfg: ScenarioConfig) -> list[str]:
    """The ``ddp`` keys given that this run's gradient reduction does not read (``ineffective_setting_warnings``):
    PyTorch DDP's buckets under FSDP, DeepSpeed ZeRO or Megatron's distributed optimizer, which bucket their own
    way; ``overlap_grad_reduce`` under FSDP and ZeRO-3, which always reduce as backward goes (ZeRO-3: its
    ``overlap_comm``); Megatron's ``bucket_size`` without the distributed optimizer (buckets: ``bucket_cap_mb``'s,
    or the owner's);
    under DeepSpeed's BF16_Optimizer / FP16_Optimizer the bucket caps and ``overlap_grad_reduce: true`` (the engine
    reduces after backward, in its own buckets). Keys set to their default are not named (a pasted ``bucket_cap_mb:
    25`` asks for what runs anyway, under every owner: those wrappers' reductions too); ``overlap_grad_reduce`` is
    named when the value the user set says what the owner does not do."""
    ddp, z, f, out = cfg.ddp, cfg.zero_optimization, cfg.fsdp, []
    # given and not the default: a pasted default (bucket_cap_mb: 25) asks for nothing other than what runs
    given = {k for k in ddp.model_fields_set if getattr(ddp, k) != type(ddp).model_fields[k].default}
    wrapper = _stage0_wrapper(cfg)
    owner = ("fsdp (one reduction per FSDP unit)" if f is not None else f"{wrapper[0]} ({wrapper[1]})"
             if wrapper else
             f"zero_optimization.stage {z.stage} (DeepSpeed's buckets: zero_optimization.reduce_bucket_size)"
             if z.stage > 0 else "ddp.use_distributed_optimizer (Megatron's buckets: ddp.bucket_size)"
             if ddp.use_distributed_optimizer else None)
    torch_keys = [k for k in ("bucket_cap_mb", "first_bucket_mb", "gradient_as_bucket_view") if k in given]
    if owner and torch_keys:
        out.append(f"ddp.{', ddp.'.join(torch_keys)} ha{'s' if len(torch_keys) == 1 else 've'} no effect with "
                   f"{owner}: PyTorch DDP's gradient buckets are not used")
    if "overlap_grad_reduce" in given and (f is not None or z.stage == 3):
        out.append(f"ddp.overlap_grad_reduce {str(ddp.overlap_grad_reduce).lower()} has no effect with "
                   + ("fsdp: each unit's gradients are reduce-scattered as backward completes it" if f is not None else
                      "zero_optimization.stage 3: zero_optimization.overlap_comm governs"))
    elif wrapper and "overlap_grad_reduce" in ddp.model_fields_set and ddp.overlap_grad_reduce:  # in force: off
        out.append(f"ddp.overlap_grad_reduce true has no effect with {wrapper[0]}: {wrapper[1]}")
    if "bucket_size" in given and not ddp.use_distributed_optimizer and ddp.bucket_size is not None:
        out.append(f"ddp.bucket_size has no effect with {owner}: Megatron-LM's --ddp-bucket-size is read only with "
                   "ddp.use_distributed_optimizer" if owner else
                   "ddp.bucket_size has no effect without ddp.use_distributed_optimizer: the data-parallel gradient "
                   "buckets here are ddp.bucket_cap_mb's (PyTorch DDP); Megatron-LM's own DDP, which also buckets by "
                   "--ddp-bucket-size, is modelled only with the distributed optimizer")
    return out


def run_scenario(cfg: ScenarioConfig, hw: Hardware | None = None) -> SimulationResult:
    """Simulate a validated scenario.

    Args:
        cfg: The scenario.
        hw: Its resolved machine, when the caller already has it (``resolve_hardware(cfg)``).

    When a rank's persistent tensors alone exceed its GPU's memory (``persistent_over_capacity``), the step is not
    simulated: the result is the out-of-memory one of those allocations (``oom`` ends with ``PERSISTENT_OOM_NOTE``,
    ``step_simulated`` is False, and the time and throughput figures are 0).

    Raises:
        ScenarioError: presets do not resolve.
        PolicyError: a policy's parameters are invalid for this scenario.
        SimulationError: the engine failed.
    """
    hw = hw if hw is not None else resolve_hardware(cfg)
    classes = rank_classes(cfg, hw)
    n_dp = len(classes) // cfg.parallelism.pipeline_model_parallel_size
    with gc_paused():  # the build too: its hundreds of thousands of ops trigger full collections otherwise
        try:
            hybrid = any(c.shard_group is not None for c in classes)
            parties = {(c.pp_rank, c.shard_group): sum(1 for q in classes if (q.pp_rank, q.shard_group) ==
                                                      (c.pp_rank, c.shard_group)) for c in classes}
            # the classes of a stage that share its scenario and machine less a slowdown (the same objects: every
            # replica not overridden, rank_folding none, a replica override of slowdown only) share one built graph;
            # each class's rendezvous ops are its own
            built: dict[tuple[int, int, int], OpGraph] = {}
            graphs = []
            for c in classes:
                ghw = c.graph_hw or c.hw
                key = (c.pp_rank, id(c.cfg), id(ghw))
                if key not in built:
                    built[key] = policy_graph(c.cfg, c.pp_rank, ghw)
                graphs.append(_meet_across_classes(built[key], c.pp_rank, c.dp_class, n_dp, c.shard_group,
                                                   parties[c.pp_rank, c.shard_group] if hybrid else 0))
            del built
        except PolicyError:
            raise
        except ValueError as exc:
            raise SimulationError(f"build phase failed: {exc}") from exc
        # persistent state alone over the GPU's memory: the out-of-memory result at once, from the persistent
        # allocations only (the step's ops dropped: nothing to simulate)
        early = any(persistent_over_capacity(g, c.hw, memory_overheads(cfg)) for g, c in zip(graphs, classes))
        if early:
            graphs = [g.with_changes(ops=()) for g in graphs]
        if len(classes) > 1:
            result = simulate_ranks(classes, graphs, cfg)
        else:
            c = classes[0]
            result = simulate_graph(graphs[0], c.hw, cfg.run.steps, cfg.run.warmup_steps, cfg.run.seed,
                                    resolved_config(cfg), c.cfg)
        del graphs  # freed now, by reference counting: not traversed by the collection that resumes below
    if early:
        result.summary["step_simulated"] = False
        result.summary["oom"] += f"; {PERSISTENT_OOM_NOTE}"
    return result


#: appended to the ``oom`` message of a run stopped before simulating (``run_scenario``)
PERSISTENT_OOM_NOTE = ("found before simulating: the persistent state (parameters, gradients, optimizer state) "
                       "alone exceeds the capacity, so the step was not simulated (the peak demand above is that "
                       "state's alone: the step's activations would add to it)")


def persistent_over_capacity(graph: OpGraph, hw: Hardware, overheads: DeviceMemoryOverheads) -> bool:
    """Whether the graph's persistent tensors on the GPU (those not placed on a host pool: the executor's
    ``Executor.start`` rule), with the CUDA context and allocator reserve of ``overheads``, already exceed
    ``hw.gpu.hbm_capacity_bytes``: the run is out of memory whatever its step does (tensors are only added)."""
    pool = MemoryPool("gpu", hw.gpu.hbm_capacity_bytes, overheads=overheads)
    for t in graph.persistent:
        if t.device not in ("host_pinned", "host_pageable"):
            pool.alloc(t.name, t.nbytes, 0.0)
    return pool.oom is not None
