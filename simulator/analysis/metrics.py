"""Metrics derived from a run's spans: step time, phase split, throughput, MFU, utilisation."""

from __future__ import annotations

import numpy as np
import pandas as pd

PHASES = ("fwd", "bwd", "opt")
DATA_PHASE = "data"
#: span kind of the GPU compute stream's kernels (``OpKind.COMPUTE``): the stream CUDA events time
COMPUTE_KIND = "compute"
#: span kinds of work on the GPU (kernels, copies, collectives): the GPU is idle when none runs
GPU_KINDS = ("compute", "collective", "memcpy_h2d", "memcpy_d2h", "memcpy_d2d")
#: stream of the training thread's host ops and synchronisations (``engine.executor.HOST_STREAM``)
HOST_STREAM = "host"


def _merge(iv: np.ndarray) -> np.ndarray:
    """Disjoint sorted intervals covering the union of ``[[start, end], ...]`` (shape ``(n, 2)``)."""
    if len(iv) == 0:
        return np.zeros((0, 2))
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    reach = np.maximum.accumulate(iv[:, 1])
    first = np.flatnonzero(np.concatenate([[True], iv[1:, 0] > reach[:-1]]))
    return np.stack([iv[first, 0], np.maximum.reduceat(iv[:, 1], first)], axis=1)


