"""ZeRO-Offload: fp32 master weights and Adam state on the host, the Adam step on the CPU.

Selected by ``zero_optimization.offload_optimizer.device: cpu`` (DeepSpeed names; see
``simulator.config.sections.offload``). The policy rewrites the built step graph:

* **Precision**: bf16 or fp16 (DeepSpeed's 2020 ZeRO-Offload ran fp16 with dynamic loss scaling); the
  sizes are the same (2 B), "bf16" in the names below stands for the 16-bit dtype. fp16's overflow
  check of the gradients (DeepSpeed ``update_overflow_tracker_for_param_grad``: ``grad.float().sum()``
  per parameter on the GPU) is not charged.
* **GPU memory** keeps bf16 parameters and bf16 gradients only: the GPU fp32 master weights and
  Adam moments are dropped; the host gets the fp32 master weights and both moments (12 B/param),
  a bf16 gradient staging buffer and a bf16 parameter staging buffer (2 B/param each), all in
  ``host_pinned`` memory when ``pin_memory`` is true, else ``host_pageable`` (copies from pageable
  memory run at the driver's staging rate). The CPU step of the PyTorch implementations allocates fp32 gradients
  (4 B/param) and one fp32 temporary (``sqrt`` of the second moment); current DeepSpeed (``deepspeed_cpu_adam``) with
  fp32 state casts each gradient to fp32 on the GPU (``offload.grad_cast.*``, on the copy stream) and copies 4 B/param
  into its persistent fp32 gradient partition (``DS_FP32_GRAD_COPY``), no host cast.
  DeepSpeed's low-precision master weights (``fp16`` / ``bf16`` sections,
  ``simulator.config.sections.half_precision``; ``deepspeed_cpu_adam``): a 16-bit master (2 B/param) and its
  16-bit gradient partition (2 B), moments fp32 or bf16 (8 or 4 B), no fp32 gradients, no casts and no parameter
  staging buffer (``offload_optimizer``'s ``master`` / ``states``, ``cpu_step_work``).
* **Gradient copies** D2H on stream ``d2h``, one per parameter tensor (as ``p.grad`` hooks do)
  or per ``reduce_bucket_size`` elements, each waiting for the kernel that finishes that
  gradient (modes ``overlap`` and ``delayed_param_update``) or for the end of backward
  (``serial``). The fp32 ``.grad`` accumulation kernels of the bf16 builder are removed: with
  bf16 gradients on the GPU, autograd's AccumulateGrad stores the weight-gradient GEMM's output.
* **The CPU step**: three host ops, ``cpu.grad_cast`` (bf16 -> fp32 gradients; the torch loops only), ``cpu.adam``
  and ``cpu.param_cast`` (fp32 -> bf16 into the staging buffer), on stream ``host`` (the training
  thread, as ``torch.optim`` on CPU tensors blocks it) or, for DPU, on stream ``cpu.adam`` (a
  worker thread).
* **Parameter upload** H2D on stream ``h2d`` after the CPU step, one copy per layer (embeddings,
  each block, final norm/head, in forward order). Copies queued back-to-back on one stream
  pipeline their set-up on the copy engine, so the per-copy latency of the profile (measured on
  isolated, event-timed copies) is charged once per layer, not once per tensor.
* **DPU** (``delayed_param_update``): in step i the CPU updates the parameters with step i-1's
  gradients while the GPU runs step i; step i's gradient copies wait until the CPU has read
  step i-1's gradients out of the staging buffer, the upload waits for the end of step i's
  backward, and step i+1's forward waits for that upload (``meta["prev_step_deps"]``).

* **Data parallel** (``data_parallel_size`` > 1 on a cluster, ZeRO 1/2): each rank owns ``ceil(P /
  dp)`` parameters (host buffers, CPU step and upload are for that partition); the builder's
  gradient reduce-scatters run in bf16 and each is followed by the D2H copy of this rank's shard
  (DeepSpeed stage_1_and_2.py with ``offload_optimizer``); the updated partition goes up in one
  H2D copy and is all-gathered in one call per param group (``ZERO_PARAM_ALL_GATHER``). ZeRO-3 (the builder's
  ``sharding`` ``zero3``): the reduce-scatters already carry 16-bit gradients (kept as built), the
  GPU keeps the 16-bit parameter partition the shard is uploaded into (no whole-model copy, no
  gradient partition), and no all-gather follows the step but that of the persistent parameters
  (DeepSpeed stage3.py ``_post_step``): the next forward gathers block by block. The node's ranks share its host:
  ``cpu_threads`` / ``hardware_models.host_kernels.shared_stream_bandwidth`` and ``host_memory_oom``
  with ``offload_ranks``; the copies of the ranks behind one PCIe switch share its uplink (the
  engine's ``pcie.uplink.*`` links, ``hardware_models.host_links``).

* **DeepSpeed 0.3** (``cpu_adam_impl: deepspeed_cpu_adam_2020``, the ZeRO-Offload release, one rank):
  its stage2.py gradient path per ``reduce_bucket_size`` bucket (microsoft/DeepSpeed
  deepspeed/runtime/zero/stage2.py of 2020, ``FP16_DeepSpeedZeroOptimizer`` with ``cpu_offload``, e.g. commit
  00c3a254: ``reduce_ipg_grads`` -> ``copy_grads_in_partition``): GPU passes on the reduction stream
  (``DS03_PREP_READ`` / ``DS03_PREP_WRITE`` bytes per element: the ipg-buffer copy, ``div_``, the fp64
  gradient norm, the overflow check's fp32 sum, the fp32 cast), then a **fp32** D2H copy (4 B/param)
  into the pinned fp32 gradient partition; the training thread blocks on it (``_has_inf_or_nan``'s
  ``float(x.float().sum())`` per gradient and ``average_tensor``'s ``torch.cuda.synchronize()`` per
  bucket with ``overlap_comm``), so later backward kernels wait (``offload.grad_sync.*``). The CPU step
  has no gradient cast and begins with ``cpu.unscale_grads`` (``unscale_and_clip_grads``: ``mul_`` over
  the fp32 partition, 8 B/param; DeepSpeed's optimizer_gradients timer, not in the CPU Adam part).
* **Host DRAM**: the CPU ops stream their bytes over the rank's ``host.dram`` link (capacity
  ``hardware_models.host_kernels.host_dram_share``), which its host<->device copies also cross (DMA
  reads/writes host DRAM): a copy beside a CPU op takes its max-min share (``OffloadSummary``).

CPU time model: the host roofline of ``hardware_models.host_kernels`` (specs of the host preset,
two parameters fitted on the measured H200 host's single-tensor AdamW microbenchmark by
scripts/fit_host_cpu_model.py):

* ``cpu.adam``: the implementation's passes (``torch_foreach`` / ``torch_single``: 8 streaming
  passes, 80 B/param, the ``sqrt`` output (and for ``torch_single`` the ``div`` output) fresh
  every step; ``torch_fused``: one pass, 28 B/param; ``deepspeed_cpu_adam``: one pass, 30 B/param
  with the half-precision copy), each ``max(bytes / bandwidth, vector slots / SIMD throughput)``
  + page faults of fresh outputs, + one dispatch per tensor per pass at the host's per-op time.
* ``cpu.grad_cast``: bf16 -> fp32 gradients, 2 B read + 4 B written into fresh tensors
  (``g.to(torch.float32)`` each step, notes.offload); none with DeepSpeed (cast on the GPU, or a 16-bit master).
* ``cpu.param_cast``: fp32 -> bf16 into the preallocated pinned staging buffer, 6 B in place (fused
  into DeepSpeed's kernel: 0).
* Threads: the host's ``threads`` (default all physical cores of the nodes in use); under DPU
  the training thread takes one core from the pool (``cpu_threads``). Pinned state lives on one
  NUMA node (first touch by the allocating thread): its streams get one node's bandwidth.
"""

