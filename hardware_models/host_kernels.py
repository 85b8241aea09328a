"""Roofline of host streaming kernels: the CPU optimizer step of ZeRO-Offload, from the host's specs.

An optimizer step over ``P`` parameters is a sequence of *passes*, each a streaming kernel over
every element (one per ``torch._foreach_*`` op for PyTorch's foreach AdamW, one fused pass for
``torch.optim.AdamW(fused=True)`` on CPU and for DeepSpeed's CPUAdam). One pass takes::

    t = max(bytes / bw(threads, memory nodes), vector slots / (threads x clock x FMA pipes x lanes))
        + fresh pages x page_fault_s / threads          (first touch of freshly mmap-ed outputs)

and the step adds ``n_tensors x n_dispatches x dispatch_s`` of Python/ATen dispatch on top.

* ``bw = min(threads x per_core_bandwidth, memory nodes x node sustained bandwidth)``: one core
  cannot saturate a socket (its outstanding-miss slots bound it, Little's law); the memory the
  step streams lives on ``memory nodes`` NUMA nodes. Sustained node bandwidth = channels x MT/s
  x 8 B x ``sustained_bandwidth_fraction`` (or the host's fitted ``stream_bandwidth_bytes_per_s``).
* Bytes are DRAM traffic per element: every operand read, every output written; in-place outputs
  need no write-allocate read (the line was just read), fresh outputs are charged as written bytes.
* Fresh outputs fault on first touch every step when the pass's fresh outputs, freed together at
  the end of the step, add up to 32 MiB or more: those of 32 MiB and more are ``mmap``-ed and
  ``munmap``-ed on free, and a freed heap top above ``M_TRIM_THRESHOLD`` (dynamic, up to twice
  the mmap threshold) is returned to the kernel by ``free`` (glibc malloc: mallopt(3),
  ``DEFAULT_MMAP_THRESHOLD_MAX`` = 32 MiB on 64-bit). Smaller totals are recycled from the heap.

Constants (all overridable per host preset):

* ``DEFAULT_SUSTAINED_FRACTION`` 0.8: STREAM triad sustains 75-85 % of the DRAM peak on
  multi-channel servers (McCalpin, STREAM benchmark, https://www.cs.virginia.edu/stream/ -- e.g.
  the published 2-socket Xeon results; Intel's own figure for Xeon Scalable 8180: 199 GB/s triad
  of 256 GB/s peak = 78 %, Intel *Xeon Scalable Platform Performance* brief, 2017).
* ``DEFAULT_PER_CORE_BANDWIDTH_BYTES_PER_S`` 12 GB/s: single-core STREAM on 2017-2023 server
  cores is 10-20 GB/s (McCalpin, "Memory Bandwidth and System Balance in HPC Systems", SC16
  invited talk: single-core bandwidth is concurrency-limited, Little's law with ~10-20 outstanding
  L1 misses x 64 B / ~80-100 ns). Assumed for hosts without a measurement.
* ``DEFAULT_PAGE_FAULT_S``: fitted on the measured H200 host (scripts/fit_host_cpu_model.py);
  hosts without their own value borrow it (an assumption: bare-metal faults are likely cheaper
  than in that KVM guest).
* Vector slots per element: an FMA/add/mul = 1 slot; ``sqrt`` 6 and ``div`` 5 slots (reciprocal
  throughput of VSQRTPS / VDIVPS zmm on Skylake-X, Agner Fog, *Instruction tables*, 2022).
* Scalar passes (``StreamPass.scalar_cycles``): core cycles per element of scalar code, on
  ``threads`` cores at the host's clock, added to the vector time. DeepSpeed 0.3's ``(__half)``
  copy-back: CUDA's host ``__float2half`` (cuda_fp16.hpp, the non-``__CUDA_ARCH__`` path, compiled by
  the host compiler in a .cpp): a software conversion whose normal-number path is ~22 integer
  instructions (bit copy, mask, sign shift, three range compares, shift/subtract/or of the exponent,
  the round-to-nearest-even compare and increment, the 16-bit store), and whose rounding branch
  depends on the dropped mantissa bits, so it is mispredicted about every second element.
  ``HALF_CONVERT_INSTRUCTIONS`` 22.52 and ``HALF_CONVERT_MISPREDICTS`` 0.503 per element: counted by
  scripts/count_half_convert.py (re-runnable; ``--check`` compares its counts with these constants): DeepSpeed's
  4-way unrolled loop around a re-implementation of the host conversion, gcc 12.2 -O3, valgrind 3.19 callgrind
  ``--branch-sim=yes`` inside the loop only, on 2^20 N(0, 0.02^2) weights (22.522 instructions and 0.5026
  mispredicts per element; g++ -O3 of the same loop as C++ and gcc -O3 -march=haswell count the same, 22.52 and
  0.503; gcc vectorises it for no -march tried, skylake-avx512 included). At ``ISSUE_WIDTH`` 4 instructions per
  cycle (Skylake's rename width, Agner Fog, *The microarchitecture of Intel, AMD and VIA CPUs*, Skylake chapter)
  and ``MISPREDICT_CYCLES`` 15 (the low end of the 15-20 cycle Skylake misprediction penalty, same source): 13.175
  cycles per element, a lower bound (no other stall counted). The mispredict rate is the data's, not the
  simulated predictor's: the rounding branch follows the dropped mantissa bits, random for such weights, so any
  predictor misses it about every second element.
* DeepSpeed 0.3's AVX-512 loop divides twice per element (``_mm512_sqrt_ps(v) / bias2_sqrt``, then the
  momentum by ``+ eps``; csrc/adam/cpu_adam.cpp of the ZeRO-Offload release, ``Adam_Optimizer::Step``), where the
  later kernels multiply by a precomputed ``1 / sqrt(1 - beta2^t)`` (one division): ``DIV_SLOTS`` more vector
  slots per element for ``deepspeed_cpu_adam_2020``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hardware_models.fluid import maxmin_rates
from hardware_models.host import HostCpuSpec

DEFAULT_SUSTAINED_FRACTION = 0.8
DEFAULT_PER_CORE_BANDWIDTH_BYTES_PER_S = 12e9
#: Fitted on the measured H200 host by scripts/fit_host_cpu_model.py (copy of its preset's value).
DEFAULT_PAGE_FAULT_S = 6.18e-6
PAGE_BYTES = 4096
MMAP_THRESHOLD_BYTES = 32 * 2**20
SQRT_SLOTS, DIV_SLOTS = 6.0, 5.0
#: Counted by scripts/count_half_convert.py (module docstring).
HALF_CONVERT_INSTRUCTIONS, HALF_CONVERT_MISPREDICTS = 22.52, 0.503
ISSUE_WIDTH, MISPREDICT_CYCLES = 4.0, 15.0
#: Core cycles per element of DeepSpeed 0.3's scalar ``(__half)`` conversion (module docstring): 13.175.
HALF_CONVERT_CYCLES = HALF_CONVERT_INSTRUCTIONS / ISSUE_WIDTH + HALF_CONVERT_MISPREDICTS * MISPREDICT_CYCLES

#: Optimizer implementations the model prices.
IMPLEMENTATIONS = ("torch_foreach", "torch_single", "torch_fused", "deepspeed_cpu_adam", "deepspeed_cpu_adam_2020")
#: Elements per tile of DeepSpeed's 2020 CPUAdam (csrc/includes/cpu_adam.h ``#define TILE (1024 * 1024 * 1024)``,
#: as released with ZeRO-Offload, DeepSpeed 0.3, September 2020): the fp16 copy-back is converted and sent per tile.
DS2020_TILE_ELEMENTS = 1024 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StreamPass:
    """One streaming kernel over every element, per element.

    Attributes:
        name: The op (``_foreach_lerp_``, ...).
        read_bytes: Bytes read per element.
        write_bytes: Bytes written in place per element.
        fresh_bytes: Bytes written into a freshly allocated output per element.
        slots: Vector instruction slots per element (FMA-pipe issue slots, see module docstring).
        scalar_cycles: Core cycles per element of scalar code (0: none; see module docstring).
    """

    name: str
    read_bytes: float
    write_bytes: float
    fresh_bytes: float = 0.0
    slots: float = 1.0
    scalar_cycles: float = 0.0

    @property
    def bytes(self) -> float:
        """DRAM bytes per element."""
        return self.read_bytes + self.write_bytes + self.fresh_bytes


def adamw_passes(impl: str, state_bytes: int = 4, grad_bytes: int = 4, copy_bytes: int = 2,
                 param_bytes: int | None = None) -> tuple[StreamPass, ...]:
    """The passes of one AdamW step, per element.

    ``state_bytes``: parameter / moment dtype size (fp32: 4); ``grad_bytes``: the gradient the
    step reads (torch: the same dtype as the parameters); ``copy_bytes``: DeepSpeed's fp16/bf16
    parameter copy written by its fused kernel (0: none); ``param_bytes``: ``deepspeed_cpu_adam`` only, the
    (master) parameter's size when it differs from the moments' (None: ``state_bytes``). DeepSpeed's CPUAdam
    kernel reads and writes the parameter and gradient in one dtype and both moments in another, the pairs it
    has kernels for being (fp32, fp32), (fp16, fp32), (fp16, fp16), (bf16, fp32) and (bf16, bf16)
    (deepspeedai/DeepSpeed@1640828d csrc/adam/cpu_adam_impl.cpp ``Step_1`` / ``InvokerInitializer``); its
    16-bit loads and stores convert to and from fp32 in registers, vector work not counted here (the step
    stays memory-bound: 19 slots per element against 8-22 DRAM bytes). Sources: ``torch/optim/adamw.py``
    ``_multi_tensor_adamw`` (foreach: mul_ weight decay, lerp_ exp_avg, mul_ + addcmul_
    exp_avg_sq, sqrt into a new list, div_, add_, addcdiv_ params), ``_single_tensor_adamw``
    (the same with ``exp_avg_sq.sqrt() / bc`` making two new tensors), ``_fused_adamw`` (one
    kernel, aten/src/ATen/native/cpu/FusedAdamKernel.cpp) and DeepSpeed csrc/adam/cpu_adam.cpp
    (``Step_AVX``: one pass over param, grad, exp_avg, exp_avg_sq, writing param and moments, plus
    the half-precision copy; Ren et al., ZeRO-Offload, ATC'21, section 4.1); ``deepspeed_cpu_adam_2020``:
    the kernel released with ZeRO-Offload (DeepSpeed 0.3, 2020), whose half copy is a second pass per tile.

    Raises:
        ValueError: an unknown implementation.
    """
    s, g = float(state_bytes), float(grad_bytes)
    w = s if param_bytes is None else float(param_bytes)
    if param_bytes is not None and impl != "deepspeed_cpu_adam":
        raise ValueError(f"param_bytes other than the state's: deepspeed_cpu_adam only, got {impl!r}")
    if impl in ("torch_foreach", "torch_single"):
        single = impl == "torch_single"
        return (
            StreamPass("mul_(weight decay)", s, s),
            StreamPass("lerp_(exp_avg)", s + g, s, slots=2),
            StreamPass("mul_(exp_avg_sq)", s, s),
            StreamPass("addcmul_(exp_avg_sq)", s + g, s, slots=2),
            StreamPass("sqrt", s, 0.0, s, slots=SQRT_SLOTS),
            StreamPass("div", s, 0.0 if single else s, s if single else 0.0, slots=DIV_SLOTS),
            StreamPass("add_(eps)", s, s),
            StreamPass("addcdiv_(params)", 3 * s, s, slots=1 + DIV_SLOTS),
        )
    if impl == "torch_fused":
        return (StreamPass("_fused_adamw", 3 * s + g, 3 * s, slots=8 + SQRT_SLOTS + DIV_SLOTS),)
    if impl == "deepspeed_cpu_adam":
        return (StreamPass("Step_AVX", w + 2 * s + g, w + 2 * s + copy_bytes, slots=8 + SQRT_SLOTS + DIV_SLOTS),)
    if impl == "deepspeed_cpu_adam_2020":
        # the ZeRO-Offload release kernel: the AVX-512 loop over a tile stores fp32 param and moments only; a second
        # OpenMP loop then reads the tile's fp32 params back (a 1 Gi-element tile is far beyond the caches) and
        # writes (__half) copies into a pinned double buffer, sent by cudaMemcpyAsync (csrc/adam/cpu_adam.cpp
        # Adam_Optimizer::Step / Step_4 / Step_8, ``if (dev_params)`` block), one scalar host __float2half each
        # (HALF_CONVERT_CYCLES, module docstring).
        # its AVX-512 loop divides twice (``sqrt(v) / bias2_sqrt``, then by ``+ eps``; module docstring)
        return (StreamPass("Step_AVX", 3 * s + g, 3 * s, slots=8 + SQRT_SLOTS + 2 * DIV_SLOTS),
                StreamPass("(__half) copy into the pinned tile buffer", s, float(copy_bytes), slots=0.0,
                           scalar_cycles=HALF_CONVERT_CYCLES))
    raise ValueError(f"unknown optimizer implementation {impl!r}; allowed: {', '.join(IMPLEMENTATIONS)}")


def stream_bandwidth(cpu: HostCpuSpec, threads: int | None = None, memory_nodes: int | None = None) -> float:
    """DRAM bandwidth ``threads`` threads sustain on memory spread over ``memory_nodes`` nodes, bytes/s.

    Defaults: the host's threads; memory on every node the threads run on (1 when bound).
    """
    t = threads or cpu.threads
    nodes = memory_nodes or (1 if cpu.numa_node >= 0 else cpu.nodes)
    node_bw = cpu.sustained_bandwidth_bytes_per_s / cpu.nodes
    per_core = cpu.per_core_bandwidth_bytes_per_s or DEFAULT_PER_CORE_BANDWIDTH_BYTES_PER_S
    return min(t * per_core, nodes * node_bw)


def shared_stream_bandwidth(cpu: HostCpuSpec, ranks: int, threads: int | None = None,
                            memory_nodes: int | None = None) -> float:
    """DRAM bandwidth one of ``ranks`` processes streaming at once on this host gets, bytes/s.

    ``ranks`` == 1: :func:`stream_bandwidth`. ``ranks`` > 1 (several GPUs' ZeRO-Offload CPU steps on
    one host, DeepSpeed runs one ``DeepSpeedCPUAdam`` per rank): each rank is bound to one NUMA node,
    ranks in consecutive blocks per node (rank ``r`` on node ``r * nodes // ranks``; DeepSpeed's
    launcher ``--bind_cores_to_rank`` splits the node's cores evenly in rank order,
    deepspeed/launcher/launch.py), its memory local to that node (first touch, as for one rank). Each
    rank is one flow capped by its own ``threads x per-core bandwidth``; the flows share each node's
    sustained bandwidth max-min fairly (``hardware_models.fluid.maxmin_rates``, the solver of the link
    network and the CPU pool). Returns the smallest rank's share: the data-parallel step waits for
    the slowest rank. ``memory_nodes`` is ignored for ``ranks`` > 1 (one node per rank). With ``numa_node`` set
    (``numactl --cpunodebind=N --membind=N`` around the launcher) every rank runs and allocates on that node.

    Not bound (``bind_cores_to_rank`` false, ``numa_node`` unset): no NUMA locality. Each rank's threads float
    over every node's cores and its buffers lie wherever its threads and the scheduler put them, taken as spread
    evenly over all nodes (interleaved), so the ranks share the whole host's sustained bandwidth max-min fairly
    as one pool. The model has no inter-socket (UPI / xGMI) figure, so the remote half of those accesses costs
    no more than local ones: with ranks spread evenly over the nodes this gives the bound placement's figure (an
    upper bound of the unbound bandwidth); an uneven split (3 ranks on 2 nodes) gets the pooled share, not the
    crowded node's.

    Raises:
        ValueError: ``ranks`` < 1.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    t = threads or cpu.threads
    if ranks == 1:
        return stream_bandwidth(cpu, t, memory_nodes)
    per_core = cpu.per_core_bandwidth_bytes_per_s or DEFAULT_PER_CORE_BANDWIDTH_BYTES_PER_S
    node_bw = cpu.sustained_bandwidth_bytes_per_s / cpu.nodes
    if not cpu.bind_cores_to_rank and cpu.numa_node < 0:  # one pool: the memory interleaved over every node
        flows = [(("mem",), t * per_core) for _ in range(ranks)]
        caps = {"mem": cpu.sustained_bandwidth_bytes_per_s}
    else:
        flows = [((f"mem{cpu.numa_node if cpu.numa_node >= 0 else r * cpu.nodes // ranks}",), t * per_core)
                 for r in range(ranks)]
        caps = {f"mem{n}": node_bw for n in range(cpu.nodes)}
    return min(maxmin_rates(flows, caps))


