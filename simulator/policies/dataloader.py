"""The input pipeline in a run: ``next(iterator)`` before each micro-batch, then its H2D copy.

Two registered pieces, both active when the scenario has a ``dataloader:`` section:

* graph policy ``dataloader``: inserts a ``DATALOADER`` op on the ``host`` stream (the training
  thread calling ``next(iterator)``) before every micro-batch's ``input.h2d`` copy, which then
  depends on it; the copy moves the batch's bytes and is pinned or pageable as ``pin_memory``
  says (the executor caps pageable copies at the driver's staging rate, over the same PCIe links
  as every other copy).
* runtime component ``dataloader``: runs ``hardware_models.dataloader.DataLoaderModel`` on the
  host's CPU pool (``system.host_cpu_pool``, created here when no other component made it, so
  that other host work can share the cores), answers the ``DATALOADER`` ops and adds to the
  summary ``data_stall_s`` (mean time per measured step the training thread waited in ``next``)
  and ``dataloader`` (waits, worker / pin-thread / host-CPU utilisation, and per step of the run
  ``stall_by_step_s`` and ``lead_by_step_s``, which ``simulate dataloader-workers`` uses to tell
  a steady state from a prefetch buffer that is still draining).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hardware_models.dataloader import (
    CpuPool,
    DataLoaderModel,
    DataLoaderSpec,
    DataLoaderSpecError,
    RemoteSpec,
    SampleCost,
    StorageSpec,
    load_storage_preset,
)
from simulator.graph.op_graph import OpGraph
from simulator.policies._rewrite import replace_op
from simulator.policies.dataloader_notes import workers_notes
from simulator.graph.ops import OpKind, OpRole, Phase, op_copier
from simulator.policies.registry import PolicyError, register_graph_policy, register_runtime

INPUT_COPY_SUFFIX = "input.h2d"
#: ``_renumbered(op, id, deps)``: ``op`` with a new id and dependencies (``graph.ops.op_copier``)
_renumbered = op_copier(("id", "deps"))
NEXT_OP_NAME = "data.next"


def loader_spec(cfg) -> DataLoaderSpec:
    """The ``DataLoaderSpec`` of a scenario (``cfg.dataloader`` must be set).

    Raises:
        PolicyError: one line naming the ``dataloader.*`` key.
    """
    d = cfg.dataloader
    mbs = cfg.training.micro_batch_size
    if d.batch_size is not None and d.batch_size != mbs:
        raise PolicyError(f"dataloader.batch_size ({d.batch_size}) must equal training.micro_batch_size ({mbs}): "
                          "each micro-batch is one DataLoader batch")
    c = d.sample.cost
    sample_bytes = d.sample.bytes or _input_sample_bytes(cfg)
    try:
        cost = SampleCost(c.distribution, c.mean_s, c.sigma or 0.0, tuple(c.samples_s or ()))
        remote = (RemoteSpec(d.remote.cores, d.remote.bandwidth_bytes_per_s, d.remote.latency_s)
                  if d.remote is not None else None)
        return DataLoaderSpec(
            batch_size=mbs, num_workers=d.num_workers, prefetch_factor=d.prefetch_factor, pin_memory=d.pin_memory,
            persistent_workers=d.persistent_workers, drop_last=d.drop_last, dataset_size=d.dataset_size,
            sample_cost=cost, sample_read_bytes=d.sample.read_bytes, sample_bytes=sample_bytes,
            collate_overhead_s=d.collate_overhead_s, pin_overhead_s=d.pin_overhead_s,
            worker_startup_s=d.worker_startup_s, handoff_s=d.handoff_s, remote=remote)
    except DataLoaderSpecError as exc:
        raise PolicyError(f"dataloader: {exc}") from None


def _input_sample_bytes(cfg) -> float:
    """Bytes of one collated sample the step copies to the GPU: ``seq_length + 1`` int64 tokens, or a ViT's
    fp32 image and int64 label (``vit.image_sample_bytes``)."""
    from simulator.graph.builders.vit import VitShape, image_sample_bytes

    m = cfg.model
    if m.architecture == "vit":
        return float(image_sample_bytes(VitShape(m.image_size, m.patch_size, m.num_channels or 3, m.num_classes)))
    return 8.0 * (m.seq_length + 1)


def storage_spec(cfg) -> StorageSpec | None:
    """The scenario's storage (preset or inline), or ``None``.

    Raises:
        PolicyError: unknown preset.
    """
    s = cfg.dataloader.storage
    if s is None:
        return None
    try:
        if isinstance(s, str):
            return load_storage_preset(s)
        return StorageSpec(s.name, s.read_bandwidth_bytes_per_s, s.read_latency_s)
    except DataLoaderSpecError as exc:
        raise PolicyError(f"dataloader.storage: {exc}") from None


def insert_dataloader_ops(graph: OpGraph, pinned: bool, batch_bytes: float | None) -> OpGraph:
    """A copy of ``graph`` with a ``DATALOADER`` host op before every input copy (``OpRole.INPUT_COPY``).

    Ids are renumbered; dependencies (and ``meta["prev_step_deps"]``) follow.
    """
    new_ops, remap = [], {}
    h2d, input_copy = OpKind.MEMCPY_H2D, OpRole.INPUT_COPY
    for op in graph.ops:
        if op.kind == h2d and op.role is input_copy:
            nid = len(new_ops)
            new_ops.append(dataclasses.replace(
                op, id=nid, name=NEXT_OP_NAME, kind=OpKind.DATALOADER, stream="host", phase=Phase.DATA,
                deps=(), allocs=(), uses=(), launch=False, flops=0.0, bytes_read=0.0, bytes_written=0.0,
                role=OpRole.NONE, meta={}))
            remap[op.id] = nid + 1
            changes = dict(id=nid + 1, deps=tuple(sorted({remap[d] for d in op.deps} | {nid})), pinned=pinned)
            if batch_bytes:
                changes["bytes_read"] = float(batch_bytes)
            new_ops.append(replace_op(op, **changes))
        else:  # (``replace_op(op, id=..., deps=...)``, built slot by slot)
            nid = remap[op.id] = len(new_ops)
            new_ops.append(_renumbered(op, nid, tuple(sorted({remap[d] for d in op.deps}))))
    # prev_step_deps may name any op of the previous step: remap them once every id is known
    for op in graph.ops:
        prev = op.meta.get("prev_step_deps") if op.meta else None
        if prev:
            i = remap[op.id]
            new_ops[i] = dataclasses.replace(new_ops[i], meta={**op.meta,
                                                               "prev_step_deps": tuple(remap[d] for d in prev)})
    return OpGraph(ops=tuple(new_ops), persistent=graph.persistent, samples_per_step=graph.samples_per_step,
                   tokens_per_step=graph.tokens_per_step, model_flops_per_step=graph.model_flops_per_step,
                   policies=graph.policies, source=graph.source, model=graph.model, meta=graph.meta,
                   param_groups=tuple(dataclasses.replace(pg, grad_op=remap[pg.grad_op]) for pg in graph.param_groups))


@register_graph_policy("dataloader", order=5)
class DataLoaderGraphPolicy:
    """Insert ``next(iterator)`` before each micro-batch's input copy."""

    @staticmethod
    def applies(cfg) -> bool:
        return getattr(cfg, "dataloader", None) is not None

    @staticmethod
    def reuse_key(cfg, hw) -> tuple:
        """What ``transform`` reads beside the graph (``registry.policies_reuse_key``): pinned, batch bytes.

        Raises:
            PolicyError: as ``transform``.
        """
        spec = loader_spec(cfg)
        storage_spec(cfg)
        return (spec.pin_memory, spec.batch_bytes)

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        spec = loader_spec(cfg)  # validate now: errors surface in the build phase
        storage_spec(cfg)
        if not any(op.kind == OpKind.MEMCPY_H2D and op.role is OpRole.INPUT_COPY for op in graph.ops):
            raise PolicyError(f"dataloader: the step graph has no input copy (role {OpRole.INPUT_COPY.value}, the "
                              f"builder's '*{INPUT_COPY_SUFFIX}') to feed")
        return insert_dataloader_ops(graph, spec.pin_memory, spec.batch_bytes)


