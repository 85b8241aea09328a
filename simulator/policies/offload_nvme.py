"""ZeRO-Infinity NVMe offload: optimizer state and 16-bit parameters swapped between NVMe and pinned host buffers.

Selected by ``zero_optimization.offload_optimizer.device: nvme`` and/or ``offload_param.device: nvme`` (ZeRO-3;
``simulator.config.sections.offload``). It rewrites the graph the CPU-offload policies built (``offload_optimizer``,
then ``offload_param``), whose mechanisms it keeps: the gradient D2H copies, the CPU Adam step on the host, the
parameter H2D fetches, PCIe and host DRAM as max-min links. What changes, following DeepSpeed:

* **Gradients** (optimizer nvme): each rank's reduced gradient partition is cast to fp32 on the GPU and copied D2H
  (4 B per element, not the 16-bit copy of CPU offload), then written to NVMe (4 B) by the gradient swapper
  (microsoft/DeepSpeed@0003660d deepspeed/runtime/zero/stage3.py ``__partition_grads``:
  ``offload_fp32_gradients[i].append(grad_buffer.float())`` then ``optimizer_swapper.swap_out_gradients``). The
  step's first swap-in waits for those writes (``_flush_gradient_swapper`` in ``swap_in_optimizer_state``).
* **The step, per sub-group** of ``sub_group_size`` elements of the rank's partition (stage3.py ``step``: for each
  sub-group ``_prepare_sub_group`` -> ``_optimizer_step`` -> ``_reassign_or_swap_out_partitioned_parameters`` ->
  ``_release_sub_group``): swap-in of the fp32 master weights, ``exp_avg``, ``exp_avg_sq`` and the gradient,
  16 B per element read from NVMe (``PartitionedOptimizerSwapper.swap_in_optimizer_state``: the three state
  tensors and the gradient into pinned buffers, microsoft/DeepSpeed@033df2d4
  deepspeed/runtime/swap_tensor/partitioned_optimizer_swapper.py); the sub-group's DeepSpeedCPUAdam (the CPU
  offload's ``cpu.adam`` price, split by elements; the gradients arrive in fp32, so no CPU cast); with parameter
  nvme the 16-bit partition written back (2 B); the swap-out of the three states, 12 B written.
  Without ``pipeline_read`` / ``pipeline_write`` every swap blocks the step (the partitioned swapper waits on its
  aio handle). ``pipeline_read``: the next sub-group's swap-in is issued once this one's has landed and runs
  during this one's step; ``pipeline_write``: a sub-group's swap-out runs during the next one's step and is waited
  for before the next swap-out is issued; the last one is synchronous (``PipelinedOptimizerSwapper``,
  microsoft/DeepSpeed@01c61b8c deepspeed/runtime/swap_tensor/pipelined_optimizer_swapper.py, ``async_swap`` =
  a next swappable sub-group exists).
* **Parameters** (param nvme): every H2D fetch of a parameter partition (``offload_param``) first reads it from
  NVMe into the pinned swap buffers (``AsyncPartitionedParameterSwapper.swap_in``, microsoft/DeepSpeed@033df2d4
  deepspeed/runtime/swap_tensor/partitioned_param_swapper.py), on one aio stream in fetch order; after the CPU
  step the updated 16-bit partition is written back (2 B per element). Each parameter's partition must be smaller
  than ``buffer_size`` (the swapper's ``get_buffer`` asserts it): larger ones are refused.
* **Host memory** holds only the pinned swap buffers: ``offload_optimizer.buffer_count`` x the largest sub-group x
  4 B (the swapper's buffer pool, ``OptimizerSwapper.swap_buffer_manager``) and ``offload_param.buffer_count`` x
  ``buffer_size`` x the 16-bit size; the fp32 master weights, moments and gradient staging of CPU offload, and with
  parameter nvme the 16-bit partition, are not in host memory.
* **The drives** are links of the rank's max-min network (``hardware_models.fabrics``), each of the rank's share
  (the node's ranks, ``offload_ranks``, swap alike at the same time: folded peers): ``nvme``, the drives' time, of
  the array's read bandwidth; a write of ``b`` bytes loads it by ``b x read_bw / write_bw`` (the weighted name
  ``nvme.write``), so reads and writes share the drives' time. Where the host preset says how the drives attach,
  ``nvme.uplink.up`` (reads, drive to host) and ``nvme.uplink.down`` (writes) of what the striped array's upstream
  PCIe links carry per direction (``NvmeArraySpec.uplink_read_bytes_per_s``). Every swap also crosses the rank's
  ``host.dram`` link (the DMA writes or reads the pinned swap buffers), which the CPU step's streams and the GPU
  copies share (``offload_optimizer.OffloadSummary``). Where the host states its PCIe switches
  (``hardware_models.pcie_switches``) and this rank's GPU shares one with drives of the array, the swaps also cross
  that switch's uplink beside the GPU's copies (reads up with the D2H copies, writes down with the H2D copies, both
  against its two-way limit: ``NvmeSummary._share_switch``). A swap's rate is its max-min share over those links.
  The run's warnings say so.

Not modelled (refused in the config): stage 1/2 (DeepSpeed swaps in ZeRO-3 only), CPU Adam implementations other
than DeepSpeedCPUAdam, fewer swap buffers than a sub-group in flight needs. ``aio`` settings are
priced by ``hardware_models.aio`` (the array's rate times the fraction the requests in flight reach against the
drive's request latency: ``aio_factor``), but ``single_submit`` (``simulator.config.sections.nvme``).
"""

