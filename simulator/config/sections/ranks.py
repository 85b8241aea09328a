"""Scenario section ``rank_overrides:``: ranks that differ from the rest (stragglers, capped GPUs).

::

    rank_overrides:
      - {dp_rank: 3, slowdown: 1.2}                       # one data-parallel replica 20% slower
      - {pp_rank: 2, dvfs: {kind: power_cap, power_limit_w: 250}}   # pipeline stage 2 power-capped
      - {dp_rank: 1, gpu: a100-sxm-80gb}                  # replica 1 on another GPU (a mixed cluster)

An override selects the ranks of one pipeline stage (``pp_rank``, all its data- and tensor-parallel
ranks) or of one data-parallel replica (``dp_rank``, all its tensor-parallel ranks in every stage: one
pipeline), and changes their GPU: ``slowdown`` multiplies every kernel's time (a thermally throttled or
degraded GPU, a noisy neighbour), ``dvfs`` replaces the scenario's clock/power policy for them, ``gpu``
puts another GPU preset in their place (its peaks, HBM, memory capacity and power model, priced with that GPU's
shipped efficiency profile or the generic one; the cluster's links and collective model stay the cluster
preset's).
Folding splits only what the override touches: a stage override changes that stage's representative; a
replica override adds one rank class (the replica) beside the others, and the data-parallel collectives
start when the slowest class arrives (``simulator.engine.rendezvous``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, model_validator

from simulator.config.sections.dvfs import DvfsConfig

#: rank_overrides entries per scenario
MAX_RANK_OVERRIDES = 64
#: ranks simulated side by side (stages x data-parallel classes): each is one SimPy executor
MAX_SIMULATED_RANKS = 1024


class RankOverride(BaseModel):
    """One set of ranks that differs from the rest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pp_rank: StrictInt | None = Field(default=None, ge=0, description="Pipeline stage whose ranks are overridden.")
    dp_rank: StrictInt | None = Field(default=None, ge=0, description="Data-parallel replica overridden (its ranks "
                                      "in every pipeline stage).")
    slowdown: StrictFloat | StrictInt = Field(default=1.0, gt=0, le=100, description="Multiplier on every kernel's "
                                              "time (1.2: 20% slower).")
    dvfs: DvfsConfig | None = Field(default=None, description="Clock/power policy of these ranks (replaces dvfs:).")
    gpu: StrictStr | None = Field(default=None, description="Another GPU preset for these ranks (hardware_models "
                                  "gpus; the cluster's links stay).")

    @model_validator(mode="after")
    def _selects_and_changes(self):
        if (self.pp_rank is None) == (self.dp_rank is None):
            raise ValueError("give exactly one of pp_rank or dp_rank (allowed: {pp_rank: N, ...} or {dp_rank: N, ...})")
        if self.slowdown == 1.0 and self.dvfs is None and self.gpu is None:
            raise ValueError("changes nothing (allowed: slowdown != 1, dvfs and/or gpu)")
        return self
