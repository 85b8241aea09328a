"""GPU and host power as a function of clocks and activity; the GPU clock controller.

GPU power model
---------------
CMOS dynamic power is ``P_dyn = a * C * V^2 * f`` (activity factor ``a``, switched capacitance
``C``, supply voltage ``V``, clock ``f``; e.g. Weste & Harris, *CMOS VLSI Design*, ch. 5). GPU DVFS
lowers ``f`` and, along the voltage-frequency curve, ``V``. We write the clock factor relative to
the maximum clock::

    phi(f) = (f / f_max) * (V(f) / V(f_max))^2

with an **assumed** piecewise-linear V-f curve: ``V/V_max`` is ``v_min_rel`` at and below
``voltage_knee_mhz`` and rises linearly to 1 at ``f_max`` (NVIDIA does not publish the H200 curve;
the shape, a floor then a linear rise, is the usual one reported for GPUs, e.g. Mei et al., *A
Survey and Measurement Study of GPU DVFS on Energy Conservation*, 2017).

The board power at SM clock ``f``, memory clock ``fm`` and activity is::

    P = P_static                                    # leakage, HBM refresh, board, fans (clock-independent)
      + P_clock * phi(f)                            # clock tree and idle SMs with clocks up
      + phi(f) * A_sm * (alpha * busy + (1 - alpha) * u_compute)   # SM pipelines
      + A_mem * u_memory * (fm / fm_max)            # HBM + memory controllers
      + A_copy * u_copy                             # copy engines + PCIe PHY

``busy`` is 1 while any kernel is resident, ``u_compute`` the fraction of the running kernel's time
that is compute-bound (tensor/ALU pipelines at their roofline) and ``u_memory`` the fraction that is
memory-bound (from the cost model's compute/memory split), ``u_copy`` is 1 while a host<->device
copy runs. This is the activity-weighted power model used by DVFS studies such as Zeus (Chung/You
et al., NSDI'23: power is a function of the power limit/clock and the workload's compute vs memory
intensity) and Perseus (SOSP'24: per-instruction time and energy per GPU frequency, plus a separate
"blocking" power for idle waits), reduced to a handful of coefficients we can fit. ``P_static`` and
``P_clock`` come from two idle points (deep idle at the lowest clock and idle with clocks at max);
``A_sm`` is fitted to measured training energy; ``alpha`` and ``A_mem / A_sm`` are assumptions
stated in the preset file (``scripts/fit_h200_power.py`` prints the sensitivity to them).

Host power (an estimate, not measured here): ``P_host = cores * (idle_w_per_core + busy_w_per_core *
busy_fraction)`` with per-core constants derived from a server CPU's TDP divided by its core count.

Nothing in this module imports ``simulator``.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from hardware_models import presets, safe_yaml

from hardware_models.gpu import GpuSpec


@dataclass(frozen=True, slots=True)
class Activity:
    """What one running GPU operation keeps busy (fractions of its own duration, 0..1)."""

    compute: float = 0.0
    memory: float = 0.0
    copy: float = 0.0
    kernel: bool = True


@dataclass(frozen=True, slots=True)
class GpuPowerModel:
    """Coefficients of the GPU power model (see the module docstring for the formula).

    Attributes:
        name: Model name (GPU product).
        max_sm_clock_mhz: ``f_max``.
        max_mem_clock_mhz: ``fm_max``.
        static_w: ``P_static``, W.
        clock_w: ``P_clock``, W (clock tree with clocks up, scales with ``phi``).
        sm_w: ``A_sm``, W: SM dynamic power of a fully compute-bound kernel at ``f_max``.
        sm_floor: ``alpha``: share of ``A_sm`` drawn by any resident kernel.
        mem_w: ``A_mem``, W: memory-system power of a fully memory-bound kernel at ``fm_max``.
        copy_w: ``A_copy``, W: a host<->device copy in flight.
        v_min_rel: ``V/V_max`` at and below the knee.
        voltage_knee_mhz: Clock below which the voltage stays at its floor.
        host_idle_w_per_core: Host power per core when idle, W.
        host_busy_w_per_core: Extra host power per fully busy core, W.
        provenance: Where the numbers came from.
    """

    name: str
    max_sm_clock_mhz: float
    max_mem_clock_mhz: float
    static_w: float
    clock_w: float
    sm_w: float
    sm_floor: float = 0.3
    mem_w: float = 0.0
    copy_w: float = 0.0
    v_min_rel: float = 0.7
    voltage_knee_mhz: float = 900.0
    host_idle_w_per_core: float = 1.5
    host_busy_w_per_core: float = 4.0
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Raises: ValueError: negative power, clocks not positive, or fractions outside [0, 1]."""
        for k in ("static_w", "clock_w", "sm_w", "mem_w", "copy_w", "host_idle_w_per_core", "host_busy_w_per_core"):
            if getattr(self, k) < 0:
                raise ValueError(f"power model {k} must be >= 0, got {getattr(self, k)}")
        if self.max_sm_clock_mhz <= 0 or self.max_mem_clock_mhz <= 0:
            raise ValueError("power model clocks must be > 0")
        if not 0 <= self.sm_floor <= 1 or not 0 < self.v_min_rel <= 1:
            raise ValueError("sm_floor must be in [0, 1] and v_min_rel in (0, 1]")

    @property
    def generic(self) -> bool:
        """Whether this is ``generic_power_model``'s unfitted model (TDP and idle power only)."""
        return "generic" in self.provenance

    # -- formula ----------------------------------------------------------------------------
    def voltage_rel(self, sm_clock_mhz: float) -> float:
        """``V(f) / V(f_max)`` on the assumed piecewise-linear V-f curve."""
        f, fmax, knee = sm_clock_mhz, self.max_sm_clock_mhz, self.voltage_knee_mhz
        if f <= knee or fmax <= knee:
            return self.v_min_rel
        x = min(1.0, (f - knee) / (fmax - knee))
        return self.v_min_rel + (1.0 - self.v_min_rel) * x

    def clock_factor(self, sm_clock_mhz: float) -> float:
        """``phi(f) = (f / f_max) * (V(f) / V_max)^2`` (1 at the maximum clock)."""
        return (sm_clock_mhz / self.max_sm_clock_mhz) * self.voltage_rel(sm_clock_mhz) ** 2

    def idle_power_w(self, sm_clock_mhz: float) -> float:
        """Board power with no kernel running and clocks at ``sm_clock_mhz``, W."""
        return self.static_w + self.clock_w * self.clock_factor(sm_clock_mhz)

    def power_w(self, sm_clock_mhz: float, mem_clock_mhz: float | None = None, *, busy: float = 0.0,
                compute: float = 0.0, memory: float = 0.0, copy: float = 0.0) -> float:
        """Board power, W, at the given clocks and activity fractions (each clipped to [0, 1])."""
        phi = self.clock_factor(sm_clock_mhz)
        fm = self.max_mem_clock_mhz if mem_clock_mhz is None else mem_clock_mhz
        busy, compute, memory, copy = (min(1.0, max(0.0, v)) for v in (busy, compute, memory, copy))
        sm = phi * self.sm_w * (self.sm_floor * busy + (1.0 - self.sm_floor) * compute)
        return (self.static_w + self.clock_w * phi + sm
                + self.mem_w * memory * (fm / self.max_mem_clock_mhz) + self.copy_w * copy)

    def power_of(self, activities, sm_clock_mhz: float, mem_clock_mhz: float | None = None) -> float:
        """Board power with the given concurrently running ``Activity`` objects, W."""
        busy = compute = memory = copy = 0.0
        for a in activities:
            busy = max(busy, 1.0 if a.kernel else 0.0)
            compute += a.compute
            memory += a.memory
            copy += a.copy
        return self.power_w(sm_clock_mhz, mem_clock_mhz, busy=busy, compute=compute, memory=memory, copy=copy)

    def host_power_w(self, cores: int, busy_cores: float) -> float:
        """Host CPU power estimate, W (``cores`` in the job, ``busy_cores`` of them busy on average)."""
        busy_cores = min(max(busy_cores, 0.0), cores)
        return cores * self.host_idle_w_per_core + busy_cores * self.host_busy_w_per_core