def vector_slots_per_s(cpu: HostCpuSpec, threads: int | None = None) -> float:
    """Vector slots per second of ``threads`` threads (element-lanes of fp32): inf when the clock is unknown."""
    clock = cpu.vector_clock_hz
    if not clock:
        return float("inf")
    return (threads or cpu.threads) * clock * cpu.fma_units_per_core * cpu.simd_width_bits / 32.0


def scalar_s(cycles: float, cpu: HostCpuSpec, threads: int | None = None) -> float:
    """Seconds of ``cycles`` core cycles of scalar code split over ``threads`` cores at the host's clock
    (``vector_clock_hz``); 0 when the clock is unknown (as :func:`vector_slots_per_s`: not priced)."""
    clock = cpu.vector_clock_hz
    return cycles / ((threads or cpu.threads) * clock) if clock and cycles else 0.0


def pass_parts(p: StreamPass, elements: float, cpu: HostCpuSpec, threads: int | None = None,
               memory_nodes: int | None = None, fresh_elements: float | None = None,
               bandwidth_bytes_per_s: float | None = None) -> tuple[float, float, float]:
    """One pass over ``elements`` split for sharing the host's DRAM (:func:`pass_time_s` = the last two summed).

    Returns:
        ``(dram_bytes, stream_s, fault_s)``: the DRAM bytes the pass moves, its streaming time
        ``max(bytes / bandwidth, vector slots / SIMD throughput)`` (the part whose rate another DRAM user
        can slow down) and the first-touch page-fault time (kernel work, not DRAM bandwidth), seconds.
    """
    t = threads or cpu.threads
    nbytes = p.bytes * elements
    mem = nbytes / (bandwidth_bytes_per_s or stream_bandwidth(cpu, t, memory_nodes))
    flop = p.slots * elements / vector_slots_per_s(cpu, t) + scalar_s(p.scalar_cycles * elements, cpu, t)
    fresh = p.fresh_bytes * (elements if fresh_elements is None else fresh_elements)
    return nbytes, max(mem, flop), first_touch_s(cpu, fresh, t)


