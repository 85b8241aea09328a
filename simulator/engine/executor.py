"""Replay a step graph on the simulated machine with CUDA-stream semantics.

* Every stream is one SimPy process that runs its ops in graph order, one at a time.
* GPU kernels and copies marked ``launch`` are first *launched* by the host's main training
  thread (stream ``host``), which also runs the host ops in graph order: in eager PyTorch the
  same Python thread dispatches kernels, runs the CPU optimizer and waits on the DataLoader, so
  a GPU op cannot start before the host has reached it. Launching costs ``launch_overhead_s`` (by
  phase, ``launch_overhead_by_phase_s``); a phase's fixed host time (``host_phase_fixed_s``: the
  optimizer step's Python work) is paid once per step before that phase's first launch.
* An op starts when its stream is free, it has been launched, and its dependencies are done
  (``simpy.AllOf`` over their completion events).
* Collectives with ``meta["collective"]`` on a machine with a collective model take the NCCL
  model's time over their group (``System.collective_s``) on their own stream, overlapping
  compute; their host launch costs the profile's ``host_dispatch_s``. Unless
  ``nccl.interference`` is false, compute and collectives interfere (``System.run_kernel`` /
  ``System.run_collective``, ``simulator.cost.interference``): in-flight collectives take SMs and
  HBM bandwidth from the kernels beside them, and run slower while compute overlaps them; rates
  change whenever a kernel or collective starts or ends.
* Kernels take the cost model's time at the current clocks; host<->device copies are fluid flows
  over the PCIe links (max-min fair sharing with everything else on them), plus their ``host_s``
  (host work serial with the transfer: the page faults of a fresh pageable destination); host ops take
  ``host_s``; ``SYNC`` ops take no time (they wait for their dependencies).
* Ops naming a ``rendezvous`` (pipeline send/recv, cross-stage all-reduces) meet the same op of the
  other ranks' executors running in the same environment: each starts when the last party arrives;
  a pipeline call then moves over every party's links together and ends at the same time on all
  (``System.run_collective``). Collectives and copies are flows over the rank's links (NVLink port,
  NIC rail, PCIe), sharing them max-min fairly.
* A layer-fidelity block (``meta["fused"]``, ``simulator.policies.fidelity``) costs the host one launch
  per part, takes the sum of its parts' kernel times, and starts once its first part is launched and
  late enough not to end before its last part could have run after its own launch
  (``System.block_tail_s``): on a launch-bound stream the gaps between its kernels sit idle before it.
* Steps repeat: each stream moves on to the next step's ops when it finishes its own; an op may
  also wait for ops of the previous step (``meta["prev_step_deps"]``), which is how a delayed
  parameter update overlaps step i's CPU work with step i+1.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial
from itertools import chain

import simpy

from simulator.engine.memory import category
from simulator.engine.system import COPY_PATHS, System
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import Op, OpKind

HOST_STREAM = "host"
_INF = float("inf")
# enum members bound once: attribute access on an Enum class is a descriptor call (slow in hot loops)
_COMPUTE, _COLLECTIVE, _D2D, _HOST = OpKind.COMPUTE, OpKind.COLLECTIVE, OpKind.MEMCPY_D2D, OpKind.HOST
# how an op runs (``Executor._plan``)
_NOTHING, _FIXED, _KERNEL, _GENERIC, _IKERNEL, _IPLAIN, _COLL, _COPY = 0, 1, 2, 3, 4, 5, 6, 7


@dataclass
class StepTimes:
    """Start and end of each simulated step, seconds."""

    start_s: list[float]
    end_s: list[float]


class Executor:
    """Runs ``steps`` repetitions of ``graph`` on ``system``.

    Args:
        env: SimPy environment.
        system: Simulated machine.
        graph: Step graph.
        recorder: Span recorder.
        steps: Number of steps to run.
        hooks: Objects with optional ``on_op_start(op, step, system)``/``on_op_end(...)``
            methods (DVFS controllers, dataloaders).
        host_ops: Extra callables ``(op, step) -> generator`` that run special host ops
            (e.g. ``DATALOADER`` ops), keyed by op kind.
        rendezvous: ``engine.rendezvous.Rendezvous`` shared with other ranks' executors: an op whose
            ``meta`` names a ``rendezvous`` key (and its ``parties``) starts, once its dependencies are
            done, only when every party has reached the same key in the same step.
    """

    def __init__(self, env: simpy.Environment, system: System, graph: OpGraph, recorder, steps: int,
                 hooks=(), host_handlers=None, rendezvous=None):
        self.env, self.sys, self.g, self.rec, self.steps = env, system, graph, recorder, steps
        #: meeting points shared with the executors of the other ranks (``engine.rendezvous``); None: one rank
        self.rendezvous = rendezvous
        self.hooks = list(hooks)
        self._on_start = [h.on_op_start for h in self.hooks if hasattr(h, "on_op_start")]
        self._on_end = [h.on_op_end for h in self.hooks if hasattr(h, "on_op_end")]
        self.host_handlers = dict(host_handlers or {})
        n = len(graph.ops)
        # completion flags and lazily created events, by op id (an event exists only if someone waits)
        self.finished: list[list[bool]] = [[False] * n for _ in range(steps)]
        self._done_ev: list[list[simpy.Event | None]] = [[None] * n for _ in range(steps)]
        # host launch time of each launched op (None until the host thread reaches it)
        self.launch_time: list[list[float | None]] = [[None] * n for _ in range(steps)]
        self._launch_ev: list[list[simpy.Event | None]] = [[None] * n for _ in range(steps)]
        self.step_start = [0.0] * steps
        self.step_end = [0.0] * steps
        self._remaining_ops = [n] * steps
        # tensor bookkeeping (per graph; refcounts are re-armed per step): the users of each tensor, and per step the
        # users left of each, by its place in ``_users``
        self._users: dict[str, int] = dict(Counter(chain.from_iterable(op.uses for op in graph.ops)))
        self._refs: list[list[int]] = [list(self._users.values()) for _ in range(steps)]
        self.by_stream: dict[str, list[Op]] = defaultdict(list)
        for op in graph.ops:
            if op.stream != HOST_STREAM:
                self.by_stream[op.stream].append(op)
        self.host_ops = [op for op in graph.ops if op.stream == HOST_STREAM or op.launch]
        # per-op plans, fixed for the run (see ``_plan``): what running the op takes, its pools
        mem = system.memory
        write = {dev: pool.writer() for dev, pool in mem.items()}  # each pool's change log (``MemoryPool.writer``)
        gpu = write["gpu"]
        write_of = {t.name: write.get(t.device, gpu) for op in graph.ops for t in op.allocs}
        #: per op: ``(write, name, bytes, category)`` per tensor it allocates (``write``: its pool's ``MemoryPool.writer``);
        #: ``(place, write, name)`` per tensor it uses that some op allocates (``_finish``; ``place``: its refcount's in
        #: ``_refs[step]``, -1 for a tensor of one user, freed when that ends); ``(write, name)`` per tensor it
        #: allocates that no op uses (freed when it ends)
        self._allocs, self._use_plan, self._unused_plan = self._tensor_plans(graph.ops, write_of, self._users)
        self._mode, self._fixed = zip(*(self._plan(op) for op in graph.ops)) if graph.ops else ((), ())
        #: the interned pricing key (``System.price_keys``) of each op priced as a kernel on the fast paths, else None
        of = system.price_keys.of
        self._key = [of(op) if m == _KERNEL or m == _IPLAIN else None for op, m in zip(graph.ops, self._mode)]
        #: layer-fidelity blocks: op id -> parts (each launched by the host; the block may start after the first)
        self._blocks = {op.id: op.meta["launches"] for op in graph.ops if op.meta and "launches" in op.meta}
        self._early: dict[int, float] = {}  # block id -> host time from its first part's launch to its last's
        #: the op running on each stream now: ``stream -> (step, op, start_s)`` (a power meter that switches to
        #: per-op metering mid-run reads it, and sleeps on ``System.start_waiter`` until the next op starts:
        #: ``policies.power_firmware.PowerLimitFirmware.watch``)
        self.running: dict[str, tuple[int, Op, float]] = {}
        system.running = self.running
        system.executor = self
        #: ``recorder.span`` without a method call: ``self._span((step, op, start_s, end_s, stream))`` (``_finish``)
        self._span = recorder.span_writer()
        #: keep ``running`` (and fire ``start_waiter``) only when a runtime watches a graph this large
        self.track_running = system.track_running = len(graph.ops) >= system.watch_min_ops

    @staticmethod
    def _tensor_plans(ops, write_of: dict, users: dict) -> tuple[list, list, list]:
        """``(allocs, use_plan, unused_plan)`` of ``ops`` (see ``__init__``; ``write_of``: tensor name -> its pool's
        writer; ``users``: tensor name -> its users, in refcount order), one tuple per op (``()`` for none)."""
        empty = ()
        # per used tensor that some op allocates: its ``use_plan`` entry ``(place, write, name)`` (``place`` -1: a
        # tensor of one user), one tuple shared by its users' plans
        use_of = {nm: (i if n > 1 else -1, write_of[nm], nm) for i, (nm, n) in enumerate(users.items()) if nm in write_of}
        use_get = use_of.get
        unused = write_of.keys() - users.keys()  # tensors some op allocates and none uses
        allocs, use_plan, unused_plan = [], [], []
        for op in ops:
            a, u = op.allocs, op.uses
            if a:
                allocs.append(tuple([(write_of[t.name], t.name, t.nbytes, category(t.name)) for t in a]))
                unused_plan.append(tuple([(write_of[t.name], t.name) for t in a if t.name in unused]) if unused else empty)
            else:
                allocs.append(empty)
                unused_plan.append(empty)
            # (``filter(None, ...)`` drops the names no op allocates: ``use_get`` gives None for them)
            use_plan.append(tuple(filter(None, map(use_get, u))) if u else empty)
        return allocs, use_plan, unused_plan

    def add_hook(self, hook) -> None:
        """Call ``hook.on_op_start`` / ``on_op_end`` (where defined) from now on, for every op starting or
        ending after this call (an op running now gets only its ``on_op_end``)."""
        self.hooks.append(hook)
        if hasattr(hook, "on_op_start"):
            self._on_start.append(hook.on_op_start)
        if hasattr(hook, "on_op_end"):
            self._on_end.append(hook.on_op_end)

    def _plan(self, op: Op) -> tuple[int, float]:
        """How ``op`` runs: ``(_NOTHING, 0)`` takes no time, ``(_FIXED, s)`` one timeout of ``s``,
        ``(_KERNEL, 0)`` one timeout of its cost-model time at the current clocks
        (``System.kernel_s``), ``(_IKERNEL, 0)`` a compute kernel beside the collectives (``System.run_kernel``
        under interference), ``(_IPLAIN, 0)`` one without TP collectives folded in, which ``_stream`` runs itself up
        to its first change of rate, ``(_COLL, 0)`` a collective the NCCL model prices (``System.run_collective``),
        ``(_COPY, 0)`` a host<->device copy (``_stream`` runs ``_run``'s transfer itself), ``(_GENERIC, 0)`` the
        general path (``_run``). The fast plans are exactly what ``_run`` would do for the op."""
        inter = self.sys.interference is not None
        if op.fixed_duration_s is not None:
            if op.fixed_duration_s <= 0:
                return _NOTHING, 0.0
            return (_GENERIC, 0.0) if op.kind is _COMPUTE and inter else (_FIXED, op.fixed_duration_s)
        if op.kind is _COMPUTE:
            if not inter:
                return _KERNEL, 0.0
            plain = not op.folded_comm and not (op.meta and "side" in op.meta)  # ``Executor._stream`` runs it itself
            return (_IPLAIN, 0.0) if plain else (_IKERNEL, 0.0)
        if op.kind is _COLLECTIVE and self.sys.collective_model(op):
            return _COLL, 0.0
        if op.kind in COPY_PATHS:
            return _COPY, 0.0
        if op.kind is _COLLECTIVE or op.kind is _D2D or op.kind in self.host_handlers:
            return _GENERIC, 0.0
        if op.kind is _HOST:
            return (_FIXED, op.host_s) if op.host_s > 0 else (_NOTHING, 0.0)
        return _NOTHING, 0.0  # SYNC and DATALOADER without a handler take no time beyond their dependencies

    def start(self) -> simpy.Event:
        """Start all stream processes; returns an event that fires when the last step ends."""
        for t in self.g.persistent:
            pool = self.sys.memory.get(t.device, self.sys.memory["gpu"])
            pool.alloc(t.name, t.nbytes, self.env.now)
        procs = [self.env.process(self._host())]
        for stream, ops in self.by_stream.items():
            procs.append(self.env.process(self._stream(stream, ops)))
        return self.env.all_of(procs)

    # -- processes -------------------------------------------------------------------------
    def done_event(self, step: int, op_id: int) -> simpy.Event:
        """Event that fires when op ``op_id`` of ``step`` finishes (already triggered if it has)."""
        ev = self._done_ev[step][op_id]
        if ev is None:
            ev = self._done_ev[step][op_id] = self.env.event()
            if self.finished[step][op_id]:
                ev.succeed()
        return ev

    def _deps_event(self, op: Op, step: int) -> simpy.Event | None:
        """The event to wait on before ``op`` of ``step`` may start (None: its dependencies are done)."""
        fin = self.finished[step]
        evs = [self.done_event(step, d) for d in op.deps if not fin[d]]
        prev = op.meta.get("prev_step_deps") if op.meta else None
        if prev and step > 0:
            pfin = self.finished[step - 1]
            evs.extend(self.done_event(step - 1, d) for d in prev if not pfin[d])
        if len(evs) == 1:
            return evs[0]
        return self.env.all_of(evs) if evs else None

    def _wait(self, op: Op, step: int):
        ev = self._deps_event(op, step)
        if ev is not None:
            yield ev

    def _execute(self, op: Op, step: int, stream: str):
        """Wait for ``op``'s dependencies, run it and record it (the op has been launched)."""
        env = self.env
        ev = self._deps_event(op, step)
        if ev is not None:
            yield ev
        start = env.now
        if self.track_running:
            self.running[stream] = (step, op, start)
            if self.sys.start_waiter is not None:
                self.sys.start_waiter, ev = None, self.sys.start_waiter
                ev.succeed(start)
        self._begin(op, step)
        mode = self._mode[op.id]
        if mode == _KERNEL:
            yield env.timeout(self.sys.kernel_s(op))
        elif mode == _FIXED:
            yield env.timeout(self._fixed[op.id])
        elif mode >= _GENERIC:
            yield from self._run(op, step)
        self._finish(op, step, start, stream)

    def _host(self):
        """The main training thread: launches device ops in order and runs host ops.

        Launch times are computed arithmetically (the thread is busy ``launch_overhead_s`` per
        launch); the process only yields when it must wait (a host op, a sync, a dependency).
        """
        env = self.env
        default = self.sys.launch_overhead_s
        by_phase = self.sys.launch_overhead_by_phase_s
        cost = self.launch_cost_s = [by_phase.get(op.phase._value_, default) for op in self.g.ops]  # .value, no descriptor
        for op in self.g.ops:  # an NCCL call's host side is the collective profile's dispatch time
            if op.kind is _COLLECTIVE and self.sys.collective_model(op):
                cost[op.id] = self.sys.collective_dispatch_s
        self._per_launch = {}
        for oid, n in self._blocks.items():  # a block's host side: one launch per part (and folded TP call)
            self._per_launch[oid] = cost[oid]
            calls = len(self.g.ops[oid].folded_comm) * self.sys.collective_dispatch_s
            self._early[oid] = cost[oid] * (n - 1) + calls
            cost[oid] = cost[oid] * n + calls
        for phase, fixed in self.sys.host_phase_fixed_s.items():  # once per step, before the phase's first launch
            first = next((op for op in self.host_ops if op.stream != HOST_STREAM and op.phase._value_ == phase), None)
            if first is not None:
                cost[first.id] += fixed
        # the thread's work in order as runs of launches, each ``[(op id, host s)]``, then the host op after it
        # (None after the last run)
        runs, launches = [], []
        for op in self.host_ops:
            if op.stream != HOST_STREAM:
                launches.append((op.id, cost[op.id]))
            else:
                runs.append((launches, op))
                launches = []
        runs.append((launches, None))
        t = env.now
        for step in range(self.steps):
            self.step_start[step] = t
            lt, lev = self.launch_time[step], self._launch_ev[step]
            for launches, op in runs:
                for oid, c in launches:
                    t += c
                    lt[oid] = t
                    ev = lev[oid]
                    if ev is not None:
                        lev[oid] = None
                        ev.succeed()
                if op is None:
                    break
                if t > env.now:
                    yield env.timeout(t - env.now)
                yield from self._execute(op, step, HOST_STREAM)
                t = env.now

    def _stream_plan(self, ops: list[Op]) -> list[tuple]:
        """What ``_stream`` reads of each of its ops, one tuple per op in order: ``(op, id, launch, special, deps,
        allocs, mode, key, fixed_s, plain, uses, unused)`` (``special``: it meets other ranks or waits on the previous
        step, ``_deps_event``; ``plain``: it carries no TP collective, so ``_stream`` records its end itself, as
        ``_finish`` does; the rest as ``__init__`` and ``_plan``)."""
        mode, key, fixed, allocs, uses, unused = (self._mode, self._key, self._fixed, self._allocs, self._use_plan,
                                                  self._unused_plan)
        out = []
        for op in ops:
            i, meta = op.id, op.meta
            special = bool(meta) and ("rendezvous" in meta or "prev_step_deps" in meta)
            out.append((op, i, op.launch, special, op.deps, allocs[i], mode[i], key[i], fixed[i], not op.folded_comm,
                        uses[i], unused[i]))
        return out

    def _stream(self, stream: str, ops: list[Op]):
        env, sys = self.env, self.sys
        on_start, on_end, finish = self._on_start, self._on_end, self._finish
        early, running, track, span = self._early, self.running, self.track_running, self._span
        kernel_s, state, dur = sys.kernel_s, sys.state, sys._dur  # (``_clocks_changed`` empties ``_dur`` in place)
        run_kernel, ikernel_s, arm, disarm = sys.run_kernel, sys.interfered_kernel_s, sys.arm, sys.disarm
        kernel_begins, kernel_ends, run_collective = sys.kernel_begins, sys.kernel_ends, sys.run_collective
        queue = env._queue  # SimPy's event heap: ``(time, priority, id, event)`` (``_wait_s``)
        net, copy_cap = sys.network, {}  # copies: each (kind, pinned)'s rate cap (``Hardware.link_rate``)
        rem, step_end = self._remaining_ops, self.step_end
        plan = self._stream_plan(ops)
        #: the process was last resumed by an event only it waits on (its own timeout, launch event or wake), as the
        #: last callback of that event: it may move the clock itself (``_wait_s``)
        own = True
        for step in range(self.steps):
            lt, lev, fin = self.launch_time[step], self._launch_ev[step], self.finished[step]
            done_ev, refs = self._done_ev[step], self._refs[step]
            for op, oid, launch, special, deps, allocs, m, key, fixed, plain, uses, unused in plan:
                if launch:
                    when = lt[oid]
                    if when is None:
                        ev = lev[oid]
                        if ev is None:
                            ev = lev[oid] = env.event()
                        yield ev
                        own = True  # the launch event is this stream's own
                        when = lt[oid]
                    if early:  # a block may start once its first part is launched
                        when -= early.get(oid, 0.0)
                    now = env._now
                    if when > now:  # ``_wait_s``, inlined
                        d = when - now
                        if own and (not queue or queue[0][0] > now + d):
                            env._now = now + d
                        else:
                            yield env.timeout(d)
                            own = True
                # _execute, inlined (one generator less per op)
                if special:
                    meta = op.meta
                    ev = self._deps_event(op, step)
                    if ev is not None:
                        yield ev
                        own = False  # a completion event other streams may wait on too
                    if "rendezvous" in meta:  # the peers (other ranks' ops) must arrive too
                        yield self.rendezvous.arrive(meta["rendezvous"], step, meta["parties"])
                        own = False
                else:
                    for d in deps:
                        if not fin[d]:
                            yield self._deps_event(op, step)
                            own = False
                            break
                if early and oid in early:  # a block: it runs when its parts' launches let it run back to back
                    late = self._block_end_s(op, step) - env.now - kernel_s(op, key)
                    if late > 0:
                        if own and (not queue or queue[0][0] > env._now + late):
                            env._now += late
                        else:
                            yield env.timeout(late)
                            own = True
                start = env._now
                if track:
                    running[stream] = (step, op, start)
                    if sys.start_waiter is not None:
                        sys.start_waiter, ev = None, sys.start_waiter
                        ev.succeed(start)
                for write, name, nbytes, cat in allocs:  # _begin, inlined
                    write((start, name, nbytes, start, cat))
                for fn in on_start:
                    fn(op, step, sys)
                if m == _KERNEL or m == _FIXED:
                    if m == _FIXED:
                        d = fixed
                    elif state.sm_clock_mhz == sys._dur_sm and state.mem_clock_mhz == sys._dur_mem:
                        d = dur.get(key)  # ``System.kernel_s``'s cache, read inline
                        if d is None:
                            d = kernel_s(op, key)
                    else:
                        d = kernel_s(op, key)
                    if own and (not queue or queue[0][0] > start + d):  # ``_wait_s``, inlined
                        env._now = start + d
                    else:
                        yield env.timeout(d)
                        own = True
                elif m == _IPLAIN:  # ``System.run_kernel`` beside the collectives, inlined up to a change of rate
                    kernel_begins()
                    d = ikernel_s(op, key)
                    if d > 0:
                        if own and (not queue or queue[0][0] > start + d):  # nothing happens before it ends
                            env._now = start + d
                        else:
                            to, wake, fire, ev = arm(d, "_comm_changed")
                            yield wake
                            own = True  # (the wake is this stream's own)
                            if to.callbacks is None:  # it ended
                                disarm("_comm_changed", ev, fire)
                            else:  # a collective started or ended beside it: the rest at the new rates
                                yield from sys.progress(partial(ikernel_s, op, key), "_comm_changed",
                                                         min(1.0, (env._now - start) / d))
                                own = False
                    kernel_ends()
                elif m == _IKERNEL:
                    yield from run_kernel(op)
                    own = False  # (its last resume may be its own wake, or it took no time)
                elif m == _COLL:
                    yield from run_collective(op, step)
                    own = False
                elif m == _COPY:  # ``_run``'s copy, inlined: a lone flow that nothing can disturb moves at once
                    kind, pinned = op.kind, op.pinned
                    cap = copy_cap.get((kind, pinned))
                    if cap is None:
                        cap = copy_cap[kind, pinned] = sys.hw.link_rate(kind.value, pinned)[1]
                    links, nbytes, lat = sys.copy_links[kind], op.bytes_read, sys.copy_latency_s
                    moves = net.moves(nbytes, links, cap)
                    if lat > 0:  # ``transfer``'s latency (``_wait_s``, inlined)
                        if own and (not queue or queue[0][0] > env._now + lat):
                            env._now += lat
                        else:
                            yield env.timeout(lat)
                            own = True
                    if moves:  # a flow that ends first, before anything else is due, runs to its end at once
                        ev = net.move(nbytes, links, cap) if own else net.start(nbytes, links, cap or _INF).done
                        if ev is not None:
                            yield ev
                            own = True  # (its flow's end: this stream's own, ``FluidScheduler._wake``)
                    d = op.host_s
                    if d > 0:  # the copy's host work beyond the transfer (``_wait_s``, inlined)
                        if own and (not queue or queue[0][0] > env._now + d):
                            env._now += d
                        else:
                            yield env.timeout(d)
                            own = True
                elif m == _GENERIC:
                    yield from self._run(op, step)
                    own = False
                if not plain:
                    finish(op, step, start, stream)
                    continue
                # ``_finish``, inlined (an op without TP collectives folded in)
                now = env._now
                span((step, op, start, now, stream))
                if track:
                    del running[stream]
                if on_end:
                    for fn in on_end:
                        fn(op, step, sys)
                if uses:  # a tensor is freed when its last user ends (refcounts re-armed per step)
                    for i, write, name in uses:
                        if i >= 0:
                            n = refs[i] - 1
                            refs[i] = n
                            if n > 0:
                                continue
                        write((now, name, None, None, None))
                if unused:
                    for write, name in unused:
                        write((now, name, None, None, None))
                fin[oid] = True
                ev = done_ev[oid]
                if ev is not None:
                    ev.succeed()
                n = rem[step] - 1
                rem[step] = n
                if n == 0:
                    step_end[step] = now

    def _block_end_s(self, op: Op, step: int) -> float:
        """Earliest end of layer-fidelity block ``op`` allowed by its parts' host launches (``System.block_tail_s``
        from its first part's launch), s. The block waits, before it starts, until it can run its parts back to
        back and end then: the same end as its kernels would have, with the launch gaps idle before it."""
        oid = op.id
        first = self.launch_time[step][oid] - self._early[oid]
        return first + self.sys.block_tail_s(op, self._per_launch[oid])

    def _begin(self, op: Op, step: int) -> None:
        """``op`` starts now: allocate its tensors, call the start hooks."""
        now = self.env.now
        for write, name, nbytes, cat in self._allocs[op.id]:
            write((now, name, nbytes, now, cat))
        for fn in self._on_start:
            fn(op, step, self.sys)

    def _run(self, op: Op, step: int):
        """SimPy process body: the time ``op`` takes once started (``_begin``)."""
        env, sys = self.env, self.sys
        if op.fixed_duration_s is not None:
            if op.fixed_duration_s > 0:
                if op.kind is _COMPUTE:
                    yield from sys.run_kernel(op, op.fixed_duration_s)
                else:
                    yield env.timeout(op.fixed_duration_s)
        elif op.kind is _COMPUTE:
            yield from sys.run_kernel(op)
        elif op.kind in COPY_PATHS:
            bw, cap = sys.hw.link_rate(op.kind.value, op.pinned)
            yield from sys.network.transfer(op.bytes_read, sys.copy_links[op.kind], sys.copy_latency_s, cap)
            if op.host_s > 0:  # the copy's host work beyond the transfer (first touch of a fresh pageable buffer)
                yield env.timeout(op.host_s)
        elif op.kind is _COLLECTIVE and sys.collective_model(op):
            yield from sys.run_collective(op, step)
        elif op.kind is _COLLECTIVE or op.kind is _D2D:
            yield env.timeout(sys.cost.duration_s(op, sys.state) if op.kind is not _D2D
                              else op.bytes_moved / sys.cost.memory_bandwidth(op.cost_class))
        elif op.kind in self.host_handlers:
            yield from self.host_handlers[op.kind](op, step)
        elif op.kind is _HOST:
            if op.host_s > 0:
                yield env.timeout(op.host_s)
        # SYNC and DATALOADER without a handler take no time beyond their dependencies

    def _finish(self, op: Op, step: int, start: float, stream: str) -> None:
        now = self.env._now  # (``env.now`` without the property call)
        if op.folded_comm and "side" in op.meta:  # TP collectives beside its kernels (``System.side_timeline``)
            self._side_spans(op, step, start, now, stream)
        elif op.folded_comm:  # a block with TP collectives folded in: its kernels' span, then each collective's
            t = now - self.sys.folded_comm_s(op)
            self.rec.span(step, op, start, t, stream)
            for c in op.folded_comm:
                d = self.sys.collective_s(c)
                self.rec.span(step, c, t, t + d, c.stream)
                t += d
        else:
            self._span((step, op, start, now, stream))
        if self.track_running:
            del self.running[stream]
        if self._on_end:
            for fn in self._on_end:
                fn(op, step, self.sys)
        oid = op.id
        uses = self._use_plan[oid]
        if uses:  # a tensor is freed when its last user ends (refcounts re-armed per step)
            refs = self._refs[step]
            for i, write, name in uses:
                if i >= 0:
                    n = refs[i] - 1
                    refs[i] = n
                    if n > 0:
                        continue
                write((now, name, None, None, None))
        unused = self._unused_plan[oid]
        if unused:
            for write, name in unused:
                write((now, name, None, None, None))
        self.finished[step][oid] = True
        ev = self._done_ev[step][oid]
        if ev is not None:
            ev.succeed()
        rem = self._remaining_ops
        n = rem[step] - 1
        rem[step] = n
        if n == 0:
            self.step_end[step] = now

    def _side_spans(self, op: Op, step: int, start: float, now: float, stream: str) -> None:
        """Spans of a layer-fidelity block carrying TP collectives beside its kernels (``meta["side"]``) at their
        places in its timeline alone (``System.side_timeline``), stretched to the block's span: its kernels as one
        compute span per stretch between waits for a collective, each collective as a span of its stream. So the
        compute stream's busy time, each group's communication time, the exposed communication and what runs at
        once are the timeline's."""
        tl = self.sys.side_timeline(op, alone=True)
        rec = self.rec
        k = (now - start) / tl.end_s if tl.end_s > 0 else 0.0
        t = t0 = 0.0
        for run, wait in zip(tl.run_s, tl.wait_s):
            if wait > 0:
                if t > t0:
                    rec.span(step, op, start + k * t0, start + k * t, stream)
                t0 = t = t + wait
            t += run
        rec.span(step, op, start + k * t0, now if t >= tl.end_s else start + k * t, stream)
        for c, c0, d in zip(op.folded_comm, tl.comm_start_s, tl.comm_s):
            rec.span(step, c, start + k * c0, start + k * (c0 + d), c.stream)