from __future__ import annotations

import numpy as np

from hardware_models.aio import aio_efficiency
from simulator.graph.op_graph import OpGraph
from simulator.graph.ops import CostClass, OpKind, Phase, TensorAlloc
from simulator.policies._rewrite import GraphRewriter
from simulator.policies.offload_optimizer import CPU_OPS, HOST_DRAM_LINK, offload_ranks
from simulator.policies.registry import PolicyError, register_graph_policy, register_runtime

KEY = "zero_optimization"
#: The link of the rank's share of the node's NVMe array's time (``OffloadSummary._host_op`` moves the flows), the
#: weighted name writes cross it by, and the links of the array's upstream PCIe links per direction
NVME_LINK, NVME_WRITE = "nvme", "nvme.write"
UPLINK_UP, UPLINK_DOWN = "nvme.uplink.up", "nvme.uplink.down"
#: The weighted names a swap crosses this rank's PCIe switch uplink by (its drives' share of the striped swaps of the
#: node's ranks, against the rank's share of the uplink: ``NvmeSummary``), reads up, writes down, both ways
SWITCH_UP, SWITCH_DOWN, SWITCH_DUPLEX = "nvme.switch.up", "nvme.switch.down", "nvme.switch.duplex"
SWITCH_NAMES = {SWITCH_UP: "pcie.uplink.d2h", SWITCH_DOWN: "pcie.uplink.h2d", SWITCH_DUPLEX: "pcie.uplink.duplex"}
#: NVMe bytes per element of one sub-group's swap-in (fp32 master weights, exp_avg, exp_avg_sq, gradient) and
#: swap-out (the three states): partitioned_optimizer_swapper.py ``swap_in_optimizer_state`` / ``swap_out_...``
SWAP_IN_BYTES, SWAP_OUT_BYTES = 16, 12
#: fp32 gradient bytes per element written to NVMe in backward (stage3.py ``grad_buffer.float()``)
GRAD_BYTES = 4
#: Host-op streams: DeepSpeed's aio handles (the pipelined swapper has a read and a write handle; the parameter
#: swapper its own)
READ_STREAM, WRITE_STREAM, PARAM_STREAM = "aio.read", "aio.write", "aio.param"


def _devices(cfg) -> tuple[bool, bool]:
    z = getattr(cfg, "zero_optimization", None)
    if z is None:
        return False, False
    return z.offload_optimizer.device == "nvme", z.offload_param.device == "nvme"


def _enabled(cfg) -> bool:
    return any(_devices(cfg))


