"""The headline summary of a run, computed from its raw records."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from hardware_models.machine import Hardware
from simulator.analysis import metrics
from simulator.graph.op_graph import PAGE_FAULT_META, OpGraph


def step_period_s(steps: pd.DataFrame) -> tuple[float, float]:
    """``(period_s, latency_s)`` of the measured (non-warm-up) steps, seconds.

    The period of step ``i > 0`` is ``end_i - end_{i-1}``: how often a step completes, which is
    what throughput follows when steps overlap (a delayed parameter update runs step ``i``'s CPU
    optimizer during step ``i + 1``). Step 0 has no predecessor: its period is its latency. The
    latency is ``end_i - start_i``. When every step starts as the previous one ends (a
    synchronised training loop) the two are equal.

    Args:
        steps: One row per step with ``step, start_s, end_s, warmup`` (in step order).
    """
    ends, starts = steps["end_s"].to_numpy(), steps["start_s"].to_numpy()
    prev_end = np.concatenate(([np.nan], ends[:-1]))
    first = steps["step"].to_numpy() == 0
    period = np.where(first, ends - starts, ends - prev_end)
    mask = ~steps["warmup"].to_numpy()
    if not mask.any():
        return 0.0, 0.0
    latency = (ends - starts)[mask]
    return float(np.mean(period[mask])), float(np.mean(latency))


def summarize(graph: OpGraph, hw: Hardware, memory: dict[str, Any], spans: pd.DataFrame,
              steps: pd.DataFrame) -> dict:
    """Headline metrics of a run (SI units; per GPU unless named otherwise).

    ``step_time_s`` is the steady-state step *period* and ``step_latency_s`` the mean time from a
    step's start to its last op (see ``step_period_s``); they differ only when steps overlap.

    Memory keys: ``peak_memory_bytes`` (= ``peak_memory_allocated_bytes``) counts tensors, as
    ``torch.cuda.max_memory_allocated()``; ``peak_memory_reserved_bytes`` adds the caching
    allocator's reserve (``max_memory_reserved()``); ``peak_device_memory_bytes`` adds the CUDA
    context too (what ``nvidia-smi`` shows) and is what is checked against the capacity (``oom``).
    ``peak_memory_by_category_bytes`` sums to ``peak_device_memory_bytes`` (categories
    ``cuda_context`` and ``allocator_reserve`` besides the tensors'); ``memory_overheads`` gives the
    two values used and whether each was assumed (a documented default) or set by the scenario.

    Host: ``host_page_fault_s`` is the host time per step spent on first-touch page faults of fresh host buffers
    (the ``page_fault_s`` of the graph's meta, ``op_graph.PAGE_FAULT_META``, that the offload and activation-offload
    policies priced into their host ops and copies; part of their time, not added to it).

    Communication: ``exposed_comm_s`` is the time per step the compute stream is idle while at
    least one collective is in flight, ``comm_s_by_group`` the busy time per step of each process
    group's collectives (``metrics.comm_exposure``); ``world_size`` and ``data_parallel_size`` are
    the cluster's (1 without one). Throughput counts every data-parallel replica; MFU and memory
    are per GPU.

    Args:
        graph: The step graph that ran.
        hw: The machine it ran on.
        memory: The run's memory pools by name (``simulator.engine.run.RunRecords.memory``).
        spans: The run's spans.
        steps: One row per step with ``step, start_s, end_s, step_time_s, warmup``.
    """
    step_time, latency = step_period_s(steps)
    gpu_mem = memory["gpu"]
    oom = [p.oom_message() for p in memory.values() if p.oom is not None]
    util = metrics.utilisation(spans, steps)
    split = metrics.phase_split(spans, steps)
    exposed, comm_by_group = metrics.comm_exposure(spans, steps)
    return {
        "step_time_s": step_time,
        "step_latency_s": latency,
        "samples_per_s": graph.samples_per_step / step_time if step_time else 0.0,
        "tokens_per_s": graph.tokens_per_step / step_time if step_time else 0.0,
        "mfu": metrics.mfu(graph.model_flops_per_step, step_time, hw.gpu.peak("bf16")),
        "model_flops_per_step": graph.model_flops_per_step,
        "peak_memory_bytes": int(gpu_mem.peak),
        "peak_memory_allocated_bytes": int(gpu_mem.peak),
        "peak_memory_reserved_bytes": int(gpu_mem.peak) + gpu_mem.overheads.reserve_bytes(gpu_mem.peak),
        "peak_device_memory_bytes": gpu_mem.peak_device_bytes,
        "peak_memory_by_category_bytes": {k: int(v) for k, v in gpu_mem.by_category_with_overheads(
            gpu_mem.peak_by_category, gpu_mem.peak).items() if v},
        "memory_overheads": {"cuda_context_bytes": gpu_mem.overheads.cuda_context_bytes,
                             "allocator_reserve_fraction": gpu_mem.overheads.allocator_reserve_fraction,
                             "sources": dict(gpu_mem.overheads.sources)},
        "gpu_memory_capacity_bytes": float(gpu_mem.capacity_bytes),
        "peak_host_pinned_bytes": int(memory["host_pinned"].peak),
        "peak_host_pageable_bytes": int(memory["host_pageable"].peak),
        "host_page_fault_s": float(graph.meta.get(PAGE_FAULT_META, 0.0)),
        "oom": oom[0] if oom else None,
        "phase_s": split,
        "data_stall_s": 0.0,
        "exposed_comm_s": exposed,
        "comm_s_by_group": comm_by_group,
        "world_size": hw.world_size,
        "data_parallel_size": len(hw.dp_group) // len(hw.cp_group),
        "context_parallel_size": len(hw.cp_group),
        "tensor_parallel_size": len(hw.tp_group),
        "utilisation": util,
        "num_ops": len(graph),
        "steps_simulated": int(len(steps)),
        "warmup_steps": int(steps["warmup"].sum()),
        "gpu": hw.gpu.name,
        "profile": hw.profile.name,
        "launch_overhead_source": hw.launch.source,
    }
