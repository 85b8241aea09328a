"""The GPU power meter: board power from the ops running at each instant, at the current clocks.

One job: given the running ops (kept as ops start and end: ``add`` / ``remove``, or read from recorded spans), the board power of
``hardware_models.power.GpuPowerModel``. It integrates nothing (``power_ledger``) and decides nothing about
clocks (``power_firmware``, ``dvfs``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter

import numpy as np

from hardware_models.power import (
    GENERIC_MEM_RATIO, GENERIC_TDP_SHARE, GENERIC_TDP_W, Activity, activity_of_kernel, generic_idle_w,
    generic_power_model, load_power_model, preset_power_model,
)
from simulator.graph.ops import OpKind, PriceKeys
from simulator.policies.registry import PolicyError

KERNEL_KINDS = (OpKind.COMPUTE, OpKind.COLLECTIVE)
COPY_KINDS = (OpKind.MEMCPY_H2D, OpKind.MEMCPY_D2H)
_MISSING = object()
_OP_ID = attrgetter("id")


def gpu_preset_name(cfg) -> str | None:
    """The scenario's GPU preset name (None for an inline GPU)."""
    ref = cfg.hardware.gpu
    return ref if isinstance(ref, str) else getattr(ref, "preset", None)


def power_model_for(cfg, gpu):
    """The power model of a scenario: ``dvfs.power_model``, else the GPU preset's, else generic.

    Raises:
        PolicyError: ``dvfs.power_model`` names no readable power model.
    """
    name = cfg.dvfs.power_model if cfg is not None and cfg.dvfs is not None else None
    if name:
        try:
            return load_power_model(name)
        except (FileNotFoundError, ValueError) as exc:
            raise PolicyError(f"dvfs.power_model: {exc}") from exc
    preset = gpu_preset_name(cfg) if cfg is not None else None
    model = preset_power_model(preset) if preset else None
    return model if model is not None else generic_power_model(gpu)


def generic_model_note(model, gpu) -> str | None:
    """The summary warning for a run priced with ``generic_power_model`` (None for a fitted or named model): its
    energy and power come from the GPU's datasheet TDP and an assumed activity model, with no measurement behind them
    (the assumptions named are ``generic_power_model``'s), and how to replace it with a fitted one."""
    if not model.generic:
        return None
    tdp = f"{gpu.tdp_w:g} W" if gpu.tdp_w else f"none given, {GENERIC_TDP_W:g} W assumed"
    idle = f"{generic_idle_w(gpu):g} W" + ("" if gpu.idle_power_w else " assumed as 15% of TDP")
    return (f"energy and power are from the generic power model of {gpu.name}, fitted to no measurement: its datasheet "
            f"TDP ({tdp}) and idle power ({idle}) with an assumed activity model (a fully compute-bound kernel at the "
            f"maximum clock draws {GENERIC_TDP_SHARE:.0%} of TDP, a fully memory-bound one's HBM power is "
            f"{GENERIC_MEM_RATIO:g}x that SM power, any resident kernel draws "
            f"{model.sm_floor:.0%} of it; V/Vmax {model.v_min_rel:g} below {model.voltage_knee_mhz:g} MHz, linear to 1 "
            "at the maximum clock); to fit one, measure energy per step with NVML as scripts/fit_h200_power.py does "
            "for the H200 and name the power YAML it writes in dvfs.power_model")