from __future__ import annotations

import numpy as np

from hardware_models.host_kernels import (
    DS2020_TILE_ELEMENTS,
    IMPLEMENTATIONS,
    StreamPass,
    adamw_step_parts,
    adamw_step_s,
    faulting_elements,
    host_dram_share,
    pass_parts,
    shared_stream_bandwidth,
)
from simulator.config.sections.half_precision import master_dtypes
from simulator.graph.builders.transformer import ZERO_PARAM_ALL_GATHER
from simulator.graph.op_graph import ModelFacts, OpGraph, with_page_faults
from simulator.graph.dtypes import DTYPE_BYTES
from simulator.graph.ops import CostClass, OpKind, OpRole, Phase, TensorAlloc
from simulator.policies._columns import value_masks
from simulator.policies._rewrite import GraphRewriter
from simulator.policies.registry import PolicyError, register_graph_policy, register_runtime

#: Eager per-tensor op dispatches of one step (hardware_models.host_kernels: passes + step counter).
ADAM_PASSES = {"torch_foreach": 9, "torch_single": 9, "torch_fused": 1, "deepspeed_cpu_adam": 1,
               "deepspeed_cpu_adam_2020": 1}
#: Training-thread cores the DPU worker loses: the training thread keeps launching GPU work on one
#: core while the CPU step runs on the intra-op pool (delayed_param_update only).
DPU_TRAINING_THREAD_CORES = 1

CPU_OPS = ("cpu.grad_cast", "cpu.adam", "cpu.param_cast")
#: DeepSpeed 0.3 (stage2.py, ZeRO-Offload's release) on each gradient of a reduce bucket, GPU bytes per element
#: (fp16 gradient, 2 B): the copy into the contiguous ipg buffer (2 r + 2 w), ``average_tensor``'s ``div_`` (2 + 2),
#: ``set_norm_for_param_grad_in_gpu``'s ``grad.double().norm(2)`` (2 r + 8 w, then 8 r), the overflow check
#: ``_has_inf_or_nan``: ``float(x.float().sum())`` (2 r + 4 w, then 4 r), and
#: ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``'s ``.float()`` (2 r + 4 w) before its fp32 D2H copy.
DS03_PREP_READ, DS03_PREP_WRITE = 22, 20
#: optimizer_gradients of DeepSpeed 0.3 with cpu_offload: ``unscale_and_clip_grads``, ``grad.data.mul_(1 / scale)``
#: over the fp32 gradient partition on the CPU (in place: 4 B read + 4 B written per element).
UNSCALE = StreamPass("fp32_grad.mul_(1/loss_scale)", 4.0, 4.0)
#: The rank's host DRAM link: its CPU ops' streams and its host<->device copies (``OffloadSummary``).
HOST_DRAM_LINK = "host.dram"
GRAD_CAST = StreamPass("grad.to(float32)", 2.0, 0.0, 4.0)
#: Current DeepSpeed with an fp32 master (``cpu_adam_impl: deepspeed_cpu_adam``): each gradient (ZeRO-1/2: this
#: rank's part of it; ZeRO-3: its reduced partition) is cast to the master dtype on the GPU, then that fp32 tensor is
#: copied into the host's fp32 gradient partition: GPU bytes per element read / written by the cast (2 r + 4 w), and
#: the D2H copy's (4). No cast on the host. deepspeedai/DeepSpeed@02aa38c3 deepspeed/runtime/zero/stage_1_and_2.py
#: ``async_inplace_copy_grad_to_fp32_buffer_from_gpu`` (``src_tensor.to(self.master_weights_and_grads_dtype)`` on the
#: GPU gradient, then ``dest_tensor.copy_(src_tensor, non_blocking=True)`` into ``single_partition_of_fp32_groups[i]
#: .grad``); @ea78ab68 deepspeed/runtime/zero/stage3.py ``_offload_grad_partition_at_boundary`` (``fp32_grad_tensor
#: .copy_(grad_buffer.to(dtype=self.master_weights_and_grads_dtype), non_blocking=True)``). A 16-bit master: no cast,
#: 2 B copied (the same lines, the dtypes equal).
DS_GPU_CAST_READ, DS_GPU_CAST_WRITE, DS_FP32_GRAD_COPY = 2, 4, 4
PARAM_CAST = StreamPass("param.copy_(bf16)", 4.0, 2.0)


# -- CPU time model ------------------------------------------------------------------------------
def offload_ranks(hw) -> int:
    """Ranks whose CPU optimizer steps (or NVMe swaps) share this rank's host: every GPU of its node, since every
    rank of an offloading run keeps its own part of the model states there. That holds at ``data_parallel_size`` 1
    too: FSDP ``cpu_offload`` shards over dp x cp, and with tp 4 x cp 2 the node's 8 ranks each offload their shard
    (ZeRO-Offload refuses tp, pp and cp > 1, so its ranks are its dp ranks). 1 without a cluster."""
    if getattr(hw, "collectives", None) is None or hw.world_size <= 1:
        return 1
    return max(1, min(hw.collectives.topo.gpus_per_node, hw.world_size))


