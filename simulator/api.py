"""The thin API every study, the CLI and the notebooks call: scenario -> graph -> engine -> summary.

``load_scenario`` validates a scenario; ``run_scenario`` builds its step graph, applies its
policies, runs it on the engine and summarises the records. Touches no files.
"""

from __future__ import annotations

import dataclasses

from hardware_models.machine import Hardware
from simulator.analysis.results import SimulationResult
from simulator.analysis.summary import summarize
from simulator.config.loader import load_scenario, resolve_hardware
from simulator.config.schema import ScenarioConfig
from simulator.engine.memory import DeviceMemoryOverheads, default_overheads
from simulator.engine.run import SimulationError, gc_paused, run_graph
from simulator.graph.builders.transformer import TransformerSpec, build_gpt_step
from simulator.graph.op_graph import OpGraph
from simulator.policies import apply_graph_policies, build_runtime
from simulator.policies.registry import PolicyError
from simulator.recording.recorder import dependencies_frame

__all__ = ["SimulationError", "build_graph", "load_scenario", "run_scenario", "simulate_graph", "transformer_spec"]


def transformer_spec(cfg: ScenarioConfig) -> TransformerSpec:
    """The builder's view of a scenario's model, batch and precision."""
    m, t, p = cfg.model, cfg.training, cfg.parallelism
    dp = p.data_parallel_size or 1
    z, ddp = cfg.zero_optimization, cfg.ddp
    per_step = t.micro_batch_size * dp
    gbs = t.global_batch_size or per_step
    return TransformerSpec(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        seq_length=m.seq_length, vocab_size=m.vocab_size, ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        micro_batch_size=t.micro_batch_size, num_micro_batches=gbs // per_step,
        tied_embeddings=not m.untie_embeddings_and_output_weights, bias=m.add_bias_linear,
        precision=t.precision, optimizer_impl=t.optimizer.impl,
        recompute=t.recompute_granularity or "none", data_parallel_size=dp,
        zero_stage=z.stage if dp > 1 else 0,
        ddp_first_bucket_bytes=int(ddp.first_bucket_mb * 2**20), ddp_bucket_cap_bytes=int(ddp.bucket_cap_mb * 2**20),
        overlap_grad_reduce=ddp.overlap_grad_reduce if z.stage == 0 else z.overlap_comm,
        gradient_as_bucket_view=ddp.gradient_as_bucket_view,
        reduce_bucket_elements=z.reduce_bucket_size or 500_000_000, allgather_bucket_elements=z.allgather_bucket_size,
        tensor_parallel_size=p.tensor_model_parallel_size, sequence_parallel=p.sequence_parallel,
        num_query_groups=m.query_groups if m.group_query_attention else None, swiglu=m.swiglu,
        normalization=m.normalization, position_embedding=m.position_embedding_type,
        max_position_embeddings=m.max_position_embeddings, qkv_bias=m.add_qkv_bias,
        num_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        expert_parallel_size=p.expert_model_parallel_size, kv_channels=m.kv_channels, window_size=m.window_size,
    )


def model_num_parameters(cfg: ScenarioConfig) -> int:
    """Parameters of the whole model, unsharded and with the vocabulary as given (no tensor-parallel
    padding): the count a model card publishes (Llama-3.1-8B: 8,030,261,248)."""
    return _whole_model(cfg).num_parameters


def _whole_model(cfg: ScenarioConfig) -> TransformerSpec:
    """The scenario's spec on one rank holding everything (tp 1, ep 1, dp 1)."""
    return dataclasses.replace(transformer_spec(cfg), tensor_parallel_size=1, sequence_parallel=False,
                               expert_parallel_size=1, data_parallel_size=1, zero_stage=0)


def build_graph(cfg: ScenarioConfig) -> OpGraph:
    """The step graph of a scenario (before its policies)."""
    return build_gpt_step(transformer_spec(cfg))


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
        step_df = rec.steps.assign(warmup=rec.steps.step < warmup_steps)
        summary = summarize(graph, hw, rec.memory, rec.spans, step_df)
        summary["warnings"] = run_warnings(hw, cfg)
        if cfg is not None:
            summary["zero_stage"] = cfg.zero_optimization.stage
            summary["num_parameters"] = model_num_parameters(cfg)
            if cfg.model.num_experts:  # parameters one token passes through (router + top-k experts)
                summary["num_active_parameters"] = _whole_model(cfg).num_active_parameters
                summary["expert_parallel_size"] = cfg.parallelism.expert_model_parallel_size
        for comp in runtime.components:
            if hasattr(comp, "summarize"):
                summary.update(comp.summarize(spans=rec.spans, steps=step_df, counters=rec.counters, summary=summary))
    return SimulationResult(summary, rec.spans, rec.counters, step_df, config or {}, rec.launches,
                            dependencies_frame(graph))


