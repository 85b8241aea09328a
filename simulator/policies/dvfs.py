"""DVFS policies and the GPU power meter (runtime components).

One runtime component, ``dvfs``, attaches to every run: it meters GPU power (from the ops running
at each instant, at the current clocks; ``hardware_models.power``), integrates energy, and runs the
GPU's clock controller and the firmware power-limit controller (always on at the board's default
limit, as on a real GPU). When nothing but the firmware could change the clock (no ``dvfs``
section, or ``locked_clock`` / ``power_cap`` without an explicit ``power_limit_w``) nothing runs per
op: the power is computed from the recorded spans after the run (``DvfsRuntime.finish``), and if
the firmware would have lowered the clock at one of its evaluations the run is repeated with the
power metered per op, so the result is exact either way. The scenario's ``dvfs.kind`` picks a clock policy from
``DVFS_POLICIES``:

* ``locked_clock`` — ``nvidia-smi -lgc F``: the SM clock is set to ``F`` before the job (a clock
  the GPU does not support is snapped to the nearest supported one, with a warning, as the driver
  rounds too). A ``power_limit_w`` given with it (or with ``phase_plan``) still binds: the
  firmware lowers the clock below the requested one while the power is above the limit, as on a
  real board, and returns to it when the power allows (see ``DvfsRuntime._firmware``).
* ``power_cap`` — ``nvidia-smi -pl W``: the firmware controller samples the average power over a
  window every period and steps the clock down (up) when it is above (below) the cap; each change
  takes the switching latency. It reacts to the draw, it does not know the future. While the limit
  cannot bind (clock not limited and power at or below the cap for a whole window) the loop sleeps
  until the power rises above the cap, so a long idle stretch costs no evaluations; the result is
  the same as evaluating every period.
* ``phase_plan`` — a clock per step phase (``fwd``, ``bwd``, ``opt``, ``data``, ``other``): when a
  GPU op of another phase starts, the clock is requested; it arrives after the switching latency
  and the GPU runs at the old clock meanwhile.

Limitations: an op's duration is fixed when it starts (a clock change lands for the next op); the
power of running ops follows the clock immediately.
"""

from __future__ import annotations

import math
from itertools import repeat
from operator import itemgetter
from typing import Callable

import numpy as np
import pandas as pd

from hardware_models.power import (
    Activity,
    ClockController,
    EnergyLedger,
    activity_of_kernel,
    generic_power_model,
    has_power_preset,
    load_power_model,
    ratio_step,
    snap_clock,
)
from simulator.config.sections.dvfs import DEFAULT_SWITCH_LATENCY_S
from simulator.graph.ops import OpKind
from simulator.policies.registry import PolicyError, register_runtime

#: DVFS clock policies by ``dvfs.kind``.
DVFS_POLICIES: dict[str, type] = {}

_KERNEL_KINDS = (OpKind.COMPUTE, OpKind.COLLECTIVE)
#: Ops per step from which an offline-metered run whose power limit may bind is watched during the run
#: (``DvfsRuntime._watch_offline``: switches to per-op metering where the limit first binds, never repeats the
#: run) rather than checked after it (``finish``: repeats the run with per-op metering if the limit bound). Both
#: are exact; the watch costs ~13% of a small run (gpt_184m_b16: 1,728 ops) and saves a second simulation of a
#: large one (the 175B scale scenario's stages: ~52k ops), so small graphs take the after-run check.
WATCH_MIN_OPS = 20_000


def requested_clock_mhz(clock_mhz: float, gpu, key: str) -> float:
    """The supported SM clock for a requested ``clock_mhz`` of ``gpu``, MHz.

    A clock between the lowest and highest supported clocks snaps to the nearest one, with a
    warning (``nvidia-smi -lgc`` rounds likewise); one outside that range is refused, since
    snapping would quietly run a typo (14100 for 1410 MHz) at the maximum clock.

    Raises:
        PolicyError: ``clock_mhz`` below the lowest or above the highest supported clock (without a
            list: above ``max_sm_clock_mhz``), naming ``key`` and the allowed range.
    """
    sup = gpu.supported_sm_clocks_mhz
    lo, hi = (min(sup), max(sup)) if sup else (0.0, gpu.max_sm_clock_mhz)
    if not lo <= clock_mhz <= hi:
        raise PolicyError(f"{key}: {clock_mhz:g} MHz is outside the SM clocks of {gpu.name} "
                          f"(allowed: {lo:g}-{hi:g} MHz)")
    return snap_clock(clock_mhz, sup, key)
