"""NVMe storage for ZeRO-Infinity offload: the host's drives (``hardware.nvme``) and DeepSpeed's ``aio`` section.

YAML::

    hardware:
      host: dgx-h100-host            # its preset names its drives (nvme: 8x samsung-pm1733-3.84tb, RAID-0)
      nvme:                          # optional: replaces the host preset's drives
        storage: samsung-pm1733-3.84tb   # a storage preset (simulate presets), or inline:
                                         # {name, read_bandwidth_bytes_per_s, write_bandwidth_bytes_per_s}
        drives: 8                    # drives striped (RAID-0)
    aio:                             # DeepSpeed's aio section, its names and defaults
      block_size: 1048576
      queue_depth: 8
      thread_count: 1
      single_submit: false
      overlap_events: true

The drive is the dataloader's storage model (``hardware_models.nvme``). The ``aio`` keys are accepted and not
priced: NVMe transfers run at the array's sequential bandwidth (datasheet figures, measured at high queue depth);
a run that sets any of them says so in its warnings (``aio_warning``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, PositiveInt, field_validator

from hardware_models.nvme import MAX_DRIVES
from simulator.config.limits import MODEL_CONFIG
from simulator.config.sections.dataloader import StorageConfig, storage_name

#: DeepSpeed's aio defaults (microsoft/DeepSpeed@077e6740 deepspeed/runtime/swap_tensor/constants.py)
AIO_DEFAULTS = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True}


class _Model(BaseModel):
    model_config = MODEL_CONFIG


class NvmeConfig(_Model):
    """The host's NVMe drives: one drive model striped over ``drives`` (RAID-0)."""

    storage: str | StorageConfig = Field(description="Storage preset name (a drive, `simulate presets`) or an "
                                         "inline spec with read_bandwidth_bytes_per_s and write_bandwidth_bytes_per_s.")
    drives: PositiveInt = Field(default=1, le=MAX_DRIVES, description="Drives striped as one array (RAID-0).")

    _storage = field_validator("storage")(lambda cls, v: storage_name(v))


class AioConfig(_Model):
    """DeepSpeed ``aio`` (libaio settings of the NVMe swapper): accepted, not priced (module docstring)."""

    block_size: PositiveInt = Field(default=AIO_DEFAULTS["block_size"], le=1 << 34, description="Bytes per I/O request.")
    queue_depth: PositiveInt = Field(default=AIO_DEFAULTS["queue_depth"], le=1 << 16, description="Requests in flight.")
    thread_count: PositiveInt = Field(default=AIO_DEFAULTS["thread_count"], le=1024, description="I/O threads per "
                                      "handle (intra-request parallelism).")
    single_submit: bool = Field(default=AIO_DEFAULTS["single_submit"], description="Submit requests one by one.")
    overlap_events: bool = Field(default=AIO_DEFAULTS["overlap_events"], description="Overlap submission and "
                                 "completion.")


def aio_warning(aio: AioConfig, fields_set: set[str]) -> str | None:
    """The run's warning when the scenario sets ``aio`` keys (their values do not change the price), else None."""
    if not fields_set:
        return None
    keys = ", ".join(f"aio.{k}" for k in sorted(fields_set))
    return (f"{keys} accepted, not priced: NVMe swaps run at the array's sequential bandwidth (datasheet rates at "
            "high queue depth); DeepSpeed's aio settings change the rate it achieves (measure the array with "
            "fio or DeepSpeed's aio benchmark and give it as hardware.nvme)")
