"""Scenario section ``dvfs:``: the GPU clock / power policy in force (one ``kind``).

Kinds (registered in ``simulator.policies.dvfs``)::

    dvfs: {kind: locked_clock, locked_clocks_mhz: 1410}          # like nvidia-smi -lgc 1410
    dvfs: {kind: power_cap, power_limit_w: 400}                  # like nvidia-smi -pl 400
    dvfs: {kind: locked_clock, locked_clocks_mhz: 1410, power_limit_w: 300}   # -lgc 1410 and -pl 300
    dvfs: {kind: phase_plan, phase_clocks_mhz: {fwd: 1980, bwd: 1980, opt: 1200}}

Without a ``dvfs`` section the GPU runs at its maximum clock under its default power limit (the
board's TDP), which is how the measured runs were taken.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from hardware_models.presets import FILE_PREFIXES, PresetError, check_name, is_file_reference
from simulator.config.limits import MAX_CLOCK_MHZ, MAX_DVFS_TIME_S, MAX_POWER_W, MIN_POWER_SAMPLE_PERIOD_S, MODEL_CONFIG
from simulator.config.quantities import MHz, Seconds, Watts
from simulator.graph.ops import Phase

#: Phases a clock plan may name.
PLAN_PHASES: tuple[str, ...] = tuple(p.value for p in Phase)

#: Default clock switching latency, s. Assumed: measured NVIDIA switching latencies are
#: milliseconds to tens of milliseconds and depend on the GPU and the target clock (Velička et al.,
#: arXiv:2502.20075, 2025); we take 10 ms.
DEFAULT_SWITCH_LATENCY_S = 0.010


class DvfsConfig(BaseModel):
    """Clock and power policy of the GPU."""

    model_config = MODEL_CONFIG

    kind: Literal["locked_clock", "power_cap", "phase_plan"] = Field(description="Which DVFS policy.")
    locked_clocks_mhz: MHz | None = Field(
        default=None, gt=0, le=MAX_CLOCK_MHZ, description="locked_clock: SM clock (snapped to the nearest supported clock, with a warning; outside the "
        "supported range refused).")
    power_limit_w: Watts | None = Field(
        default=None, gt=0, le=MAX_POWER_W, description="Board power limit, W (must lie in the GPU's settable range; default the "
        "GPU's TDP). Needed by power_cap; with locked_clock or phase_plan it still binds: the firmware lowers the "
        "clock below the requested one while the power is above the limit (nvidia-smi -pl over -lgc).")
    phase_clocks_mhz: dict[str, MHz] = Field(
        default_factory=dict, description=f"phase_plan: SM clock per phase ({', '.join(PLAN_PHASES)}); "
        "unnamed phases run at the maximum clock.")
    clock_switch_latency_s: Seconds = Field(
        default=DEFAULT_SWITCH_LATENCY_S, ge=0, le=MAX_DVFS_TIME_S,
        description="Time from a clock request to the new clock; the GPU runs at the old clock meanwhile "
        "(default 10 ms, assumed; see DEFAULT_SWITCH_LATENCY_S).")
    power_sample_period_s: Seconds = Field(
        default=0.01, ge=MIN_POWER_SAMPLE_PERIOD_S, le=MAX_DVFS_TIME_S,
        description="Power-cap controller: how often the firmware re-evaluates (assumed 10 ms).")
    power_window_s: Seconds = Field(
        default=0.02, gt=0, le=MAX_DVFS_TIME_S, description="Power-cap controller: averaging window of the power reading (assumed 20 ms).")
    power_model: str | None = Field(
        default=None, description="Power-model preset name (looked up under presets/power only) or a YAML file "
        f"given as a path starting with {', '.join(FILE_PREFIXES)} (default: the GPU preset's, else generic).")

    @field_validator("power_model")
    @classmethod
    def _power_model_name(cls, v):
        if v is not None and not is_file_reference(v):
            try:
                check_name("power", v)
            except PresetError as exc:
                raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _fields_for_kind(self):
        for key, kinds in (("locked_clocks_mhz", ("locked_clock",)), ("phase_clocks_mhz", ("phase_plan",))):
            if getattr(self, key) and self.kind not in kinds:  # else it would be ignored without a word
                hint = (" (a locked clock under a power limit: kind locked_clock with power_limit_w)"
                        if self.kind == "power_cap" and key == "locked_clocks_mhz" else "")
                raise ValueError(f"{key} applies to dvfs kind {kinds[0]} only, not {self.kind}{hint}")
        if self.kind == "locked_clock" and self.locked_clocks_mhz is None:
            raise ValueError("dvfs kind locked_clock needs locked_clocks_mhz")
        if self.kind == "power_cap" and self.power_limit_w is None:
            raise ValueError("dvfs kind power_cap needs power_limit_w")
        if self.kind == "phase_plan":
            if not self.phase_clocks_mhz:
                raise ValueError("dvfs kind phase_plan needs phase_clocks_mhz")
            bad = sorted(set(self.phase_clocks_mhz) - set(PLAN_PHASES))
            if bad:
                raise ValueError(f"phase_clocks_mhz names unknown phase(s) {', '.join(bad)}; "
                                 f"allowed: {', '.join(PLAN_PHASES)}")
            for ph, mhz in self.phase_clocks_mhz.items():
                if not 0 < mhz <= MAX_CLOCK_MHZ:
                    raise ValueError(f"phase_clocks_mhz.{ph} must lie in (0, {MAX_CLOCK_MHZ:g}] MHz, got {mhz}")
        return self
