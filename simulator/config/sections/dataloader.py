"""Scenario section ``dataloader:``: the PyTorch input pipeline (``torch.utils.data.DataLoader`` names).

Example::

    dataloader:
      num_workers: 8
      prefetch_factor: 2          # leave out (null) with num_workers: 0, as PyTorch requires
      pin_memory: true
      sample:
        cost: {distribution: constant, mean_s: "6.055 ms"}   # decode/transform CPU time
        bytes: "8200 B"           # collated tensor bytes per sample
      storage: null               # or a preset (local-nvme-pm9a3, aws-efs-elastic) for reads

The mechanism is ``hardware_models.dataloader``; ``simulator.policies.dataloader`` attaches it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from hardware_models.presets import PresetError, check_name
from simulator.config.limits import (
    MAX_MICRO_BATCH_SIZE,
    MAX_NUM_WORKERS,
    MAX_PREFETCH_FACTOR,
    MAX_REMOTE_CORES,
    MAX_SAMPLE_BYTES,
    MAX_SAMPLE_COST_S,
    MODEL_CONFIG,
)
from simulator.config.quantities import Bytes, BytesPerS, Seconds

_S = MAX_SAMPLE_COST_S


class _Model(BaseModel):
    model_config = MODEL_CONFIG


class SampleCostConfig(_Model):
    """Decode/transform CPU seconds per sample."""

    distribution: Literal["constant", "lognormal", "empirical"] = "constant"
    mean_s: Seconds = Field(default=0.0, ge=0, le=_S, description="Mean seconds per sample (constant, lognormal).")
    sigma: float | None = Field(default=None, le=10.0, description="Lognormal: standard deviation of log(cost), > 0.")
    samples_s: list[Seconds] | None = Field(default=None, max_length=100_000,
                                            description="Empirical: measured seconds per sample.")

    @field_validator("samples_s")
    @classmethod
    def _samples(cls, v):
        if v is not None and any(not 0 <= x <= MAX_SAMPLE_COST_S for x in v):
            raise ValueError(f"samples_s values must lie in 0..{MAX_SAMPLE_COST_S:g} s")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.distribution == "lognormal" and (self.sigma is None or not self.sigma > 0):
            raise ValueError(f"lognormal cost needs sigma > 0 (standard deviation of log(cost)), got {self.sigma}")
        if self.distribution == "lognormal" and not self.mean_s > 0:
            raise ValueError(f"lognormal cost needs mean_s > 0, got {self.mean_s}")
        if self.distribution == "empirical" and not self.samples_s:
            raise ValueError("empirical cost needs a non-empty samples_s list of measured seconds")
        return self


class SampleConfig(_Model):
    """One sample: its read from storage, its CPU cost and its size in the batch."""

    cost: SampleCostConfig = SampleCostConfig()
    read_bytes: Bytes = Field(default=0.0, ge=0, le=MAX_SAMPLE_BYTES, description="Bytes read from storage per sample (0 = none).")
    bytes: Bytes = Field(default=0.0, ge=0, le=MAX_SAMPLE_BYTES, description="Collated tensor bytes per sample (default: the "
                         "training step's input, seq_length + 1 int64 tokens; a ViT's fp32 image and int64 label, 4 C H W + 8).")


def storage_name(v):
    """Field validator body: a string must be a shipped storage preset (``ValueError`` listing them); other values
    pass (``StorageConfig`` checks an inline spec)."""
    if isinstance(v, str):
        try:
            check_name("storage", v)
        except PresetError as exc:
            raise ValueError(str(exc)) from None
    return v


class StorageConfig(_Model):
    """Storage spec given inline (instead of a preset name)."""

    name: str = "custom"
    read_bandwidth_bytes_per_s: BytesPerS = Field(ge=1e3, description="At least 1 kB/s.")
    read_latency_s: Seconds = Field(default=0.0, ge=0, le=_S)
    write_bandwidth_bytes_per_s: BytesPerS = Field(default=0.0, ge=0, description="Sequential write rate (0: not "
                                                   "given; NVMe offload needs it, the dataloader only reads).")


class RemoteConfig(_Model):
    """Preprocessing workers on other hosts (OVERLORD / tf.data service what-if)."""

    cores: PositiveInt = Field(le=MAX_REMOTE_CORES, description="Cores of the remote preprocessing hosts (all together).")
    bandwidth_bytes_per_s: BytesPerS = Field(ge=1e3, description="Network bandwidth into the trainer (>= 1 kB/s).")
    latency_s: Seconds = Field(default=0.0, ge=0, le=_S)


class DataLoaderConfig(_Model):
    """``torch.utils.data.DataLoader`` arguments plus what the dataset costs."""

    batch_size: PositiveInt | None = Field(default=None, le=MAX_MICRO_BATCH_SIZE,
                                           description="Default: training.micro_batch_size.")
    num_workers: NonNegativeInt = Field(default=0, le=MAX_NUM_WORKERS)
    prefetch_factor: PositiveInt | None = Field(
        default=None, le=MAX_PREFETCH_FACTOR, description="Batches outstanding per worker (PyTorch default 2; must be null with 0 workers).")
    pin_memory: bool = False
    persistent_workers: bool = False
    drop_last: bool = False
    dataset_size: PositiveInt | None = Field(default=None, lt=2**63, description="Samples per epoch (null = endless).")
    sample: SampleConfig = SampleConfig()
    collate_overhead_s: Seconds = Field(default=0.0, ge=0, le=_S, description="Fixed CPU s per batch of collate.")
    pin_overhead_s: Seconds = Field(default=0.0, ge=0, le=_S, description="Fixed CPU s per batch of pinning.")
    worker_startup_s: Seconds = Field(default=0.0, ge=0, le=_S, description="Start-up of a worker process, s.")
    handoff_s: Seconds = Field(default=0.0, ge=0, le=_S,
                               description="CPU s the training thread spends receiving a batch from a worker.")
    storage: str | StorageConfig | None = Field(default=None, description="Storage preset name or inline spec.")
    remote: RemoteConfig | None = None

    _storage = field_validator("storage")(lambda cls, v: storage_name(v))

    @model_validator(mode="before")
    @classmethod
    def _torch_checks(cls, data):
        if isinstance(data, dict):
            nw = data.get("num_workers", 0)
            if isinstance(nw, int) and nw < 0:
                raise ValueError(
                    f"num_workers option should be non-negative; use num_workers=0 to disable multiprocessing "
                    f"(got {nw})")
            if nw == 0 and data.get("prefetch_factor") is not None:
                raise ValueError(
                    "prefetch_factor option could only be specified in multiprocessing: let num_workers > 0 to "
                    "enable multiprocessing, otherwise set prefetch_factor to None (PyTorch rejects it too)")
            if nw == 0 and data.get("persistent_workers"):
                raise ValueError("persistent_workers option needs num_workers > 0 (PyTorch rejects it too)")
        return data