class PowerMeter:
    """Board power of the running ops (``GpuPowerModel.power_of``) at the device's current clocks.

    Args:
        model: The GPU power model.
        gpu: The GPU spec (maximum clocks, to scale an op's compute and memory time to the current clocks).
        state: The device state (``sm_clock_mhz``, ``mem_clock_mhz``: the clocks now).
        cost: The run's cost model (``split_s``: an op's compute / memory / fixed seconds at the maximum clocks;
            ``fused_s``: the same for a layer-fidelity block).
        price_keys: The ops' interned pricing keys (``graph.ops.PriceKeys``; the machine's, ``System.price_keys``, so
            that both are released with the run's ops); None: the meter's own.
        collective_s: Time alone of a collective op, s (the machine's NCCL model, ``System.collective_s``): weighs
            the blocking TP collectives folded into a layer-fidelity block into its activity (``block_activity``);
            None: they are metered at the block's kernels' activity.

    Attributes:
        active: Activity of each running op that draws power, by ``(step, op id)``, in start order.
    """

    def __init__(self, model, gpu, state, cost, price_keys: PriceKeys | None = None,
                 collective_s: Callable[[object], float] | None = None):
        self.model, self.gpu, self.state, self.cost = model, gpu, state, cost
        self.collective_s = collective_s
        self.active: dict[tuple, Activity] = {}
        #: what each entry of ``active`` stands for, in its order (the power-cache key): its ``activity`` cache key
        #: ``(pricing key, SM clock, memory clock)`` at the clocks it started at, so that every running set of the same
        #: ops' kinds, in the same order, hits (a 175B step has ~30,000 op starts and few such sets), or where its
        #: activity is not that cache's, ``("op", op id, SM clock, memory clock)``
        self._keys: dict[tuple, tuple] = {}
        #: each op's interned pricing key (``graph.ops.price_key``: kind, fixed duration, cost split or block parts)
        self.price_keys = price_keys if price_keys is not None else PriceKeys()
        #: ``activity`` by ``(pricing key, SM clock, memory clock)``
        self._activity_cache: dict[tuple, Activity | None] = {}
        self._power_cache: dict[tuple, float] = {}
        #: ``excess_w`` by ``(activity, SM clock, memory clock)``
        self._excess: dict[tuple, float] = {}
        #: ``activity`` as the row ``(compute, memory, copy, kernel 1.0 / 0.0)`` ``levels`` reads (None: draws no
        #: power), by ``(pricing key, SM clock, memory clock)``
        self._rows: dict[tuple, tuple | None] = {}
        #: ``excess_w`` by ``(pricing key, SM clock, memory clock)``
        self._excess_by_key: dict[tuple, float] = {}
        #: ``excess_parts_w`` by ``(pricing key, SM clock, memory clock)``
        self._parts_by_key: dict[tuple, tuple[float, float, bool]] = {}

    # -- the running set --------------------------------------------------------------------------------
    def add(self, op, step, act: Activity) -> None:
        """Op ``op`` of ``step``, drawing power (``act``: its ``activity`` at the current clocks), starts: add it to the
        running set."""
        self.active[(step, op.id)] = act
        sm, mem = self.state.sm_clock_mhz, self.state.mem_clock_mhz
        hit = self.price_keys.by_op.get(id(op))
        key = (hit[1] if hit is not None else self.price_keys.of(op), sm, mem)
        self._keys[(step, op.id)] = key if self._activity_cache.get(key, _MISSING) is act else ("op", op.id, sm, mem)

    def is_running(self, op, step) -> bool:
        """Whether op ``op`` of ``step`` is in the running set."""
        return (step, op.id) in self.active

    def remove(self, op, step) -> None:
        """Op ``op`` of ``step`` (running, ``is_running``) ends: leave the running set."""
        del self.active[(step, op.id)]
        del self._keys[(step, op.id)]

    def power(self) -> float:
        """Board power of the running ops at the current clocks, W (cached by the running ops' activities, in order,
        each named by its cache key, and the current clocks: ``GpuPowerModel.power_of`` of equal activities in the
        same order is the same float)."""
        key = (tuple(self._keys.values()), self.state.sm_clock_mhz, self.state.mem_clock_mhz)
        p = self._power_cache.get(key)
        if p is None:
            p = self._power_cache[key] = self.model.power_of(self.active.values(), self.state.sm_clock_mhz,
                                                              self.state.mem_clock_mhz)
        return p

    def max_reachable_power_w(self, fmax_mhz: float) -> float:
        """Highest board power the model can draw: every unit fully busy at ``fmax_mhz``, W."""
        return self.model.power_w(fmax_mhz, busy=1.0, compute=1.0, memory=1.0, copy=1.0)

    def excess_w(self, op) -> float:
        """Power above idle of ``op`` running alone at the current clocks, W (0 for an op that draws none); cached by
        pricing key and clocks, as its activity (``activity``)."""
        hit = self.price_keys.by_op.get(id(op))
        sm, mem = self.state.sm_clock_mhz, self.state.mem_clock_mhz
        pk = (hit[1] if hit is not None else self.price_keys.of(op), sm, mem)
        e = self._excess_by_key.get(pk)
        if e is None:
            a = self.activity(op)
            if a is None:
                e = 0.0
            else:
                key = (a, sm, mem)  # the excess depends only on the activity and the clocks
                e = self._excess.get(key)
                if e is None:
                    e = self._excess[key] = max(0.0, self.model.power_of((a,), sm, mem)
                                                - self.model.power_of((), sm, mem))
            self._excess_by_key[pk] = e
        return e

    def busy_w(self) -> float:
        """Power above idle of a kernel that keeps no unit busy (``Activity()``: the SM floor of every running kernel,
        drawn once however many run) at the current clocks, W; a kernel's ``excess_w`` is this plus the share of its
        activity, which adds over concurrent ops."""
        sm, mem = self.state.sm_clock_mhz, self.state.mem_clock_mhz
        return max(0.0, self.model.power_of((Activity(),), sm, mem) - self.model.power_of((), sm, mem))

    def excess_parts_w(self, op) -> tuple[float, float, bool]:
        """``(excess, share, kernel)`` of ``op`` at the current clocks: its ``excess_w``, W; the part of it that adds
        over concurrent ops, W (a kernel's excess less ``busy_w``, at least 0; a copy's whole excess); whether it is a
        kernel (draws the SM floor). Cached by pricing key and clocks, as ``excess_w``."""
        hit = self.price_keys.by_op.get(id(op))
        pk = (hit[1] if hit is not None else self.price_keys.of(op), self.state.sm_clock_mhz, self.state.mem_clock_mhz)
        parts = self._parts_by_key.get(pk)
        if parts is None:
            e = self.excess_w(op)
            a = self.activity(op) if e else None
            kernel = a is not None and a.kernel
            parts = self._parts_by_key[pk] = (e, max(0.0, e - self.busy_w()) if kernel else e, kernel)
        return parts

    def excess_bound_w(self, ops, parts: dict | None = None, above_w: float = math.inf,
                       base_w: float = 0.0) -> float:
        """Sum over streams of the largest ``excess_w`` of ``ops`` on each (an iterable of ops; a stream runs one op
        at a time and the power above idle is subadditive, so idle plus this bounds every level of a run of them), W.

        The streams are summed in the order their first op with a positive excess comes in ``ops``. ``parts``: a dict
        that also receives each op's ``excess_parts_w`` by op id (the ops read so far). ``above_w``: stop as soon as
        ``base_w`` plus the sum so far exceeds it and return that partial sum, for a caller that only asks whether
        ``base_w`` plus the bound exceeds ``above_w`` (the same answer: each stream's largest so far is at most its
        largest, the streams so far come first in the sum's order, and a float sum is non-decreasing in each term).
        """
        top: dict[str, float] = {}
        get = top.get
        if parts is None:
            excess = self.excess_w
            for op in ops:
                e = excess(op)
                if e > get(op.stream, 0.0):
                    top[op.stream] = e
                    if above_w < math.inf and base_w + sum(top.values()) > above_w:
                        break
        else:
            of = self.excess_parts_w
            for op in ops:
                p = parts[op.id] = of(op)
                if p[0] > get(op.stream, 0.0):
                    top[op.stream] = p[0]
                    if above_w < math.inf and base_w + sum(top.values()) > above_w:
                        break
        return sum(top.values())

    # -- activities -------------------------------------------------------------------------------------
    def activity(self, op) -> Activity | None:
        """The op's activity at the current clocks (cached: ops repeat every step); None: it draws no power."""
        hit = self.price_keys.by_op.get(id(op))  # what the activity depends on besides the clocks (ops alike share it)
        key = (hit[1] if hit is not None else self.price_keys.of(op), self.state.sm_clock_mhz, self.state.mem_clock_mhz)
        hit = self._activity_cache.get(key, _MISSING)
        if hit is _MISSING:
            hit = self._activity_cache[key] = self._activity_uncached(op)
        return hit

    def _activity_uncached(self, op) -> Activity | None:
        if op.meta and "fused" in op.meta:  # a layer-fidelity block: its parts' time-weighted mean activity
            return self.block_activity(op)
        if op.kind in KERNEL_KINDS and op.fixed_duration_s is None:
            return self._kernel_activity_uncached(op)  # cached by ``activity`` (its pricing key holds the cost split)
        if op.kind in KERNEL_KINDS:
            return Activity(compute=0.5, memory=0.5)
        if op.kind == OpKind.MEMCPY_D2D:
            return Activity(memory=1.0)
        if op.kind in COPY_KINDS:
            return Activity(copy=1.0, kernel=False)
        return None

    def block_activity(self, op) -> Activity:
        """Activity of layer-fidelity block ``op`` (``meta["fused"]``) at the current clocks: the time-weighted mean
        of its parts' (``cost.fused_s``: compute and memory seconds over their total), and, for the blocking TP
        collectives folded into it (``Op.folded_comm`` without ``meta["side"]``: between the runs of its kernels they
        cut, ``System.folded_stretches``, with interference; one after another after its kernels without), of each collective's own kernel activity over its time alone
        (``collective_s``), as kernel fidelity meters that time. So the block's energy at one clock is its parts'
        and collectives' energy at kernel fidelity (up to the power model's clip at full activity when another
        stream overlaps it); the block's span and its collectives' spans (which share its id) draw this mean.
        Collectives beside the kernels (``meta["side"]``) are not weighed in: they share the block's activity."""
        c, m, d = self.cost.fused_s(op, self.state)
        if op.folded_comm and self.collective_s is not None and "side" not in op.meta:
            for coll in op.folded_comm:
                t = self.collective_s(coll)
                a = self._kernel_activity_uncached(coll)
                c, m, d = c + a.compute * t, m + a.memory * t, d + t
        return Activity(compute=c / d, memory=m / d) if d > 0 else Activity(kernel=True)

    def _kernel_activity_uncached(self, op) -> Activity:
        """Activity of GPU kernel ``op`` (not a block, no fixed duration) at the current clocks."""
        c, m, f = self.cost.split_s(op)
        c *= self.gpu.max_sm_clock_mhz / self.state.sm_clock_mhz
        if self.gpu.mem_clock_mhz:
            m *= self.gpu.mem_clock_mhz / self.state.mem_clock_mhz
        return activity_of_kernel(c, m, f)

    # -- power from recorded spans ----------------------------------------------------------------------
    def activity_row(self, op) -> tuple | None:
        """``activity(op)`` as the row ``(compute, memory, copy, kernel 1.0 / 0.0)`` ``levels`` reads, or None for an op
        that draws no power; cached by ``activity``'s key (pricing key and clocks)."""
        hit = self.price_keys.by_op.get(id(op))
        key = (hit[1] if hit is not None else self.price_keys.of(op), self.state.sm_clock_mhz, self.state.mem_clock_mhz)
        row = self._rows.get(key, _MISSING)
        if row is _MISSING:
            a = self.activity(op)
            row = self._rows[key] = None if a is None else (a.compute, a.memory, a.copy, 1.0 if a.kernel else 0.0)
        return row

    def levels(self, spans, columns=None, pricing=None):
        """``(times, power, last_starts)``: the power levels of ``spans`` ``(step, op, start_s, end_s, stream)`` at
        the current clocks (each level from its instant to the next; ``last_starts``: an op starts at the last
        instant), or None when no span draws power.

        The level at each instant is the power of the ops running just after it, as ``add`` / ``remove`` keep it
        (``GpuPowerModel.power_of``, evaluated on arrays). A stream runs one op at a time, so the op running on
        each stream at an instant is the last one started on it, if not yet ended. Monotone: the power at every
        instant from a subset of the spans is at most that from all of them (every coefficient of the power
        model is >= 0 and the activities only add).

        ``columns``: ``spans`` as ``recording.recorder.SpanColumns`` when the caller has them (the recorder's
        ``span_columns``, shared with its ``spans_frame``); None: built here. ``pricing``: the graph's
        ``power_spans.SpanPricing``, whose ``rows`` are read by each span's op id in place of each distinct op's
        ``activity_row`` where ``pricing.by_id`` holds (every span's op prices as the graph's op of its id) and its
        clocks are the current ones; the same levels."""
        if not spans:
            return None
        uniq = pos = None
        if (pricing is not None and pricing.by_id
                and pricing.clocks == (self.state.sm_clock_mhz, self.state.mem_clock_mhz)):
            _steps, ops, s_all, e_all, streams = zip(*spans)
            op_ids = np.fromiter(map(_OP_ID, ops), dtype=np.intp, count=len(ops))
            has, act = pricing.has[op_ids], pricing.rows[op_ids]
        else:
            if columns is None:
                _steps, ops, s_all, e_all, streams = zip(*spans)
                uniq = {id(op): op for op in ops}  # in first-span order
                # each span's distinct op (the spans repeat a step's ops): per-op columns are taken by it
                index = {k: i for i, k in enumerate(uniq)}
                pos = np.fromiter(map(index.__getitem__, map(id, ops)), dtype=np.intp, count=len(ops))
            else:
                ops, s_all, e_all, streams, uniq_ops, pos = columns[1:]
                uniq = {id(op): op for op in uniq_ops}
            table: dict[int, tuple] = {}
            row_of = self.activity_row
            for op in uniq.values():  # a block's folded TP collectives share its id and activity (``PriceKeys``)
                row = row_of(op)
                if row is not None:
                    table[op.id] = row
            if not table:
                return None
            top = max(max(table), max(op.id for op in uniq.values()))
            act_of = np.zeros((top + 1, 4))
            has_of = np.zeros(top + 1, dtype=bool)
            keys = np.fromiter(table, dtype=np.int64, count=len(table))
            act_of[keys] = np.array(list(table.values()), dtype=float)
            has_of[keys] = True
            op_ids = np.array([op.id for op in uniq.values()], dtype=np.int64)[pos]
            has, act = has_of[op_ids], act_of[op_ids]
        codes: dict[str, int] = {}  # stream -> code, in first-span order (the order the streams are summed in)
        if all(streams):  # every span names its stream (the executor's)
            codes = {st: k for k, st in enumerate(dict.fromkeys(streams))}
            stream_code = np.fromiter(map(codes.__getitem__, streams), dtype=np.int64, count=len(ops))
        elif any(streams):
            stream_code = np.fromiter((codes.setdefault(st or op.stream, len(codes)) for op, st in zip(ops, streams)),
                                      dtype=np.int64, count=len(ops))
        elif uniq is not None:  # every span on its op's stream: a stream's first span is its first op's first span
            stream_code = np.array([codes.setdefault(op.stream, len(codes)) for op in uniq.values()],
                                   dtype=np.int64)[pos]
        else:
            stream_code = np.fromiter((codes.setdefault(op.stream, len(codes)) for op in ops), dtype=np.int64,
                                      count=len(ops))
        s_all, e_all = np.fromiter(s_all, dtype=float, count=len(ops)), np.fromiter(e_all, dtype=float, count=len(ops))
        use = has & (e_all > s_all)
        if not use.any():
            return None
        times = np.unique(np.concatenate((s_all[use], e_all[use])))
        busy = np.zeros(len(times), dtype=bool)
        compute = np.zeros(len(times))
        memory = np.zeros(len(times))
        copy = np.zeros(len(times))
        starts = np.zeros(len(times), dtype=bool)
        for k in range(len(codes)):
            sel = np.nonzero(use & (stream_code == k))[0]
            if not len(sel):
                continue
            sel = sel[np.argsort(s_all[sel], kind="stable")]
            s_k, e_k, a = s_all[sel], e_all[sel], act[sel]
            i = np.searchsorted(s_k, times, side="right") - 1
            ok = i >= 0
            i = np.maximum(i, 0)
            run = ok & (e_k[i] > times)
            compute = compute + np.where(run, a[i, 0], 0.0)
            memory = memory + np.where(run, a[i, 1], 0.0)
            copy = copy + np.where(run, a[i, 2], 0.0)
            busy |= run & (a[i, 3] > 0)
            starts |= ok & (s_k[i] == times)
        m, sm_mhz, mem_mhz = self.model, self.state.sm_clock_mhz, self.state.mem_clock_mhz
        phi = m.clock_factor(sm_mhz)
        fm = m.max_mem_clock_mhz if mem_mhz is None else mem_mhz
        b = np.where(busy, 1.0, 0.0)
        compute, memory, copy = (np.minimum(1.0, np.maximum(0.0, v)) for v in (compute, memory, copy))
        sm = phi * m.sm_w * (m.sm_floor * b + (1.0 - m.sm_floor) * compute)
        power = (m.static_w + m.clock_w * phi + sm + m.mem_w * memory * (fm / m.max_mem_clock_mhz) + m.copy_w * copy)
        return times, power, bool(starts[-1])