def cpu_threads(hw, mode: str = "overlap", ranks: int = 1) -> int:
    """Intra-op threads one rank's CPU step gets.

    One rank: the host's ``threads``. ``ranks`` > 1 sharing the host: ``threads_used`` if set (per
    rank), else the available cores split evenly, ``cores_available // ranks`` (DeepSpeed runs one
    CPUAdam per rank; its launcher's ``--bind_cores_to_rank`` gives each rank ``cores / ranks`` cores,
    deepspeed/launcher/launch.py); with ``numa_node`` set every rank is bound to that node, whose cores
    they split. Under DPU the training thread takes one core from the rank's pool
    when the pool already covers every core it has (oversubscription: the two share it).

    Not bound (``hardware.host.bind_cores_to_rank: false``): each rank's pool is ``threads_used``, else every core
    of the host (no launcher sets ``OMP_NUM_THREADS``: torch's default pool is the physical cores). When the
    ranks' pools together exceed the cores (8 ranks x 112 threads on 112 cores) the kernel time-slices them, priced
    plainly: each rank's CPU step gets ``cores_available // ranks`` cores' worth of compute, per-core bandwidth
    and fault handling, the figure a bound rank gets (its memory bandwidth: ``host_kernels.shared_stream_bandwidth``,
    without NUMA locality). Not modelled, so the unbound step is a lower bound: OpenMP's barrier spin-waits
    (libgomp spins ``GOMP_SPINCOUNT`` 300,000 iterations before sleeping under the default ``OMP_WAIT_POLICY``; GCC
    libgomp manual, "GOMP_SPINCOUNT"), whose threads burn the time slices of the pools they share cores with, and
    the context switches and cache refills of the preempted threads (``oversubscribed_threads`` says so in the
    run's warnings)."""
    cpu = hw.host_cpu
    avail = cpu.cores_available if ranks == 1 else max(1, cpu.cores_available // ranks)
    # ranks x threads above the cores oversubscribes them: the threads time-share, so a rank's step runs on its
    # cores / ranks share (``oversubscribed_threads`` flags it in the run's warnings); unbound, a rank's pool
    # defaults to every core (so it is oversubscribed) and bound to its own cores / ranks
    t = cpu.threads if ranks == 1 else min(cpu.threads_used or (avail if cpu.bind_cores_to_rank else cpu.cores_available), avail)
    if mode == "delayed_param_update" and t >= avail:
        t = max(1, t - DPU_TRAINING_THREAD_CORES)
    return t


def oversubscribed_threads(hw, ranks: int) -> str | None:
    """A warning when ``ranks`` CPU steps of ``threads_used`` threads each (not bound, ``bind_cores_to_rank``
    false: every core when unset) need more than the host's cores, else None (``cpu_threads`` then gives each
    rank ``cores_available // ranks`` cores' worth, time-sliced)."""
    cpu = hw.host_cpu
    cores = cpu.cores_available  # the bound NUMA node's, else the host's
    unbound = not cpu.bind_cores_to_rank
    per_rank = cpu.threads_used or (cores if unbound else 0)
    if ranks <= 1 or not per_rank or per_rank * ranks <= cores:
        return None
    share = max(1, cores // ranks)
    where = f"the {cores} cores of NUMA node {cpu.numa_node}" if cpu.numa_node >= 0 else f"{cores} cores"
    what = (f"hardware.host.threads {cpu.threads_used}" if cpu.threads_used else
            f"hardware.host.bind_cores_to_rank false with threads not set ({cores}, torch's default pool)")
    note = (f"{what} x {ranks} ranks = {per_rank * ranks} CPU-step threads on {where}: oversubscribed, so each "
            f"rank's CPU step is priced time-sliced on {share} cores' worth (allowed without this note: threads <= {share})")
    if unbound:
        note += ("; not bound: its memory bandwidth is a share of the whole host's, interleaved over the NUMA nodes "
                 "with no extra cost for remote accesses (the host model has no inter-socket figure); not modelled: "
                 "OpenMP barrier spin-waits and context switches of the oversubscribed pools, so the CPU step is a "
                 "lower bound")
    return note


def cpu_step_times(params: int, n_tensors: int, impl: str, hw, *, tensor_elements=None, mode: str = "overlap",
                   pin_memory: bool = True, ranks: int = 1, master_bytes: int = 4,
                   state_bytes: int = 4) -> dict[str, float]:
    """Seconds of the three CPU ops of one offloaded optimizer step (host roofline, see
    ``hardware_models.host_kernels``).

    ``ranks``: ranks of the node running their CPU steps on this host at the same time (each on its
    own ``params``); they split the cores (``cpu_threads``) and share the memory bandwidth max-min
    fairly (``hardware_models.host_kernels.shared_stream_bandwidth``). 1: the host is this rank's.

    ``tensor_elements``: element count per parameter tensor (default: ``n_tensors`` equal ones),
    used for the page-fault term of fresh outputs (only tensors of 32 MiB and more fault each
    step). Pinned host buffers are allocated and first touched by the main thread, so Linux's
    first-touch policy puts them on ONE NUMA node (kernel doc admin-guide/mm/numa_memory_policy:
    the default policy allocates on the node of the touching CPU): their streams get one node's
    bandwidth. Pageable buffers filled by the intra-op pool spread over the threads' nodes.

    Raises:
        PolicyError: an unknown implementation.
    """
    return {k: v[0] for k, v in cpu_step_work(params, n_tensors, impl, hw, tensor_elements=tensor_elements, mode=mode,
                                              pin_memory=pin_memory, ranks=ranks, master_bytes=master_bytes,
                                              state_bytes=state_bytes).items()}


def cpu_step_work(params: int, n_tensors: int, impl: str, hw, *, tensor_elements=None, mode: str = "overlap",
                  pin_memory: bool = True, ranks: int = 1, master_bytes: int = 4,
                  state_bytes: int = 4) -> dict[str, tuple[float, float, float]]:
    """``cpu_step_times`` with each CPU op's host DRAM traffic: per op ``(seconds, dram_bytes, fault_s)``, its
    seconds alone, the DRAM bytes its passes stream and the first-touch page-fault seconds of its fresh outputs
    inside its seconds (``host_kernels.pass_parts``). The run moves ``dram_bytes`` over
    the rank's host DRAM link, shared with the DMA copies (``OffloadSummary``). ``deepspeed_cpu_adam_2020``: no
    gradient cast, plus ``cpu.unscale_grads`` (DeepSpeed 0.3's optimizer_gradients, ``UNSCALE``).

    ``master_bytes`` / ``state_bytes``: the master parameters' and gradients' / the Adam moments' bytes per element
    (4: fp32; 2: DeepSpeed's ``fp16_master_weights_and_grads`` / ``bf16_master_weights_and_grads`` and
    ``bf16_optimizer_states``, ``simulator.config.sections.half_precision``; ``deepspeed_cpu_adam`` only). With a
    16-bit master the gradients arrive in its dtype (no cast) and the kernel updates the 16-bit master in place
    (no separate half copy): ``deepspeed_cpu_adam`` moves ``2 + 2 + 2 s`` bytes read and ``2 + 2 s`` written per
    element (s = ``state_bytes``), 22 B with fp32 moments, 14 B with bf16 ones, against 30 B (no host cast either
    way with DeepSpeed: ``DS_FP32_GRAD_COPY``).

    Raises:
        PolicyError: an unknown implementation, or 16-bit master / moments with another implementation.
    """
    if (master_bytes, state_bytes) != (4, 4) and (impl != "deepspeed_cpu_adam" or master_bytes != 2):
        raise PolicyError(f"zero_optimization.offload_optimizer.cpu_adam_impl: 16-bit master weights / optimizer "
                          f"states need deepspeed_cpu_adam with a 16-bit master, got {impl!r}, master {master_bytes} B, "
                          f"moments {state_bytes} B")
    if impl not in IMPLEMENTATIONS:
        raise PolicyError(f"zero_optimization.offload_optimizer.cpu_adam_impl: unknown {impl!r}; "
                          f"allowed: {', '.join(IMPLEMENTATIONS)}")
    cpu = hw.host_cpu
    sizes = list(tensor_elements) if tensor_elements is not None else [params / max(n_tensors, 1)] * n_tensors
    launch = hw.launch.per_op_s
    t = cpu_threads(hw, mode, ranks)
    nodes = 1 if pin_memory else None
    bw = shared_stream_bandwidth(cpu, ranks, t, nodes)
    ds = impl.startswith("deepspeed")
    # DeepSpeed casts the gradients on the GPU (DS_FP32_GRAD_COPY; 0.3: DS03_PREP_WRITE) or not at all (a 16-bit
    # master): no host cast; the torch loops cast the copied 16-bit gradients on the host, into fresh tensors
    grad_cast = param_cast = (0.0, 0.0, 0.0)
    if not ds:
        b, st, f = pass_parts(GRAD_CAST, params, cpu, t, nodes, faulting_elements(sizes, GRAD_CAST.fresh_bytes), bw)
        grad_cast = (st + f + n_tensors * launch, b, f)
        b, st, f = pass_parts(PARAM_CAST, params, cpu, t, nodes, None, bw)
        param_cast = (st + f + n_tensors * launch, b, f)
    low = state_bytes_kwargs(master_bytes, state_bytes)
    adam = adamw_step_parts(cpu, impl, sizes, dispatch_s=launch, threads=t, memory_nodes=nodes,
                            bandwidth_bytes_per_s=bw, **low)
    out = {"cpu.grad_cast": grad_cast, "cpu.adam": adam, "cpu.param_cast": param_cast}
    if impl == "deepspeed_cpu_adam_2020":  # DeepSpeed 0.3: its optimizer_gradients unscale the fp32 partition
        # first (``UNSCALE``, not part of the CPU Adam)
        b, st, f = pass_parts(UNSCALE, params, cpu, t, nodes, None, bw)
        out["cpu.unscale_grads"] = (st + f, b, f)
    return out


def state_bytes_kwargs(master_bytes: int, state_bytes: int) -> dict:
    """``adamw_step_parts`` keywords of the host state's dtypes (``cpu_step_work``): none for fp32; a 16-bit master
    is the parameter and gradient DeepSpeed's kernel reads, updated in place (no half copy)."""
    if master_bytes == 4:
        return {}
    return {"param_bytes": master_bytes, "grad_bytes": master_bytes, "copy_bytes": 0, "state_bytes": state_bytes}


def cpu_adam_rate(params: float, impl: str, hw, mode: str = "overlap", pin_memory: bool = True,
                  ranks: int = 1, master_bytes: int = 4, state_bytes: int = 4) -> tuple[float, str]:
    """AdamW throughput of one rank on one tensor of ``params`` parameters, params/s, and how it was
    got (``ranks``: ranks sharing the host; the dtypes' bytes: see ``cpu_step_work``)."""
    t = cpu_threads(hw, mode, ranks)
    nodes = 1 if pin_memory else None
    low = state_bytes_kwargs(master_bytes, state_bytes)
    s = adamw_step_s(hw.host_cpu, impl, [params], threads=t, memory_nodes=nodes,
                     bandwidth_bytes_per_s=shared_stream_bandwidth(hw.host_cpu, ranks, t, nodes), **low)
    shared = f", host shared by {ranks} ranks" if ranks > 1 else ""
    return params / s, f"host roofline ({hw.host_cpu.name}, {t} threads{shared})"


def param_tensor_sizes(graph: OpGraph) -> list[int]:
    """Elements of each parameter tensor of the built graph (what a per-parameter loop iterates over): the
    builder's ``param_groups``, so the layout follows the model (GQA, SwiGLU, RMSNorm, untied head; was a GPT-2
    formula that gave a Llama one tensor too many and 2% fewer elements); sums to ``graph.model.num_parameters``."""
    return [p.numel for p in graph.param_groups]


# -- gradients of the built graph ------------------------------------------------------------------
def _model(graph: OpGraph, key: str) -> ModelFacts:
    if graph.model is None:
        raise PolicyError(f"{key}: needs a graph from the model builder (this one is {graph.source or 'unknown'})")
    return graph.model


def gradients(graph: OpGraph) -> list[dict]:
    """Gradients in the order backward completes them, as ZeRO-Offload copies them with 16-bit gradients on the
    GPU: producer op (new id), bf16 bytes, GPU tensor kept alive until the copy (or None), layer, name.

    Read from the builder's ``param_groups`` and op roles (``OpRole``), never from op names. A group finished by
    a ``GRAD_ACCUM`` op (fp32 ``.grad`` accumulation, which the rewrite removes) is produced by the op that wrote
    the tensor the accumulation reads: a ``WEIGHT_GRAD`` GEMM (its bf16 output is the gradient tensor) or, for the
    token table, the embedding backward; with tied embeddings the table's gradient lives in the LM head's
    ``WEIGHT_GRAD`` output (the latest weight gradient outside the blocks that no group claims). Groups finished by
    the same op (a norm's weight and bias) are one gradient. The bytes add up to ``2 * num_parameters`` (checked).

    Raises:
        PolicyError: not a builder graph, or a layout whose gradients do not add up to the model's parameters.
    """
    key = "zero_optimization.offload_optimizer"
    model = _model(graph, key)
    ops = graph.ops
    writer = {t.name: op.id for op in ops for t in op.allocs}
    found: dict[int, dict] = {}  # by producer op
    tied: list[dict] = []
    claimed: set[int] = set()
    for pg in graph.param_groups:
        done = ops[pg.grad_op]
        producer, tensor = done.id, None
        if done.role is OpRole.GRAD_ACCUM and done.uses and done.uses[0] in writer:
            producer = writer[done.uses[0]]
            if ops[producer].role is OpRole.WEIGHT_GRAD:
                tensor = done.uses[0]
                claimed.add(producer)
        g = found.get(producer)
        if g is None:
            g = found[producer] = {"op": producer, "bytes": 0, "tensor": tensor, "layer": ops[producer].layer,
                                   "name": pg.name}
            if done.role is OpRole.GRAD_ACCUM and tensor is None and model.tied_embeddings:
                tied.append(g)
        else:
            g["name"] += f"+{pg.name}"
        g["bytes"] += 2 * pg.numel
    for g in tied:  # the tied LM head's weight gradient: no group of its own
        heads = [op.id for op in ops[:g["op"]] if op.role is OpRole.WEIGHT_GRAD and op.layer < 0
                 and op.id not in claimed and op.allocs]
        g["tensor"] = ops[heads[-1]].allocs[0].name if heads else None
    grads = sorted(found.values(), key=lambda g: g["op"])
    total = sum(g["bytes"] for g in grads)
    if total != 2 * model.num_parameters:
        raise PolicyError(
            f"{key}: found {total // 2} gradient elements in the graph, "
            f"expected {model.num_parameters} (unknown graph layout)"
        )
    return grads


# -- the policy -------------------------------------------------------------------------------------
def _enabled(cfg) -> bool:
    z = getattr(cfg, "zero_optimization", None)
    return z is not None and z.offload_optimizer.device in ("cpu", "nvme")


@register_graph_policy("offload_optimizer", order=30)
class OffloadOptimizer:
    """Rewrite a GPU-resident step into a ZeRO-Offload step (see the module docstring)."""

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    def transform(self, graph: OpGraph, cfg, hw) -> OpGraph:
        z = cfg.zero_optimization
        oo = z.offload_optimizer
        master, states = master_dtypes(cfg)
        return offload_optimizer(graph, hw, mode=z.offload_mode, impl=oo.cpu_adam_impl, pin_memory=oo.pin_memory,
                                 bucket_elems=z.reduce_bucket_size, master=master, states=states)


def offload_optimizer(graph: OpGraph, hw, mode: str = "overlap", impl: str = "torch_foreach",
                      pin_memory: bool = True, bucket_elems: int | None = None, master: str = "fp32",
                      states: str = "fp32") -> OpGraph:
    """The rewrite itself, usable without a scenario (tests, notebooks).

    ``master`` / ``states``: the dtypes of the host's master parameters and gradients / Adam moments (DeepSpeed's
    ``fp16_master_weights_and_grads``, ``bf16_master_weights_and_grads``, ``bf16_optimizer_states``:
    ``simulator.config.sections.half_precision``). A 16-bit master: the host holds it (2 B/param) and the gradient
    partition in its dtype (2 B, what the D2H copies fill), no fp32 gradients and no parameter staging buffer (the
    master is copied up as it is, 2 B/param as before); moments 4 or 2 B each. With an fp32 master
    (``deepspeed_cpu_adam``) the gradients are cast on the GPU and copied in fp32 (``DS_FP32_GRAD_COPY``). The CPU
    step: ``cpu_step_work``.

    Host memory is a capacity, not a precondition: buffers that do not fit make an out-of-memory
    result (the engine's host pools, ``host_memory_oom``), as on the GPU.

    Raises:
        PolicyError: not a bf16 / fp16 builder graph, or an unknown mode.
    """
    key = "zero_optimization.offload_optimizer"
    model = _model(graph, key)
    if model.precision not in ("bf16", "fp16"):
        raise PolicyError(f"{key}: needs training.precision bf16 or fp16 (16-bit weights on the GPU), got "
                          f"{model.precision}")
    if mode not in ("serial", "overlap", "delayed_param_update"):
        raise PolicyError(f"{key}.mode: unknown mode {mode!r}; allowed: serial, overlap, delayed_param_update")
    P = model.num_parameters
    dp = model.data_parallel_size
    shard = -(-P // dp)  # this rank's ZeRO partition (DeepSpeed pads the flat buffer to dp)
    share = shard / P
    ranks = offload_ranks(hw)
    host_dev = "host_pinned" if pin_memory else "host_pageable"
    persistent = [t for t in graph.persistent if t.name not in
                  ("params.fp32", "params.master_fp32", "optimizer.exp_avg", "optimizer.exp_avg_sq")]
    zero3 = dp > 1 and graph.meta.get("sharding") == "zero3"
    if zero3:  # the reduced gradient partition lives in the host's fp32 buffer, not on the GPU
        persistent = [t for t in persistent if t.name not in ("grad.bf16.partition", "grad.fp16.partition")]
    half = f"params.{model.precision}"  # the builder's 16-bit weights (params.bf16 / params.fp16)
    if not zero3 and not any(t.name == half for t in persistent):
        persistent.append(TensorAlloc(half, 2 * P, "gpu"))
    mb, sb = DTYPE_BYTES[master], DTYPE_BYTES[states]
    low = master != "fp32"  # a 16-bit master: DeepSpeed's low-precision master weights (docstring)
    persistent += [
        TensorAlloc(f"params.master_{master}.host", mb * shard, host_dev),
        TensorAlloc("optimizer.exp_avg.host", sb * shard, host_dev),
        TensorAlloc("optimizer.exp_avg_sq.host", sb * shard, host_dev),
        # DeepSpeed 0.3 sends fp32 gradients into its pinned fp32 gradient partition (module docstring); current
        # DeepSpeed into its gradient partition in the master dtype (DS_FP32_GRAD_COPY), pinned with pin_memory
        (TensorAlloc("offload.grad_partition.fp32", 4 * shard, "host_pinned") if impl == "deepspeed_cpu_adam_2020"
         else TensorAlloc(f"offload.grad_partition.{master}", mb * shard, host_dev) if impl == "deepspeed_cpu_adam"
         else TensorAlloc("offload.grad_staging.bf16", 2 * shard, host_dev)),
    ] + ([] if low else [TensorAlloc("offload.param_staging.bf16", 2 * shard, host_dev)])

    grads = gradients(graph)
    buckets = _buckets(grads, bucket_elems) if dp == 1 else []
    by_producer: dict[int, list[list[dict]]] = {}
    for b in buckets:
        by_producer.setdefault(b[-1]["op"], []).append(b)
    bwd_ops = [op for op in graph.ops if op.phase == Phase.BWD and op.kind == OpKind.COMPUTE]
    last_bwd = bwd_ops[-1].id
    sizes = [n * share for n in param_tensor_sizes(graph)]
    work = cpu_step_work(shard, len(sizes), impl, hw, tensor_elements=sizes, mode=mode, pin_memory=pin_memory,
                         ranks=ranks, master_bytes=mb, state_bytes=sb)
    ds03 = impl == "deepspeed_cpu_adam_2020"  # DeepSpeed 0.3's stage2.py gradient path (module docstring)
    gpu_cast = impl == "deepspeed_cpu_adam" and not low  # current DeepSpeed, fp32 master: cast on the GPU
    grad_bytes = DS_FP32_GRAD_COPY if ds03 or gpu_cast else 2  # bytes per element of each gradient D2H copy
    if ds03 and dp > 1:
        raise PolicyError(f"{key}.cpu_adam_impl: deepspeed_cpu_adam_2020 models DeepSpeed 0.3's ZeRO-Offload on one "
                          f"GPU; data_parallel_size {dp} is not modelled with it (allowed: 1, or another cpu_adam_impl)")
    times = {k: v[0] for k, v in work.items()}
    dpu = mode == "delayed_param_update"
    ds2020 = impl == "deepspeed_cpu_adam_2020"
    if ds2020 and dpu:
        raise PolicyError(f"{key}.cpu_adam_impl: deepspeed_cpu_adam_2020 (DeepSpeed 0.3) predates "
                          "delayed_param_update; allowed modes: serial, overlap")
    if ds2020:  # the kernel's two pinned tile buffers (cudaMallocHost(TILE * sizeof(float)) each, cpu_adam.h)
        persistent.append(TensorAlloc("cpu_adam.doubled_buffer", 2 * 4 * DS2020_TILE_ELEMENTS, "host_pinned"))
    cpu_stream = "cpu.adam" if dpu else "host"
    rw = GraphRewriter(graph)
    tile_copies: list[int] = []

    def cpu_chain(deps: list[int]) -> list[int]:
        ids = []
        d = list(deps)
        if ds03:  # optimizer_gradients: unscale_and_clip_grads on the fp32 partition, before the CPU Adam
            d = [rw.add("cpu.unscale_grads", OpKind.HOST, cpu_stream, deps=d, phase=Phase.OPT,
                        host_s=times["cpu.unscale_grads"], launch=False, cost_class=CostClass.OPTIMIZER, dtype="fp32",
                        meta={"params": shard, **_dram_meta(work["cpu.unscale_grads"])})]
        for name in CPU_OPS:
            allocs, uses = (), ()
            if ds03 and name != "cpu.param_cast":
                pass  # the fp32 gradients are in the persistent pinned partition: nothing allocated per step
            elif impl == "deepspeed_cpu_adam":
                pass  # the gradients are in the persistent partition of the master dtype: nothing per step
            elif name == "cpu.grad_cast":
                allocs = (TensorAlloc("grad.fp32.host", 4 * shard, "host_pageable"),)
            elif name == "cpu.adam":
                uses = ("grad.fp32.host",)
                if impl in ("torch_foreach", "torch_single"):
                    allocs = (TensorAlloc("optimizer.sqrt_tmp.host", 4 * shard, "host_pageable"),)
            if ds2020 and name == "cpu.adam":  # tile by tile, each tile's fp16 copy sent while the next one runs
                for k, t0 in enumerate(range(0, shard, DS2020_TILE_ELEMENTS)):
                    n = min(DS2020_TILE_ELEMENTS, shard - t0)
                    i = rw.add(name, OpKind.HOST, cpu_stream, deps=d, phase=Phase.OPT, host_s=times[name] * n / shard,
                               launch=False, cost_class=CostClass.OPTIMIZER, allocs=allocs if k == 0 else (),
                               uses=uses, dtype="fp32", meta={"params": n, "impl": impl, "tile": k,
                                                              **_dram_meta(work[name], n / shard)})
                    tile_copies.append(rw.add(f"offload.h2d.params.tile{k}", OpKind.MEMCPY_H2D, "h2d", deps=[i],
                                              phase=Phase.OPT, cost_class=CostClass.COPY, bytes_read=float(2 * n),
                                              pinned=True, role=OpRole.PARAM_UPLOAD))
                    ids.append(i)
                    d = [i]
                continue
            i = rw.add(name, OpKind.HOST, cpu_stream, deps=d, phase=Phase.OPT, host_s=times[name], launch=False,
                       cost_class=CostClass.OPTIMIZER, allocs=allocs, uses=uses, dtype="fp32",
                       meta={"params": shard, "impl": impl, **_dram_meta(work[name])})
            ids.append(i)
            d = [i]
        return ids

    chain: list[int] = []
    if dpu:  # step i's CPU work (on step i-1's gradients) is issued first, on its own thread
        chain = cpu_chain([])
    d2h_ids: list[int] = []
    first_fwd: int | None = None

    def emit_copies(bucket_list, deps):
        for b in bucket_list:
            name = b[0]["name"] if len(b) == 1 else f"{b[0]['name']}..{b[-1]['name']}"
            uses = tuple(g["tensor"] for g in b if g["tensor"])
            n = sum(g["bytes"] for g in b) // 2
            if ds03:  # the bucket's GPU passes on the reduction stream, then its fp32 copy, the host blocked on it
                deps = [rw.add(f"offload.grad_prep.{name}", OpKind.COMPUTE, "d2h", deps=deps, phase=Phase.BWD,
                               layer=b[-1]["layer"], cost_class=CostClass.ELEMENTWISE, dtype="fp32",
                               bytes_read=float(DS03_PREP_READ * n), bytes_written=float(DS03_PREP_WRITE * n))]
            if gpu_cast:  # the bucket cast to fp32 on the copy's stream, then the fp32 copy (DS_FP32_GRAD_COPY)
                deps = [_gpu_cast(rw, f"offload.grad_cast.{name}", n, deps, b[-1]["layer"])]
            i = rw.add(f"offload.d2h.grad.{name}", OpKind.MEMCPY_D2H, "d2h", deps=deps + ([chain[0]] if dpu else []),
                       phase=Phase.BWD, layer=b[-1]["layer"], cost_class=CostClass.COPY,
                       bytes_read=float(grad_bytes * n), pinned=pin_memory, uses=uses)
            d2h_ids.append(i)
            if ds03:
                rw.add(f"offload.grad_sync.{name}", OpKind.SYNC, "host", deps=[i], phase=Phase.BWD, launch=False)

    for op in graph.ops:
        if op.phase == Phase.OPT:
            rw.drop(op)
            continue
        if op.phase == Phase.BWD and op.role is OpRole.GRAD_ACCUM:
            rw.drop(op)
            continue
        if op.name == "step.synchronize":
            break
        if dp > 1 and op.kind == OpKind.COLLECTIVE and (op.meta or {}).get("collective") == "reduce_scatter":
            # ZeRO-2 offload: the bucket is reduce-scattered in the model dtype (bf16: half the fp32
            # bytes of the builder), then this rank's reduced shard goes to the host's fp32 buffer
            # (DeepSpeed stage_1_and_2.py: copy_grads_in_partition -> async copy to the CPU buffer)
            # (ZeRO-3: the builder's reduce-scatters already carry the 16-bit gradients)
            # (DeepSpeed ZeRO-1/2 gradients already in the model dtype, zero_half_grads: kept as built too)
            half_built = zero3 or op.dtype in ("bf16", "fp16")
            nb = int(op.meta["bytes"]) if half_built else int(op.meta["bytes"]) // 2
            new = (rw.copy(op) if half_built else
                   rw.copy(op, bytes_read=float(nb), meta={**op.meta, "bytes": nb},
                           allocs=tuple(TensorAlloc(a.name, -(-a.nbytes // 2), a.device) for a in op.allocs)))
            tag = op.name.rsplit('.', 1)[-1]
            elems = -(-nb // dp) // 2  # this rank's reduced shard, 16-bit
            deps = [_gpu_cast(rw, f"offload.grad_cast.shard.{tag}", elems, [new], op.layer)] if gpu_cast else [new]
            i = rw.add(f"offload.d2h.grad.shard.{tag}", OpKind.MEMCPY_D2H, "d2h",
                       deps=deps + ([chain[0]] if dpu else []), phase=Phase.BWD, layer=op.layer,
                       cost_class=CostClass.COPY, bytes_read=float(grad_bytes * elems if gpu_cast else -(-nb // dp)),
                       pinned=pin_memory)
            d2h_ids.append(i)
            continue
        new = rw.copy(op)
        if first_fwd is None and op.kind == OpKind.COMPUTE and op.phase == Phase.FWD:
            first_fwd = new
        if mode != "serial" and op.id in by_producer:
            emit_copies(by_producer[op.id], list(rw.new(op.id)))
        if mode == "serial" and op.id == last_bwd:
            emit_copies(buckets, list(rw.new(op.id)))
    bwd_done = rw.add("offload.bwd_done", OpKind.SYNC, "host", deps=list(rw.new(last_bwd)) + d2h_ids,
                      phase=Phase.BWD, launch=False)
    if not dpu:
        chain = cpu_chain([bwd_done])
    h2d_ids = list(tile_copies)  # deepspeed_cpu_adam_2020: the fp16 parameters went up inside the step
    groups = [] if ds2020 else model.upload_groups if dp == 1 else [("shard", -1, shard)]  # flat partition
    for gname, layer, n in groups:
        deps = [chain[-1]] + (list(rw.new(last_bwd)) if dpu else [])
        h2d_ids.append(rw.add(f"offload.h2d.params.{gname}", OpKind.MEMCPY_H2D, "h2d", deps=deps, phase=Phase.OPT,
                              layer=layer, cost_class=CostClass.COPY, bytes_read=float(2 * n), pinned=pin_memory,
                              role=OpRole.PARAM_UPLOAD))
    ag_ids = []
    if zero3 or dp > 1:  # the builder's post-step all-gathers, after the uploads: ZeRO-3 gathers blocks on demand
        # in the next step, only the persistent (unpartitioned) parameters after it (DeepSpeed stage3.py _post_step);
        # ZeRO-1/2 every rank's updated 16-bit partition, one call per param group (ZERO_PARAM_ALL_GATHER)
        for op in graph.ops:
            if op.phase == Phase.OPT and (op.meta or {}).get("collective") == "all_gather" and (
                    zero3 or op.name.startswith(ZERO_PARAM_ALL_GATHER)):
                ag_ids.append(rw.add(op.name, OpKind.COLLECTIVE, op.stream, deps=h2d_ids, phase=Phase.OPT,
                                     bytes_read=op.bytes_read, dtype=op.dtype, meta=dict(op.meta)))
    sync_deps = [bwd_done] if dpu else h2d_ids + ag_ids
    rw.add("step.synchronize", OpKind.SYNC, "host", deps=sync_deps, phase=Phase.OTHER, launch=False)
    if dpu:
        rw.prev_step(chain[0], d2h_ids)  # step i's CPU work reads step i-1's gradients
        if first_fwd is not None:
            rw.prev_step(first_fwd, h2d_ids + ag_ids)  # step i+1 runs on the parameters uploaded in step i
    meta = with_page_faults(graph.meta, sum(v[2] for v in work.values()))  # each CPU op runs once a step
    meta["offload_optimizer"] = {"mode": mode, "impl": impl, "pin_memory": pin_memory, "cpu_s": times,
                                 "grad_copies": len(d2h_ids), "param_copies": len(h2d_ids),
                                 "params_per_rank": shard, "ranks_per_host": ranks,
                                 "adam_rate": cpu_adam_rate(shard, impl, hw, mode, pin_memory, ranks, mb, sb)}
    if low:
        meta["offload_optimizer"].update(master_dtype=master, state_dtype=states)
    return rw.finish(persistent=persistent, meta=meta)


def _gpu_cast(rw: GraphRewriter, name: str, elems: int, deps: list[int], layer) -> int:
    """Current DeepSpeed's GPU cast of ``elems`` 16-bit gradient elements to fp32 before their D2H copy, on the
    copy's stream (``DS_GPU_CAST_READ`` / ``DS_GPU_CAST_WRITE``); its transient fp32 output is not counted in the GPU
    memory."""
    return rw.add(name, OpKind.COMPUTE, "d2h", deps=deps, phase=Phase.BWD, layer=layer,
                  cost_class=CostClass.ELEMENTWISE, dtype="fp32", bytes_read=float(DS_GPU_CAST_READ * elems),
                  bytes_written=float(DS_GPU_CAST_WRITE * elems))


def _dram_meta(work: tuple[float, float, float], fraction: float = 1.0) -> dict:
    """Op meta of a CPU op's host DRAM stream (``cpu_step_work``), for ``fraction`` of its elements:
    ``dram_bytes`` (none for an op without DRAM traffic or time)."""
    seconds, nbytes, _ = work
    return {"dram_bytes": nbytes * fraction} if nbytes > 0 and seconds > 0 else {}


def _buckets(grads: list[dict], bucket_elems: int | None) -> list[list[dict]]:
    if not bucket_elems:
        return [[g] for g in grads]
    out, cur, n = [], [], 0
    for g in grads:
        cur.append(g)
        n += g["bytes"] // 2
        if n >= bucket_elems:
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def host_memory_oom(pinned_peak_bytes: float, pageable_peak_bytes: float, hw, ranks: int = 1,
                    what: tuple[str, str, str] = ("offload buffers", "fp32 master weights, Adam moments, staging",
                                                  "fp32 gradients, temporaries")) -> str | None:
    """One line naming what did not fit in host memory, or None: the pinned and pageable host
    buffers together against ``hardware.host`` memory (each pool alone is checked by the engine,
    like the GPU's). ``ranks``: ranks of the node whose buffers (this rank's, each) share the host.
    ``what``: the buffers, what the pinned pool holds, what the pageable pool holds (for the message)."""
    pinned_peak_bytes, pageable_peak_bytes = ranks * pinned_peak_bytes, ranks * pageable_peak_bytes
    total = pinned_peak_bytes + pageable_peak_bytes
    cap = hw.host_memory.capacity_bytes
    if total <= cap:
        return None
    who = f" for the node's {ranks} ranks" if ranks > 1 else ""
    return (f"out of memory on host: {what[0]}{who} need {total / 1e9:.2f} GB (pinned {pinned_peak_bytes / 1e9:.2f} GB: "
            f"{what[1]}; pageable {pageable_peak_bytes / 1e9:.2f} GB: {what[2]}) but hardware.host "
            f"({hw.host_cpu.name}) has {cap / 1e9:.2f} GB, short by "
            f"{(total - cap) / 1e9:.2f} GB")


# -- runtime summary ---------------------------------------------------------------------------------
@register_runtime("offload_optimizer")
class OffloadSummary:
    """Adds the offload parts of the step to the summary (and the DPU step period)."""

    #: the buffers the host out-of-memory line names (``host_memory_oom``'s ``what``)
    what = ("offload buffers", "fp32 master weights, Adam moments, staging", "fp32 gradients, temporaries")

    def __init__(self, cfg, hw, env, system):
        self.cfg, self.hw, self.env, self.system = cfg, hw, env, system
        #: this rank's share of the host DRAM its CPU step streams through and its copies' DMA reads or writes
        self.dram_bytes_per_s = host_dram_share(hw.host_cpu, offload_ranks(hw),
                                                1 if self.pinned(cfg) else None)
        system.add_copy_link(HOST_DRAM_LINK, self.dram_bytes_per_s)

    @classmethod
    def applies(cls, cfg) -> bool:
        return _enabled(cfg)

    @staticmethod
    def pinned(cfg) -> bool:
        """Whether the copied host buffers are page-locked (on one NUMA node, ``cpu_step_times``)."""
        return cfg.zero_optimization.offload_optimizer.pin_memory

    def host_handlers(self) -> dict:
        """Host ops run here: a CPU op with a DRAM stream (``meta["dram_bytes"]``, ``cpu_step_work``) is one flow
        of its bytes over the host DRAM link, at most at its average rate alone (``dram_bytes / host_s``: its page
        faults and per-tensor dispatch spread evenly over it, as they interleave with the streaming tensor by
        tensor), max-min fairly with the copies in flight; it takes ``host_s`` exactly when nothing shares the
        link. A host op with ``meta["flow"]`` (``{links, units, latency_s}``) is that flow over the rank's links
        (an NVMe swap, ``offload_nvme``). Other host ops take ``host_s``."""
        return {OpKind.HOST: self._host_op}

    def _host_op(self, op, step):
        meta = op.meta or {}
        flow = meta.get("flow")
        if flow:  # a transfer a policy puts on the host's own links (an NVMe swap: simulator/policies/offload_nvme.py)
            yield from self.system.network.transfer(flow["units"], tuple(flow["links"]), flow.get("latency_s", 0.0))
            return
        nbytes = meta.get("dram_bytes", 0.0)
        if nbytes:
            yield from self.system.network.transfer(nbytes, (HOST_DRAM_LINK,), 0.0, nbytes / op.host_s)
        elif op.host_s > 0:
            yield self.env.timeout(op.host_s)

    def summarize(self, spans, steps, counters, summary) -> dict:
        out = offload_parts(spans, steps)
        host_oom = host_memory_oom(summary.get("peak_host_pinned_bytes", 0), summary.get("peak_host_pageable_bytes", 0),
                                   self.hw, offload_ranks(self.hw), what=self.what)
        if host_oom and not summary.get("oom"):
            out["oom"] = host_oom
        return out


def offload_parts(spans, steps) -> dict:
    """Per-step parts of an offloaded step, averaged over measured steps (seconds).

    ``offload_gpu_fwd_bwd_s``: step start to the end of backward and its gradient copies (the
    measured run's "forward+backward incl. synchronize"); ``offload_cpu_optimizer_s``: the CPU ops (with
    ``deepspeed_cpu_adam_2020``, plus the in-step fp16 copies still running after the last CPU op: DeepSpeed's
    timers synchronize the device before they stop);
    ``offload_h2d_s``: first to last parameter-upload byte; ``offload_d2h_wait_s``: end of the last
    backward kernel to the end of the last gradient copy.

    Computed on the span columns once: each distinct name is classified once (``_columns.value_masks``), and each step's
    rows are one slice of the spans in step order (the frame's order kept within a step), so every max, min and
    sum takes the same values in the same order as filtering the frame step by step.
    """
    parts = {"offload_gpu_fwd_bwd_s": [], "offload_cpu_optimizer_s": [], "offload_h2d_s": [], "offload_d2h_wait_s": []}
    done_m, h2d_m, tile_m, cpu_m = value_masks(spans["name"].to_numpy(object), (
        lambda n: n == "offload.bwd_done", lambda n: n.startswith("offload.h2d.params"),
        lambda n: n.startswith("offload.h2d.params.tile"), lambda n: n in CPU_OPS))
    bwd_m = (spans["phase"].to_numpy(object) == "bwd") & (spans["stream"].to_numpy(object) == "compute")
    step_all = spans["step"].to_numpy()
    order = np.argsort(step_all, kind="stable")
    step_sorted = step_all[order]
    start, end, dur = (spans[c].to_numpy(float)[order] for c in ("start_s", "end_s", "duration_s"))
    done_m, h2d_m, tile_m, cpu_m, bwd_m = (m[order] for m in (done_m, h2d_m, tile_m, cpu_m, bwd_m))
    meas = ~steps.warmup.to_numpy(bool)
    for step, step_start in zip(steps.step.to_numpy()[meas].tolist(), steps.start_s.to_numpy()[meas].tolist()):
        r = slice(int(np.searchsorted(step_sorted, step, "left")), int(np.searchsorted(step_sorted, step, "right")))
        e, s_ = end[r], start[r]
        done, bwd, h2d, tiles, cpu = (m[r] for m in (done_m, bwd_m, h2d_m, tile_m, cpu_m))
        if done.any():
            done_end = float(e[done].max())
            bwd_end = float(e[bwd].max()) if bwd.any() else np.nan  # NaN: no backward kernel (max(0.0, NaN) is 0.0)
            parts["offload_gpu_fwd_bwd_s"].append(done_end - step_start)
            parts["offload_d2h_wait_s"].append(max(0.0, done_end - bwd_end))
        has_cpu = cpu.any()
        tail = max(0.0, float(e[tiles].max()) - float(e[cpu].max())) if tiles.any() and has_cpu else 0.0
        parts["offload_cpu_optimizer_s"].append(float(dur[r][cpu].sum()) + tail if has_cpu else 0.0)
        if h2d.any():
            parts["offload_h2d_s"].append(float(e[h2d].max() - s_[h2d].min()))
    out = {k: float(np.mean(v)) if v else 0.0 for k, v in parts.items()}
    return out