def activity_of_kernel(compute_s: float, memory_s: float, fixed_s: float) -> Activity:
    """Activity of a kernel from its cost split at the clocks it runs at (``fixed + max(c, m)``)."""
    d = fixed_s + max(compute_s, memory_s)
    if d <= 0:
        return Activity(kernel=True)
    return Activity(compute=compute_s / d, memory=memory_s / d)


# -- presets ---------------------------------------------------------------------------------
def _num(v):
    return v["value"] if isinstance(v, dict) and "value" in v else v


def power_model_from_dict(data: dict, source: str = "<power model>") -> GpuPowerModel:
    """Build a model from a preset mapping (values may be ``{value, source}``)."""
    known = set(GpuPowerModel.__dataclass_fields__)
    vals = {k: _num(v) for k, v in data.items() if k not in ("provenance",)}
    unknown = sorted(set(vals) - known)
    if unknown:
        raise ValueError(f"{source}: unknown power-model keys {unknown}; allowed: {sorted(known)}")
    try:
        return GpuPowerModel(**{k: (float(v) if k != "name" else v) for k, v in vals.items()},
                             provenance=data.get("provenance", {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from exc


def load_power_model(name_or_path: str) -> GpuPowerModel:
    """A shipped power preset (``presets/power/<name>.yaml``, read by ``presets.read``) or a YAML file path.

    Raises:
        FileNotFoundError: neither a preset nor a file of that name exists.
        ValueError: the file is not a valid power model.
    """
    if not Path(name_or_path).suffix:
        if not has_power_preset(name_or_path):
            raise FileNotFoundError(f"no power model preset or file {name_or_path!r}")
        try:
            data = presets.read("power", name_or_path)
        except presets.PresetError as exc:
            raise ValueError(str(exc)) from None
        return power_model_from_dict(data, f"preset power/{name_or_path}")
    p = Path(name_or_path)
    if not p.exists():
        raise FileNotFoundError(f"no power model preset or file {name_or_path!r}")
    try:
        data = safe_yaml.load_mapping(p, "a mapping of power-model fields")
    except safe_yaml.YamlInputError as exc:
        raise ValueError(f"{p}: {exc}") from None
    return power_model_from_dict(data, str(p))


@lru_cache(maxsize=None)
def preset_power_model(name: str) -> GpuPowerModel | None:
    """The shipped power preset ``name`` (``load_power_model``), built once per process (the model is frozen and the
    presets ship with the package, read once by ``presets``), or None when there is none of that name.

    Raises:
        ValueError: the preset file is not a valid power model.
    """
    return load_power_model(name) if has_power_preset(name) else None


def has_power_preset(name: str) -> bool:
    """Whether a shipped power preset ``name`` exists."""
    return name in presets.list_presets("power")["power"]


#: What ``generic_power_model`` appends to the GPU's name: the mark of an unfitted model (``GpuPowerModel.generic``).
GENERIC_SUFFIX = " (generic)"
#: TDP assumed by ``generic_power_model`` for a GPU spec without ``tdp_w``, W.
GENERIC_TDP_W = 400.0
#: Idle power at the maximum clocks as a share of TDP, for a GPU spec without ``idle_power_w``.
GENERIC_IDLE_SHARE = 0.15
#: Board power of a fully compute-bound kernel at the maximum clock as a share of TDP (an assumption).
GENERIC_TDP_SHARE = 0.95
#: ``A_mem / A_sm`` of the generic model (an assumption, also used by the fitted presets: scripts/fit_h200_power.py).
GENERIC_MEM_RATIO = 0.45


def generic_idle_w(gpu: GpuSpec) -> float:
    """Idle power at the maximum clocks that ``generic_power_model`` uses: ``idle_power_w``, else 15% of the TDP, W."""
    return gpu.idle_power_w or GENERIC_IDLE_SHARE * (gpu.tdp_w or GENERIC_TDP_W)


def generic_power_model(gpu: GpuSpec) -> GpuPowerModel:
    """An unfitted model from a GPU's spec sheet: idle power and TDP only.

    Assumptions (no measurement behind them): idle at max clocks = ``idle_power_w`` (or 15% of TDP; 400 W where
    the spec has no TDP), of which 70% is static; a fully compute-bound kernel at max clock reaches 95% of TDP; a
    fully memory-bound one draws ``A_mem = 0.45 * A_sm``; any resident kernel draws ``sm_floor`` (30%) of ``A_sm``;
    the V-f curve is the class default (``GpuPowerModel``: 0.7 of ``V_max`` below 900 MHz).
    """
    tdp = gpu.tdp_w or GENERIC_TDP_W
    idle = generic_idle_w(gpu)
    static = 0.7 * idle
    sm = max(GENERIC_TDP_SHARE * tdp - idle, 0.0)
    return GpuPowerModel(
        name=f"{gpu.name}{GENERIC_SUFFIX}", max_sm_clock_mhz=gpu.max_sm_clock_mhz,
        max_mem_clock_mhz=gpu.mem_clock_mhz or 1.0, static_w=static, clock_w=idle - static, sm_w=sm,
        mem_w=GENERIC_MEM_RATIO * sm, copy_w=20.0,
        provenance={"generic": "derived from GpuSpec tdp_w/idle_power_w; not fitted"},
    )


# -- clocks ----------------------------------------------------------------------------------
def nearest_clock(clock_mhz: float, supported_mhz) -> float:
    """The supported clock nearest ``clock_mhz`` (ties to the lower), MHz; ``supported_mhz`` non-empty."""
    return float(min(supported_mhz, key=lambda s: (abs(s - clock_mhz), s)))


def snap_clock(clock_mhz: float, supported_mhz, what: str = "clock") -> float:
    """The supported clock nearest ``clock_mhz``; warns (``UserWarning``) when it had to snap.

    Like ``nvidia-smi -lgc``, which accepts any value and rounds to a supported clock, we snap
    rather than reject; ties go to the lower clock. An empty list returns the clock unchanged.
    """
    if not supported_mhz:
        return float(clock_mhz)
    best = nearest_clock(clock_mhz, supported_mhz)
    if best != clock_mhz:
        warnings.warn(f"{what} {clock_mhz:g} MHz is not a supported SM clock; using the nearest supported "
                      f"clock {best:g} MHz", UserWarning, stacklevel=2)
    return float(best)


class ClockController:
    """Applies SM clock changes after a switching latency, as the driver does.

    The GPU keeps running at the old clock until ``latency_s`` after the request (measured
    switching latencies of NVIDIA GPUs are milliseconds to tens of milliseconds: Velička et al.,
    *Methodology for GPU Frequency Switching Latency Measurement*, arXiv:2502.20075, 2025). The
    effective clock is ``min(target, limit)``: ``target`` is what a clock policy asks for (lock or
    plan), ``limit`` what the power-cap controller allows. A newer request supersedes a pending one.

    Args:
        env: SimPy environment (anything with ``now``, ``timeout`` and ``process``).
        state: Object with a mutable ``sm_clock_mhz`` attribute (the device state read by the cost model).
        max_clock_mhz: Highest clock.
        latency_s: Switching latency, s.
        on_change: Called as ``on_change(now_s, new_clock_mhz)`` right after the clock changes.
    """

    def __init__(self, env, state, max_clock_mhz: float, latency_s: float,
                 on_change: Callable[[float, float], None] | None = None):
        self.env, self.state, self.latency_s = env, state, latency_s
        self.target_mhz = float(max_clock_mhz)
        self.limit_mhz = float(max_clock_mhz)
        self.on_change = on_change
        self.switches = 0
        self._seq = 0
        self._pending: float | None = None

    @property
    def pending(self) -> bool:
        """Whether a requested clock has not arrived yet."""
        return self._pending is not None

    @property
    def wanted_mhz(self) -> float:
        return min(self.target_mhz, self.limit_mhz)

    def set_target(self, mhz: float, immediate: bool = False) -> None:
        """Ask for ``mhz`` (policy clock); ``immediate`` applies it now (clocks set before the job)."""
        self.target_mhz = float(mhz)
        self._request(immediate)

    def set_limit(self, mhz: float) -> None:
        """Cap the clock at ``mhz`` (power-cap controller)."""
        self.limit_mhz = float(mhz)
        self._request(False)

    def _request(self, immediate: bool) -> None:
        want = self.wanted_mhz
        if immediate or self.latency_s <= 0:
            self._seq += 1
            self._pending = None
            self._apply(want, count=not immediate)
            return
        if want == (self._pending if self._pending is not None else self.state.sm_clock_mhz):
            return
        self._seq += 1
        self._pending = want
        self.env.process(self._later(self._seq, want))

    def _later(self, seq: int, want: float):
        yield self.env.timeout(self.latency_s)
        if seq == self._seq:
            self._pending = None
            self._apply(want)

    def _apply(self, mhz: float, count: bool = True) -> None:
        if mhz == self.state.sm_clock_mhz:
            return
        self.state.sm_clock_mhz = mhz
        self.switches += int(count)
        if self.on_change:
            self.on_change(self.env.now, mhz)


class EnergyLedger:
    """Piecewise-constant power over time and its integral (energy)."""

    def __init__(self, t0: float, p0: float):
        self.t = [t0]
        self.p = [p0]
        self.e = [0.0]

    def set(self, t: float, p: float) -> bool:
        """Power becomes ``p`` at ``t``; returns whether the level changed."""
        if p == self.p[-1]:
            return False
        e = self.e[-1] + self.p[-1] * (t - self.t[-1])
        if t == self.t[-1]:
            self.p[-1] = p
            return True
        self.t.append(t)
        self.p.append(p)
        self.e.append(e)
        return True

    def energy_at(self, t: float) -> float:
        """Energy from the start to ``t``, J."""
        i = max(0, bisect.bisect_right(self.t, t) - 1)
        return self.e[i] + self.p[i] * (t - self.t[i])

    def energy_between(self, t0: float, t1: float) -> float:
        return self.energy_at(t1) - self.energy_at(t0)

    def average_w(self, t0: float, t1: float) -> float:
        return self.energy_between(t0, t1) / (t1 - t0) if t1 > t0 else self.p[-1]


def nearest_supported_below(mhz: float, supported_desc) -> float:
    """Highest supported clock <= ``mhz`` (the lowest supported one if none)."""
    cands = [s for s in supported_desc if s <= mhz + 1e-9]
    return float(max(cands)) if cands else float(min(supported_desc))


def ratio_step(cur: float, ratio: float, supported_desc) -> float:
    """Supported clock reached from ``cur`` scaled by ``ratio``, at least one bin away when ratio != 1."""
    want = cur * ratio
    ordered = sorted(supported_desc)
    if ratio < 1:
        below = [s for s in ordered if s <= want + 1e-9 and s < cur]
        lower = [s for s in ordered if s < cur]
        return float(max(below) if below else (max(lower) if lower else ordered[0]))
    above = [s for s in ordered if s > cur]
    ok = [s for s in above if s <= want + 1e-9]
    return float(max(ok) if ok else (min(above) if above else cur))


__all__ = [
    "Activity", "GpuPowerModel", "activity_of_kernel", "power_model_from_dict", "load_power_model",
    "has_power_preset", "generic_power_model", "generic_idle_w", "GENERIC_SUFFIX", "GENERIC_TDP_W",
    "GENERIC_TDP_SHARE", "GENERIC_MEM_RATIO", "snap_clock", "ClockController",
    "EnergyLedger", "nearest_supported_below", "ratio_step",
]