def first_touch_s(cpu: HostCpuSpec | None, nbytes: float, threads: int = 1) -> float:
    """Seconds ``threads`` threads spend faulting in ``nbytes`` of freshly mapped anonymous memory on
    their first write: one fault (kernel entry, page allocation, zeroing) per 4 KiB page, the pages
    split evenly between the threads. The host's ``page_fault_s`` (0, or no ``cpu``: ``DEFAULT_PAGE_FAULT_S``,
    see the module docstring). Used for a CPU kernel's fresh outputs and for a pageable device-to-host copy
    into a fresh buffer, whose staging memcpy in the calling thread takes the faults
    (``simulator.policies.recompute``).

    Raises:
        ValueError: ``nbytes`` < 0 or ``threads`` < 1.
    """
    if nbytes < 0 or threads < 1:
        raise ValueError(f"first_touch_s: nbytes must be >= 0 and threads >= 1, got {nbytes}, {threads}")
    return nbytes / PAGE_BYTES * ((cpu.page_fault_s if cpu else 0.0) or DEFAULT_PAGE_FAULT_S) / threads


def pass_time_s(p: StreamPass, elements: float, cpu: HostCpuSpec, threads: int | None = None,
                memory_nodes: int | None = None, fresh_elements: float | None = None,
                bandwidth_bytes_per_s: float | None = None) -> float:
    """Seconds of one pass over ``elements`` (``fresh_elements``: those whose fresh output faults;
    ``bandwidth_bytes_per_s``: the DRAM bandwidth this pass gets, default :func:`stream_bandwidth`)."""
    _, stream, fault = pass_parts(p, elements, cpu, threads, memory_nodes, fresh_elements, bandwidth_bytes_per_s)
    return stream + fault


