"""DVFS clock policies and the runtime component that puts the GPU's power parts together.

One runtime component, ``dvfs``, attaches to every run (every summary has energy). It composes three
parts with one job each:

* the power meter (``power_meter.PowerMeter``): board power from the ops running at each instant, at the
  current clocks (``hardware_models.power``);
* the energy ledger (``power_ledger.PowerLedger``): the power levels, their integral and the ``power_w``
  counters;
* the power-limit firmware (``power_firmware.PowerLimitFirmware``): the clock decisions of the board power
  limit, created only where the limit can bind (the board's default limit too, as on a real GPU);

plus the clock policy of a ``dvfs`` section (below), created only when there is one, and the GPU's
``ClockController``. When nothing but the firmware could change the clock (no ``dvfs``
section, or ``locked_clock`` / ``power_cap`` without an explicit ``power_limit_w``) nothing runs per
op: the power is computed from the recorded spans after the run (``DvfsRuntime.finish``), and if
the firmware would have lowered the clock at one of its evaluations the run is repeated with the
power metered per op, so the result is exact either way. A multi-rank run of at least ``WATCH_MIN_OPS`` ops
whose stages are each below it (the layer-fidelity pipeline stages) starts with the power metered per op where
a bound cannot rule the limit out (``DvfsRuntime.may_repeat``): the run the check would repeat, simulated once. The scenario's ``dvfs.kind`` picks a clock policy from
``DVFS_POLICIES``:

* ``locked_clock`` — ``nvidia-smi -lgc F``: the SM clock is set to ``F`` before the job (a clock
  the GPU does not support is snapped to the nearest supported one, with a warning, as the driver
  rounds too). A ``power_limit_w`` given with it (or with ``phase_plan``) still binds: the
  firmware lowers the clock below the requested one while the power is above the limit, as on a
  real board, and returns to it when the power allows (``power_firmware``).
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

from collections.abc import Callable

import numpy as np
import pandas as pd

from hardware_models.power import ClockController, nearest_clock, snap_clock
from simulator.config.sections.dvfs import DEFAULT_SWITCH_LATENCY_S
from simulator.graph.ops import OpKind
from simulator.policies._columns import value_masks
from simulator.policies.dvfs_notes import settings_without_effect
from simulator.policies.power_firmware import HYSTERESIS, PowerLimitFirmware, window_over
from simulator.policies.power_ledger import SCOPE, PowerLedger
from simulator.policies.power_meter import KERNEL_KINDS, PowerMeter, generic_model_note, power_model_for
from simulator.policies.registry import PolicyError, register_runtime

#: DVFS clock policies by ``dvfs.kind``.
DVFS_POLICIES: dict[str, type] = {}

#: Ops per step from which an offline-metered run whose power limit may bind is watched during the run
#: (``PowerLimitFirmware.watch``: switches to per-op metering where the limit first binds, never repeats the
#: run) rather than checked after it (``finish``: repeats the run with per-op metering if the limit bound). Both
#: are exact; the watch costs ~13% of a small run (gpt_184m_b16: 1,728 ops) and saves a second simulation of a
#: large one (the 175B scale scenario's stages: ~52k ops), so small graphs take the after-run check.
WATCH_MIN_OPS = 20_000


def _cpu_step_threads(cfg, hw) -> int:
    """Intra-op threads of this rank's CPU optimizer step (``offload_optimizer.cpu_threads`` for the run's offload
    mode and the ranks sharing its host); 1 without a config."""
    if cfg is None:
        return 1
    # imported here: a module-level import would register the offload components before dvfs's neighbours in
    # simulator.policies' import order, and so reorder every offload run's summary keys
    from simulator.policies.offload_optimizer import cpu_threads, offload_ranks

    z = cfg.zero_optimization
    mode = z.offload_mode if z.offload_optimizer.device != "none" else "overlap"  # the effective mode
    return cpu_threads(hw, mode, offload_ranks(hw))


def requested_clock_mhz(clock_mhz: float, gpu, key: str, warn: bool = True) -> float:
    """The supported SM clock for a requested ``clock_mhz`` of ``gpu``, MHz.

    A clock between the lowest and highest supported clocks snaps to the nearest one, with a
    warning unless ``warn`` is false (``nvidia-smi -lgc`` rounds likewise); one outside that range is refused,
    since snapping would quietly run a typo (14100 for 1410 MHz) at the maximum clock.

    Raises:
        PolicyError: ``clock_mhz`` below the lowest or above the highest supported clock (without a
            list: above ``max_sm_clock_mhz``), naming ``key`` and the allowed range.
    """
    sup = gpu.supported_sm_clocks_mhz
    lo, hi = (min(sup), max(sup)) if sup else (0.0, gpu.max_sm_clock_mhz)
    if not lo <= clock_mhz <= hi:
        raise PolicyError(f"{key}: {clock_mhz:g} MHz is outside the SM clocks of {gpu.name} "
                          f"(allowed: {lo:g}-{hi:g} MHz)")
    return snap_clock(clock_mhz, sup, key) if warn else (nearest_clock(clock_mhz, sup) if sup else float(clock_mhz))


def register_dvfs(kind: str) -> Callable[[type], type]:
    """Class decorator: register a DVFS clock policy under ``dvfs.kind``."""

    def deco(cls: type) -> type:
        DVFS_POLICIES[kind] = cls
        return cls

    return deco


@register_dvfs("locked_clock")
class LockedClock:
    """Fixed SM clock (``nvidia-smi -lgc``)."""

    #: the policy does nothing per op (the clock is set once, before the job)
    per_op = False

    def __init__(self, dcfg, gpu, ctl: ClockController):
        # a snapped clock is the run's warning (api.run_warnings), not a second one here
        self.clock_mhz = requested_clock_mhz(dcfg.locked_clocks_mhz, gpu, "dvfs.locked_clocks_mhz", warn=False)
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
    return None if cap is None else settable_power_limit_w(cap, gpu, "dvfs.power_limit_w")


def settable_power_limit_w(cap_w: float, gpu, key: str) -> float:
    """``cap_w`` (W) as a float when ``gpu``'s board can be set to it (``nvidia-smi -pl``; a board without a
    ``max_power_limit_w`` takes any).

    Raises:
        PolicyError: outside ``[min_power_limit_w, max_power_limit_w]``, naming ``key`` (the scenario key or the
            command-line flag that gave it) and the range.
    """
    lo, hi = gpu.min_power_limit_w, gpu.max_power_limit_w
    if hi and not lo <= cap_w <= hi:
        raise PolicyError(f"{key} {cap_w:g} W is outside the settable range of {gpu.name}: {lo:g}-{hi:g} W")
    return float(cap_w)


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
        self.plan = {ph: requested_clock_mhz(mhz, gpu, f"dvfs.phase_clocks_mhz.{ph}", warn=False)  # as above
                     for ph, mhz in dcfg.phase_clocks_mhz.items()}
        self.default = gpu.max_sm_clock_mhz

    def on_op_start(self, op, ctl: ClockController) -> None:
        if op.kind not in KERNEL_KINDS and op.kind != OpKind.MEMCPY_D2D:
            return
        want = self.plan.get(op.phase.value, self.default)
        if want != ctl.target_mhz:
            ctl.set_target(want)


#: how ``DvfsRuntime.warnings`` starts its line (a study that keeps only its rows' figures picks these out)
LIMIT_NOT_HELD = "dvfs: power limit"
#: in a ``LIMIT_NOT_HELD`` warning: the firmware had not settled (the figures are of its transient, not of the cap)
LIMIT_UNSETTLED = "while the firmware was still lowering the clock"


@register_runtime("dvfs")
class DvfsRuntime:
    """The GPU's power parts in one run: meter, ledger, firmware (where the limit can bind) and clock policy (with
    a ``dvfs`` section); meters per op (``online``) or from the spans after the run (module docstring).

    Attributes:
        meter, ledger, ctl: ``PowerMeter``, ``PowerLedger``, ``ClockController``.
        firmware: ``PowerLimitFirmware``, or None where the limit cannot bind.
        policy: The ``dvfs.kind`` clock policy, or None without a ``dvfs`` section.
        online: Metered per op during the run (True) or from the spans afterwards (``finish``).
        switched_at_s: When an offline-metered run switched to per-op metering (``PowerLimitFirmware.watch``);
            None: it did not.
    """

    @staticmethod
    def applies(cfg) -> bool:
        return True

    def __init__(self, cfg, hw, env, system):
        self.cfg, self.env, self.sys = cfg, env, system
        self.gpu = gpu = hw.gpu
        self.host_cores = hw.host_cpu.cores
        self.cpu_step_threads = _cpu_step_threads(cfg, hw)
        self.model = power_model_for(cfg, gpu)
        self.rec = getattr(system, "recorder", None)
        self.state = system.state
        dcfg = cfg.dvfs if cfg is not None else None
        latency = dcfg.clock_switch_latency_s if dcfg is not None else DEFAULT_SWITCH_LATENCY_S
        self.ctl = ClockController(env, self.state, gpu.max_sm_clock_mhz, latency, self._clock_changed)
        self.supported = tuple(gpu.supported_sm_clocks_mhz) or (gpu.max_sm_clock_mhz,)
        self.kind = dcfg.kind if dcfg is not None else "default"
        self.period_s = dcfg.power_sample_period_s if dcfg is not None else 0.01
        self.window_s = dcfg.power_window_s if dcfg is not None else 0.02
        self.fmax_mhz = float(max(max(self.supported), gpu.max_sm_clock_mhz))
        self._fw_t0 = env.now  # the firmware's evaluation grid starts here
        self.meter = PowerMeter(self.model, gpu, self.state, system.cost, system.price_keys, system.collective_s)
        self.ledger = PowerLedger(env, self.rec, self.meter.power)
        # the power limit binds whatever the clock policy (nvidia-smi -pl over -lgc): see power_firmware
        cap = requested_power_limit_w(dcfg, gpu) or gpu.tdp_w or gpu.max_power_limit_w or None
        self.power_limit_w = cap
        self._can_bind = bool(cap and cap < self.max_reachable_power_w())
        self.firmware = (PowerLimitFirmware(env, self.ctl, self.ledger, self.meter, self.state, cap, self.supported,
                                            self.fmax_mhz, self.period_s, self.window_s, self._quiet_since)
                         if self._can_bind else None)
        self.policy = DVFS_POLICIES[dcfg.kind](dcfg, gpu, self.ctl) if dcfg is not None else None
        self.switched_at_s = None
        self.ledger.update()
        self.ledger.count(env.now, "sm_clock_mhz", self.state.sm_clock_mhz)
        self.ledger.count(env.now, "power_w", self.ledger.p[-1])
        self.online = bool(getattr(system, "exact_power", False)
                           or (self.policy is not None and getattr(self.policy, "per_op", True))
                           or (dcfg is not None and dcfg.power_limit_w is not None)
                           or self.ctl.limit_mhz < self.fmax_mhz)
        if self._can_bind and self.online:
            env.process(self.firmware.run())
        elif self._can_bind and self.rec is not None and hasattr(system, "executor"):
            system.watch_min_ops = WATCH_MIN_OPS  # the executor keeps its running-op table for graphs this large
            env.process(self.firmware.watch(system, self.rec, self._go_online))

    def may_repeat(self, graph, run_ops: int) -> bool:
        """Whether this offline-metered rank of a run of ``run_ops`` ops per step (every rank in the environment)
        could make ``finish`` ask for a repeat, in a run large enough that starting exact costs less.

        True when the rank is metered from the spans afterwards, is not watched (``PowerLimitFirmware.watch``: a
        graph of fewer than ``WATCH_MIN_OPS`` ops), the whole run has at least ``WATCH_MIN_OPS`` ops, and the
        limit is not ruled out by the bound the watch uses first: idle power plus each stream's largest op excess
        (the power above idle is subadditive over the running ops, one op per stream) above the limit. The
        caller then runs every rank with per-op metering from the start (``System.exact_power``), which is the
        run ``finish`` would otherwise ask to repeat: the same result, one simulation instead of two. False: the
        after-run check stays (exact too).
        """
        if self.online or not self._can_bind or run_ops < WATCH_MIN_OPS or len(graph.ops) >= WATCH_MIN_OPS:
            return False
        device = (op for op in graph.ops if op.stream != "host")  # as the watch's bound: ``Executor.by_stream``
        limit = self.power_limit_w * (1.0 - 1e-9)
        return self.ledger.p[0] + self.meter.excess_bound_w(device, None, limit, self.ledger.p[0]) > limit

    def max_reachable_power_w(self) -> float:
        """Highest board power the model can draw: every unit fully busy at the highest clock, W."""
        return self.meter.max_reachable_power_w(self.fmax_mhz)

    @property
    def firmware_ticks(self) -> int:
        """Firmware evaluations that ran (0 without a firmware; the loop sleeps while the limit cannot bind)."""
        return self.firmware.ticks if self.firmware is not None else 0

    def _quiet_since(self, t: float) -> bool:
        """May the firmware loop sleep at ``t`` (``PowerLimitFirmware.quiet_since``; tests replace it to compare
        the sleeping loop with one evaluating every period)."""
        return self.firmware.quiet_since(t)

    def _levels(self, spans):
        """``PowerMeter.levels`` of ``spans``."""
        return self.meter.levels(spans)

    def _window_over(self, T, P, E, t_end: float, cap: float) -> bool:
        """``power_firmware.window_over`` on this run's evaluation grid."""
        return window_over(T, P, E, t_end, cap, self._fw_t0, self.period_s, self.window_s)

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
        # the clock's samples (``_avg_clock``): complete, as only the run changes the clock
        self._clock_samples = recorder.samples(SCOPE, "sm_clock_mhz")
        if self.online:
            return True
        self.ledger.record_levels(self.meter.levels(recorder._spans, recorder.span_columns()))
        return not (self._can_bind and self.firmware.would_act(self.env.now))

    def _go_online(self, running, k: int, pricing=None) -> None:
        """Switch an offline-metered run to online metering now (``PowerLimitFirmware.watch``): ledger and counters
        from the spans so far (levels before now), the running ops active, hooks on, firmware from tick ``k``
        (``pricing``: the graph's ``power_spans.SpanPricing`` at the clocks so far, for ``PowerMeter.levels``)."""
        now = self.env.now
        lv = self.meter.levels(list(self.rec._spans) + running, pricing=pricing)
        if lv is not None:
            times, power, _ = lv
            keep = times < now
            self.ledger.append_levels(times[keep], power[keep])
        self.firmware.resume()
        for st, op, start, _, _ in sorted(running, key=lambda r: r[2]):
            act = self.meter.activity(op)
            if act is not None:
                self.meter.add(op, st, act)
        self.online = True
        self.switched_at_s = now
        self.sys.executor.add_hook(self)
        self.ledger.update()
        self.env.process(self.firmware.run(k))

    def on_op_start(self, op, step, system) -> None:
        if self.policy is not None:
            self.policy.on_op_start(op, self.ctl)
        act = self.meter.activity(op)
        if act is not None:
            self.ledger.flush()
            self.meter.add(op, step, act)
            self.ledger.update()

    def on_op_end(self, op, step, system) -> None:
        # Deferred: when the stream's next op starts at the same instant (the common case), the
        # idle level in between lasts zero time and is never computed (``PowerLedger.flush``).
        if self.meter.is_running(op, step):
            self.ledger.flush()  # a level deferred from an earlier instant lasted until now, with this op running
            self.meter.remove(op, step)
            self.ledger.defer()

    def _clock_changed(self, now: float, mhz: float) -> None:
        self.ledger.count(now, "sm_clock_mhz", mhz)
        self.ledger.update()

    def summarize(self, spans=None, steps=None, counters=None, summary=None) -> dict:
        """GPU energy and power over the measured steps, host estimate, clock statistics."""
        summary = summary or {}
        self.ledger.update()  # commit any deferred level change
        warmup = steps["warmup"].to_numpy(bool)
        n = max(int((~warmup).sum()), 1)
        w = int(warmup.sum())
        ends = steps["end_s"].to_numpy()
        t0 = float(ends[w - 1]) if w > 0 else float(steps["start_s"].to_numpy()[0])
        t1 = float(ends[-1])
        window = max(t1 - t0, 1e-12)
        energy = self.ledger.energy_between(t0, t1)
        e_step = energy / n
        tokens = summary.get("tokens_per_s", 0.0) * summary.get("step_time_s", 0.0)
        samples = summary.get("samples_per_s", 0.0) * summary.get("step_time_s", 0.0)
        busy = self._host_busy_cores(spans, t0, t1)
        host_w = self.model.host_power_w(self.host_cores, busy)
        self.measured_avg_power_w = energy / window
        self.short_phases = self._phases_shorter_than_switch(spans, steps) if self.kind == "phase_plan" else []
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

    def warnings(self) -> list[str]:
        """What the summary's power figures do not hold (call after ``summarize``): a power limit the measured
        steps' average power exceeds by more than the firmware's dead band (``power_firmware.HYSTERESIS``).

        A settled firmware keeps the windowed average at or below the limit (it lowers the clock whenever an
        evaluation finds it above), so a measured average above it means either that the firmware was still
        stepping the clock down during the measured steps (a run too short for the loop to settle: step time,
        energy and power are of that transient, not of the capped steady state), or that the lowest supported
        clock still draws more than the limit. Empty when the limit holds or cannot bind. Also the ``dvfs`` settings
        that changed nothing (``dvfs_notes.settings_without_effect``: a limit that never bound, a lock at the
        maximum clock), and first, where the power model is the unfitted generic one, that its energy and power rest on
        the datasheet TDP and assumptions (``power_meter.generic_model_note``)."""
        generic = generic_model_note(self.model, self.gpu)
        short = ([generic] if generic else []) + list(getattr(self, "short_phases", [])) + settings_without_effect(self)
        cap, avg = self.power_limit_w, getattr(self, "measured_avg_power_w", None)
        if self.firmware is None or avg is None or avg <= cap * (1.0 + HYSTERESIS):
            return short
        floor = min(self.supported)
        if self.ctl.limit_mhz <= floor:
            return short + [f"{LIMIT_NOT_HELD} {cap:g} W not held: the measured steps average {avg:.0f} W at the "
                            f"lowest supported clock ({floor:g} MHz), which the modelled firmware cannot go below"]
        return short + [f"{LIMIT_NOT_HELD} {cap:g} W not held: the measured steps average {avg:.0f} W "
                        f"{LIMIT_UNSETTLED} "
                f"(now {self.ctl.limit_mhz:g} MHz; at most one step per "
                f"{self.period_s * 1e3:g} ms evaluation of the {self.window_s * 1e3:g} ms average power), so step "
                f"time, energy and power are of that transient, not of the capped steady state: measure later steps "
                f"(raise run.warmup_steps and run.steps)"]

    def _phases_shorter_than_switch(self, spans, steps) -> list[str]:
        """One line per ``phase_clocks_mhz`` phase whose GPU work (the ops that request the plan's clock:
        ``PhaseClockPlan.on_op_start``), first start to last end, lasts less than ``clock_switch_latency_s`` in
        every measured step while its clock differs from another phase's: the request made when it starts is
        still pending when the next phase asks for its own clock, so the planned clock never takes effect."""
        plan = getattr(self.policy, "plan", None)
        latency = self.ctl.latency_s
        if not plan or spans is None or not len(spans) or not latency:
            return []
        gpu = spans[spans["kind"].isin([k.value for k in (*KERNEL_KINDS, OpKind.MEMCPY_D2D)])
                    & spans["step"].isin(steps["step"][~steps["warmup"]])]
        default = getattr(self.policy, "default", self.fmax_mhz)
        in_run = {str(ph): plan.get(str(ph), default) for ph in gpu.phase.unique()}
        out = []
        for ph, mhz in sorted(plan.items()):
            rows = gpu[gpu.phase == ph]
            if not len(rows) or all(c == mhz for c in in_run.values()):
                continue
            longest = float((rows.groupby("step").end_s.max() - rows.groupby("step").start_s.min()).max())
            if longest < latency:
                out.append(f"dvfs.phase_clocks_mhz.{ph} {mhz:g} MHz cannot take effect: the {ph} phase's GPU work "
                           f"lasts {longest * 1e3:.3g} ms per step, shorter than dvfs.clock_switch_latency_s "
                           f"{latency * 1e3:g} ms, so the next phase's clock is requested before it applies "
                           f"(the {ph} phase runs at the clock before it)")
        return out

    def _host_busy_cores(self, spans, t0: float, t1: float) -> float:
        """Average busy host cores over ``[t0, t1]``, capped by the host's cores: the training thread (1 core, the
        eager launch loop), plus the extra threads of each CPU-step op (``cpu.*``, host kind) while it runs, plus
        one core per dataloader worker while it loads.

        A CPU-step op runs on ``cpu_step_threads`` intra-op threads (``offload_optimizer.cpu_threads``: the host's
        ``threads``, or its per-rank share): on the ``host`` stream the training thread is one of them (PyTorch's
        intra-op pool runs ``at::parallel_for`` chunks on the calling thread too), so it adds ``threads - 1``; on
        its own stream (delayed_param_update's ``cpu.adam`` thread) it adds ``threads``. Other host ops (the
        training thread's own work: page faults, syncs) add nothing beyond its core. (Was ``cores - 1`` for every
        host op whatever the thread count: threads=1 read 87.0 W on the offload scenario, more than 16 threads.)
        """
        window = max(t1 - t0, 1e-12)
        busy = 1.0
        if spans is not None and len(spans):
            start, end = spans["start_s"].to_numpy(float), spans["end_s"].to_numpy(float)
            sel = (end > t0) & (start < t1)
            dur = np.minimum(end[sel], t1) - np.maximum(start[sel], t0)
            stream, kind = spans["stream"].to_numpy(object)[sel], spans["kind"].to_numpy(object)[sel]
            (cpu_name,) = value_masks(spans["name"].to_numpy(object)[sel], (lambda n: n.startswith("cpu."),))
            cpu_step = (kind == "host") & cpu_name
            t = float(self.cpu_step_threads)
            on_host = dur[cpu_step & (stream == "host")].sum()  # the training thread is one of the t threads
            beside = dur[cpu_step & (stream != "host")].sum()  # DPU's worker thread: t threads of its own
            codes, names = pd.factorize(stream)
            is_worker = np.array([str(n).startswith(("dataloader", "worker")) for n in names], dtype=bool)
            workers = dur[is_worker[codes] if len(names) else np.zeros(len(dur), dtype=bool)].sum()
            busy += (t - 1.0) * on_host / window + t * beside / window + workers / window
        return min(busy, float(self.host_cores))

    def _avg_clock(self, counters, t0: float, t1: float) -> float:
        """Time-weighted mean SM clock over ``[t0, t1]``, MHz: from the clock's samples taken in ``finish`` (the
        ``sm_clock_mhz`` rows of the counters frame, in its order), else from ``counters`` (a frame)."""
        samples = getattr(self, "_clock_samples", None)
        if samples is not None:
            if not samples:
                return float(self.state.sm_clock_mhz)
            ts, vs = [float(t) for t, _ in samples] + [t1], [float(v) for _, v in samples]
        else:
            if counters is None or not len(counters):
                return float(self.state.sm_clock_mhz)
            sel = ((counters["metric"].to_numpy(object) == "sm_clock_mhz")
                   & (counters["scope"].to_numpy(object) == SCOPE))
            if not sel.any():
                return float(self.state.sm_clock_mhz)
            ts, vs = counters["t_s"].to_numpy()[sel].tolist() + [t1], counters["value"].to_numpy()[sel].tolist()
        total = 0.0
        for i, v in enumerate(vs):
            a, b = max(ts[i], t0), min(ts[i + 1], t1)
            if b > a:
                total += v * (b - a)
        return total / (t1 - t0) if t1 > t0 else float(vs[-1])