def memory_overheads(cfg: ScenarioConfig) -> DeviceMemoryOverheads:
    """The scenario's non-tensor GPU memory (``memory:`` section; documented defaults for unset keys)."""
    m = cfg.memory
    return default_overheads(m.cuda_context_bytes, m.allocator_reserve_fraction)


def run_warnings(hw: Hardware, cfg: ScenarioConfig | None) -> list[str]:
    """One line per thing in this run that is assumed rather than measured, or accepted but not modelled."""
    out = []
    if hw.profile.name.startswith("generic:"):
        out.append(f"generic GPU profile {hw.profile.name!r}: no fitted efficiency profile for this GPU, so GEMM and "
                   "memory-kernel efficiencies are assumed (70% / 80% of peak); comparisons with a fitted GPU "
                   "(h200-sxm-141gb) mix measured and assumed numbers")
    if hw.launch.source == "generic":
        out.append(f"host {hw.host_cpu.name!r} has no measured dispatch time per op: the generic "
                   f"{hw.launch.per_op_s * 1e6:.0f} us is assumed (set hardware.launch_overhead_s or calibrate the host)")
    if hw.collectives is not None and len(hw.dp_group) * len(hw.tp_group) > 1:
        out.append(f"{len(hw.dp_group)} data-parallel x {len(hw.tp_group)} tensor-parallel ranks folded symmetrically: "
                   "one representative rank is simulated and its collectives are priced by the NCCL model (no "
                   "stragglers, no network contention from other jobs)")
        nccl = hw.nccl
        if nccl is None or nccl.interference:
            from simulator.cost.interference import InterferenceFactors

            f = InterferenceFactors.from_profile(hw.collectives.profile, nccl.nchannels if nccl is not None else None)
            out.append(f.describe(hw.gpu.sm_count))
        else:
            out.append("compute/communication interference off (nccl.interference: false): overlapped collectives do "
                       "not slow the kernels beside them (measured: overlapped compute 19% slower on average, up to "
                       "40%; Lee et al. 2025, arXiv 2507.03114), so exposed_comm_s and step_time_s are lower bounds")
    if cfg is not None and cfg.training.precision in ("bf16", "amp_fp32_params") and "bf16" not in hw.gpu.peak_flops_per_s:
        out.append(f"training.precision {cfg.training.precision} uses bf16, which {hw.gpu.name} has no tensor-core rate "
                   "for (Volta/Turing): its GEMMs are priced at the fp16 rate, while a real bf16 job runs emulated, "
                   "far slower, or fails; use training.precision: fp16 for this GPU")
    if cfg is not None and cfg.dataloader is not None and hw.collectives is not None and hw.world_size > 1:
        per_node = hw.collectives.topo.gpus_per_node
        out.append(f"the host is shared by {per_node} ranks per node, which is not modelled: this rank's DataLoader "
                   "workers get every core and all host memory bandwidth, so data_stall_s is a lower bound")
    if cfg is not None and cfg.model.num_experts:
        m = cfg.model
        out.append(f"model.num_experts {m.num_experts}: routing is assumed balanced (every expert receives "
                   f"T x {m.moe_router_topk} / {m.num_experts} of each rank's T tokens; not modelled: load imbalance, "
                   "padding to capacity), so expert GEMM and all-to-all times are lower bounds")
    if cfg is not None and cfg.parallelism.sequence_parallel and cfg.parallelism.tensor_model_parallel_size == 1:
        out.append("parallelism.sequence_parallel has no effect with tensor_model_parallel_size 1 (Megatron-LM turns "
                   "it off); the run is the same as without it")
    z = getattr(cfg, "zero_optimization", None)
    dp_many = len(hw.dp_group) > 1
    if (z is not None and not dp_many and z.stage >= 1 and z.offload_optimizer.device == "none"
            and z.offload_param.device == "none"):
        out.append(f"zero_optimization.stage {z.stage} without offload shards nothing on one GPU: ZeRO stages only "
                   "partition model states across data-parallel ranks (set hardware.cluster for data_parallel_size > 1)")
    return out


def run_scenario(cfg: ScenarioConfig, hw: Hardware | None = None) -> SimulationResult:
    """Simulate a validated scenario.

    Args:
        cfg: The scenario.
        hw: Its resolved machine, when the caller already has it (``resolve_hardware(cfg)``).

    Raises:
        ScenarioError: presets do not resolve.
        PolicyError: a policy's parameters are invalid for this scenario.
        SimulationError: the engine failed.
    """
    hw = hw if hw is not None else resolve_hardware(cfg)
    try:
        graph = apply_graph_policies(build_graph(cfg), cfg, hw)
    except PolicyError:
        raise
    except ValueError as exc:
        raise SimulationError(f"build phase failed: {exc}") from exc
    return simulate_graph(graph, hw, cfg.run.steps, cfg.run.warmup_steps, cfg.run.seed,
                          cfg.model_dump(mode="json"), cfg)