def faulting_elements(tensor_elements, elem_bytes: float) -> float:
    """Elements of a pass's fresh outputs (``elem_bytes`` each) that fault: all of them when they
    total 32 MiB or more (returned to the kernel when freed together), else none."""
    n = float(sum(tensor_elements))
    return n if n * elem_bytes >= MMAP_THRESHOLD_BYTES else 0.0


def mmapped_elements(tensor_elements, elem_bytes: float) -> float:
    """Elements of tensors (``elem_bytes`` each) allocated and freed one at a time that fault on every allocation:
    those of 32 MiB and more, which glibc ``mmap``-s and ``munmap``-s on free (module docstring); smaller ones are
    recycled from the heap. :func:`faulting_elements` is the rule for tensors freed together."""
    return float(sum(n for n in tensor_elements if n * elem_bytes >= MMAP_THRESHOLD_BYTES))


def adamw_step_s(cpu: HostCpuSpec, impl: str, tensor_elements, *, dispatch_s: float = 0.0, threads: int | None = None,
                 memory_nodes: int | None = None, state_bytes: int = 4, grad_bytes: int = 4,
                 copy_bytes: int = 2, bandwidth_bytes_per_s: float | None = None,
                 param_bytes: int | None = None) -> float:
    """Seconds of one AdamW step over tensors of ``tensor_elements`` elements on ``cpu``.

    ``bandwidth_bytes_per_s``: DRAM bandwidth the step gets (default :func:`stream_bandwidth`; a
    rank sharing the host: :func:`shared_stream_bandwidth`).

    ``dispatch_s``: host time per op per tensor (Python + ATen dispatch); each pass of the
    PyTorch implementations dispatches once per tensor (foreach ops on CPU loop over tensors),
    plus the step-counter update; the fused implementations dispatch once per tensor.
    """
    return adamw_step_parts(cpu, impl, tensor_elements, dispatch_s=dispatch_s, threads=threads,
                            memory_nodes=memory_nodes, state_bytes=state_bytes, grad_bytes=grad_bytes,
                            copy_bytes=copy_bytes, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                            param_bytes=param_bytes)[0]