_COPY_KINDS = (OpKind.MEMCPY_H2D, OpKind.MEMCPY_D2H)
#: The firmware raises the clock only when the power is this far below the cap.
_HYSTERESIS = 0.03


def register_dvfs(kind: str) -> Callable[[type], type]:
    """Class decorator: register a DVFS clock policy under ``dvfs.kind``."""

    def deco(cls: type) -> type:
        DVFS_POLICIES[kind] = cls
        return cls

    return deco


def gpu_preset_name(cfg) -> str | None:
    ref = cfg.hardware.gpu
    return ref if isinstance(ref, str) else getattr(ref, "preset", None)


def power_model_for(cfg, gpu):
    """The power model of a scenario: ``dvfs.power_model``, else the GPU preset's, else generic."""
    name = cfg.dvfs.power_model if cfg is not None and cfg.dvfs is not None else None
    if name:
        try:
            return load_power_model(name)
        except (FileNotFoundError, ValueError) as exc:
            raise PolicyError(f"dvfs.power_model: {exc}") from exc
    preset = gpu_preset_name(cfg) if cfg is not None else None
    if preset and has_power_preset(preset):
        return load_power_model(preset)
    return generic_power_model(gpu)


_MISSING = object()
_first = itemgetter(0)


@register_dvfs("locked_clock")
class LockedClock:
    """Fixed SM clock (``nvidia-smi -lgc``)."""

    #: the policy does nothing per op (the clock is set once, before the job)
    per_op = False

    def __init__(self, dcfg, gpu, ctl: ClockController):
        self.clock_mhz = requested_clock_mhz(dcfg.locked_clocks_mhz, gpu, "dvfs.locked_clocks_mhz")
        ctl.set_target(self.clock_mhz, immediate=True)

    def on_op_start(self, op, ctl: ClockController) -> None:
        return None


def requested_power_limit_w(dcfg, gpu) -> float | None:
    """``dvfs.power_limit_w`` checked against the board's settable range, W (None when not set).

    Applies with every ``dvfs.kind``: the firmware enforces the limit over locked or planned clocks.

    Raises:
        PolicyError: the limit lies outside ``[min_power_limit_w, max_power_limit_w]``.
    """
    cap = getattr(dcfg, "power_limit_w", None)
    if cap is None:
        return None
    lo, hi = gpu.min_power_limit_w, gpu.max_power_limit_w
    if hi and not lo <= cap <= hi:
        raise PolicyError(f"dvfs.power_limit_w {cap:g} W is outside the settable range of {gpu.name}: "
                          f"{lo:g}-{hi:g} W")
    return float(cap)


@register_dvfs("power_cap")
class PowerCap:
    """Power limit (``nvidia-smi -pl``) at the maximum clock; the controller is the runtime's firmware loop."""

    per_op = False

    def __init__(self, dcfg, gpu, ctl: ClockController):
        self.power_limit_w = requested_power_limit_w(dcfg, gpu)

    def on_op_start(self, op, ctl: ClockController) -> None:
        return None


@register_dvfs("phase_plan")
class PhaseClockPlan:
    """A clock per phase, requested when a GPU op of that phase starts."""

    per_op = True

    def __init__(self, dcfg, gpu, ctl: ClockController):
        self.plan = {ph: requested_clock_mhz(mhz, gpu, f"dvfs.phase_clocks_mhz.{ph}")
                     for ph, mhz in dcfg.phase_clocks_mhz.items()}
        self.default = gpu.max_sm_clock_mhz

    def on_op_start(self, op, ctl: ClockController) -> None:
        if op.kind not in _KERNEL_KINDS and op.kind != OpKind.MEMCPY_D2D:
            return
        want = self.plan.get(op.phase.value, self.default)
        if want != ctl.target_mhz:
            ctl.set_target(want)


