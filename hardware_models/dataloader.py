"""The PyTorch input pipeline on the host: DataLoader workers, host CPU cores, storage.

A SimPy model of ``torch.utils.data.DataLoader`` (PyTorch 2.x ``_MultiProcessingDataLoaderIter``
and ``_SingleProcessDataLoaderIter``) with its argument names:

* ``num_workers == 0``: the training thread itself fetches every sample, collates and (with
  ``pin_memory``) pins the batch inside ``next(iterator)``: loading is serialised with training.
* ``num_workers > 0``: each worker is a process that builds *whole batches*: batch ``i`` of an
  epoch goes to worker ``i % num_workers``, and each worker handles its batches in order. At
  most ``prefetch_factor * num_workers`` batches are outstanding: when the training loop
  receives batch ``i``, the index of batch ``i + prefetch_factor * num_workers`` is sent (to the
  same worker). The training loop receives batches strictly in order (round-robin over the
  workers), whatever order they finish in.
* ``pin_memory``: with workers, one pin-memory thread in the training process copies each
  finished batch (in arrival order) into page-locked memory; without workers the training
  thread does it. The copy runs at the host's memcpy bandwidth.
* ``persistent_workers``: workers survive the end of an epoch; otherwise they are started again
  (paying ``worker_startup_s``) when the next epoch's iterator is created.
* ``drop_last``: with ``dataset_size`` set, the last partial batch of an epoch is dropped.

Per-sample cost = storage read (latency + bytes over the storage's shared bandwidth) + decode/
transform CPU seconds (constant, lognormal or an empirical list of measured samples); per batch,
collate (default collate: a memcpy of the batch plus ``collate_overhead_s``).

Host CPU cores are a *processor-sharing* pool (``CpuPool``): every runnable thread (workers, the
training thread while it is not blocked in ``next``, the pin-memory thread, other host work such
as a CPU optimizer step) gets ``min(1, cores / runnable)`` of a core. More workers than cores is
allowed (with a warning) and slows every thread accordingly.

Remote preprocessing (OVERLORD, tf.data service): with ``remote`` set, the workers run on other
hosts (their own core pool) and each finished batch crosses a network link to the trainer.

Nothing here imports the simulator: the runtime component in ``simulator.policies.dataloader``
connects this model to the step graph.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import simpy

from hardware_models import presets
from hardware_models.fabrics import FluidNetwork
from hardware_models.fluid import FluidScheduler

DISTRIBUTIONS = ("constant", "lognormal", "empirical")


class DataLoaderSpecError(ValueError):
    """Invalid DataLoader or sample-cost parameters (one line, naming the argument)."""


class OversubscribedCpuWarning(UserWarning):
    """More loader threads than host cores: allowed, modelled as processor sharing."""


# -- specs -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SampleCost:
    """CPU seconds to decode/transform one sample (``__getitem__`` after the read).

    Attributes:
        distribution: ``constant`` (``mean_s``), ``lognormal`` (mean ``mean_s``, log-space
            standard deviation ``sigma``) or ``empirical`` (drawn uniformly from ``samples_s``).
        mean_s: Mean CPU seconds per sample (constant and lognormal).
        sigma: Lognormal shape: standard deviation of ``log(cost)`` (> 0).
        samples_s: Measured per-sample seconds (empirical).
    """

    distribution: str = "constant"
    mean_s: float = 0.0
    sigma: float = 0.0
    samples_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        """Raises: DataLoaderSpecError: an unknown distribution or impossible parameters."""
        d = self.distribution
        if d not in DISTRIBUTIONS:
            raise DataLoaderSpecError(f"sample cost distribution must be one of {DISTRIBUTIONS}, got {d!r}")
        if d in ("constant", "lognormal") and not (self.mean_s >= 0 and math.isfinite(self.mean_s)):
            raise DataLoaderSpecError(f"sample cost mean_s must be a finite number >= 0, got {self.mean_s}")
        if d == "lognormal":
            if not (self.sigma > 0 and math.isfinite(self.sigma)):
                raise DataLoaderSpecError(
                    f"lognormal sample cost needs sigma > 0 (the standard deviation of log(cost)), got {self.sigma}")
            if self.mean_s <= 0:
                raise DataLoaderSpecError(f"lognormal sample cost needs mean_s > 0, got {self.mean_s}")
        if d == "empirical":
            if len(self.samples_s) == 0:
                raise DataLoaderSpecError("empirical sample cost needs a non-empty samples_s list of measured seconds")
            if any(not (s >= 0 and math.isfinite(s)) for s in self.samples_s):
                raise DataLoaderSpecError("empirical sample cost: every entry of samples_s must be a finite number >= 0")

    @property
    def expected_s(self) -> float:
        """Mean cost per sample, seconds."""
        if self.distribution == "empirical":
            return float(np.mean(self.samples_s))
        return self.mean_s

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` independent per-sample costs, seconds."""
        if self.distribution == "constant":
            return np.full(n, self.mean_s)
        if self.distribution == "lognormal":
            mu = math.log(self.mean_s) - 0.5 * self.sigma**2  # so that E[cost] = mean_s
            return rng.lognormal(mu, self.sigma, n)
        return rng.choice(np.asarray(self.samples_s, dtype=float), size=n, replace=True)