def sub_group_sizes(shard: int, sub_group_size: int) -> list[int]:
    """Elements of each optimizer sub-group of a rank's ``shard`` elements: ``sub_group_size`` each, the last one the
    remainder (DeepSpeed splits each parameter group's partition into sub-groups of at most ``sub_group_size``)."""
    if shard <= 0:
        return []
    n = -(-shard // sub_group_size)
    return [sub_group_size] * (n - 1) + [shard - sub_group_size * (n - 1)]


@register_graph_policy("offload_nvme", order=45)
class OffloadNvme:
    """Swap optimizer state and / or parameters to NVMe (see the module docstring)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        z = cfg.zero_optimization
        opt, par = _devices(cfg)
        return offload_nvme(graph, hw, optimizer=opt, params=par, sub_group_size=z.sub_group_size,
                            optimizer_buffers=z.offload_optimizer.buffer_count,
                            pipeline_read=z.offload_optimizer.pipeline_read,
                            pipeline_write=z.offload_optimizer.pipeline_write,
                            param_buffers=z.offload_param.buffer_count, param_buffer_size=z.offload_param.buffer_size)


def swap_links(nv, write: bool, switch: bool = False) -> tuple[str, ...]:
    """The links one swap's bytes cross: the drives' time (a write by its weighted name), the upstream link of its
    direction when the array has one (``nv.fullest_uplink``), with ``switch`` this rank's PCIe switch uplink (its
    direction and both ways, by the weighted names of ``SWITCH_NAMES``: ``NvmeSummary``), host DRAM."""
    up = (UPLINK_DOWN if write else UPLINK_UP,) if nv.fullest_uplink else ()
    sw = (SWITCH_DOWN if write else SWITCH_UP, SWITCH_DUPLEX) if switch else ()
    return (NVME_WRITE if write else NVME_LINK, *up, *sw, HOST_DRAM_LINK)


def rank_switch(hw) -> int | None:
    """The host PCIe switch (index in ``hw.pcie_switches``) of this rank's GPU when it also holds drives of the NVMe
    array, else None (no topology stated, the GPU on a root port, or no drive behind its switch)."""
    topo = getattr(hw, "pcie_switches", None)
    if topo is None or hw.nvme is None:
        return None
    rank = hw.pp_group[hw.pp_rank] if hw.pp_group else 0
    gpn = hw.collectives.topo.gpus_per_node if getattr(hw, "collectives", None) is not None else 1
    j = topo.switch_of("gpus", rank % gpn)
    return j if j is not None and topo.switches[j].drives else None


def aio_factor(hw, aio) -> float:
    """Fraction of the array's sequential rate DeepSpeed's aio settings reach (``hardware_models.aio``), with every
    rank of the node (``offload_ranks``) swapping at once; 1.0 without ``aio`` (an ``AioConfig``)."""
    if aio is None:
        return 1.0
    nv = hw.nvme
    return aio_efficiency(aio.block_size, aio.queue_depth, aio.thread_count, aio.overlap_events, nv.read_bytes_per_s,
                          nv.drive.read_latency_s, offload_ranks(hw))


def nvme_links(hw, aio=None) -> dict[str, float]:
    """This rank's NVMe links, bytes/s: ``nvme`` (the array's read bandwidth x ``aio_factor``) and, with upstream
    links, ``nvme.uplink.up`` / ``.down`` (``uplink_read_bytes_per_s``), each over the node's ranks
    (``offload_ranks``), which all swap alike."""
    nv, ranks = hw.nvme, offload_ranks(hw)
    out = {NVME_LINK: aio_factor(hw, aio) * nv.read_bytes_per_s / ranks}
    if nv.fullest_uplink:
        out[UPLINK_UP] = out[UPLINK_DOWN] = nv.uplink_read_bytes_per_s / ranks
    return out


def nvme_op(rw: GraphRewriter, hw, name: str, nbytes: float, write: bool, stream: str, deps, phase: Phase,
            **meta) -> int:
    """Add one NVMe swap of ``nbytes`` (a host op on ``stream`` whose ``meta["flow"]`` the offload runtime moves, after
    the drive's request latency, over ``swap_links``)."""
    nv = hw.nvme
    links = swap_links(nv, write, rank_switch(hw) is not None)
    flow = {"links": links, "units": float(nbytes), "latency_s": nv.drive.read_latency_s}
    return rw.add(name, OpKind.HOST, stream, deps=sorted(set(deps)), phase=phase, launch=False,
                  cost_class=CostClass.COPY, meta={"flow": flow, "nvme_bytes": float(nbytes),
                                                   "nvme_dir": "write" if write else "read", **meta})


def offload_nvme(graph: OpGraph, hw, *, optimizer: bool, params: bool, sub_group_size: int = 1_000_000_000,
                 optimizer_buffers: int = 4, pipeline_read: bool = False, pipeline_write: bool = False,
                 param_buffers: int = 5, param_buffer_size: int = 100_000_000) -> OpGraph:
    """The rewrite itself (after ``offload_optimizer`` and ``offload_param``).

    Args:
        graph: The CPU-offload graph (``meta["offload_optimizer"]``; with ``params``, ``meta["offload_param"]``).
        hw: The machine; ``hw.nvme`` is the host's array.
        optimizer: Swap the optimizer state (offload_optimizer nvme).
        params: Swap the 16-bit parameters (offload_param nvme).
        sub_group_size: Elements per optimizer sub-group.
        optimizer_buffers: Pinned buffers of one sub-group's fp32 elements each.
        pipeline_read, pipeline_write: DeepSpeed's pipelined swapper (module docstring).
        param_buffers, param_buffer_size: The parameter swapper's pinned buffers (count, elements each).

    Raises:
        PolicyError: no NVMe array, the CPU-offload graph missing, or a parameter partition of ``param_buffer_size``
            elements or more.
    """
    if hw.nvme is None:
        raise PolicyError(f"{KEY}: NVMe offload needs the host's NVMe drives (hardware.nvme)")
    oo = graph.meta.get("offload_optimizer")
    if oo is None or (params and "offload_param" not in graph.meta):
        raise PolicyError(f"{KEY}: NVMe offload rewrites the CPU-offload graph (offload_optimizer / offload_param "
                          "applied first)")
    model = graph.model
    dp = model.data_parallel_size
    shard = int(oo["params_per_rank"])
    if params:
        biggest = max(-(-pg.numel // dp) for pg in graph.param_groups)
        if biggest >= param_buffer_size:
            raise PolicyError(f"{KEY}.offload_param.buffer_size: {param_buffer_size} elements is too small for the "
                              f"largest parameter partition ({biggest} elements; DeepSpeed's parameter swapper asserts "
                              f"each fits one buffer; allowed: > {biggest})")
    half = 2  # the 16-bit parameter bytes per element
    sizes = sub_group_sizes(shard, sub_group_size) if optimizer else []
    rw = GraphRewriter(graph)
    grad_writes: list[int] = []
    totals = {"read": 0.0, "write": 0.0}

    def swap(name, nbytes, write, stream, deps, phase, **meta):
        totals["write" if write else "read"] += nbytes
        return nvme_op(rw, hw, name, nbytes, write, stream, deps, phase, **meta)

    def step_loop(start: list[int]) -> int:
        """The sub-group loop of the CPU step; returns the id of its last op."""
        adam_s, adam_dram = adam["host_s"], adam["dram"]
        cursor, pending, ahead = list(start), None, None
        for k, n in enumerate(sizes):
            r = ahead if ahead is not None else swap(f"nvme.swap_in.sub_group{k}", SWAP_IN_BYTES * n, False,
                                                     READ_STREAM, cursor, Phase.OPT, sub_group=k)
            cursor = cursor + [r]
            ahead = None
            if pipeline_read and k + 1 < len(sizes):
                ahead = swap(f"nvme.swap_in.sub_group{k + 1}", SWAP_IN_BYTES * sizes[k + 1], False, READ_STREAM,
                             cursor, Phase.OPT, sub_group=k + 1)
            f = n / shard
            meta = {"params": n, "impl": oo["impl"], "sub_group": k}
            if adam_dram:
                meta["dram_bytes"] = adam_dram * f
            a = rw.add("cpu.adam", OpKind.HOST, "host", deps=sorted(set(cursor)), phase=Phase.OPT,
                       host_s=adam_s * f, launch=False, cost_class=CostClass.OPTIMIZER, dtype="fp32", meta=meta)
            cursor = [a]
            if params:
                cursor = [swap(f"nvme.swap_out.params.sub_group{k}", half * n, True, PARAM_STREAM, cursor, Phase.OPT,
                               sub_group=k)]
            if pipeline_write and pending is not None:
                cursor = cursor + [pending]
            w = swap(f"nvme.swap_out.sub_group{k}", SWAP_OUT_BYTES * n, True, WRITE_STREAM, cursor, Phase.OPT,
                     sub_group=k)
            if pipeline_write and k + 1 < len(sizes):
                pending = w  # asynchronous: the next sub-group steps while it writes
            else:
                cursor, pending = [w], None
        return cursor[-1]

    adam: dict = {}
    param_fetches = 0
    for op in graph.ops:
        m = op.meta or {}
        if optimizer and op.kind is OpKind.MEMCPY_D2H and op.name.startswith("offload.d2h.grad"):
            elems = op.bytes_read / GRAD_BYTES  # the CPU-offload copy already carries the fp32 gradient (cast on
            # the GPU: offload_optimizer.DS_FP32_GRAD_COPY, deepspeed_cpu_adam being the NVMe path's implementation)
            c = rw.copy(op, bytes_read=float(GRAD_BYTES * elems))
            grad_writes.append(swap(f"nvme.swap_out.{op.name.removeprefix('offload.d2h.')}", GRAD_BYTES * elems, True,
                                    WRITE_STREAM, [c], op.phase))
            continue
        if optimizer and op.name == "offload.bwd_done":
            rw.copy(op, extra_deps=grad_writes)  # the step's first swap-in flushes the gradient swapper
            continue
        if op.kind is OpKind.HOST and op.name in CPU_OPS and optimizer:
            if op.name == "cpu.adam":
                adam = {"host_s": op.host_s, "dram": m.get("dram_bytes", 0.0)}
                rw.alias(op, [step_loop(sorted(rw._remap(op.deps)))])
            else:  # the fp32 gradients arrive cast on the GPU; DeepSpeedCPUAdam writes the 16-bit copy in its pass
                rw.drop(op)
            continue
        if params and op.kind is OpKind.MEMCPY_H2D and op.name.endswith("offload_param.fetch"):
            deps = sorted(rw._remap(op.deps))
            r = swap(f"nvme.swap_in.{op.name.removesuffix('.offload_param.fetch')}", op.bytes_read, False,
                     PARAM_STREAM, deps, op.phase, layer=op.layer)
            rw.copy(op, extra_deps=[r])
            param_fetches += 1
            continue
        if params and not optimizer and op.kind is OpKind.HOST and op.name == "cpu.param_cast":
            c = rw.copy(op)  # CPU offload of the optimizer: the updated 16-bit partition goes back to NVMe
            rw.alias(op, [swap("nvme.swap_out.params", half * shard, True, PARAM_STREAM, [c], Phase.OPT)])
            continue
        rw.copy(op)
    if params and not param_fetches:
        raise PolicyError(f"{KEY}.offload_param: found no parameter fetches to feed from NVMe")
    drop = set()
    if optimizer:
        drop |= {"params.master_fp32.host", "optimizer.exp_avg.host", "optimizer.exp_avg_sq.host",
                 "offload.grad_partition.fp32"}  # the fp32 gradients go to the drives
    if params:
        drop |= {"offload.param_staging.bf16"}
    persistent = [t for t in graph.persistent if t.name not in drop]
    if optimizer:
        persistent.append(TensorAlloc("nvme.optimizer_swap_buffers", 4 * optimizer_buffers * max(sizes), "host_pinned"))
    if params:
        persistent.append(TensorAlloc("nvme.param_swap_buffers", half * param_buffers * param_buffer_size,
                                      "host_pinned"))
    meta = dict(graph.meta)
    meta["offload_nvme"] = {"optimizer": optimizer, "params": params, "sub_groups": len(sizes),
                            "read_bytes_per_step": totals["read"], "write_bytes_per_step": totals["write"]}
    return rw.finish(persistent=persistent, meta=meta)


@register_runtime("offload_nvme")
class NvmeSummary:
    """Adds the ``nvme`` link and the per-step NVMe figures to the summary."""

    def __init__(self, cfg, hw, env, system):
        self.hw = hw
        self.ranks = offload_ranks(hw)
        self.aio = cfg.aio
        self.aio_factor = aio_factor(hw, cfg.aio)
        system.network.add_links(nvme_links(hw, cfg.aio))
        system.network.add_weighted_name(NVME_WRITE, NVME_LINK, hw.nvme.write_cost)
        self.switch = rank_switch(hw)
        if self.switch is not None:
            self._share_switch(hw, system)
        self._bytes: dict[int, dict[str, float]] = {}

    def _share_switch(self, hw, system) -> None:
        """Put the swaps on this rank's PCIe switch uplink beside its GPU's copies: the ``pcie.uplink.*`` links are
        this rank's ``1 / sharers`` of the uplink (``hardware_models.host_links.UplinkShare``; added here for a lone
        GPU behind its switch). The node's ``ranks`` swap alike and RAID-0 puts ``drives_s / drives`` of every byte on
        the switch's drives, so one byte of this rank's swaps loads its share of the uplink by
        ``w = ranks x drives_s / (drives x sharers)`` (reads up, writes down, and both ways)."""
        from hardware_models.host_links import UplinkShare

        sw = hw.pcie_switches.switches[self.switch]
        if system.uplink is None:
            cluster = hw.collectives.topo.cluster if getattr(hw, "collectives", None) is not None else None
            gpu_link = cluster.pcie_bytes_per_s if cluster is not None else hw.pcie.bandwidth_bytes_per_s
            system.share_uplink(UplinkShare(f"pcie_switches[{self.switch}]", 1, sw.uplink_bytes_per_s, gpu_link))
        self.switch_weight = self.ranks * len(sw.drives) / (hw.nvme.drives * system.uplink.sharers)
        for name, link in SWITCH_NAMES.items():
            system.network.add_weighted_name(name, link, self.switch_weight)

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    def hooks(self) -> list:
        return [self]

    def on_op_end(self, op, step, system) -> None:
        """Count the NVMe bytes of each step (hook)."""
        m = op.meta or {}
        if "nvme_bytes" in m:
            d = self._bytes.setdefault(step, {"read": 0.0, "write": 0.0})
            d[m["nvme_dir"]] += m["nvme_bytes"]

    def summarize(self, spans, steps, counters, summary) -> dict:
        """``nvme_read_bytes_per_step`` / ``nvme_write_bytes_per_step`` (this rank's), ``nvme_busy_s`` (time an NVMe
        swap of the rank was in flight, per step) and ``nvme_bound_s`` (the node's swaps alone on the array:
        ``ranks x (read / read_bw + write / write_bw)``, the drives' time at the aio settings' rate,
        ``aio_factor``), means over the measured steps."""
        meas = [int(s) for s in steps[~steps.warmup].step]
        rd = [self._bytes.get(s, {}).get("read", 0.0) for s in meas]
        wr = [self._bytes.get(s, {}).get("write", 0.0) for s in meas]
        busy = []
        for s in meas:
            d = spans[(spans.step == s) & spans.name.str.startswith("nvme.")].sort_values("start_s")
            t, end = 0.0, -np.inf
            for a, b in zip(d.start_s, d.end_s):
                if b > end:
                    t += b - max(a, end)
                    end = b
            busy.append(t)
        mean = lambda v: float(np.mean(v)) if v else 0.0  # noqa: E731
        r, w = mean(rd), mean(wr)
        return {"nvme_read_bytes_per_step": r, "nvme_write_bytes_per_step": w, "nvme_busy_s": mean(busy),
                "nvme_bound_s": self.ranks * self.hw.nvme.busy_s(r, w, self.aio_factor)}

    def warnings(self) -> list[str]:
        """What the NVMe price assumes (one line)."""
        nv, a = self.hw.nvme, self.aio
        up = (f"behind upstream PCIe links of {nv.uplink_bytes_per_s / 1e9:.1f} GB/s per direction, "
              f"{nv.drives_per_uplink} drives each (at most {nv.uplink_read_bytes_per_s / 1e9:.1f} GB/s for the "
              "striped array)" if nv.fullest_uplink else "each on its own root port (the host preset states no "
              "shared upstream link)")
        return [f"NVMe offload: {nv.drives} x {nv.drive.name} striped (RAID-0, {nv.source or 'hardware.nvme'}) taken "
                f"at {nv.read_bytes_per_s / 1e9:.1f} GB/s read, {nv.write_bytes_per_s / 1e9:.1f} GB/s write (drives x "
                f"datasheet sequential rates), {up}, shared by {self.ranks} rank(s) of the node, reads and writes "
                "sharing the drives' time; the swaps' DMA shares host DRAM (host.dram) with the CPU step and the GPU "
                f"copies; DeepSpeed's aio settings reach {self.aio_factor:.1%} of the drives' rate "
                f"({self.ranks} x {a.thread_count} thread(s) x queue_depth {a.queue_depth} x {a.block_size} B "
                f"{'overlapped' if a.overlap_events else 'in batches'} against a {nv.drive.read_latency_s * 1e6:g} us "
                f"request latency, hardware_models.aio{self._knee_note()}); {self._switch_note()}; not priced: "
                "aio.single_submit, a write latency of its own"]

    def _knee_note(self) -> str:
        """The warning's caveat when the aio settings leave the array below its rate (the model's knee)."""
        if self.aio_factor >= 1.0:
            return ""
        return (": below saturation the rate rests on the drive's request latency (the storage preset's "
                "read_latency_s; fitted on a datacenter drive's 512 KiB depth sweep it is 154 us, axboe/fio#406) and "
                "on every request in flight being served in parallel, which fits that drive within 1.1 % but "
                "over-predicts a DRAM-less consumer drive by up to 76 % at queue depth 4 (0xBakeer/deepseek-v41-"
                "flash-spark#2); measure the array with DeepSpeed's ds_nvme_tune for a prediction")

    def _switch_note(self) -> str:
        """The warning's words on the PCIe switches the drives share with the GPUs."""
        topo = getattr(self.hw, "pcie_switches", None)
        if topo is None:
            return ("not modelled: the drives' PCIe switch uplinks shared with the GPUs' copies (the host states no "
                    "pcie_switches)")
        held = [sw for sw in topo.switches if sw.drives]
        if not held:
            return f"the host's PCIe switches ({topo.source}) hold no drive: the swaps share no switch uplink"
        kinds = {(len(sw.gpus), len(sw.drives), sw.uplink_bytes_per_s) for sw in held}
        rest = ("" if len(kinds) == 1 and len(held) == len(topo.switches) else
                ": the switches differ, and on the others the drives' share is bounded by their uplinks alone, "
                "without their GPUs' copies (exact when every switch holds the same GPUs and drives)")
        if self.switch is None:
            return ("this rank's GPU shares no PCIe switch with a drive; the drives' switch uplinks bound the "
                    "striped swaps (nvme.uplink.*) without those switches' GPUs' copies (the host's pcie_switches, "
                    f"{topo.source})")
        sw = topo.switches[self.switch]
        return (f"this rank's GPU shares PCIe switch {self.switch} ({len(sw.drives)} of the {self.hw.nvme.drives} "
                f"drives, {sw.uplink_bytes_per_s / 1e9:g} GB/s uplink per direction; the host's pcie_switches, "
                f"{topo.source}) with the swaps: reads share its uplink with the D2H copies, writes with the H2D "
                f"copies, both with its two-way limit{rest}")
