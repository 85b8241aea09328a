"""NVMe storage for ZeRO-Infinity offload: the host's drives (``hardware.nvme``) and DeepSpeed's ``aio`` section.

YAML::

    hardware:
      host: dgx-h100-host            # its preset names its drives (nvme: 8x samsung-pm1733-3.84tb, RAID-0)
      nvme:                          # optional: replaces the host preset's drives (a key left out: the preset's)
        storage: samsung-pm1733-3.84tb   # a storage preset (simulate presets), or inline:
                                         # {name, read_bandwidth_bytes_per_s, write_bandwidth_bytes_per_s}
        drives: 8                    # drives striped (RAID-0); default the host preset's, else 1
    aio:                             # DeepSpeed's aio section, its names and defaults
      block_size: 1048576
      queue_depth: 8
      thread_count: 1
      single_submit: false
      overlap_events: true

The drive is the dataloader's storage model (``hardware_models.nvme``); the host preset's ``nvme`` block may also
state the chassis' ``bays`` (more drives are refused) and the upstream PCIe links the drives share
(``drives_per_uplink``, ``uplink_bytes_per_s``), which hold for drives given here too. The ``aio`` keys are
the swaps' rate: the array's sequential bandwidth (datasheet figures, measured at high queue depth) times the
fraction the requests in flight reach against the drive's request latency (``hardware_models.aio``), within what
the upstream links and host DRAM leave them; ``single_submit`` is accepted and not priced (``aio_warning``).
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

    storage: str | StorageConfig | None = Field(
        default=None, description="Storage preset name (a drive, `simulate presets`) or an inline spec with "
        "read_bandwidth_bytes_per_s and write_bandwidth_bytes_per_s; default: the host preset's drive (needed when "
        "the host names none).")
    drives: PositiveInt | None = Field(default=None, le=MAX_DRIVES, description="Drives striped as one array "
                                       "(RAID-0); default: the host preset's count, else 1; at most the host "
                                       "preset's bays where it states them.")

    _storage = field_validator("storage")(lambda cls, v: v if v is None else storage_name(v))


class AioConfig(_Model):
    """DeepSpeed ``aio`` (libaio settings of the NVMe swapper): each key is priced by ``hardware_models.aio``
    except ``single_submit``, accepted and not priced (module docstring)."""

    block_size: PositiveInt = Field(default=AIO_DEFAULTS["block_size"], le=1 << 34, description="Bytes per I/O request.")
    queue_depth: PositiveInt = Field(default=AIO_DEFAULTS["queue_depth"], le=1 << 16, description="Requests in flight.")
    thread_count: PositiveInt = Field(default=AIO_DEFAULTS["thread_count"], le=1024, description="I/O threads per "
                                      "handle (intra-request parallelism: each its own queue_depth).")
    single_submit: bool = Field(default=AIO_DEFAULTS["single_submit"], description="Submit requests one by one.")
    overlap_events: bool = Field(default=AIO_DEFAULTS["overlap_events"], description="Overlap submission and "
                                 "completion.")


#: The ``aio`` keys the NVMe price does not depend on (``hardware_models.aio``: no source sizes their cost)
AIO_UNPRICED = ("single_submit",)


def aio_warning(aio: AioConfig, fields_set: set[str], nvme_offload: bool = True) -> str | None:
    """The run's warning about the ``aio`` keys the scenario sets, else None: without ``nvme_offload`` (no offload
    device nvme) they have no effect; with it, those of ``AIO_UNPRICED`` set to other than DeepSpeed's default are
    accepted and not priced (the model submits a batch per ``io_submit``, the default; the others
    set the swaps' rate, ``hardware_models.aio``, and the NVMe warning states it)."""
    if not nvme_offload:
        if not fields_set:
            return None
        keys = ", ".join(f"aio.{k}" for k in sorted(fields_set))
        return (f"{keys} ha{'s' if len(fields_set) == 1 else 've'} no effect: no zero_optimization offload device "
                "nvme (the aio section sets DeepSpeed's NVMe swapper)")
    unpriced = sorted(k for k in set(fields_set) & set(AIO_UNPRICED) if getattr(aio, k) != AIO_DEFAULTS[k])
    if not unpriced:
        return None
    keys = ", ".join(f"aio.{k}" for k in unpriced)
    return (f"{keys} accepted, not priced: DeepSpeed then calls io_submit once per request instead of once per "
            "batch (deepspeedai/DeepSpeed@02fa6329 csrc/aio/common/deepspeed_aio_common.cpp _do_io_submit_singles), "
            "queue_depth - 1 more system calls per batch, whose cost apart from the requests' own submission no "
            "published measurement sizes (block_size, queue_depth, thread_count and overlap_events set the swaps' "
            "rate, hardware_models.aio)")


#: The ``offload_optimizer`` / ``offload_param`` keys DeepSpeed reads for device nvme only
#: (microsoft/DeepSpeed@b1cb0dfc deepspeed/runtime/zero/offload_config.py: each field's description names NVMe)
NVME_ONLY_KEYS = {"offload_optimizer": ("nvme_path", "buffer_count", "pipeline_read", "pipeline_write", "fast_init"),
                  "offload_param": ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")}


def nvme_keys_without_effect(cfg) -> list[str]:
    """One line per NVMe setting of ``cfg`` (a ``ScenarioConfig``) that changes nothing in its run: ``hardware.nvme``,
    ``hardware.host.pcie_switches`` and the nvme-only offload keys (``NVME_ONLY_KEYS``) without an offload device
    nvme, and ``offload_param.max_in_cpu`` (accepted, not priced) with one, each when set to other than its default; the
    ``aio`` line is ``aio_warning``'s."""
    z, out = cfg.zero_optimization, []
    nvme = [k for k in NVME_ONLY_KEYS if getattr(z, k).device == "nvme"]
    if cfg.hardware.nvme is not None and not nvme:
        out.append("hardware.nvme has no effect: no zero_optimization offload device nvme (the drives are read "
                   "only by ZeRO-Infinity NVMe offload)")
    if getattr(cfg.hardware.host, "pcie_switches", None) is not None and not nvme:
        out.append("hardware.host.pcie_switches has no effect: no zero_optimization offload device nvme (the GPUs' "
                   "switch uplinks are priced from hardware.cluster; the switches' drives are read only by NVMe "
                   "offload)")
    for part, keys in NVME_ONLY_KEYS.items():
        sub = getattr(z, part)
        # set to other than DeepSpeed's default (a resolved config, which carries every default, stays quiet)
        given = [k for k in keys if k in sub.model_fields_set and getattr(sub, k) != type(sub).model_fields[k].default]
        if given and sub.device != "nvme":
            out.append(f"zero_optimization.{part}.{', '.join(given)} ha{'s' if len(given) == 1 else 've'} no effect "
                       f"with device {sub.device} (DeepSpeed reads {'it' if len(given) == 1 else 'them'} for device "
                       "nvme only)")
    op = z.offload_param
    if op.device == "nvme" and op.max_in_cpu != type(op).model_fields["max_in_cpu"].default:
        out.append("zero_optimization.offload_param.max_in_cpu accepted, not priced: every parameter partition is "
                   "swapped from NVMe at each fetch")
    return out