@register_runtime("dvfs")
class DvfsRuntime:
    """Meters GPU power and energy; runs the clock controller, power-limit firmware and clock policy."""

    @staticmethod
    def applies(cfg) -> bool:
        return True

    def __init__(self, cfg, hw, env, system):
        self.cfg, self.env, self.sys = cfg, env, system
        self.gpu = gpu = hw.gpu
        self.host_cores = hw.host_cpu.cores
        self.model = power_model_for(cfg, gpu)
        self.rec = getattr(system, "recorder", None)
        self.state = system.state
        dcfg = cfg.dvfs if cfg is not None else None
        latency = dcfg.clock_switch_latency_s if dcfg is not None else DEFAULT_SWITCH_LATENCY_S
        self.ctl = ClockController(env, self.state, gpu.max_sm_clock_mhz, latency, self._clock_changed)
        self.supported = tuple(gpu.supported_sm_clocks_mhz) or (gpu.max_sm_clock_mhz,)
        self.active: dict[tuple, Activity] = {}
        self._ids: list[int] = []  # op ids of ``active``, in insertion order (the power-cache key)
        self._dirty_t: float | None = None
        self._activity_cache: dict[tuple, Activity | None] = {}
        self._power_cache: dict[tuple, float] = {}
        self.policy = None
        self.kind = dcfg.kind if dcfg is not None else "default"
        # the power limit binds whatever the clock policy (nvidia-smi -pl over -lgc): see _firmware
        cap = requested_power_limit_w(dcfg, gpu) or gpu.tdp_w or gpu.max_power_limit_w or None
        self.power_limit_w = cap
        self.ledger = EnergyLedger(env.now, self._power())
        self._fw_sleep = None  # event the sleeping firmware waits on (see _firmware)
        self._over_end_t = -math.inf  # when the last power level above the cap ended
        if dcfg is not None:
            self.policy = DVFS_POLICIES[dcfg.kind](dcfg, gpu, self.ctl)
        self.period_s = dcfg.power_sample_period_s if dcfg is not None else 0.01
        self.window_s = dcfg.power_window_s if dcfg is not None else 0.02
        self.fmax_mhz = float(max(max(self.supported), gpu.max_sm_clock_mhz))
        #: firmware evaluations that ran (the loop sleeps while the limit cannot bind)
        self.firmware_ticks = 0
        #: when an offline-metered run switched to online metering (``_watch_offline``); None: it did not
        self.switched_at_s = None
        self._fw_t0 = env.now
        self._update()
        self._count(env.now, "sm_clock_mhz", self.state.sm_clock_mhz)
        self._count(env.now, "power_w", self.ledger.p[-1])
        #: meter per op during the run (True) or from the spans afterwards (False, see ``finish``)
        self.online = bool(getattr(system, "exact_power", False)
                           or (self.policy is not None and getattr(self.policy, "per_op", True))
                           or (dcfg is not None and dcfg.power_limit_w is not None)
                           or self.ctl.limit_mhz < self.fmax_mhz)
        self._can_bind = bool(cap and cap < self.max_reachable_power_w())
        if self._can_bind and self.online:
            env.process(self._firmware(cap))
        elif self._can_bind and self.rec is not None and hasattr(system, "executor"):
            system.watch_min_ops = WATCH_MIN_OPS  # the executor keeps its running-op table for graphs this large
            env.process(self._watch_offline())

    def max_reachable_power_w(self) -> float:
        """Highest board power the model can draw: every unit fully busy at the highest clock, W."""
        return self.model.power_w(self.fmax_mhz, busy=1.0, compute=1.0, memory=1.0, copy=1.0)

    # -- runtime-component interface ----------------------------------------------------------
    def hooks(self) -> list:
        return [self] if self.online else []

    def finish(self, recorder) -> bool:
        """After the run: meter power from the recorded spans when it was not metered online.

        Offline metering applies when the clock cannot change during the run except by the
        power-limit firmware (no ``dvfs`` section, ``locked_clock`` or ``power_cap`` at the board's
        default limit): the power at each instant is that of the spans covering it at the constant
        clocks, so the ledger and the ``power_w`` counters equal the online ones. The firmware only
        changes anything when the windowed average power exceeds the limit at one of its evaluation
        times (``t0 + k * period``; a sleeping firmware evaluates a subset of them), so that is
        checked on the whole grid.

        Returns:
            False when the firmware would have lowered the clock: the run must be repeated with
            online metering (``System.exact_power``) to stay exact; True otherwise.
        """
        if self.online:
            return True
        self._meter_spans(recorder._spans)
        return not (self._can_bind and self._firmware_would_act(self.env.now))

    def _meter_spans(self, spans) -> None:
        """Ledger and ``power_w`` counters from spans ``(step, op, start_s, end_s, stream)`` at the current clocks.

        The level at each instant is the power of the ops running just after it, as ``on_op_start`` /
        ``on_op_end`` set it (``GpuPowerModel.power_of``, evaluated on arrays); the level after the
        last op end stays deferred (``summarize`` commits it). A stream runs one op at a time, so the
        op running on each stream at an instant is the last one started on it, if not yet ended.
        """
        lv = self._levels(spans)
        if lv is None:
            return
        times, power, last_starts = lv
        n = len(times)
        if not last_starts:
            n -= 1
            self._dirty_t = float(times[-1])  # as online: the level after the last op end is committed by ``summarize``
        self._append_levels(times[:n], power[:n])

    def _levels(self, spans):
        """``(times, power, last_starts)``: the power levels ``_meter_spans`` records from ``spans`` (each
        level from its instant to the next; ``last_starts``: an op starts at the last instant), or None when
        no span draws power. Monotone: the power at every instant from a subset of the spans is at most
        that from all of them (every coefficient of the power model is >= 0 and the activities only add)."""
        if not spans:
            return None
        _steps, ops, s_all, e_all, streams = zip(*spans)
        uniq = {id(op): op for op in ops}
        table: dict[int, tuple] = {}
        for op in uniq.values():
            a = self._activity(op)
            if a is not None:
                table[op.id] = (a.compute, a.memory, a.copy, 1.0 if a.kernel else 0.0)
        codes: dict[str, int] = {}
        stream_code = np.fromiter((codes.setdefault(st or op.stream, len(codes)) for op, st in zip(ops, streams)),
                                  dtype=np.int64, count=len(ops))
        if not table:
            return None
        top = max(max(table), max(op.id for op in uniq.values()))
        act_of = np.zeros((top + 1, 4))
        has_of = np.zeros(top + 1, dtype=bool)
        keys = np.fromiter(table, dtype=np.int64, count=len(table))
        act_of[keys] = np.array(list(table.values()), dtype=float)
        has_of[keys] = True
        op_ids = np.fromiter((op.id for op in ops), dtype=np.int64, count=len(ops))
        has, act = has_of[op_ids], act_of[op_ids]
        s_all, e_all = np.array(s_all, dtype=float), np.array(e_all, dtype=float)
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

    def _append_levels(self, times, power) -> None:
        """``_set_level(t, p)`` for each level in time order (the firmware is not running), on arrays:
        the same ledger entries (energy accumulated in the same order) and ``power_w`` counters."""
        led = self.ledger
        if not len(times):
            return
        keep = power != np.concatenate(([led.p[-1]], power[:-1]))  # ledger.set skips an unchanged level
        times, power = times[keep], power[keep]
        if not len(times):
            return
        t_list, p_list = times.tolist(), power.tolist()
        if t_list[0] == led.t[-1]:  # a change at the ledger's last instant replaces its level
            led.p[-1] = p_list[0]
            self._count(t_list[0], "power_w", p_list[0])
            t_list, p_list, times, power = t_list[1:], p_list[1:], times[1:], power[1:]
            if not t_list:
                return
        t_prev = np.concatenate(([led.t[-1]], times[:-1]))
        p_prev = np.concatenate(([led.p[-1]], power[:-1]))
        e = np.cumsum(np.concatenate(([led.e[-1]], p_prev * (times - t_prev))))[1:]
        led.t.extend(t_list)
        led.p.extend(p_list)
        led.e.extend(e.tolist())
        if self.rec is not None:
            self._count(t_list[0], "power_w", p_list[0])  # may replace a sample at that instant
            rows = self.rec.counters
            rows.extend(zip(t_list[1:], repeat("gpu0"), repeat("power_w"), p_list[1:]))
            self.rec._last[("gpu0", "power_w")] = len(rows) - 1

    def _firmware_would_act(self, t_end: float) -> bool:
        """Whether the windowed average power exceeds the limit at a firmware evaluation time up to ``t_end``."""
        T, P, E = (np.asarray(x, dtype=float) for x in (self.ledger.t, self.ledger.p, self.ledger.e))
        return self._window_over(T, P, E, t_end, self.power_limit_w)

    def _window_over(self, T, P, E, t_end: float, cap: float) -> bool:
        """Whether the average of the piecewise-constant power ``P`` (levels from ``T``, energy ``E`` at
        ``T``) over the window ``[max(0, t - window_s), t]`` exceeds ``cap`` at an evaluation time
        ``t = t0 + k * period <= t_end`` (``k >= 1``; the firmware's grid, see ``_firmware``)."""
        t0, period = self._fw_t0, self.period_s
        kmax = int((t_end - t0) // period)
        if kmax < 1:
            return False
        tk = t0 + np.arange(1, kmax + 1) * period
        lo = np.maximum(0.0, tk - self.window_s)

        def energy_at(x):
            i = np.maximum(np.searchsorted(T, x, side="right") - 1, 0)
            return E[i] + P[i] * (x - T[i])

        avg = (energy_at(tk) - energy_at(lo)) / (tk - lo)
        return bool(np.any(avg > cap))

    def _watch_offline(self):
        """SimPy process of an offline-metered run whose power limit may bind: it keeps the run offline until
        the firmware could act, then switches it to online metering at that instant, so that the run is never
        repeated (``finish``'s fallback) and costs per-op metering only from then on.

        At each firmware evaluation time ``t = t0 + k * period`` it computes the average power over the
        evaluation window ``[max(0, t - window_s), t]`` exactly as the online meter would (``_levels`` of the
        spans ending in the window plus the ops still running, ``System.running``). While it is at or below the
        limit the firmware, had it run, would not have changed the clock (an evaluation only lowers the clock
        when the window average exceeds the limit; the limit starts at the highest clock, so raising it does
        nothing either; see ``_firmware``), so the offline record is exact up to ``t``. At the first ``t`` where
        it is above the limit (less a 1e-9 relative margin, so that float rounding can only switch early, which
        is exact too), the ledger and counters are metered from the spans so far, the running ops become the
        meter's active set, the meter hooks into the executor (``System.executor.add_hook``) and the firmware
        starts with its evaluation at ``t``: from there on the run is the online run.

        Windows: the modelled firmware acts on the power averaged over ``window_s``, evaluated every
        ``period_s`` (``dvfs.power_window_s`` / ``power_sample_period_s``, defaults 20 ms and 10 ms), not on
        the instantaneous draw: NVIDIA's NVML reference, *nvmlDeviceGetPowerUsage*, states that on Ampere
        (except GA100) and newer GPUs the board power it reports is averaged over a 1 s interval, with the
        instantaneous value a separate field (``NVML_FI_DEV_POWER_INSTANT`` vs ``NVML_FI_DEV_POWER_AVERAGE``).
        So one kernel drawing more than the limit does not by itself make an evaluated average exceed it, and
        only the window average decides the switch.
        """
        env, rec, sys_ = self.env, self.rec, self.sys
        if not getattr(sys_, "track_running", False):
            return  # a small graph: cheaper to check after the run and repeat it in the rare case it binds (finish)
        t0, period, w = self._fw_t0, self.period_s, self.window_s
        cap = self.power_limit_w
        thresh = cap * (1.0 - 1e-9)
        idle = self.ledger.p[0]
        excess: dict[int, float] = {}
        spans = rec._spans
        recent: list = []
        seen = 0
        k = 0
        while True:
            k += 1
            t = t0 + k * period
            if t > env.now:
                yield env.timeout(t - env.now)
            if sys_.executor is None:  # no executor to hook into (a bare harness): ``finish`` decides
                return
            if k == 1:
                # a stream runs one op at a time and the power above idle is subadditive (see below): idle plus
                # each stream's largest op excess bounds every level of the run; at or below the limit the firmware
                # can never act and the offline record is exact without watching
                ex = sys_.executor
                top: dict[str, float] = {}
                for stream, ops in ex.by_stream.items():
                    for op in ops:
                        e = excess.get(op.id)
                        if e is None:
                            e = excess[op.id] = self._excess_w(op)
                        if e > top.get(stream, 0.0):
                            top[stream] = e
                if idle + sum(top.values()) <= thresh:
                    return
            lo = max(0.0, t - w)
            if len(spans) > seen:
                recent.extend(spans[seen:])
                seen = len(spans)
            recent = [x for x in recent if x[3] > lo]
            running = [(st, op, start, t, stream) for stream, (st, op, start) in sys_.running.items()]
            # cheap bounds first: the power above idle is subadditive over the running ops (a max and sums clipped
            # at 1, all coefficients >= 0), so idle + the sum of each op's own excess bounds every level
            inst = avg_hi = 0.0
            for x in (*recent, *running):  # a running op's end is t (above)
                e = excess.get(x[1].id)
                if e is None:
                    e = excess[x[1].id] = self._excess_w(x[1])
                if e:
                    inst += e
                    avg_hi += e * (min(x[3], t) - max(x[2], lo))
            quiet = idle + inst <= thresh
            if not quiet and (idle * (t - lo) + avg_hi <= thresh * (t - lo)):
                continue  # this window's average cannot exceed the limit
            lv = None if quiet else self._levels(recent + running)
            if lv is None or lv[1].max() <= thresh:
                # every level in the window and the current one at or below the limit: power changes only when an op
                # starts or ends, and an end only lowers it (``_levels`` is monotone), so no window can exceed the
                # limit before the next op starts: sleep until then, and go on at the next evaluation time after it
                ev = sys_.start_waiter = env.event()
                t_start = yield ev
                k = max(k, int((t_start - t0) // period))
                continue
            times, power, _ = lv
            # integral of the levels over [lo, t]: idle before the first level
            edges = np.clip(np.concatenate((times, [t])), lo, t)
            energy = float(np.sum(power * np.diff(edges))) + idle * max(0.0, min(times[0], t) - lo)
            if t > lo and energy / (t - lo) > thresh:
                self._go_online(running, k)
                return

    def _excess_w(self, op) -> float:
        """Power above idle of ``op`` running alone at the current clocks, W (0 for an op that draws none)."""
        a = self._activity(op)
        if a is None:
            return 0.0
        sm, mem = self.state.sm_clock_mhz, self.state.mem_clock_mhz
        return max(0.0, self.model.power_of((a,), sm, mem) - self.model.power_of((), sm, mem))

    def _go_online(self, running, k: int) -> None:
        """Switch an offline-metered run to online metering now (see ``_watch_offline``): ledger and counters
        from the spans so far (levels before now), the running ops active, hooks on, firmware from tick ``k``."""
        now = self.env.now
        lv = self._levels(list(self.rec._spans) + running)
        if lv is not None:
            times, power, _ = lv
            keep = times < now
            self._append_levels(times[keep], power[keep])
        p = np.asarray(self.ledger.p)
        over = np.nonzero((p[:-1] > self.power_limit_w) & (p[1:] <= self.power_limit_w))[0]
        if len(over):
            self._over_end_t = float(self.ledger.t[over[-1] + 1])
        for st, op, start, _, _ in sorted(running, key=lambda r: r[2]):
            act = self._activity(op)
            if act is not None:
                self.active[(st, op.id)] = act
                self._ids.append(op.id)
        self.online = True
        self.switched_at_s = now
        self.sys.executor.add_hook(self)
        self._update()
        self.env.process(self._firmware(self.power_limit_w, k))

    def on_op_start(self, op, step, system) -> None:
        if self.policy is not None:
            self.policy.on_op_start(op, self.ctl)
        act = self._activity(op)
        if act is not None:
            self._flush()
            self.active[(step, op.id)] = act
            self._ids.append(op.id)
            self._update()

    def on_op_end(self, op, step, system) -> None:
        # Deferred: when the stream's next op starts at the same instant (the common case), the
        # idle level in between lasts zero time and is never computed (see ``_flush``).
        key = (step, op.id)
        if key in self.active:
            self._flush()  # a level deferred from an earlier instant lasted until now, with this op running
            del self.active[key]
            self._ids.remove(op.id)
            if self._dirty_t is None:
                self._dirty_t = self.env.now

    def _flush(self) -> None:
        """Commit a level change deferred by ``on_op_end`` if time has moved on since."""
        t = self._dirty_t
        if t is not None:
            self._dirty_t = None
            if t < self.env.now:
                self._set_level(t, self._power())

    def summarize(self, spans=None, steps=None, counters=None, summary=None) -> dict:
        """GPU energy and power over the measured steps, host estimate, clock statistics."""
        summary = summary or {}
        self._update()  # commit any deferred level change
        measured = steps[~steps.warmup]
        n = max(len(measured), 1)
        w = int(steps.warmup.sum())
        t0 = float(steps.end_s.iloc[w - 1]) if w > 0 else float(steps.start_s.iloc[0])
        t1 = float(steps.end_s.iloc[-1])
        window = max(t1 - t0, 1e-12)
        energy = self.ledger.energy_between(t0, t1)
        e_step = energy / n
        tokens = summary.get("tokens_per_s", 0.0) * summary.get("step_time_s", 0.0)
        samples = summary.get("samples_per_s", 0.0) * summary.get("step_time_s", 0.0)
        busy = self._host_busy_cores(spans, t0, t1)
        host_w = self.model.host_power_w(self.host_cores, busy)
        return {
            "energy_j_per_step": e_step,
            "avg_power_w": energy / window,
            "energy_per_token_j": e_step / tokens if tokens else 0.0,
            "energy_per_sample_j": e_step / samples if samples else 0.0,
            "host_avg_power_w": float(host_w),
            "host_energy_j_per_step": float(host_w * window / n),
            "avg_sm_clock_mhz": self._avg_clock(counters, t0, t1),
            "clock_switches": self.ctl.switches,
            "power_limit_w": self.power_limit_w,
            "dvfs_policy": self.kind,
            "power_model": self.model.name,
        }

    # -- internals ------------------------------------------------------------------------------
    def _activity(self, op) -> Activity | None:
        """The op's activity at the current clocks (cached: ops repeat every step)."""
        key = (op.id, self.state.sm_clock_mhz, self.state.mem_clock_mhz)
        hit = self._activity_cache.get(key, _MISSING)
        if hit is _MISSING:
            hit = self._activity_cache[key] = self._activity_uncached(op)
        return hit

    def _activity_uncached(self, op) -> Activity | None:
        if op.meta and "fused" in op.meta:  # a layer-fidelity block: its parts' time-weighted mean activity
            c, m, d = self.sys.cost.fused_s(op, self.state)
            return Activity(compute=c / d, memory=m / d) if d > 0 else Activity(kernel=True)
        if op.kind in _KERNEL_KINDS and op.fixed_duration_s is None:
            c, m, f = self.sys.cost.split_s(op)
            c *= self.gpu.max_sm_clock_mhz / self.state.sm_clock_mhz
            if self.gpu.mem_clock_mhz:
                m *= self.gpu.mem_clock_mhz / self.state.mem_clock_mhz
            return activity_of_kernel(c, m, f)
        if op.kind in _KERNEL_KINDS:
            return Activity(compute=0.5, memory=0.5)
        if op.kind == OpKind.MEMCPY_D2D:
            return Activity(memory=1.0)
        if op.kind in _COPY_KINDS:
            return Activity(copy=1.0, kernel=False)
        return None

    def _power(self) -> float:
        """Board power of the running ops at the current clocks (cached by running op set)."""
        key = (tuple(self._ids), self.state.sm_clock_mhz, self.state.mem_clock_mhz)
        p = self._power_cache.get(key)
        if p is None:
            p = self._power_cache[key] = self.model.power_of(self.active.values(), self.state.sm_clock_mhz,
                                                              self.state.mem_clock_mhz)
        return p

    def _update(self) -> None:
        self._flush()
        self._set_level(self.env.now, self._power())

    def _set_level(self, t: float, p: float) -> None:
        """Power becomes ``p`` at ``t``: ledger, counter, and a sleeping firmware wakes if it may bind."""
        prev, cap = self.ledger.p[-1], self.power_limit_w
        if self.ledger.set(t, p):
            self._count(t, "power_w", p)
            if cap is None:
                return
            if prev > cap >= p:
                self._over_end_t = t
            elif p > cap and self._fw_sleep is not None:
                ev, self._fw_sleep = self._fw_sleep, None
                ev.succeed(t)

    def _count(self, t: float, metric: str, value: float) -> None:
        if self.rec is not None:
            self.rec.counter(t, "gpu0", metric, float(value))

    def _clock_changed(self, now: float, mhz: float) -> None:
        self._count(now, "sm_clock_mhz", mhz)
        self._update()

    def _firmware(self, cap: float, k0: int = 1):
        """Power-limit loop: every period, compare the windowed average power with the cap.

        The limit is the firmware's, so it binds over any clock policy: a locked or planned clock is
        only the upper bound, and the effective clock is ``min(target, limit)`` (NVIDIA NVML API
        reference, *NvmlClocksThrottleReasons*: ``SwPowerCap`` = "SW Power Scaling algorithm is
        reducing the clocks below requested clocks because the GPU is consuming too much power";
        nvidia-smi reports it as "SW Power Cap" under Clocks Throttle Reasons). When power allows, the
        limit climbs back to the highest clock, so the GPU returns to the requested clock.

        Evaluations happen on the grid ``t0 + k * period``. While the limit cannot bind (clock not
        limited, current level and every level in the last window at or below the cap) the loop
        sleeps until a level above the cap appears; the evaluations it skips would have done nothing,
        so the result equals ticking every period (up to the float rounding of the grid times).
        """
        env, ctl = self.env, self.ctl
        fmax, t0, period = self.fmax_mhz, self._fw_t0, self.period_s
        k = k0 - 1  # the first evaluation: tick k0 (1 from the start; later when switched online mid-run)
        while True:
            k += 1
            t_next = t0 + k * period
            if t_next > env.now:
                yield env.timeout(t_next - env.now)
            self.firmware_ticks += 1
            if ctl.pending:  # wait until the last change has landed before judging again
                continue
            now = env.now
            self._flush()
            avg = self.ledger.average_w(max(0.0, now - self.window_s), now)
            if avg <= 0:
                continue
            if avg > cap:
                cur = min(ctl.limit_mhz, self.state.sm_clock_mhz)
                ratio = max(0.85, (cap / avg) ** 0.5)
                ctl.set_limit(ratio_step(cur, ratio, self.supported))
            elif avg < cap * (1 - _HYSTERESIS) and ctl.limit_mhz < fmax:
                ratio = min(1.05, (cap / avg) ** 0.5)
                ctl.set_limit(min(fmax, ratio_step(ctl.limit_mhz, ratio, self.supported + (fmax,))))
            elif ctl.limit_mhz >= fmax and self._quiet_since(now - self.window_s):
                # cannot bind until the power rises above the cap: sleep until it does
                self._fw_sleep = env.event()
                t_rise = yield self._fw_sleep
                k = max(k, int((max(t_rise, env.now) - t0) // period))

    def _quiet_since(self, t: float) -> bool:
        """Whether the power has been at or below the cap since ``t`` and still is (deferred level included)."""
        cap = self.power_limit_w
        return self.ledger.p[-1] <= cap and self._power() <= cap and self._over_end_t <= t

    def _host_busy_cores(self, spans, t0: float, t1: float) -> float:
        """Average busy host cores: the eager launch thread (1 core) plus host ops (all cores) and workers."""
        window = max(t1 - t0, 1e-12)
        busy = 1.0
        if spans is not None and len(spans):
            s = spans[(spans.end_s > t0) & (spans.start_s < t1)]
            dur = (s.end_s.clip(upper=t1) - s.start_s.clip(lower=t0))
            host_ops = dur[(s.stream == "host") & (s.kind == "host")].sum()
            codes, names = pd.factorize(s.stream)
            is_worker = np.array([str(n).startswith(("dataloader", "worker")) for n in names], dtype=bool)
            workers = dur[is_worker[codes] if len(names) else np.zeros(len(s), dtype=bool)].sum()
            busy += (self.host_cores - 1) * host_ops / window + workers / window
        return min(busy, float(self.host_cores))

    def _avg_clock(self, counters, t0: float, t1: float) -> float:
        if counters is None or not len(counters):
            return float(self.state.sm_clock_mhz)
        c = counters[(counters.scope == "gpu0") & (counters.metric == "sm_clock_mhz")]
        if not len(c):
            return float(self.state.sm_clock_mhz)
        ts, vs = list(c.t_s) + [t1], list(c.value)
        total = 0.0
        for i, v in enumerate(vs):
            a, b = max(ts[i], t0), min(ts[i + 1], t1)
            if b > a:
                total += v * (b - a)
        return total / (t1 - t0) if t1 > t0 else float(vs[-1])