def adamw_step_parts(cpu: HostCpuSpec, impl: str, tensor_elements, *, dispatch_s: float = 0.0,
                     threads: int | None = None, memory_nodes: int | None = None, state_bytes: int = 4,
                     grad_bytes: int = 4, copy_bytes: int = 2,
                     bandwidth_bytes_per_s: float | None = None,
                     param_bytes: int | None = None) -> tuple[float, float, float]:
    """:func:`adamw_step_s` with the step's host DRAM traffic: ``(seconds, dram_bytes, fault_s)``, the step's
    seconds, the DRAM bytes its passes move and the first-touch page-fault seconds inside the seconds
    (:func:`pass_parts`)."""
    sizes = [float(n) for n in tensor_elements]
    P = sum(sizes)
    passes = adamw_passes(impl, state_bytes, grad_bytes, copy_bytes, param_bytes)
    total = nbytes = faults = 0.0
    for p in passes:
        fe = faulting_elements(sizes, p.fresh_bytes) if p.fresh_bytes else 0.0
        b, s, f = pass_parts(p, P, cpu, threads, memory_nodes, fe, bandwidth_bytes_per_s)
        total += s + f
        nbytes += b
        faults += f
    # one call per tensor for DeepSpeed's kernels (both loops run inside it)
    dispatches = 1 if impl.startswith("deepspeed") else len(passes) + (0 if impl == "torch_fused" else 1)
    return total + len(sizes) * dispatches * dispatch_s, nbytes, faults