@dataclass(frozen=True, slots=True)
class StorageSpec:
    """Where the samples are read from.

    Attributes:
        name: Product / service name.
        read_bandwidth_bytes_per_s: Achievable read bandwidth of one client, shared by all
            concurrent readers (max-min fair), bytes/s.
        read_latency_s: Fixed latency of one read, s.
        sources: Citation per field.
        write_bandwidth_bytes_per_s: Sequential write bandwidth, bytes/s (0: not given; the dataloader only
            reads, NVMe offload (``hardware_models.nvme``) needs it).
    """

    name: str
    read_bandwidth_bytes_per_s: float
    read_latency_s: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)
    write_bandwidth_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        """Raises: DataLoaderSpecError: non-positive bandwidth or negative latency."""
        if not self.read_bandwidth_bytes_per_s > 0:
            raise DataLoaderSpecError(f"storage read_bandwidth_bytes_per_s must be > 0, got {self.read_bandwidth_bytes_per_s}")
        if self.read_latency_s < 0:
            raise DataLoaderSpecError(f"storage read_latency_s must be >= 0, got {self.read_latency_s}")
        if not (self.write_bandwidth_bytes_per_s >= 0 and math.isfinite(self.write_bandwidth_bytes_per_s)):
            raise DataLoaderSpecError("storage write_bandwidth_bytes_per_s must be >= 0 (0: not given), got "
                                      f"{self.write_bandwidth_bytes_per_s}")


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    """Preprocessing on other hosts (OVERLORD / tf.data service style).

    Attributes:
        cores: Cores of the remote preprocessing hosts available to the workers (all hosts).
        bandwidth_bytes_per_s: Network bandwidth into the trainer host, bytes/s.
        latency_s: Per-batch network latency, s.
    """

    cores: int
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        """Raises: DataLoaderSpecError: non-positive cores or bandwidth, negative latency."""
        if self.cores <= 0:
            raise DataLoaderSpecError(f"remote cores must be > 0, got {self.cores}")
        if not self.bandwidth_bytes_per_s > 0:
            raise DataLoaderSpecError(f"remote bandwidth_bytes_per_s must be > 0, got {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0:
            raise DataLoaderSpecError(f"remote latency_s must be >= 0, got {self.latency_s}")


@dataclass(frozen=True, slots=True)
class DataLoaderSpec:
    """A ``torch.utils.data.DataLoader`` and the dataset behind it.

    Attributes:
        batch_size: Samples per batch.
        num_workers: Worker processes (0 = load in the training thread).
        prefetch_factor: Batches outstanding per worker (PyTorch default 2 with workers; must be
            ``None`` with 0 workers, as PyTorch requires).
        pin_memory: Copy batches into page-locked memory (pin-memory thread with workers).
        persistent_workers: Keep workers alive across epochs (needs workers, as in PyTorch).
        drop_last: Drop the last partial batch of an epoch.
        dataset_size: Samples per epoch (``None`` = one endless epoch).
        sample_cost: Decode/transform CPU seconds per sample.
        sample_read_bytes: Bytes read from storage per sample (0 = no storage read).
        sample_bytes: Bytes of one sample as collated into the batch (tensor bytes).
        collate_overhead_s: Fixed CPU seconds per batch of the collate function besides the memcpy.
        pin_overhead_s: Fixed CPU seconds per batch of pinning besides the memcpy.
        worker_startup_s: Seconds to start a worker process before its first batch.
        handoff_s: CPU seconds the training thread spends receiving one batch from a worker
            (queue get, unpickling the shared-memory handles); 0 by default.
        remote: Remote preprocessing hosts, or ``None`` for local workers.
    """

    batch_size: int
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    drop_last: bool = False
    dataset_size: int | None = None
    sample_cost: SampleCost = SampleCost()
    sample_read_bytes: float = 0.0
    sample_bytes: float = 0.0
    collate_overhead_s: float = 0.0
    pin_overhead_s: float = 0.0
    worker_startup_s: float = 0.0
    handoff_s: float = 0.0
    remote: RemoteSpec | None = None

    def __post_init__(self) -> None:
        """Raises: DataLoaderSpecError: PyTorch's own argument checks, and negative costs."""
        if not isinstance(self.batch_size, (int, np.integer)) or self.batch_size <= 0:
            raise DataLoaderSpecError(f"batch_size should be a positive integer value, but got batch_size={self.batch_size}")
        if self.num_workers < 0:
            raise DataLoaderSpecError(
                "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing "
                f"(got num_workers={self.num_workers})")
        if self.num_workers == 0 and self.prefetch_factor is not None:
            raise DataLoaderSpecError(
                "prefetch_factor option could only be specified in multiprocessing: let num_workers > 0 to enable "
                "multiprocessing, otherwise set prefetch_factor to None (PyTorch's DataLoader rejects it too)")
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise DataLoaderSpecError(f"prefetch_factor must be >= 1, got {self.prefetch_factor}")
        if self.persistent_workers and self.num_workers == 0:
            raise DataLoaderSpecError("persistent_workers option needs num_workers > 0 (PyTorch rejects it too)")
        if self.remote is not None and self.num_workers == 0:
            raise DataLoaderSpecError("remote preprocessing needs num_workers > 0 (the remote workers)")
        if self.dataset_size is not None and self.dataset_size <= 0:
            raise DataLoaderSpecError(f"dataset_size must be > 0, got {self.dataset_size}")
        if self.dataset_size is not None and self.drop_last and self.dataset_size < self.batch_size:
            raise DataLoaderSpecError(
                f"dataset_size ({self.dataset_size}) < batch_size ({self.batch_size}) with drop_last: no batch at all")
        for name in ("sample_read_bytes", "sample_bytes", "collate_overhead_s", "pin_overhead_s",
                     "worker_startup_s", "handoff_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise DataLoaderSpecError(f"{name} must be a finite number >= 0, got {v}")

    @property
    def effective_prefetch_factor(self) -> int:
        """``prefetch_factor``, or PyTorch's default 2 when workers are used."""
        return 0 if self.num_workers == 0 else (self.prefetch_factor or 2)

    @property
    def batches_per_epoch(self) -> int | None:
        """Batches per epoch, or ``None`` for an endless epoch."""
        if self.dataset_size is None:
            return None
        n, b = self.dataset_size, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    @property
    def batch_bytes(self) -> float:
        """Bytes of a full batch."""
        return self.batch_size * self.sample_bytes


def load_storage_preset(name: str) -> StorageSpec:
    """A storage preset from ``hardware_models/presets/storage/<name>.yaml``.

    Raises:
        DataLoaderSpecError: unknown name (lists the known ones) or a bad file.
    """
    try:
        return presets.build_spec(StorageSpec, presets.read("storage", name), f"preset storage/{name}")
    except presets.PresetError as exc:
        raise DataLoaderSpecError(str(exc)) from None


# -- host CPU as processor sharing --------------------------------------------------------------
class CpuPool:
    """Host CPU cores shared by runnable threads (egalitarian processor sharing).

    Each runnable thread advances at ``min(1, cores / runnable)`` CPU-seconds per second, where
    ``runnable`` counts the jobs in ``run`` plus the *background* threads (``set_background``:
    e.g. the training thread while it is not blocked). Rates are recomputed whenever a job
    starts or ends; the time stepping (and its termination at any simulated time) is
    ``hardware_models.fluid.FluidScheduler``'s, shared with the link network.

    Args:
        env: SimPy environment.
        cores: Cores available.
        name: Name for messages.
    """

    def __init__(self, env: simpy.Environment, cores: int, name: str = "host.cpu"):
        if cores <= 0:
            raise DataLoaderSpecError(f"{name}: cores must be > 0, got {cores}")
        self.env, self.cores, self.name = env, int(cores), name
        self._background: dict[str, int] = {}
        self._fluid = FluidScheduler(env, self._rates, self._integrate)
        #: integral of busy cores over time (core-seconds)
        self.busy_core_s = 0.0

    @property
    def runnable(self) -> int:
        """Threads currently runnable (jobs + background)."""
        return len(self._fluid.flows) + sum(self._background.values())

    def speed(self) -> float:
        """CPU-seconds per second each runnable thread gets now."""
        n = self.runnable
        return 1.0 if n <= self.cores else self.cores / n

    def set_background(self, key: str, threads: int) -> None:
        """Declare ``threads`` always-runnable threads under ``key`` (0 removes them)."""
        self._fluid.advance()
        if threads:
            self._background[key] = threads
        else:
            self._background.pop(key, None)
        self._fluid.reschedule()

    def run(self, cpu_s: float):
        """SimPy process body: do ``cpu_s`` CPU-seconds of single-threaded work.

        Raises:
            ValueError: ``cpu_s`` is NaN or infinite.
        """
        if not math.isfinite(cpu_s):
            raise ValueError(f"{self.name}: CPU work must be finite, got {cpu_s!r} s")
        if cpu_s <= 0:
            return
        yield self._fluid.add(float(cpu_s))

    def _rates(self, jobs) -> None:
        s = self.speed()
        for j in jobs:
            j.rate = s

    def _integrate(self, dt: float) -> None:
        self.busy_core_s += min(self.runnable, self.cores) * dt


# -- the loader ---------------------------------------------------------------------------------
@dataclass
class BatchRecord:
    """One batch's life: who built it and when (seconds)."""

    index: int
    epoch: int
    worker: int
    samples: int
    dispatched_s: float = math.nan
    start_s: float = math.nan
    built_s: float = math.nan
    ready_s: float = math.nan
    received_s: float = math.nan
    wait_s: float = math.nan


class DataLoaderModel:
    """A running DataLoader: call ``next_batch()`` from the training process.

    Args:
        env: SimPy environment.
        spec: The DataLoader.
        cpu: Host CPU pool (shared with other host work).
        rng: The run's random generator, for per-sample costs (drawn in sample order, 1024 at a
            time: deterministic for a given generator state). Required unless the cost is
            ``constant``; the caller owns the seed (no generator is created here).
        memcpy_bandwidth_bytes_per_s: Host memcpy bandwidth counting bytes read + written
            (collate and pinning copy each batch once: 2 x bytes).
        storage: Storage read from, if samples are read (``sample_read_bytes > 0``).
        training_thread: Count the training thread as runnable on ``cpu`` while it is not
            waiting for a batch.

    Raises:
        DataLoaderSpecError: samples need reading but no storage is given, or the sample cost is
            random and no generator is given.
    """

    def __init__(self, env: simpy.Environment, spec: DataLoaderSpec, cpu: CpuPool,
                 rng: np.random.Generator | None = None, memcpy_bandwidth_bytes_per_s: float = 0.0,
                 storage: StorageSpec | None = None, training_thread: bool = True):
        if spec.sample_read_bytes > 0 and storage is None:
            raise DataLoaderSpecError("sample_read_bytes > 0 needs a storage (preset or spec)")
        self.env, self.spec, self.cpu = env, spec, cpu
        if rng is None and spec.sample_cost.distribution != "constant":
            raise DataLoaderSpecError(f"a {spec.sample_cost.distribution} sample cost needs the run's random "
                                      "generator (rng)")
        self.rng = rng
        self.memcpy_bw = memcpy_bandwidth_bytes_per_s
        self.storage = storage
        self._storage_net = (FluidNetwork(env, {"storage.read": storage.read_bandwidth_bytes_per_s})
                             if storage is not None else None)
        self.remote_cpu = None
        self._remote_net = None
        if spec.remote is not None:
            self.remote_cpu = CpuPool(env, spec.remote.cores, "remote.cpu")
            self._remote_net = FluidNetwork(env, {"remote.net": spec.remote.bandwidth_bytes_per_s})
        local_threads = (0 if spec.remote else spec.num_workers) + 1 + (1 if spec.pin_memory and spec.num_workers else 0)
        if local_threads > cpu.cores:
            warnings.warn(
                f"{spec.num_workers} DataLoader workers + the training thread"
                f"{' + the pin-memory thread' if spec.pin_memory else ''} exceed the host's {cpu.cores} cores: "
                "allowed, modelled as processor sharing (each thread runs at cores/runnable speed)",
                OversubscribedCpuWarning, stacklevel=2)
        self.training_thread = training_thread
        if training_thread:
            cpu.set_background("training_thread", 1)
        self._costs = np.zeros(0)
        self.records: list[BatchRecord] = []
        self.worker_busy_s = [0.0] * spec.num_workers
        self.pin_busy_s = 0.0
        self._epoch = -1
        self._pos = 0  # next batch index within the epoch
        self._global = 0  # batches consumed so far
        self._epoch_started = False
        self._workers_alive = False

    # -- costs -----------------------------------------------------------------------------
    def sample_cost_s(self, sample: int) -> float:
        """Decode/transform seconds of global sample number ``sample`` (drawn in order)."""
        if sample >= len(self._costs):
            n = max(sample + 1 - len(self._costs), 1024)
            self._costs = np.concatenate([self._costs, self.spec.sample_cost.draw(self.rng, n)])
        return float(self._costs[sample])

    def _copy_s(self, nbytes: float) -> float:
        return 2.0 * nbytes / self.memcpy_bw if self.memcpy_bw > 0 and nbytes > 0 else 0.0

    def _batch_samples(self, pos: int) -> int:
        b, n = self.spec.batch_size, self.spec.dataset_size
        if n is None:
            return b
        return min(b, n - pos * b)

    # -- epochs ----------------------------------------------------------------------------
    def _start_epoch(self) -> None:
        """``iter(loader)``: start (or resume) the workers and prime the prefetch."""
        spec, env = self.spec, self.env
        self._epoch += 1
        self._pos = 0
        self._epoch_base = self._global
        nb = spec.batches_per_epoch
        self._nb = nb
        self._ready: dict[int, simpy.Event] = {}
        self._recs: dict[int, BatchRecord] = {}
        if spec.num_workers == 0:
            return
        nw = spec.num_workers
        self._dispatch: dict[int, simpy.Event] = {}
        startup = spec.worker_startup_s if (not self._workers_alive or not spec.persistent_workers) else 0.0
        self._workers_alive = True
        self._results = simpy.Store(env)
        for w in range(nw):
            env.process(self._worker(w, startup))
        if spec.pin_memory:
            env.process(self._pin_thread())
        window = spec.effective_prefetch_factor * nw
        for i in range(window if nb is None else min(window, nb)):
            self._dispatch_task(i)

    def _dispatch_event(self, i: int) -> simpy.Event:
        ev = self._dispatch.get(i)
        if ev is None:
            ev = self._dispatch[i] = self.env.event()
        return ev

    def _dispatch_task(self, i: int) -> None:
        if self._nb is not None and i >= self._nb:
            return
        rec = self._record(i)
        rec.dispatched_s = self.env.now
        self._dispatch_event(i).succeed()

    def _record(self, i: int) -> BatchRecord:
        rec = self._recs.get(i)
        if rec is None:
            nw = max(self.spec.num_workers, 1)
            rec = BatchRecord(index=self._epoch_base + i, epoch=self._epoch,
                              worker=i % nw if self.spec.num_workers else -1, samples=self._batch_samples(i))
            self._recs[i] = rec
            self.records.append(rec)
        return rec

    def _ready_event(self, i: int) -> simpy.Event:
        ev = self._ready.get(i)
        if ev is None:
            ev = self._ready[i] = self.env.event()
        return ev

    # -- building a batch ------------------------------------------------------------------
    def _build(self, i: int, cpu: CpuPool):
        """Fetch the batch's samples one after the other, then collate (one thread)."""
        spec = self.spec
        n = self._batch_samples(i)
        first = (self._epoch_base + i) * spec.batch_size
        for k in range(n):
            if spec.sample_read_bytes > 0:
                yield from self._storage_net.transfer(spec.sample_read_bytes, ("storage.read",),
                                                      self.storage.read_latency_s)
            yield from cpu.run(self.sample_cost_s(first + k))
        yield from cpu.run(spec.collate_overhead_s + self._copy_s(n * spec.sample_bytes))

    def _worker(self, w: int, startup_s: float):
        spec, env = self.spec, self.env
        nw = spec.num_workers
        cpu = self.remote_cpu or self.cpu
        epoch = self._epoch
        if startup_s > 0:
            yield env.timeout(startup_s)
        i = w
        while self._nb is None or i < self._nb:
            yield self._dispatch_event(i)
            if epoch != self._epoch:
                return
            rec = self._record(i)
            rec.start_s = env.now
            yield from self._build(i, cpu)
            rec.built_s = env.now
            self.worker_busy_s[w] += env.now - rec.start_s
            if spec.remote is not None:
                yield from self._remote_net.transfer(rec.samples * spec.sample_bytes, ("remote.net",),
                                                     spec.remote.latency_s)
            if spec.pin_memory:
                yield self._results.put(i)
            else:
                rec.ready_s = env.now
                self._ready_event(i).succeed()
            i += nw

    def _pin_thread(self):
        env = self.env
        epoch = self._epoch
        while True:
            i = yield self._results.get()
            if epoch != self._epoch:
                return
            t0 = env.now
            yield from self.cpu.run(self._pin_s(i))
            self.pin_busy_s += env.now - t0
            self._recs[i].ready_s = env.now
            self._ready_event(i).succeed()

    def _pin_s(self, i: int) -> float:
        return self.spec.pin_overhead_s + self._copy_s(self._batch_samples(i) * self.spec.sample_bytes)

    # -- the training loop's side ------------------------------------------------------------
    def next_batch(self):
        """SimPy process body: ``next(iterator)``; returns the ``BatchRecord`` received.

        A new epoch's iterator is created when the previous one is exhausted.
        """
        spec, env = self.spec, self.env
        if self._epoch < 0 or (self._nb is not None and self._pos >= self._nb):
            self._start_epoch()
        i = self._pos
        t0 = env.now
        if spec.num_workers == 0:
            rec = self._record(i)
            rec.dispatched_s = rec.start_s = t0
            if self.training_thread:  # the training thread's work now runs as jobs on the pool
                self.cpu.set_background("training_thread", 0)
            yield from self._build(i, self.cpu)
            rec.built_s = env.now
            if spec.pin_memory:
                yield from self.cpu.run(self._pin_s(i))
            rec.ready_s = env.now
        else:
            if self.training_thread:
                self.cpu.set_background("training_thread", 0)
            ev = self._ready_event(i)
            if not ev.triggered:
                yield ev
            yield from self.cpu.run(spec.handoff_s)
            rec = self._recs[i]
            # _process_data -> _try_put_index: the next index goes out when this batch is received
            self._dispatch_task(i + spec.effective_prefetch_factor * spec.num_workers)
        if self.training_thread:
            self.cpu.set_background("training_thread", 1)
        rec.received_s = env.now
        rec.wait_s = env.now - t0
        self._pos += 1
        self._global += 1
        return rec

    # -- metrics ---------------------------------------------------------------------------
    def worker_utilisation(self, t0: float, t1: float) -> float:
        """Mean fraction of ``[t0, t1]`` the workers spent building batches (0-1)."""
        if self.spec.num_workers == 0 or t1 <= t0:
            return 0.0
        busy = 0.0
        for r in self.records:
            if r.worker >= 0 and not math.isnan(r.start_s) and not math.isnan(r.built_s):
                busy += max(0.0, min(r.built_s, t1) - max(r.start_s, t0))
        return busy / (self.spec.num_workers * (t1 - t0))


def simulate_loader(spec: DataLoaderSpec, consumer_s: float, batches: int, cores: int = 1024,
                    seed: int = 0, memcpy_bandwidth_bytes_per_s: float = 0.0,
                    storage: StorageSpec | None = None) -> list[BatchRecord]:
    """Run a loader against a training loop that computes ``consumer_s`` after each batch.

    Used by tests and quick what-ifs. Returns the records of the ``batches`` batches received.
    """
    env = simpy.Environment()
    pool = CpuPool(env, cores)
    loader = DataLoaderModel(env, spec, pool, np.random.default_rng(seed), memcpy_bandwidth_bytes_per_s, storage)
    got: list[BatchRecord] = []

    def loop():
        for _ in range(batches):
            rec = yield from loader.next_batch()
            got.append(rec)
            if consumer_s > 0:
                yield env.timeout(consumer_s)

    env.run(env.process(loop()))
    return got
