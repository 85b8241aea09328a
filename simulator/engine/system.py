"""The simulated machine: one GPU's compute and copy engines, its PCIe link, host CPU and memory.

``System`` instantiates the runtime objects the executor needs from the specs: the cost model,
the fluid network of links (PCIe per direction plus the shared duplex limit), memory pools
(HBM, pinned and pageable host memory) and the current device clocks.

It also holds the GPU's interference state (``simulator.cost.interference``): the collectives in
flight (the SMs and HBM traffic they take) and whether compute kernels are running. Kernels and
collectives progress at rates that follow that state (``run_kernel``, ``run_collective``): when
a collective starts or ends mid-kernel, the kernel's remaining work continues at the new rate,
and a collective runs ``1 + gamma`` times slower exactly while a compute kernel runs beside it.

Collectives are flows over the rank's own links (``collective_flows``, ``run_collective``): its GPU's
NVLink / NVSwitch port, its NIC's rail and its GPU's PCIe link (which GPUDirect traffic to the NIC and
the host copies share on HGX boards), in this rank's ``FluidNetwork``, so concurrent TP, DP,
pipeline and offload traffic of the rank share those links max-min fairly. Under rank folding
(symmetry) the representative rank's links stand for every folded peer's: a peer's port carries what
the representative's does at the same time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import simpy
from simpy.events import PENDING

from hardware_models.collective_flows import port_capacities, rank_loads
from hardware_models.fabrics import FluidNetwork
from hardware_models.fluid import maxmin_rates
from hardware_models.host_links import uplink_share
from hardware_models.machine import Hardware
from simulator.cost.base import DeviceState
from simulator.cost.interference import CommLoad, InterferenceFactors, comm_load, kernel_share
from simulator.cost.overlap import Timeline, overlap_timeline
from simulator.cost.roofline import RooflineCostModel
from simulator.engine.links import Fabric
from simulator.engine.memory import MemoryPool, Timelines
from simulator.graph.ops import OpKind, PriceKeys

#: Groups spanning pipeline stages (named by the op, not the machine): their rendezvous is one shared call of the
#: stages (``Fabric.join``) and each party loads only its own links.
_NAMED = ("pp", "mp", "world")

#: Links crossed by each copy direction.
COPY_PATHS = {
    OpKind.MEMCPY_H2D: ("pcie.h2d", "pcie.duplex"),
    OpKind.MEMCPY_D2H: ("pcie.d2h", "pcie.duplex"),
}

#: The PCIe switch uplink's links each copy direction also crosses when the uplink is shared (``uplink_links``)
UPLINK_PATHS = {
    OpKind.MEMCPY_H2D: ("pcie.uplink.h2d", "pcie.uplink.duplex"),
    OpKind.MEMCPY_D2H: ("pcie.uplink.d2h", "pcie.uplink.duplex"),
}


def uplink_links(up, copy) -> dict[str, float]:
    """This rank's share of its PCIe switch uplink per direction and both ways, bytes/s: ``up.share_of`` (an
    ``hardware_models.host_links.UplinkShare``) of the copy rates ``copy`` (``hw.copy``) reach alone."""
    return {"pcie.uplink.h2d": up.share_of(copy.h2d_bytes_per_s), "pcie.uplink.d2h": up.share_of(copy.d2h_bytes_per_s),
            "pcie.uplink.duplex": up.share_of(copy.duplex_bytes_per_s)}


def memory_counter_blocks(pools: list[tuple[str, Timelines]]) -> list[tuple]:
    """``System.memory_counter_parts`` of ``(pool name, its timelines)`` per pool (``memory.Timelines``), in order."""
    cols = [(name, tl.columns()) for name, tl in pools]
    parts = [(t, name, "memory_bytes", v) for name, ((t, v), _) in cols]
    names: dict[str, str] = {}
    for name, (_, (t, cats, v)) in cols:
        for c in set(cats).difference(names):
            names[c] = f"memory_bytes.{c}"
        parts.append((t, name, list(map(names.__getitem__, cats)), v))
    return parts


class _Wake(simpy.Event):
    """An event triggered by the first of the events it is a callback of (``fire``) to be processed."""

    def fire(self, _event) -> None:
        """Callback: trigger this event unless it has been already."""
        if self._value is PENDING:
            self.succeed()

    def fire_last(self, _event) -> None:
        """Callback, the last one of the event being processed: trigger this event unless it has been already,
        and when no other event is due at this instant (none in SimPy's heap at or before now) process it at
        once: what ``Environment.step`` would do next, without the heap push and pop (same order, same times)."""
        if self._value is not PENDING:
            return
        env = self.env
        queue = env._queue
        if queue and queue[0][0] <= env._now:
            self.succeed()
            return
        self._ok, self._value = True, None
        callbacks, self.callbacks = self.callbacks, None
        for callback in callbacks:
            callback(self)


class System:
    """Runtime objects of one simulated run.

    Args:
        env: SimPy environment.
        hw: Hardware specs.
        recorder: The run's recorder (runtime components record counters through it).
        fabric: The run's calls shared with the other simulated ranks (``engine.links.Fabric``); None: a
            fabric of this rank alone.
    """

    def memory_counters(self) -> tuple[list[float], list[str], list[str], list[int]]:
        """Memory timelines of all pools as counter columns ``(t_s, scope, metric, value)``: the rows of
        ``memory_counter_parts`` one block after another."""
        t_s: list = []
        scope: list = []
        metric: list = []
        value: list = []
        for t, sc, m, v in self.memory_counter_parts():
            t_s += t
            value += v
            scope += [sc] * len(t)
            metric += [m] * len(t) if isinstance(m, str) else m
        return t_s, scope, metric, value

    def memory_counter_parts(self) -> list[tuple]:
        """Memory timelines of all pools as counter blocks ``(t_s, scope, metric, value)`` (``Recorder.counters_frame``'s
        ``parts``): per pool ``(t_s, pool name, "memory_bytes", bytes)``, then per pool its tensor categories
        ``(t_s, pool name, ["memory_bytes.<category>", ...], bytes)`` (``memory.category``); ``t_s`` and bytes are
        the pools' own lists (read, don't modify)."""
        return memory_counter_blocks([(pool.name, pool.timelines()) for pool in self.memory.values()])

    def take_memory_counter_parts(self) -> Callable[[], list[tuple]]:
        """``memory_counter_parts`` of the changes so far, built when called (a run's counters frame, built when
        read: ``engine.run.run_ranks``); the pools' timelines are handed over (``MemoryPool.take_timelines``: they
        record afresh from now)."""
        return partial(memory_counter_blocks, [(pool.name, pool.take_timelines()) for pool in self.memory.values()])

    def __init__(self, env: simpy.Environment, hw: Hardware, recorder, fabric: Fabric | None = None):
        self.env = env
        self.hw = hw
        self.recorder = recorder
        #: runtime components meter power per op during the run (else they may from the spans afterwards)
        self.exact_power = False
        #: the executor running on this machine and its op running per stream (set by ``Executor``)
        self.executor = None
        self.running: dict = {}
        #: an event the executor fires (with the time) when the next op starts, then clears; None: nobody waits
        self.start_waiter: simpy.Event | None = None
        #: graphs of at least this many ops keep ``running`` up to date (a runtime that reads it sets it; inf: none)
        self.watch_min_ops = math.inf
        #: whether this run's executor keeps ``running`` (set by ``Executor``)
        self.track_running = False
        self.cost = RooflineCostModel(hw.gpu, hw.profile, hw.slowdown)
        self.fabric = fabric if fabric is not None else Fabric(env)
        c = hw.copy  # profile's measured rates > link preset (hardware_models.machine.resolve_copy_rates)
        links = {"pcie.h2d": c.h2d_bytes_per_s, "pcie.d2h": c.d2h_bytes_per_s, "pcie.duplex": c.duplex_bytes_per_s}
        #: global rank of this simulated (representative) rank
        self.rank = hw.pp_group[hw.pp_rank] if hw.pp_group else 0
        #: the cluster's topology (None: no cluster, or a collective model without one: no port links)
        self._topo = getattr(hw.collectives, "topo", None)
        if self._topo is not None:
            links.update(port_capacities(self._topo, self.rank))
        #: this rank's PCIe switch uplink shared with its folded peers behind the same switch (None: not shared)
        self.uplink = None
        copy_links = COPY_PATHS
        if self._topo is not None and hw.world_size > 1:
            stage = hw.world_size // max(1, len(hw.pp_group))  # Megatron tp-cp-ep-dp-pp order: pp outermost
            first = (self.rank // stage) * stage
            up = uplink_share(self._topo, self.rank, range(first, min(first + stage, hw.world_size)))
            if up is not None and up.sharers > 1:
                self.uplink = up
                links.update(uplink_links(up, c))
                copy_links = {k: v + UPLINK_PATHS[k] for k, v in COPY_PATHS.items()}
        #: this rank's links (``collective_flows.PORT_LINKS``): only its own flows cross them, so the solver
        #: works on one rank's flows at a time
        self.network = FluidNetwork(env, links)
        #: links crossed by each copy direction
        self.copy_links = copy_links
        self._flows: dict[tuple, tuple[list, float]] = {}
        #: ``run_collective``'s per (collective, group, bytes, pipeline ranks): its flows, their time alone, its
        #: latency and its load (None without interference)
        self._run_plans: dict[tuple, tuple] = {}
        self.copy_latency_s = c.latency_s
        launch = hw.launch  # scenario > calibrated profile > host > generic (hardware_models.machine)
        self.launch_overhead_s = launch.per_op_s
        #: host time per launched op by phase (a scenario override applies to every phase)
        self.launch_overhead_by_phase_s = launch.by_phase_s
        #: host time once per occurrence of a phase besides its launches (the optimizer step's Python work)
        self.host_phase_fixed_s = launch.fixed_by_phase_s
        self.state = DeviceState(hw.gpu.max_sm_clock_mhz, hw.gpu.mem_clock_mhz or 1.0)
        self._collective: dict[tuple[str, str, int], object] = {}
        self._by_op: dict[int, tuple] = {}  # id(op) -> (op, collective_result(op))
        self._folded: dict[int, tuple] = {}  # id(op) -> (op, folded_comm_s(op))
        nccl = hw.nccl
        #: interference factors of this run (None: off, no collective model or nccl.interference false)
        self.interference: InterferenceFactors | None = None
        if hw.collectives is not None and (nccl is None or nccl.interference):
            self.interference = InterferenceFactors.from_profile(hw.collectives.profile,
                                                                 nccl.nchannels if nccl is not None else None)
        #: each op's interned pricing key (``graph.ops.price_key``): the duration caches' key, shared by the
        #: ops that price alike (a step's repeated layers and micro-batches)
        self.price_keys = PriceKeys()
        self._dur: dict[int, float] = {}  # kernel_s cache at the clocks below, by pricing key
        #: interfered_kernel_s cache at the clocks below: ``(sm_held, hbm_share) -> {pricing key: s}``
        self._idur: dict[tuple, dict[int, float]] = {}
        self._itab: dict[int, float] | None = None  # ``_idur[_itab_share]`` (None: to look up)
        self._itab_share: tuple[int, float] | None = None
        self._share: tuple[int, float] | None = None  # kernel_share of self._loads (None: to compute)
        self._shares: dict[tuple, tuple] = {}  # the shares seen, each as one tuple object
        self._tail: dict[tuple, float] = {}  # block_tail_s cache
        self._side: dict[tuple, Timeline] = {}  # side_timeline cache: (pricing key, share, clocks) -> timeline
        self._stretch: dict[tuple, tuple] = {}  # folded_stretches cache: (pricing key, share) -> stretches
        self._dur_sm, self._dur_mem = self.state.sm_clock_mhz, self.state.mem_clock_mhz
        self._loads: list[CommLoad] = []  # collectives in flight on this GPU
        self._kernels = 0  # compute kernels running on this GPU
        self._comm_changed: simpy.Event | None = None  # fires when self._loads changes
        self._compute_changed: simpy.Event | None = None  # fires when compute goes busy <-> idle
        clock = type(env).now.fget.__get__(env)  # env.now as a bound call (no lambda frame)
        # pools are named after the rank: pipeline stage r > 0 is global rank pp_group[r] (its host: ppR.host)
        gpu, host = ("gpu0", "host") if hw.pp_rank == 0 else (f"gpu{hw.pp_group[hw.pp_rank]}", f"pp{hw.pp_rank}.host")
        self.memory = {
            "gpu": MemoryPool(f"{gpu}.hbm", hw.gpu.hbm_capacity_bytes, clock),
            "host_pinned": MemoryPool(f"{host}.pinned", hw.host_memory.pinned_capacity_bytes, clock),
            "host_pageable": MemoryPool(f"{host}.pageable", hw.host_memory.capacity_bytes, clock),
        }

    def share_uplink(self, up) -> None:
        """Route this rank's host<->device copies over its PCIe switch uplink ``up`` (an ``UplinkShare``) when
        ``__init__`` did not (a lone rank behind its switch, ``up.sharers`` 1: a runtime component whose traffic
        shares the uplink needs it as a link). Sets ``uplink``.

        Raises:
            ValueError: the uplink links exist already (``FluidNetwork.add_links``).
        """
        self.network.add_links(uplink_links(up, self.hw.copy))
        self.copy_links = {k: (*v, *UPLINK_PATHS[k]) for k, v in self.copy_links.items()}
        self.uplink = up

    def add_copy_link(self, name: str, capacity_bytes_per_s: float) -> None:
        """Route this rank's host<->device copies over one more link ``name`` of ``capacity_bytes_per_s`` (the host
        DRAM their DMA reads or writes, shared with host work a runtime component puts on it).

        Raises:
            ValueError: as ``FluidNetwork.add_links`` (a bad capacity, or a link of that name exists).
        """
        self.network.add_links({name: capacity_bytes_per_s})
        self.copy_links = {k: (*v, name) for k, v in self.copy_links.items()}

    def release_ops(self) -> None:
        """Drop what refers to the run's ops (the per-op caches, the running-op table) once the run is over
        (``engine.run._release``): the machine sits in the environment's reference cycles, and the ops it held
        (each block with its parts) would wait for the cyclic collector, whose pass over them costs seconds."""
        self._by_op, self._folded, self._dur, self._tail, self._idur, self._side = {}, {}, {}, {}, {}, {}
        self._stretch, self._itab, self._itab_share = {}, None, None
        self.price_keys.release()
        self.running.clear()

    def collective_model(self, op) -> bool:
        """Whether ``op`` is a collective this machine prices with its NCCL model (``meta["collective"]``)."""
        return self.hw.collectives is not None and bool(op.meta) and "collective" in op.meta

    def collective_result(self, op):
        """The NCCL model's ``CollectiveResult`` of collective ``op`` over its group (``meta``:
        ``collective``, ``bytes``, ``group``), in isolation.

        Priced once per (collective, group, bytes) by ``hw.collectives.price(...).time_s`` with the
        scenario's NCCL settings; the group ``"dp"`` is ``hw.dp_group``, ``"tp"`` is ``hw.tp_group``,
        ``"dp_shard"`` / ``"dp_replicate"`` are ``hw.dp_shard_group`` / ``hw.dp_replicate_group`` (HYBRID_SHARD),
        ``"dp_post_forward"`` ``hw.dp_post_forward_group`` (FSDP2's int ``reshard_after_forward``).
        ``"pp"`` the pipeline ranks ``meta["pp_ranks"]`` (indices into ``hw.pp_group``), ``"mp"`` the
        model-parallel group (the TP group on every stage), ``"world"`` every rank. ``"ep"`` is ``hw.ep_group``, ``"edp"`` ``hw.edp_group``, ``"etp"`` ``hw.etp_group``, ``"tp_ep"`` every
        ``etp`` rank of every ``ep`` rank (Megatron's ``tp_ep_group``: the all-gather token dispatcher).

        Raises:
            CollectiveError: an unknown group name or an op/size the model cannot price.
        """
        r = self._by_op.get(id(op))  # the run's graph holds its ops: an object's id is its own for the run
        if r is not None:
            return r[1]
        m = op.meta
        key = (m["collective"], m.get("group", "dp"), int(m["bytes"]), m.get("pp_ranks"))
        r = self._collective.get(key)
        if r is None:
            r = self._collective[key] = self.hw.collectives.price(key[0], self._group_of(op), key[2], self.hw.nccl)
        self._by_op[id(op)] = (op, r)  # the op kept alive with its entry, so that its id is not reused
        return r

    def _group_of(self, op) -> tuple[int, ...]:
        """Global ranks of collective ``op``'s process group (see ``collective_result``).

        Raises:
            CollectiveError: an unknown group name.
        """
        m = op.meta
        name = m.get("group", "dp")
        groups = {"dp": self.hw.dp_group, "tp": self.hw.tp_group, "dp_shard": self.hw.dp_shard_group,
                  "dp_replicate": self.hw.dp_replicate_group, "dp_post_forward": self.hw.dp_post_forward_group, "ep": self.hw.ep_group, "edp": self.hw.edp_group,
                  "cp": self.hw.cp_group, "etp": self.hw.etp_group}
        if m["collective"] == "send_recv" and name == "cp":  # the CP ring: this rank to its next neighbour
            groups["cp"] = self.hw.cp_group[:2]
        if name == "pp":  # the pipeline ranks named by index (``pp_ranks``) in ``hw.pp_group``
            groups["pp"] = tuple(self.hw.pp_group[i] for i in m.get("pp_ranks"))
        elif name == "mp":  # Megatron's model-parallel group: this rank's TP group on every pipeline stage
            t0 = self.hw.tp_group[0]
            groups["mp"] = tuple(sorted(s + t - t0 for s in self.hw.pp_group for t in self.hw.tp_group))
        elif name == "tp_ep":  # Megatron's tp_ep group: the etp x ep ranks of this rank's expert grid
            t0 = self.hw.etp_group[0]
            groups["tp_ep"] = tuple(sorted(e + t - t0 for e in self.hw.ep_group for t in self.hw.etp_group))
        elif name == "world":  # every rank (the default process group)
            groups["world"] = tuple(range(self.hw.world_size))
        if name not in groups:
            from hardware_models.collectives import CollectiveError

            raise CollectiveError(f"op {op.name}: process group {name!r} is not modelled (allowed: "
                                  f"{', '.join([*(g for g in groups if g not in _NAMED), *_NAMED])})")
        return tuple(groups[name])

    def collective_s(self, op) -> float:
        """Isolated device time of collective ``op`` (``collective_result(op).time_s``), s."""
        return self.collective_result(op).time_s

    # -- interference ------------------------------------------------------------------------------
    def _signal(self, name: str) -> None:
        ev = getattr(self, name)
        if ev is not None and ev.callbacks:  # (a watch nobody waits on stays for the next: ``disarm``)
            setattr(self, name, None)
            ev.succeed()

    def _watch(self, name: str) -> simpy.Event:
        ev = getattr(self, name)
        if ev is None:
            ev = self.env.event()
            setattr(self, name, ev)
        return ev

    def progress(self, duration_s, watch: str, done: float = 0.0):
        """Run one unit of work whose full duration at the current state is ``duration_s()``,
        re-rated whenever the event ``watch`` names fires (rate = 1 / duration); ``done``: the fraction of it
        already done."""
        env = self.env
        while True:
            d = duration_s()
            left = (1.0 - done) * d
            if left <= 0:
                return
            t0 = env.now
            to, wake, fire, ev = self.arm(left, watch)
            yield wake
            if to.callbacks is None:  # the timeout was processed
                self.disarm(watch, ev, fire)
                return
            done = min(1.0, done + (env.now - t0) / d)

    def arm(self, delay_s: float, watch: str) -> tuple[simpy.Timeout, _Wake, object, simpy.Event]:
        """``yield to | watch`` without the condition object: ``(to, wake, fire, ev)`` where ``to`` is a timeout of
        ``delay_s`` and ``wake`` fires (scheduled at the same point) when the first of ``to`` and the event ``watch``
        names (``ev``, made if there is none) is processed; a later one finds it triggered and does nothing.
        ``fire`` is ``wake``'s callback on ``ev`` (for ``disarm``)."""
        env = self.env
        to, wake = simpy.Timeout(env, delay_s), _Wake(env)
        to.callbacks.append(wake.fire_last)  # the timeout's only callback
        ev = getattr(self, watch)
        if ev is None:
            ev = simpy.Event(env)
            setattr(self, watch, ev)
        fire = wake.fire
        ev.callbacks.append(fire)
        return to, wake, fire, ev

    def disarm(self, watch: str, ev: simpy.Event, fire) -> None:
        """The wait ``arm`` made ended by its timeout: its ``fire`` leaves the watch event ``ev`` (where it would do
        nothing). An event nobody watches any more stays in place, untriggered, for the next ``arm`` or ``_watch``
        (one event less to make per wait): the changes (``kernel_begins``, ``_add_load``...) trigger only a watch
        someone waits on, so that a change nobody watches schedules nothing (an event whose callbacks all do
        nothing changes no state: the results are those with it)."""
        cbs = ev.callbacks
        if cbs is not None:  # None: ``ev`` was processed (it fired at the same instant, after the timeout)
            cbs.remove(fire)

    def kernel_begins(self) -> None:
        """A compute kernel starts on this GPU (interference, ``run_kernel``): the collectives in flight are re-rated
        if it is the only one."""
        self._kernels += 1
        if self._kernels == 1:
            ev = self._compute_changed
            if ev is not None and ev.callbacks:  # (a watch nobody waits on stays for the next: ``disarm``)
                self._compute_changed = None
                ev.succeed()

    def kernel_ends(self) -> None:
        """A compute kernel (``kernel_begins``) ends: the collectives in flight are re-rated if it was the last."""
        self._kernels -= 1
        if self._kernels == 0:
            ev = self._compute_changed
            if ev is not None and ev.callbacks:  # (a watch nobody waits on stays for the next: ``disarm``)
                self._compute_changed = None
                ev.succeed()

    def kernel_s(self, op, key: int | None = None) -> float:
        """``cost.duration_s(op, state)`` (plus ``folded_comm_s``), cached per pricing key while the clocks stay the
        same, s. ``key``: the op's interned pricing key (``price_keys.of(op)``) where the caller holds it.

        The cost model's time depends only on what the op's pricing key holds (``graph.ops.price_key``) and
        the device clocks (without interference, which ``run_kernel`` prices itself).
        """
        st = self.state
        if st.sm_clock_mhz != self._dur_sm or st.mem_clock_mhz != self._dur_mem:
            self._clocks_changed()
        if key is None:
            hit = self.price_keys.by_op.get(id(op))
            k = hit[1] if hit is not None else self.price_keys.of(op)
        else:
            k = key
        d = self._dur.get(k)
        if d is None:
            if op.meta and "side" in op.meta:  # TP collectives beside its kernels: their timeline
                d = self._dur[k] = self.side_timeline(op, alone=True).end_s
                return d
            d = self.cost.duration_s(op, st)
            if op.folded_comm:  # a block with TP collectives folded in: each one's time alone on its links
                d += self.folded_comm_s(op)
            self._dur[k] = d
        return d

    def _clocks_changed(self) -> None:
        """The clocks moved since the duration caches were filled: empty them."""
        st = self.state
        self._dur.clear()
        self._idur.clear()
        self._itab = self._itab_share = None
        self._side.clear()
        self._stretch.clear()
        self._dur_sm, self._dur_mem = st.sm_clock_mhz, st.mem_clock_mhz

    def _add_load(self, load: CommLoad) -> None:
        """A collective holding ``load`` starts on this GPU: the kernels beside it are re-rated."""
        self._loads.append(load)
        self._share = None
        ev = self._comm_changed
        if ev is not None and ev.callbacks:  # (a watch nobody waits on stays for the next: ``disarm``)
            self._comm_changed = None
            ev.succeed()

    def _remove_load(self, load: CommLoad) -> None:
        """The collective holding ``load`` (``_add_load``) ends: the kernels beside it are re-rated."""
        self._loads.remove(load)
        self._share = None
        ev = self._comm_changed
        if ev is not None and ev.callbacks:  # (a watch nobody waits on stays for the next: ``disarm``)
            self._comm_changed = None
            ev.succeed()

    def _current_share(self) -> tuple[int, float]:
        """``kernel_share`` of the collectives in flight now (SMs held, HBM share), cached until a collective
        starts or ends; the duration caches are dropped first if the clocks changed (``_clocks_changed``)."""
        st = self.state
        if st.sm_clock_mhz != self._dur_sm or st.mem_clock_mhz != self._dur_mem:
            self._clocks_changed()
        share = self._share
        if share is None:
            gpu = self.hw.gpu
            share = kernel_share(self._loads, gpu.sm_count, gpu.hbm_bandwidth_bytes_per_s)
            # the same tuple object while it is the same share (``interfered_kernel_s`` tests it by identity)
            share = self._share = self._shares.setdefault(share, share)
        return share

    def interfered_kernel_s(self, op, key: int | None = None) -> float:
        """Duration of compute kernel ``op`` beside the collectives in flight now (``kernel_share`` of them) at the
        current clocks: ``cost.duration_s(op, state, sm_held, hbm_share)``, cached per pricing key, share and clocks,
        s; a block carrying TP collectives beside its kernels (``meta["side"]``) takes its ``side_timeline`` end.
        ``key``: the op's interned pricing key (``price_keys.of(op)``) where the caller holds it."""
        st = self.state
        share = self._share
        if share is None or st.sm_clock_mhz != self._dur_sm or st.mem_clock_mhz != self._dur_mem:
            share = self._current_share()
        if op.meta and "side" in op.meta:
            return self.side_timeline(op).end_s
        tab = self._itab
        if tab is None or self._itab_share is not share:
            tab = self._idur.get(share)
            if tab is None:
                tab = self._idur[share] = {}
            self._itab, self._itab_share = tab, share
        if key is None:
            hit = self.price_keys.by_op.get(id(op))
            key = hit[1] if hit is not None else self.price_keys.of(op)
        d = tab.get(key)
        if d is None:
            d = tab[key] = self.cost.duration_s(op, st, *share)
        return d

    def folded_comm_s(self, op) -> float:
        """Time of the TP collectives folded into layer-fidelity block ``op`` (``Op.folded_comm``): the sum of
        their NCCL-model times alone (``collective_s``; alone on its links a collective's flows take exactly
        that, ``collective_flows``), s. 0 for any other op."""
        hit = self._folded.get(id(op))
        if hit is None:
            t = 0.0 if op.meta and "side" in op.meta else sum(self.collective_s(c) for c in op.folded_comm)
            hit = self._folded[id(op)] = (op, t)
        return hit[1]

    def folded_stretches(self, op) -> tuple[tuple[float, float], ...]:
        """The runs of layer-fidelity block ``op``'s kernels between the blocking TP collectives folded into it
        (``Op.folded_comm`` without ``meta["side"]``; collective ``k`` runs before part ``meta["folded_at"][k]``):
        one ``(kernels_s, comm_s)`` per run, its kernels' time beside the collectives in flight now (each part's
        ``cost.duration_s(part, state, *kernel_share)``, summed) and the time alone of the collectives after it
        (``collective_s``; 0 after the last run), s. Cached per pricing key, cut points (``folded_at``: the pricing
        key does not hold them) and share at the current clocks."""
        st = self.state
        share = self._current_share()
        hit = self.price_keys.by_op.get(id(op))
        key = (hit[1] if hit is not None else self.price_keys.of(op), tuple(op.meta["folded_at"]), share)
        out = self._stretch.get(key)
        if out is None:
            parts, cost = op.meta["fused"], self.cost
            after: dict[int, float] = {}
            for j, c in zip(op.meta["folded_at"], op.folded_comm):
                after[j] = after.get(j, 0.0) + self.collective_s(c)
            bounds = [0, *sorted(after), len(parts)]
            out = self._stretch[key] = tuple(
                (sum(cost.duration_s(p, st, *share) for p in parts[i:j]), after.get(j, 0.0))
                for i, j in zip(bounds, bounds[1:]))
        return out

    def side_timeline(self, op, alone: bool = False) -> Timeline:
        """Timeline of layer-fidelity block ``op`` carrying TP collectives beside its kernels (``meta["side"]``,
        ``simulator.graph.side_blocks``) beside the other collectives in flight now (``alone``: none), which leave
        its kernels a share of the GPU (``kernel_share``: SMs held, HBM share), at the current clocks
        (``cost.overlap.overlap_timeline``).

        Each part alone is ``cost.duration_s(part, state, *share)``; beside one of the block's collectives it is
        priced with that collective's load (``comm_load`` of its isolated bus bandwidth) added to the others';
        a collective takes its NCCL-model time alone on its links (``collective_s``: alone, its flows take
        exactly that) and ``1 + gamma`` times longer while a part runs. Without interference (``nccl.interference:
        false``) neither slows the other. Cached per pricing key and share; the cache is dropped when the clocks
        change (``_clocks_changed``).
        """
        st = self.state
        if st.sm_clock_mhz != self._dur_sm or st.mem_clock_mhz != self._dur_mem:
            self._clocks_changed()
        f, gpu = self.interference, self.hw.gpu
        base = [] if alone or f is None else self._loads
        if not base:
            share = (0, 1.0)
        else:
            share = self._share
            if share is None:
                share = self._share = kernel_share(base, gpu.sm_count, gpu.hbm_bandwidth_bytes_per_s)
        hit = self.price_keys.by_op.get(id(op))
        key = (hit[1] if hit is not None else self.price_keys.of(op), share)
        tl = self._side.get(key)
        if tl is not None:
            return tl
        parts, cost = op.meta["fused"], self.cost
        alone_s = [cost.duration_s(p, st, *share) for p in parts]
        comms = [(a, b, self.collective_s(c)) for (a, b), c in zip(op.meta["side"], op.folded_comm)]
        if f is None:
            tl = overlap_timeline(alone_s, comms, 1.0, lambda i, k: alone_s[i])
        else:
            shares = [kernel_share([*base, comm_load(f, self.collective_result(c).busbw_bytes_per_s)], gpu.sm_count,
                                   gpu.hbm_bandwidth_bytes_per_s) for c in op.folded_comm]
            memo: dict[tuple[int, int], float] = {}

            def beside(i: int, k: int) -> float:
                d = memo.get((i, k))
                if d is None:
                    d = memo[i, k] = cost.duration_s(parts[i], st, *shares[k])
                return d

            tl = overlap_timeline(alone_s, comms, 1.0 + f.comm_slowdown, beside)
        self._side[key] = tl
        return tl

    def block_tail_s(self, op, per_launch_s: float) -> float:
        """Shortest time from a block's first host launch to its end when its parts (``meta["fused"]``) are
        launched ``per_launch_s`` apart and each starts only once launched: ``max_i (i * per_launch_s +
        sum_{j >= i} d_j)`` over parts ``i = 0..n-1`` of durations ``d_j`` at the current clocks, s
        (layer fidelity, ``simulator.policies.fidelity``: a launch-bound stream keeps its kernel-level time).
        """
        st = self.state
        m = op.meta  # identical blocks (same parts, same folded collectives) share one entry
        if "side" in m:  # TP collectives beside the kernels: each part's time and wait in the block's timeline
            key = (self.price_keys.of(op), per_launch_s, st.sm_clock_mhz, st.mem_clock_mhz)
            t = self._tail.get(key)
            if t is None:
                tl = self.side_timeline(op, alone=True)
                t = rest = 0.0
                for i in range(len(tl.run_s) - 1, -1, -1):
                    rest += tl.run_s[i] + (tl.wait_s[i + 1] if i + 1 < len(tl.wait_s) else 0.0)
                    t = max(t, i * per_launch_s + rest)
                self._tail[key] = t
            return t
        fold = tuple((c.meta["collective"], c.meta.get("group"), c.meta["bytes"]) for c in op.folded_comm) \
            if op.folded_comm else None
        key = (m["fused_key"], m.get("folded_at"), fold, per_launch_s, st.sm_clock_mhz, st.mem_clock_mhz)
        t = self._tail.get(key)
        if t is None:
            parts = op.meta["fused"]
            comm = dict(zip(op.meta.get("folded_at", ()), (self.collective_s(c) for c in op.folded_comm)))
            t = rest = 0.0
            for i in range(len(parts) - 1, -1, -1):
                rest += self.cost.duration_s(parts[i], st) + comm.get(i, 0.0)  # a folded TP collective before part i
                t = max(t, i * per_launch_s + rest)
            self._tail[key] = t
        return t

    def run_kernel(self, op, duration_s: float | None = None):
        """SimPy process body: compute kernel ``op`` on this GPU (``duration_s``: a measured time).

        Without interference it takes ``cost.duration_s(op, state)`` (or ``duration_s``). With it,
        the kernel's rate at each moment is 1 / its duration beside the collectives then in flight
        (``cost.duration_s(op, state, sm_held, hbm_share)``); a measured kernel is not re-priced
        (its measurement includes whatever ran beside it) but counts as compute for the
        collectives' slowdown. The clocks are read when the rate changes.

        A layer-fidelity block with TP collectives folded in (``Op.folded_comm``) also takes their time alone
        (``folded_comm_s``) with the GPU counted idle (as the compute stream is while the blocking collective
        runs at kernel fidelity): after its kernels without interference, in its place between them with it
        (``_run_folded``); approximated: that time does not stretch beside compute on another stream, holds no
        SMs or HBM from it, and shares no link with other traffic (``simulator.policies.fidelity``).
        """
        env = self.env
        if self.interference is None:
            if duration_s is not None:
                d = duration_s
            elif op.meta and "side" in op.meta:
                d = self.kernel_s(op)
            else:
                d = self.cost.duration_s(op, self.state)
            yield env.timeout(d + self.folded_comm_s(op) if op.folded_comm else d)
            return
        if op.folded_comm and duration_s is None and "side" not in op.meta:
            yield from self._run_folded(op)
            return
        self.kernel_begins()
        try:
            if duration_s is not None:
                yield env.timeout(duration_s)
            else:
                yield from self.progress(partial(self.interfered_kernel_s, op), "_comm_changed")
        finally:
            self.kernel_ends()

    def _run_folded(self, op):
        """SimPy process body of layer-fidelity block ``op`` with blocking TP collectives folded in, with
        interference: each run of its kernels (``folded_stretches``) re-rated beside the collectives in flight, then
        the collectives after it with the compute stream idle, as at kernel fidelity (a collective on another
        stream runs at its rate alone then and slows no kernel). Approximated: the folded collectives hold no SMs
        or HBM from, and share no link with, what runs beside them."""
        env = self.env
        for k in range(len(self.folded_stretches(op))):
            self.kernel_begins()
            try:
                yield from self.progress(lambda: self.folded_stretches(op)[k][0], "_comm_changed")
            finally:
                self.kernel_ends()
            comm_s = self.folded_stretches(op)[k][1]
            if comm_s > 0:
                yield env.timeout(comm_s)

    def collective_flows(self, op) -> tuple[list[tuple[tuple[str, ...], float, float]], float]:
        """The flows collective ``op`` puts on this rank's links and its time after the latency.

        Returns ``(flows, alone_s)``: ``alone_s = time_s - latency_s`` of ``collective_result(op)`` (s) and one
        ``(links, bytes, cap_bytes_per_s)`` per set of this rank's links a part of the collective crosses
        (``hardware_models.collective_flows.rank_loads``; parts of equal bytes on disjoint links, such as a
        ring's send and receive on the NVLink port, are one flow), with ``cap = bytes / alone_s``: the
        rate at which the part moves alone, so that alone (nothing else on its links) the collective takes
        exactly its NCCL-model time (the size efficiency, protocol and fill terms are in that rate). Where the
        collective's own parts would not fit its links at those rates (its tx and rx inside one PCIe duplex
        limit, a model bandwidth above a link's datasheet rate), a part's bytes and cap are scaled down to
        its max-min rate alone x ``alone_s``: its time alone is unchanged. A send/recv outside a pipeline
        rendezvous (the context-parallel ring) also loads the receive side, as the folded predecessor sends
        to this rank at the same time. Cached per (collective, group, bytes).
        """
        m = op.meta
        key = (m["collective"], m.get("group", "dp"), int(m["bytes"]), m.get("pp_ranks"))
        hit = self._flows.get(key)
        if hit is not None:
            return hit
        res = self.collective_result(op)
        lat = getattr(res, "latency_s", 0.0)  # a priced result without a latency term: all of it alone
        alone = res.time_s - lat
        flows: list = []
        if alone > 0 and self._topo is not None:
            loads = rank_loads(self.hw.collectives, key[0], self._group_of(op), key[2], res.algorithm, self.rank,
                               mirror=key[1] not in _NAMED)
            caps = self.network.capacities
            merged: list[tuple[tuple[str, ...], float]] = []
            for links, b in loads.items():  # parts moving the same bytes at once are one flow (a ring step is coupled)
                if b <= 0:
                    continue
                k = next((i for i, (ls, bb) in enumerate(merged) if bb == b and not set(ls) & set(links)), None)
                if k is None:
                    merged.append((links, b))
                else:
                    merged[k] = (merged[k][0] + links, b)
            parts = [(links, b, b / alone) for links, b in merged]
            rates = maxmin_rates([(links, cap) for links, _, cap in parts], caps) if parts else []
            flows = [(links, b, cap) if r >= cap else (links, r * alone, r)
                     for (links, b, cap), r in zip(parts, rates)]
        out = self._flows[key] = (flows, alone)
        return out

    def _move(self, flows, alone_s: float, slow: float | None = None):
        """SimPy process body: move ``flows`` (``collective_flows``) over the network; with ``slow``, their
        caps are divided by it while a compute kernel runs (interference). Without flows: ``alone_s``."""
        env = self.env
        if not flows:
            if slow is None:
                if alone_s > 0:
                    yield env.timeout(alone_s)
            else:
                yield from self.progress(lambda: alone_s * (slow if self._kernels else 1.0), "_compute_changed")
            return
        net = self.network
        factor = slow if slow is not None and self._kernels else 1.0
        live = [(net.start(b, links, cap / factor), cap) for links, b, cap in flows]
        if slow is None:
            yield env.all_of([f.done for f, _ in live]) if len(live) > 1 else live[0][0].done
            return
        while True:
            live = [(f, cap) for f, cap in live if not f.done.triggered]
            if not live:
                return
            done = live[0][0].done if len(live) == 1 else env.all_of([f.done for f, _ in live])
            # ``yield done | watch`` without the condition object (as ``progress``): scheduled at the same point;
            # ``done`` (this collective's own flow's or condition) has no callback after ``wake``'s
            wake = _Wake(env)
            done.callbacks.append(wake.fire_last)
            watch = self._watch("_compute_changed")
            fire = wake.fire
            watch.callbacks.append(fire)
            yield wake
            if done.callbacks is None:  # ``done`` was processed
                self.disarm("_compute_changed", watch, fire)
            now = slow if self._kernels else 1.0
            if now != factor:
                factor = now
                live = [(f, cap) for f, cap in live if not f.done.triggered]
                if live:
                    net.set_caps([(f, cap / factor) for f, cap in live])

    def run_collective(self, op, step: int = 0):
        """SimPy process body: collective ``op`` of step ``step`` priced by the NCCL model
        (``collective_result``): its latency, then its flows over this rank's links (``collective_flows``),
        sharing them max-min fairly with every other transfer on them (other collectives, copies).

        With interference it holds its SMs and HBM traffic (``comm_load``) while in flight, and
        progresses at ``1 / (1 + gamma)`` of its isolated rate while any compute kernel runs (the latency
        stretched, the flows' caps divided). Alone on its links it takes exactly ``time_s`` (stretched so).
        A pipeline call met at a rendezvous (send/recv, cross-stage all-reduce) is one ``SharedCall`` of
        the stages: the flows of every stage's links start together and it ends at the same time on all.
        """
        m = op.meta
        f = self.interference
        key = (m["collective"], m.get("group", "dp"), int(m["bytes"]), m.get("pp_ranks"))
        plan = self._run_plans.get(key)
        if plan is None:
            res = self.collective_result(op)
            flows, alone = self.collective_flows(op)
            plan = self._run_plans[key] = (flows, alone, res.time_s - alone,
                                           comm_load(f, res.busbw_bytes_per_s) if f is not None else None)
        flows, alone, lat, load = plan
        # a pipeline rendezvous (send/recv, cross-stage all-reduce) ends at the same time on both stages: its
        # flows, not re-rated by one GPU's compute; a data-parallel collective met across rank classes
        # keeps its interference (each class beside its own kernels); a fused GEMM + collective kernel
        # (tp_comm_overlap: fused) takes nothing from the GEMM beside it
        if m.get("group") in _NAMED and "rendezvous" in m:
            yield self.fabric.join((m["rendezvous"], step), m.get("parties", 1), lat,
                                   [(self.network, *fl) for fl in flows], alone, self._run_shared)
            return
        if f is None or m.get("fused_gemm") or m.get("group") == "pp":
            if lat > 0:
                yield self.env.timeout(lat)
            yield from self._move(flows, alone)
            return
        self._add_load(load)
        slow = 1.0 + f.comm_slowdown
        try:
            if lat > 0:
                yield from self.progress(lambda: lat * (slow if self._kernels else 1.0), "_compute_changed")
            yield from self._move(flows, alone, slow)
        finally:
            self._remove_load(load)

    def _run_shared(self, call):
        """SimPy process body of a ``SharedCall``: its latency, then every party's flows together, each on its
        party's links; done when the last ends (without flows: ``alone_s``)."""
        env = self.env
        if call.latency_s > 0:
            yield env.timeout(call.latency_s)
        if call.flows:
            yield env.all_of([net.start(b, links, cap).done for net, links, b, cap in call.flows])
        elif call.alone_s > 0:
            yield env.timeout(call.alone_s)
        call.done.succeed()

    @property
    def collective_dispatch_s(self) -> float:
        """Host time of one eager collective call (the collective profile's ``host_dispatch_s``), s."""
        return self.hw.collectives.profile.host_dispatch_s if self.hw.collectives is not None else 0.0
