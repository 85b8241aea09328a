"""Results of ranks simulated side by side: the bubble of one pipeline stage, one summary from the stages'
summaries (``combine_stages``) or from data-parallel rank classes' (``combine_classes``: stragglers)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simulator.analysis.metrics import COLLECTIVE_KIND, COMPUTE_KIND, _codes, _merge, _rows_in, mfu
from simulator.analysis.results import BREAKDOWN_IDLE, BREAKDOWN_PIPELINE_WAIT, rank_partition
from simulator.analysis.summary import step_period_s

#: per-stage keys copied into ``summary["pipeline"]["stages"]``
_STAGE_KEYS = ("step_time_s", "exposed_comm_s", "comm_s_by_group", "pipeline_bubble_s", "pipeline_imbalance_s",
               "pipeline_wait_s", "host_idle_s", "compute_clock_mhz",
               "peak_device_memory_bytes", "peak_memory_bytes", "oom", "phase_compute_s", "energy_j_per_step",
               "avg_power_w", "num_ops")
#: DVFS / energy keys averaged over the stages (per GPU)
_MEAN_KEYS = ("energy_j_per_step", "avg_power_w", "avg_sm_clock_mhz")


def pipeline_bubble_s(spans: pd.DataFrame, steps: pd.DataFrame) -> float:
    """Pipeline bubble of one stage: the time per measured step its compute stream is idle while none of
    its collectives (send/recv included) is in flight, ``|window - union(compute, collectives)|``, s.

    It counts the waits for the neighbouring stages (a send/recv is in flight only once both sides
    have posted it: the time before is the bubble) and also any host-bound gap of the stage.

    Args:
        spans: The stage's spans.
        steps: Its steps with ``step, start_s, end_s, warmup``.
    """
    measured = steps[~steps.warmup] if "warmup" in steps else steps
    if measured.empty:
        return 0.0
    iv_all = spans[["start_s", "end_s"]].to_numpy(dtype=float)[_rows_in(_codes(spans.kind), COMPUTE_KIND, COLLECTIVE_KIND)]
    total = 0.0
    for t0, t1 in measured[["start_s", "end_s"]].to_numpy(dtype=float):
        iv = iv_all[(iv_all[:, 1] > t0) & (iv_all[:, 0] < t1)]
        total += (t1 - t0) - float(np.sum(np.diff(_merge(np.clip(iv, t0, t1)), axis=1)))
    return total / len(measured)


def stage_idle_split(spans: pd.DataFrame, launches: pd.DataFrame | None, steps: pd.DataFrame) -> dict[str, float]:
    """One stage's idle time per measured step, s, split as ``SimulationResult.breakdown`` splits it:
    ``pipeline_wait_s`` (its compute stream holds a launched kernel that waits for another stage: bubble and
    imbalance) and ``host_idle_s`` (nothing runs and nothing is launched: host-bound gaps). Together with its
    exposed communication, copies and data wait they make up ``pipeline_bubble_s``'s idle time.

    Args:
        spans: The stage's spans; launches: its host launches (``step, op_id, start_s, end_s``); steps: its steps.
    """
    part = dict(rank_partition(spans, launches, steps, pipeline=True).itertuples(index=False))
    return {"pipeline_wait_s": part.get(BREAKDOWN_PIPELINE_WAIT, 0.0), "host_idle_s": part.get(BREAKDOWN_IDLE, 0.0)}


def phase_compute_s(spans: pd.DataFrame, steps: pd.DataFrame) -> dict[str, float]:
    """Compute-kernel time per phase of one stage, per measured step: the union of its ``compute`` spans of
    each phase (``fwd_s``, ``bwd_s``, ``opt_s``; ``data_s`` 0), s. Unlike ``metrics.phase_split`` (the
    CUDA-event split, whose phases also hold the waits between them) it leaves the pipeline's idle time out.
    """
    measured = steps[~steps.warmup] if "warmup" in steps else steps
    comp = spans[_rows_in(_codes(spans.kind), COMPUTE_KIND) & spans.step.isin(measured.step).to_numpy(bool)]
    iv_all, phase = comp[["start_s", "end_s"]].to_numpy(dtype=float), _codes(comp.phase)
    out = {"data_s": 0.0}
    for ph in ("fwd", "bwd", "opt"):
        iv = iv_all[_rows_in(phase, ph)]
        out[f"{ph}_s"] = float(np.sum(np.diff(_merge(iv), axis=1))) / max(len(measured), 1)
    return out


def compute_clock_mhz(spans: pd.DataFrame, counters: pd.DataFrame | None, steps: pd.DataFrame) -> float | None:
    """Mean SM clock of one stage while its compute stream runs, over its measured steps, MHz: the ``sm_clock_mhz``
    level of its GPU (``gpu0``; each sample holds until the next) weighted by the union of its ``compute`` spans.

    It says at what clock each stage's kernels ran, which its compute time and so ``pipeline_imbalance_s`` follow
    under DVFS: each board's firmware lowers its own clock while its own power average is above the cap, so a
    busier stage computes at a lower clock, and a stage back from idling (a pipeline's fill or drain) at a higher
    one than its mean (``avg_sm_clock_mhz`` also counts the idle time).

    Args:
        spans: The stage's spans; counters: its counters (``t_s, scope, metric, value``); steps: its steps.

    Returns:
        The clock, MHz; None without clock samples (no power model) or without compute in the measured steps.
    """
    if counters is None or not len(counters):
        return None
    clk = counters[(counters.metric.astype(str) == "sm_clock_mhz") & (counters.scope.astype(str) == "gpu0")]
    measured = steps[~steps.warmup] if "warmup" in steps else steps
    comp = spans[(spans.kind == COMPUTE_KIND) & spans.step.isin(measured.step)]
    if clk.empty or comp.empty:
        return None
    busy = _merge(comp[["start_s", "end_s"]].to_numpy(dtype=float))
    cum = np.concatenate([[0.0], np.cumsum(busy[:, 1] - busy[:, 0])])

    def busy_before(t: np.ndarray) -> np.ndarray:  # busy time in (-inf, t], s
        j = np.searchsorted(busy[:, 0], t, side="right")
        inside = np.clip(t - busy[np.maximum(j - 1, 0), 0], 0.0, None)
        part = np.minimum(inside, busy[np.maximum(j - 1, 0), 1] - busy[np.maximum(j - 1, 0), 0])
        return cum[np.maximum(j - 1, 0)] + np.where(j > 0, part, 0.0)

    clk = clk.sort_values("t_s", kind="stable")
    t = clk.t_s.to_numpy(dtype=float)
    level = clk.value.to_numpy(dtype=float)
    lo = np.concatenate([[-np.inf], t[1:]])  # the first level also holds before its sample (the initial clock)
    hi = np.concatenate([t[1:], [np.inf]])
    weight = busy_before(hi) - busy_before(lo)
    return float(np.sum(weight * level) / cum[-1]) if cum[-1] > 0 else None


def first_op_s(spans: pd.DataFrame, steps: int) -> np.ndarray:
    """Start of each step's first op on one rank (any stream, host ops included), s; ``inf`` for a step with
    no span. ``spans``: the rank's spans (``step, start_s``); ``steps``: how many steps ran."""
    out = np.full(steps, np.inf)
    if len(spans):
        first = spans.groupby("step").start_s.min()
        out[first.index.to_numpy(dtype=np.int64)] = first.to_numpy(dtype=float)
    return out


def combined_steps(stage_steps: list[pd.DataFrame], first_ops: list[np.ndarray] | None = None) -> pd.DataFrame:
    """One row per step over all ranks (stages or rank classes): ``end_s`` the last rank's end (the step's last
    op on any rank), ``start_s`` where the step begins on the job.

    Step 0 begins when the first rank's training loop does. A later step ``i`` begins at its first op on any
    rank (``first_ops``: ``first_op_s`` of each rank) if that runs before step ``i - 1``'s end (the steps
    overlap: a stage that finished step ``i - 1`` early, e.g. after a shorter optimizer, already runs step
    ``i``), and at step ``i - 1``'s end otherwise: a rank whose loop started step ``i`` early but only waits
    (its first op is a receive from a stage still in step ``i - 1``) does not start the step, and the launch
    gap after the previous step is the step's, as on one GPU. So ``step_latency_s - step_time_s`` (``summary
    .step_period_s``) is exactly the overlap of consecutive steps, 0 when every rank's next step starts after
    the last rank's step ends. Without ``first_ops`` each rank's loop start counts (the earliest).

    Args:
        stage_steps: Each rank's ``steps`` frame (``step, start_s, end_s``, optional ``warmup``), same steps.
        first_ops: Each rank's first-op start per step, s (``first_op_s``), same order.
    """
    starts = np.min([s.start_s.to_numpy() for s in stage_steps], axis=0)
    ends = np.max([s.end_s.to_numpy() for s in stage_steps], axis=0)
    if first_ops is not None and len(starts) > 1:
        first = np.min(first_ops, axis=0)
        starts[1:] = np.maximum(starts[1:], np.minimum(first[1:], ends[:-1]))
    out = stage_steps[0][["step"]].copy()
    out["start_s"], out["end_s"] = starts, ends
    out["step_time_s"] = out.end_s - out.start_s
    if "warmup" in stage_steps[0]:
        out["warmup"] = stage_steps[0].warmup.to_numpy()
    return out


def step_end_spread_s(stage_steps: list[pd.DataFrame]) -> float:
    """Mean over the measured steps of the spread of the ranks' step ends (last rank's end minus the first
    rank's), s: how far the ranks are from ending a step together. ``stage_steps``: as ``combined_steps``."""
    ends = np.array([s.end_s.to_numpy() for s in stage_steps])
    mask = ~stage_steps[0].warmup.to_numpy() if "warmup" in stage_steps[0] else np.ones(ends.shape[1], dtype=bool)
    if not mask.any():
        return 0.0
    return float(np.mean((ends.max(axis=0) - ends.min(axis=0))[mask]))


def replica_mean(values: list[float], replicas: list[int]) -> float:
    """The mean over data-parallel replicas of a figure of rank classes (``values``: one per class, same unit),
    each class weighted by the replicas it stands for (``replicas``), computed as ``x_0 + sum(n_i (x_i - x_0)) /
    sum(n_i)``: exactly ``x_0`` when every class has the same value (symmetric replicas under ``run.rank_folding:
    none`` give the folded run's figure to the last bit). A PP2 x DP2 stage with one replica's GPU 2x slow: the
    mean of its compute times is 1.5x the fast replica's."""
    x0 = values[0]
    return float(x0 + sum(n * (x - x0) for x, n in zip(values, replicas)) / sum(replicas))


def replica_mean_phases(phases: list[dict[str, float]], replicas: list[int]) -> dict[str, float]:
    """Per key of ``phases`` (one dict of phase times per rank class, s, same keys: ``phase_compute_s`` or
    ``metrics.phase_split``), the ``replica_mean`` over the classes."""
    return {k: replica_mean([p[k] for p in phases], replicas) for k in phases[0]}


def stage_summaries(parts: list[dict], pp_ranks: list[int], replicas: list[int]) -> list[dict]:
    """The per-stage summaries ``combine_stages`` takes, from rank classes (``parts``: ``summarize`` plus
    ``phase_compute_s`` each; ``pp_ranks``: each one's pipeline stage, stage-major with the stage's first
    data-parallel class first; ``replicas``: the replicas each stands for). A stage's summary is its first class's
    (the replicas not overridden) except ``phase_compute_s``, the ``replica_mean_phases`` over the stage's classes:
    with a straggler replica (``rank_overrides`` ``dp_rank``, or every replica simulated under ``run.rank_folding:
    none``) the stage's and the run's ``phase_s`` count every replica, not the first class's alone. One class per
    stage: its summary as it is."""
    members: dict[int, list[int]] = {}
    for k, r in enumerate(pp_ranks):
        members.setdefault(r, []).append(k)
    out = []
    for ks in members.values():
        s = parts[ks[0]]
        if len(ks) > 1:
            s = {**s, "phase_compute_s": replica_mean_phases([parts[k]["phase_compute_s"] for k in ks],
                                                             [replicas[k] for k in ks])}
        out.append(s)
    return out


def combine_stages(stages: list[dict], steps: pd.DataFrame, *, layers: list[int], schedule: str,
                   virtual: int, micro_batches: int, samples_per_step: float, tokens_per_step: float,
                   model_flops_per_step: float, peak_flops_per_s: float, ranks_per_stage: int) -> dict:
    """One run summary from the stages' summaries (``summarize`` plus ``pipeline_bubble_s`` each).

    ``step_time_s`` is the period of the whole pipeline's steps (``steps``: ``combined_steps``); memory
    keys are those of the stage with the largest device memory (``peak_memory_pp_rank`` names it) and
    ``oom`` that of the worst stage that ran out; ``exposed_comm_s``, ``host_page_fault_s`` and each
    ``comm_s_by_group`` entry are the largest over the stages; ``phase_s`` is the mean over the stages of each phase's compute time
    (``phase_compute_s``: the stages' fwd/bwd/opt kernels, without the bubble; with data-parallel rank classes each
    stage's is already the mean over its replicas, ``stage_summaries``); ``pipeline_bubble_s`` is
    the least idle stage's bubble (the schedule's own bubble) and each stage's ``pipeline_imbalance_s``
    its idle time beyond that (waits for slower stages); energy and power are the mean per GPU and
    ``energy_j_per_step_all_gpus`` the sum over every GPU of the job (each stage x ``ranks_per_stage``).
    ``pipeline.stages`` lists every stage, with its ``pipeline_wait_s`` and ``host_idle_s`` when given
    (``stage_idle_split``), its ``compute_clock_mhz`` when given (``compute_clock_mhz``) and its ``gpu_busy`` (its compute stream's busy share of its own
    step window; the top-level ``utilisation`` is that of the peak-memory stage).

    Args:
        stages: Per-stage summaries, stage order.
        steps: ``combined_steps`` of the stages (with ``warmup``).
        layers: Transformer blocks per stage.
        schedule, virtual, micro_batches: The pipeline schedule, chunks per rank and micro-batches per step.
        samples_per_step, tokens_per_step: Global per step.
        model_flops_per_step: Model FLOPs per GPU per step (the stages' average).
        peak_flops_per_s: The GPU's dense bf16 peak (MFU).
        ranks_per_stage: GPUs per pipeline stage (tp x dp).
    """
    step, latency = step_period_s(steps)
    mem = max(range(len(stages)), key=lambda r: stages[r]["peak_device_memory_bytes"])
    out = dict(stages[mem])
    bubble = min(s["pipeline_bubble_s"] for s in stages)
    for s in stages:
        s["pipeline_imbalance_s"] = s["pipeline_bubble_s"] - bubble
    out.update(step_time_s=step, step_latency_s=latency,
               samples_per_s=samples_per_step / step if step else 0.0,
               tokens_per_s=tokens_per_step / step if step else 0.0,
               mfu=mfu(model_flops_per_step, step, peak_flops_per_s), model_flops_per_step=model_flops_per_step,
               peak_memory_pp_rank=mem, num_ops=sum(s["num_ops"] for s in stages),
               exposed_comm_s=max(s["exposed_comm_s"] for s in stages), pipeline_bubble_s=bubble,
               host_page_fault_s=max(s.get("host_page_fault_s", 0.0) for s in stages),
               phase_s={k: float(np.mean([s["phase_compute_s"][k] for s in stages])) for k in stages[0]["phase_compute_s"]})
    for k in ("phase_compute_s", "pipeline_wait_s", "host_idle_s", "compute_clock_mhz"):  # per stage only
        out.pop(k, None)
    ooms = sorted((r for r, s in enumerate(stages) if s.get("oom")), key=lambda r: -stages[r]["peak_device_memory_bytes"])
    out["oom"] = f"pipeline stage {ooms[0]}: {stages[ooms[0]]['oom']}" if ooms else None
    groups = sorted({g for s in stages for g in s["comm_s_by_group"]})
    out["comm_s_by_group"] = {g: max(s["comm_s_by_group"].get(g, 0.0) for s in stages) for g in groups}
    for k in _MEAN_KEYS:
        if all(k in s for s in stages):
            out[k] = float(np.mean([s[k] for s in stages]))
    if all("energy_j_per_step" in s for s in stages):
        out["energy_j_per_step_all_gpus"] = float(sum(s["energy_j_per_step"] for s in stages) * ranks_per_stage)
    out["pipeline"] = {
        "pipeline_model_parallel_size": len(stages), "virtual_pipeline_model_parallel_size": virtual,
        "schedule": schedule, "micro_batches": micro_batches,
        "stages": [{"pp_rank": r, "layers": layers[r], **{k: s[k] for k in _STAGE_KEYS if k in s},
                    **({"gpu_busy": s["utilisation"]["compute"]} if "compute" in s.get("utilisation", {}) else {})}
                   for r, s in enumerate(stages)],
    }
    return out


def combine_classes(classes: list[dict], steps: pd.DataFrame, *, labels: list[str], replicas: list[int],
                    slowdowns: list[float], gpus_per_replica: int, samples_per_step: float, tokens_per_step: float,
                    model_flops_per_step: float, peak_flops_per_s: float) -> dict:
    """One run summary from data-parallel rank classes (``rank_overrides`` by ``dp_rank``) that meet at every
    data-parallel collective.

    ``step_time_s`` is the period of the job's steps (``steps``: ``combined_steps``, first start to last end
    over the classes); the other keys are the first class's (the replicas not overridden), except memory and
    ``oom`` (the worst class's) and ``phase_s``, the mean over every replica (``replica_mean_phases`` of the
    classes' ``metrics.phase_split``; each class's phase compute time is in its ``rank_classes`` row).
    ``rank_classes`` lists every class with its ``replicas``, ``slowdown``, own ``step_time_s``, ``compute_s``
    (compute-stream busy time per step), ``wait_s`` (the rest of the job's step: what it waits for the slowest
    class, at the collectives), exposed communication and peak memory;
    ``straggler`` names the class with the most compute. Energy and power are the per-GPU mean weighted by
    replicas and ``energy_j_per_step_all_gpus`` the sum over every GPU.

    Args:
        classes: Per-class summaries (``summarize`` each), the not-overridden class first.
        steps: ``combined_steps`` of the classes.
        labels, replicas, slowdowns: Each class's name, data-parallel replicas and kernel-time multiplier.
        gpus_per_replica: GPUs of one replica (tensor-parallel size).
        samples_per_step, tokens_per_step, model_flops_per_step, peak_flops_per_s: as ``combine_stages``.
    """
    step, latency = step_period_s(steps)
    out = dict(classes[0])
    out["oom"] = None  # add_classes: the worst class's
    out.update(step_time_s=step, step_latency_s=latency,
               samples_per_s=samples_per_step / step if step else 0.0,
               tokens_per_s=tokens_per_step / step if step else 0.0,
               mfu=mfu(model_flops_per_step, step, peak_flops_per_s),
               phase_s=replica_mean_phases([c["phase_s"] for c in classes], replicas))
    out.pop("phase_compute_s", None)
    out.pop("pipeline_bubble_s", None)
    add_classes(out, classes, labels=labels, replicas=replicas, slowdowns=slowdowns, groups=None,
                gpus_per_replica=gpus_per_replica)
    return out


#: summary keys of a run's memory peak (taken together from the worst simulated rank)
MEMORY_KEYS = ("peak_memory_bytes", "peak_memory_allocated_bytes", "peak_memory_reserved_bytes",
               "peak_device_memory_bytes", "peak_memory_by_category_bytes")


def add_classes(summary: dict, classes: list[dict], *, labels: list[str], replicas: list[int],
                slowdowns: list[float], groups: list[int] | None, gpus_per_replica: int) -> None:
    """Put the rank classes into ``summary`` (in place): the memory peak and GPU capacity of the class that binds,
    the least headroom (capacity minus peak device memory; with one GPU type, the largest peak), named by
    ``memory_binding_class`` (its label) when the classes' GPUs differ in memory (``rank_overrides`` ``gpu``), the
    ``oom`` (when ``summary`` has none, the binding class's, else the first class's, prefixed by its label), ``rank_classes`` (``class_rows``), ``straggler``
    (``straggler``, compared within ``groups``: each class's pipeline stage) and, when every class metered
    energy, the per-GPU mean energy, power and clock (``_MEAN_KEYS``, weighted by replicas) and
    ``energy_j_per_step_all_gpus`` (each class x its replicas x ``gpus_per_replica``)."""
    def headroom(c: dict) -> float:
        return c.get("gpu_memory_capacity_bytes", math.inf) - c["peak_device_memory_bytes"]

    worst = min(classes, key=headroom)
    summary.update({k: worst[k] for k in MEMORY_KEYS})
    caps = {c.get("gpu_memory_capacity_bytes") for c in classes}
    if len(caps) > 1:
        summary["gpu_memory_capacity_bytes"] = worst["gpu_memory_capacity_bytes"]
        summary["memory_binding_class"] = labels[classes.index(worst)]
    if not summary.get("oom"):  # named by its class: the classes may run on GPUs of different capacity
        i = next((i for i in sorted(range(len(classes)), key=lambda i: classes[i] is not worst)
                  if classes[i].get("oom")), None)
        summary["oom"] = f"{labels[i]}: {classes[i]['oom']}" if i is not None else None
    summary["rank_classes"] = class_rows(classes, summary["step_time_s"], labels, replicas, slowdowns)
    summary["straggler"] = straggler(summary["rank_classes"], groups)
    if all("energy_j_per_step" in c for c in classes):
        # per-GPU means over every class (each of every stage), weighted by its replicas: with a pipeline the
        # stages' combination (``combine_stages``) saw each stage's first class only, which left the overridden
        # replicas out of the mean (PP4 x DP2, dp_rank 1 1.5x slower: 33.86 J per GPU against the 38.73 J of
        # energy_j_per_step_all_gpus / 8)
        for k in _MEAN_KEYS:
            if all(k in c for c in classes):
                summary[k] = replica_mean([c[k] for c in classes], replicas)
        summary["energy_j_per_step_all_gpus"] = float(sum(c["energy_j_per_step"] * n for c, n in zip(classes, replicas))
                                                      * gpus_per_replica)


def class_rows(classes: list[dict], step_s: float, labels: list[str], replicas: list[int],
               slowdowns: list[float]) -> list[dict]:
    """One row per rank class: ``label, replicas, slowdown, gpu`` (its GPU's name), its own ``step_time_s``, ``compute_s``
    (compute-stream busy time per step), ``wait_s`` (the rest of the job's step ``step_s``), exposed
    communication, peak device memory, its GPU's memory, its ``phase_compute_s`` when given (``phase_compute_s``: its
    own fwd/bwd/opt kernel time per step; the summary's ``phase_s`` is the mean over every replica) and, when metered,
    energy and power."""
    rows = []
    for lab, n, slow, c in zip(labels, replicas, slowdowns, classes):
        compute = c["utilisation"].get("compute", 0.0) * c["step_time_s"]
        rows.append({"label": lab, "replicas": n, "slowdown": slow, "gpu": c.get("gpu"), "step_time_s": c["step_time_s"],
                     "compute_s": compute, "wait_s": max(step_s - compute, 0.0), "exposed_comm_s": c["exposed_comm_s"],
                     "peak_device_memory_bytes": c["peak_device_memory_bytes"],
                     "gpu_memory_capacity_bytes": c.get("gpu_memory_capacity_bytes"),
                     **{k: c[k] for k in ("phase_compute_s", "energy_j_per_step", "avg_power_w") if k in c}})
    return rows


def straggler(rows: list[dict], groups: list[int] | None = None) -> str | None:
    """The label of the class that gates the step: the most compute (``compute_s``) of all classes, once some
    class computes beyond the others of its group (its pipeline stage; ``groups``: each row's group, default
    one); None when every class of each group computes the same (within 1e-9 relative: symmetric ranks have
    no straggler, and stages that differ only in their layers are no straggler either). A stage's and a
    replica's slowdowns compound on their common rank, so the gating class is compared over all stages, not
    within each (a stage-wide 1.5x with one replica 1.1x: that replica on that stage, 1.65x)."""
    groups = groups if groups is not None else [0] * len(rows)
    for g in set(groups):
        mine = [r for r, k in zip(rows, groups) if k == g]
        low = min(r["compute_s"] for r in mine)
        top = max(r["compute_s"] for r in mine)
        if low > 0 and top / low - 1 > 1e-9:
            return max(rows, key=lambda r: r["compute_s"])["label"]
    return None