def host_cpu_pool(env, hw, system) -> CpuPool:
    """The run's host CPU pool (created on first use and kept on ``system``)."""
    pool = getattr(system, "host_cpu_pool", None)
    if pool is None:
        pool = CpuPool(env, hw.host_cpu.cores, "host.cpu")
        system.host_cpu_pool = pool
    return pool


@register_runtime("dataloader")
class DataLoaderRuntime:
    """Feeds the ``DATALOADER`` ops from a simulated ``torch.utils.data.DataLoader``.

    Per-sample costs are drawn from the run's random generator ``env.rng`` (set by
    ``simulate_graph`` from ``run.seed``), in sample order.
    """

    @staticmethod
    def applies(cfg) -> bool:
        return getattr(cfg, "dataloader", None) is not None

    def __init__(self, cfg, hw, env, system):
        self.env = env
        self.spec = loader_spec(cfg)
        self.pool = host_cpu_pool(env, hw, system)
        # per-sample costs come from the run's generator (simulate_graph: default_rng(run.seed)), so
        # that run.seed decides every random draw of the run
        self.loader = DataLoaderModel(env, self.spec, self.pool, env.rng, hw.host_cpu.memory_bandwidth_bytes_per_s,
                                      storage_spec(cfg))
        self.waits: list[tuple[int, float]] = []  # (step, wait_s) per batch
        self.leads: list[tuple[int, float]] = []  # (step, request_s - ready_s) per batch

    def host_handlers(self) -> dict:
        return {OpKind.DATALOADER: self._next}

    def _next(self, op, step):
        rec = yield from self.loader.next_batch()
        self.waits.append((step, rec.wait_s))
        self.leads.append((step, (rec.received_s - rec.wait_s) - rec.ready_s))

    def warnings(self) -> list[str]:
        """What the run shows of the workers setting (call after ``summarize``): ``dataloader_notes.workers_notes``
        (workers that do not hold up the step, so more change nothing; a prefetch buffer that is draining)."""
        return workers_notes(self.spec, self.loader.records, self.waits, self.leads, getattr(self, "_steps", None),
                             self.loader.pin_busy_s)

    def summarize(self, spans=None, steps=None, counters=None, summary=None) -> dict:
        self._steps = steps
        measured = steps[~steps.warmup]
        ms = set(int(s) for s in measured.step)
        per_step = {s: 0.0 for s in ms}
        for s, w in self.waits:
            if s in per_step:
                per_step[s] += w
        waits = [w for s, w in self.waits if s in ms]
        t0 = float(measured.start_s.min()) if len(measured) else 0.0
        t1 = float(measured.end_s.max()) if len(measured) else 0.0
        span = t1 - t0
        n_steps = len(steps)
        stall_by_step, lead_by_step = [0.0] * n_steps, [[] for _ in range(n_steps)]
        for (s, w), (_, lead) in zip(self.waits, self.leads):
            if 0 <= s < n_steps:
                stall_by_step[s] += w
                lead_by_step[s].append(lead)
        return {
            "data_stall_s": float(np.mean(list(per_step.values()))) if per_step else 0.0,
            "dataloader": {
                "num_workers": self.spec.num_workers,
                "prefetch_factor": self.spec.effective_prefetch_factor or None,
                "pin_memory": self.spec.pin_memory,
                "batches": len(self.waits),
                "mean_wait_s": float(np.mean(waits)) if waits else 0.0,
                "max_wait_s": float(np.max(waits)) if waits else 0.0,
                "worker_utilisation": self.loader.worker_utilisation(t0, t1),
                "pin_thread_busy_s": self.loader.pin_busy_s,  # whole run
                "host_cpu_busy_cores": (self.pool.busy_core_s / self.env.now) if self.env.now > 0 else 0.0,
                "host_cores": self.pool.cores,
                "sample_cost_s": self.spec.sample_cost.expected_s,
                "batch_bytes": self.spec.batch_bytes,
                "stall_fraction": (float(np.mean(list(per_step.values()))) / float(measured.step_time_s.mean())
                                   if per_step and len(measured) and not math.isclose(span, 0.0) else 0.0),
                # per step of the run (warm-up included): time in next() and the mean lead of the
                # step's batches (ready this long before next() asked; negative: a stall)
                "stall_by_step_s": stall_by_step,
                "lead_by_step_s": [float(np.mean(v)) if v else 0.0 for v in lead_by_step],
            },
        }