def _subtract(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Disjoint intervals ``a`` minus disjoint sorted intervals ``b`` (both shape ``(n, 2)``; ``b`` as ``_merge``
    gives them, each starting after the one before ends), in ``a``'s order.

    ``a`` is intersected with the gaps of ``b`` (``(-inf, b[0].start), (b[0].end, b[1].start), ..., (b[-1].end,
    inf)``): each interval of ``a`` with the gaps from the first ending after its start to the last starting
    before its end (``np.searchsorted``), each piece ``(max(starts), min(ends))`` kept where it is not empty.
    Linear in the pieces, not ``|a| x |b|``, and vectorised (a 175B pipeline stage has ~10^5 spans).
    """
    if len(a) == 0:
        return np.zeros((0, 2))
    gs = np.concatenate([[-np.inf], b[:, 1]])  # the gaps of ``b``
    ge = np.concatenate([b[:, 0], [np.inf]])
    s, e = a[:, 0], a[:, 1]
    j0 = np.searchsorted(ge, s, side="right")  # first gap ending after the start
    j1 = np.searchsorted(gs, e, side="left")  # past the last gap starting before the end
    n = np.maximum(j1 - j0, 0)
    i = np.repeat(np.arange(len(a)), n)
    j = np.repeat(j0 - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
    lo, hi = np.maximum(s[i], gs[j]), np.minimum(e[i], ge[j])
    keep = hi > lo
    return np.stack([lo[keep], hi[keep]], axis=1)


_NO_INTERVALS = np.zeros((0, 2))


def _overlap(iv: np.ndarray, t0: float, t1: float) -> float:
    """Length of disjoint intervals ``iv`` inside ``[t0, t1]``."""
    if t1 <= t0 or len(iv) == 0:
        return 0.0
    return float(np.clip(np.minimum(iv[:, 1], t1) - np.maximum(iv[:, 0], t0), 0.0, None).sum())


def _segments(phase: np.ndarray, start: np.ndarray, end: np.ndarray, inph: np.ndarray,
              comp: np.ndarray, names: list[str] | None = None,
              thread: np.ndarray | None = None) -> list[tuple[str, float]]:
    """``[(phase, end_s), ...]`` of one step's spans (1-D arrays), in device order (``phase_split``); ``inph``: the
    spans of a phase in ``PHASES``, ``comp``: those that are also compute kernels (boolean arrays). ``names``: the
    phase of each code when ``phase`` holds integer codes (``_codes``); None: ``phase`` holds the names.
    ``thread``: the spans of the training thread (stream ``host``: host ops and synchronisations; None: none),
    which join the segment of their phase the thread was in (``phase_split``)."""
    ci = np.flatnonzero(comp)
    ci = ci[np.lexsort((end[ci], start[ci]))]
    ph, ends, starts = phase[ci], end[ci], start[ci]
    segs: list[list] = []  # [phase, end_s, sort key]
    heads: list[float] = []  # each compute segment's first kernel start (stream order: by start)
    if len(ci):
        # each run of one phase from its first kernel: its phase, first start and last end (the run's max)
        first = np.concatenate([[0], np.flatnonzero(ph[1:] != ph[:-1]) + 1])
        for p, e, h in zip(ph[first].tolist(), np.maximum.reduceat(ends, first).tolist(), starts[first].tolist()):
            segs.append([p, e, e])
            heads.append(h)
    orphans: dict[str, float] = {}
    oi = np.flatnonzero(inph & ~comp)
    o_phase, o_end = phase[oi], end[oi]
    o_thread = thread[oi] if thread is not None else np.zeros(len(oi), dtype=bool)
    for p in dict.fromkeys(o_phase.tolist()):  # each phase's other ops, at once
        sel = o_phase == p
        e = o_end[sel]
        same = [g for g in segs if g[0] == p]
        if not same:
            orphans[p] = float(e.max())
            continue
        if o_thread[sel].any():  # the training thread's ops that end before the next segment's kernels start
            at = [i for i, g in enumerate(segs) if g[0] == p]
            keys = np.maximum.accumulate([segs[i][2] for i in at])
            prev = np.searchsorted(keys, e, side="left") - 1  # the last of its phase ending before the op
            nxt = np.array([at[j] + 1 if j >= 0 else len(segs) for j in prev.tolist()])
            nxt_first = np.array([heads[i] if i < len(heads) else -np.inf for i in nxt.tolist()])
            held = o_thread[sel] & (prev >= 0) & (e <= nxt_first)
            for j, t in zip(prev[held].tolist(), e[held].tolist()):
                if t > segs[at[j]][1]:
                    segs[at[j]][1] = t
            e = e[~held]
            if not len(e):
                continue
        # the first of its phase ending after it (the segments' keys are fixed): the first whose running max of
        # the keys reaches it; none: the last
        first = np.searchsorted(np.maximum.accumulate([g[2] for g in same]), e, side="left")
        top = np.full(len(same), -np.inf)
        np.maximum.at(top, np.minimum(first, len(same) - 1), e)
        for g, t in zip(same, top.tolist()):
            if t > g[1]:
                g[1] = t
    segs.extend([p, e, e] for p, e in orphans.items())
    segs.sort(key=lambda g: g[2])
    label = str if names is None else names.__getitem__
    return [(label(p), e) for p, e, _ in segs]


def _codes(col: pd.Series) -> tuple[np.ndarray, list[str]]:
    """``(codes, names)`` of a column: each row's code into ``names``, its distinct values as strings (as
    ``to_numpy().astype(str)`` gives them) in first-row order; equal codes are equal strings.

    A column of pandas' default string dtype (``str``: missing values NaN, as the span frames' are) is factorized as
    it is, in half the time of its object array, with the same codes and names (its missing values read ``nan``
    either way; not so with ``string``'s ``pd.NA``, which goes through the object array)."""
    dtype = col.dtype
    plain_str = isinstance(dtype, pd.StringDtype) and dtype.na_value is np.nan
    codes, uniques = pd.factorize(col.array if plain_str else col.to_numpy(object), use_na_sentinel=False)
    return codes, np.asarray(uniques, dtype=str).tolist()


def _rows_in(coded: tuple[np.ndarray, list[str]], *values: str) -> np.ndarray:
    """Which rows of a column coded by ``_codes`` hold one of ``values`` (as ``col.astype(str).isin(values)``), from
    the integer codes: one pass over the column's strings however many masks are taken from it."""
    codes, names = coded
    hit = [k for k, n in enumerate(names) if n in values]
    return np.isin(codes, hit) if len(hit) > 1 else codes == hit[0] if hit else np.zeros(len(codes), dtype=bool)


def phase_split(spans: pd.DataFrame, steps: pd.DataFrame) -> dict[str, float]:
    """Mean data-wait / forward / backward / optimizer time per measured step, seconds.

    The split is what CUDA events recorded on the compute stream at every phase boundary of every
    micro-batch measure, summed per phase over the micro-batches of the step:

    * The step's GPU compute kernels (span kind ``compute``), in stream order, form *segments*:
      maximal runs of one phase (``fwd`` / ``bwd`` / ``opt``). With ``m`` micro-batches there are
      ``2m`` forward/backward segments (``fwd, bwd, fwd, bwd, ..., opt``).
    * Other ops of a phase (copies, host ops such as a CPU optimizer, collectives) belong to the
      first segment of their phase whose kernels end after them (a micro-batch's input copy,
      prefetched during the previous backward, belongs to the next forward); one that ends after
      every segment of its phase extends the last (gradient copies trailing backward). A phase
      with no GPU kernel forms one segment of its own, placed by its end.
    * Except the training thread's ops (stream ``host``: host work, synchronisations): the thread
      runs the micro-batches in program order and records the next phase's boundary event only
      after them, so one that ends after a segment of its phase and before the first kernel of the
      segment after that starts extends that segment (FSDP2's blocking gradient copies and CPU
      accumulation of a micro-batch's backward, which the next forward waits for, are backward).
    * Segment ``k`` lasts from the end of segment ``k - 1`` to its own last end, at least 0 (the
      boundary event of a phase completes when its last op has). The first starts at the step
      start or, if later, at the end of the previous step's last phase op: an event recorded at
      the step start completes only once the stream has finished the previous step (steps that
      overlap, as with a delayed parameter update or a GPU lagging behind the host).
    * ``data_s``: the time in these intervals during which the training thread waits for an
      input batch (spans of phase ``data``, ``next(iterator)``) while the GPU runs nothing (no
      kernel, copy or collective, ``GPU_KINDS``), i.e. the GPU time lost to the input pipeline. It is taken out of the segment it falls in, so
      forward is not inflated by a data stall; a stall hidden behind GPU work counts nowhere
      (the host-side wait is the dataloader's ``data_stall_s``).

    ``data_s + fwd_s + bwd_s + opt_s`` is the time from the step start (as above) to the end of
    the step's last phase op. With one micro-batch and no data wait this is the same as taking each phase's
    boundary at the end of its last op.

    Args:
        spans: Span frame (``step, kind, phase, start_s, end_s``).
        steps: Step frame (``step, start_s, warmup``).

    Returns:
        ``{"data_s", "fwd_s", "bwd_s", "opt_s"}``, means over the measured steps (0 without any).
    """
    out = {p: [] for p in (DATA_PHASE, *PHASES)}
    step_all = spans["step"].to_numpy()
    order = np.argsort(step_all, kind="stable")
    step_col = step_all[order]
    kind, kind_names = _codes(spans["kind"])
    phase, phase_names = _codes(spans["phase"])
    kind, phase = kind[order], phase[order]
    thread_all = (spans["stream"].to_numpy(object) == HOST_STREAM)[order] if "stream" in spans else None
    start = spans["start_s"].to_numpy(float)[order]
    end = spans["end_s"].to_numpy(float)[order]
    # per span, once for all steps (each step below takes its slice); each tested once per distinct value

    def of(names: list[str], test) -> np.ndarray:
        return np.array([test(n) for n in names], dtype=bool)

    inph = of(phase_names, lambda n: n in PHASES)[phase]
    comp = inph & of(kind_names, lambda n: n == COMPUTE_KIND)[kind]
    gpu = of(kind_names, lambda n: n in GPU_KINDS)[kind]
    data = of(phase_names, lambda n: n == DATA_PHASE)[phase]
    iv_all = np.stack([start, end], axis=1)

    def rows(step: int) -> slice:
        return slice(int(np.searchsorted(step_col, step, "left")), int(np.searchsorted(step_col, step, "right")))

    def last_phase_end(step: int) -> float:
        r = rows(step)
        m = inph[r]
        return float(end[r][m].max()) if m.any() else -np.inf

    measured = ~steps["warmup"].to_numpy(bool)
    for step, step_start_s in zip(steps["step"].to_numpy()[measured].tolist(),
                                  steps["start_s"].to_numpy()[measured].tolist()):
        r = rows(step)
        acc = dict.fromkeys(out, 0.0)
        if r.stop > r.start:
            iv = iv_all[r]
            waits = data[r]
            # no data wait in the step: nothing idle to take out (``_overlap`` of no intervals is 0)
            idle_data = _subtract(_merge(iv[waits]), _merge(iv[gpu[r]])) if waits.any() else _NO_INTERVALS
            t = max(float(step_start_s), last_phase_end(step - 1))
            thread = thread_all[r] if thread_all is not None else None
            for p, e in _segments(phase[r], start[r], end[r], inph[r], comp[r], phase_names, thread):
                if e > t:
                    w = _overlap(idle_data, t, e)
                    acc[DATA_PHASE] += w
                    acc[p] += (e - t) - w
                    t = e
        for p, v in acc.items():
            out[p].append(v)
    return {f"{p}_s": float(np.mean(v)) if v else 0.0 for p, v in out.items()}


def _union_s(start, end) -> float:
    """Length of the union of intervals ``[start_i, end_i]`` (arrays, any order), seconds."""
    if not len(start):
        return 0.0
    order = np.argsort(start, kind="stable")
    s, e = np.asarray(start, dtype=float)[order], np.asarray(end, dtype=float)[order]
    reach = np.maximum.accumulate(e)  # the furthest end so far: the current merged interval's end
    first = np.concatenate(([True], s[1:] > reach[:-1]))  # an interval that starts a new merged one
    heads = np.flatnonzero(first)
    lasts = np.concatenate((heads[1:] - 1, [len(s) - 1]))
    return sum((reach[lasts] - s[heads]).tolist())  # summed in time order, as merging one by one


def busy_time(spans: pd.DataFrame, stream: str) -> float:
    """Union of busy intervals of one stream, seconds."""
    d = spans[spans["stream"] == stream]
    return _union_s(d["start_s"].to_numpy(), d["end_s"].to_numpy())


def utilisation(spans: pd.DataFrame, steps: pd.DataFrame) -> dict[str, float]:
    """Busy fraction of each stream over the measured steps (0-1)."""
    measured = ~steps["warmup"].to_numpy(bool)
    if not measured.any():
        return {}
    t0, t1 = float(steps["start_s"].to_numpy()[measured].min()), float(steps["end_s"].to_numpy()[measured].max())
    if not t1 > t0:
        return {}
    d = np.isin(spans["step"].to_numpy(), steps["step"].to_numpy()[measured])
    codes, names = pd.factorize(spans["stream"].to_numpy(object)[d])
    start, end = spans["start_s"].to_numpy()[d], spans["end_s"].to_numpy()[d]
    out = {}
    for k, name in sorted(enumerate(names), key=lambda kv: kv[1]):
        sel = codes == k
        out[name] = _union_s(start[sel], end[sel]) / (t1 - t0)
    return out


def mfu(model_flops_per_step: float, step_time_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation.

    ``MFU = model_flops_per_step / (step_time_s * peak_flops_per_s)``, where model FLOPs count
    forward + backward (3x forward) without recompute (Chowdhery et al., *PaLM*, 2022, appendix B;
    Korthikanti et al., 2023, section 6 use the same definition), and the peak is the GPU's dense
    bf16 tensor-core rate at the maximum clock.
    """
    if step_time_s <= 0 or peak_flops_per_s <= 0:
        return 0.0
    return model_flops_per_step / (step_time_s * peak_flops_per_s)


def job_energy_per_work(summary: dict) -> dict[str, float]:
    """``energy_per_token_j`` and ``energy_per_sample_j`` of the whole job: the GPU energy of every GPU per step
    (``energy_j_per_step_all_gpus``, else ``energy_j_per_step`` x ``world_size``: symmetric folding, every rank
    the representative's) over the tokens / samples per step of all replicas (``tokens_per_s`` x step). The
    per-rank figure each rank's meter gives (one GPU's energy over the job's tokens) was ``world_size`` times
    too small on a cluster (GPT 1.3B DP8: 0.255 mJ/token against 2.04). Empty when the summary has no energy,
    no tokens, or one GPU (the meter's figure is then the job's already)."""
    e, world = summary.get("energy_j_per_step"), summary.get("world_size", 1) or 1
    if e is None or (world == 1 and "energy_j_per_step_all_gpus" not in summary):
        return {}
    total = summary.get("energy_j_per_step_all_gpus", e * world)
    step = summary.get("step_time_s", 0.0)
    tokens, samples = summary.get("tokens_per_s", 0.0) * step, summary.get("samples_per_s", 0.0) * step
    return {"energy_per_token_j": total / tokens if tokens else 0.0,
            "energy_per_sample_j": total / samples if samples else 0.0}


def megatron_flops_per_step(batch: int, seq_length: int, num_layers: int, hidden_size: int, vocab_size: int,
                            full_recompute: bool) -> float:
    """FLOPs of one training iteration as the Megatron-LM papers count them for a GPT model.

    ``F = 24 k B s l h^2 (1 + s / (6 h)) + 6 B s h V``: with full activation recompute ``k = 4``
    (one extra forward), which is Narayanan et al., *Efficient Large-Scale Language Model Training
    on GPU Clusters Using Megatron-LM* (SC21), eq. 3, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``;
    otherwise ``k = 3``, ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` (the model-FLOPs count behind
    Korthikanti et al., MLSys 2023, Table 5 MFU; selective recompute is not counted). It assumes the
    GPT block (FFN 4h, one K/V head per query head, GELU MLP) and counts the full ``s^2`` attention.

    Args:
        batch: Samples per iteration (global batch, every data-parallel replica).
        seq_length: Tokens per sample ``s``.
        num_layers: ``l``.
        hidden_size: ``h``.
        vocab_size: ``V`` (as the papers do: the vocabulary given, not a TP-padded one).
        full_recompute: Count the recompute forward (``k = 4``).

    Returns:
        FLOPs per iteration (all GPUs together).
    """
    B, s, l, h, V = batch, seq_length, num_layers, hidden_size, vocab_size
    k = 4 if full_recompute else 3
    return 24.0 * k * B * s * l * h**2 * (1 + s / (6 * h)) + 6.0 * B * s * h * V


COLLECTIVE_KIND = "collective"


def comm_group(streams: pd.Series) -> pd.Series:
    """Process group of each collective's stream: ``comm.<group>[.<channel>]`` -> ``<group>``, else ``other`` (the
    string work done once per distinct stream: a pipeline stage has ~10^4 collective spans on a few streams)."""
    codes, uniq = pd.factorize(streams.to_numpy(object))
    names = [s.split(".")[1] if s.startswith("comm.") else "other" for s in uniq]
    return pd.Series(np.asarray(names, dtype=object)[codes] if len(codes) else [], index=streams.index, dtype=object)


def comm_exposure(spans: pd.DataFrame, steps: pd.DataFrame) -> tuple[float, dict[str, float]]:
    """Exposed communication and communication busy time per process group, per measured step.

    **Exposed communication** of a step = the time within the step's ``[start_s, end_s]`` during
    which the compute stream is idle (no ``compute`` span) while at least one collective is in
    flight: ``|union(collective spans) - union(compute spans)|``. A collective that runs under
    compute is hidden and counts zero; compute idle with no collective in flight (host-bound gaps,
    data stalls) is not communication.

    **Busy time per group** = the length of the union of the group's collective spans in the
    step; the group is the stream's second part (``comm.dp`` -> ``dp``, ``comm.pp.send_next`` -> ``pp``;
    other streams -> ``other``: ``comm_group``).

    Args:
        spans: The run's spans (``SPAN_COLUMNS``).
        steps: One row per step with ``step, start_s, end_s`` and a boolean ``warmup``.

    Returns:
        ``(exposed_comm_s, {group: busy_s})``: means over the measured (non-warmup) steps, s.
    """
    measured = ~steps["warmup"].to_numpy(bool) if "warmup" in steps else np.ones(len(steps), dtype=bool)
    kind = spans["kind"].to_numpy(object)
    coll = kind == COLLECTIVE_KIND
    if not coll.any() or not measured.any():
        return 0.0, {}
    iv_all = spans[["start_s", "end_s"]].to_numpy(dtype=float)
    coll_iv, comp_iv = iv_all[coll], iv_all[kind == COMPUTE_KIND]
    codes, streams = pd.factorize(spans["stream"].to_numpy(object)[coll])
    group = comm_group(pd.Series(streams, dtype=object)).to_numpy(object)[codes]  # per collective span
    names = {g: g for g in group}
    by_group = [(g, coll_iv[group == g]) for g in sorted(set(names.values()))]
    exposed, busy = 0.0, {}
    for t0, t1 in zip(steps["start_s"].to_numpy(float)[measured].tolist(),
                      steps["end_s"].to_numpy(float)[measured].tolist()):

        def window(iv):
            iv = iv[(iv[:, 1] > t0) & (iv[:, 0] < t1)]
            return _merge(np.clip(iv, t0, t1))

        k = window(coll_iv)
        exposed += float(np.sum(np.diff(_subtract(k, window(comp_iv)), axis=1)))
        for g, iv in by_group:
            busy[g] = busy.get(g, 0.0) + float(np.sum(np.diff(window(iv), axis=1)))
    n = int(measured.sum())
    return exposed / n, {g: v / n for g, v in busy.items()}