def host_dram_share(cpu: HostCpuSpec, ranks: int = 1, memory_nodes: int | None = None) -> float:
    """Host DRAM bandwidth one rank's host traffic shares, bytes/s: its CPU streaming kernels and its GPU's
    DMA copies, which read (H2D) and write (D2H) host DRAM at the PCIe rate (a DMA engine's reads and writes go
    through the memory controllers like a core's: the root complex is a memory-controller client).

    One rank (``ranks`` == 1): the sustained bandwidth of the ``memory_nodes`` nodes its buffers live on
    (default as :func:`stream_bandwidth`). ``ranks`` > 1 placed as in :func:`shared_stream_bandwidth` (consecutive
    blocks per node): the node with the most ranks split evenly among them (symmetric ranks' equal flows: their
    max-min shares); not bound (``bind_cores_to_rank`` false): the host's sustained bandwidth split evenly among the
    ranks. The same sustained figure as the CPU step's roofline (``HostCpuSpec.sustained_bandwidth_bytes_per_s``:
    the fitted STREAM-like rate, or channels x MT/s x 8 B x the sustained fraction).

    Raises:
        ValueError: ``ranks`` < 1.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    node_bw = cpu.sustained_bandwidth_bytes_per_s / cpu.nodes
    if ranks == 1:
        return (memory_nodes or (1 if cpu.numa_node >= 0 else cpu.nodes)) * node_bw
    if cpu.numa_node >= 0:  # every rank bound to that node (shared_stream_bandwidth)
        return node_bw / ranks
    if not cpu.bind_cores_to_rank:  # not bound: the whole host's bandwidth as one pool (shared_stream_bandwidth)
        return cpu.sustained_bandwidth_bytes_per_s / ranks
    return node_bw / max(1, -(-ranks // cpu.nodes))
