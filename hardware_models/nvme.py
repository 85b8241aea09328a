"""NVMe storage attached to a host: one drive model striped over several drives (RAID-0), for ZeRO-Infinity offload.

The drive is the storage spec the dataloader reads from (``hardware_models.dataloader.StorageSpec``, presets under
``presets/storage``): one device model for both. An array stripes ``drives`` of them (Linux md RAID-0, as NVIDIA's
DGX systems configure their data drives at ``/raid``: DGX A100 / DGX H100 User Guides, "Internal storage"); its
sequential bandwidth is taken as ``drives`` times the drive's (inferred: large sequential requests spread evenly
over the stripes; measured arrays fall short of it when the host's PCIe switches or the md layer limit them, so a
measured figure, ``fio --rw=read --bs=1M --iodepth=32`` on the array, is the better input).

The array is shared by every rank of the node that swaps to it; a read and a write share the drives' time (a
drive busy writing is not reading: ``NvmeArraySpec.busy_s``).

Where the host preset says how the drives attach (``drives_per_uplink`` drives behind one PCIe link of
``uplink_bytes_per_s`` per direction to the CPU's root complex: a PCIe switch's upstream port, or a shared root
port), the array is also bounded by those links (``uplink_read_bytes_per_s``): RAID-0 stripes every transfer evenly
over the drives, so the fullest upstream link limits them all. A preset that states ``bays`` refuses more drives
than the chassis holds. A host that states its PCIe switches (``hardware_models.pcie_switches``) gives these
links from the drives behind each switch instead. Every byte also crosses host DRAM (the DMA lands in, or is read from, the pinned swap
buffers): ``simulator.policies.offload_nvme`` puts the swaps on the rank's ``host.dram`` link with the CPU step and
the GPU copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hardware_models.dataloader import StorageSpec

#: The host preset's ``nvme`` keys that say how the drives attach (``NvmeArraySpec``)
TOPOLOGY = ("bays", "drives_per_uplink", "uplink_bytes_per_s")
#: Most drives of one array (a sanity bound: 8 on DGX systems; 24 U.2 bays on the largest 2U servers).
MAX_DRIVES = 64


@dataclass(frozen=True, slots=True)
class NvmeArraySpec:
    """NVMe drives striped as one array (RAID-0).

    Attributes:
        drive: One drive (needs ``read_bandwidth_bytes_per_s`` and ``write_bandwidth_bytes_per_s``).
        drives: Drives striped, 1..``MAX_DRIVES``.
        source: Where the drive count comes from (a host preset's citation, or "scenario").
        bays: Drives the host holds (0: not stated, then up to ``MAX_DRIVES``).
        drives_per_uplink: Drives behind one upstream PCIe link to the root complex (0: not stated, no shared link
            modelled: each drive on its own root port).
        uplink_bytes_per_s: That link's rate per direction, bytes/s (needed with ``drives_per_uplink``).

    Raises:
        ValueError: no drive write bandwidth, a drive count outside 1..``MAX_DRIVES`` or above ``bays``, or an
            upstream link without a positive rate.
    """

    drive: StorageSpec
    drives: int = 1
    source: str = ""
    bays: int = 0
    drives_per_uplink: int = 0
    uplink_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        """Raises: ValueError: see the class docstring."""
        if isinstance(self.drives, bool) or not isinstance(self.drives, int) or not 1 <= self.drives <= MAX_DRIVES:
            raise ValueError(f"drives must be an integer in 1..{MAX_DRIVES}, got {self.drives!r}")
        if self.bays and self.drives > self.bays:
            raise ValueError(f"drives: {self.drives} drives, but the host holds {self.bays} (its bays; allowed: "
                             f"1..{self.bays})")
        if self.drives_per_uplink and not (self.uplink_bytes_per_s > 0 and math.isfinite(self.uplink_bytes_per_s)):
            raise ValueError("uplink_bytes_per_s must be a positive finite rate with drives_per_uplink, got "
                             f"{self.uplink_bytes_per_s!r}")
        if not self.drive.write_bandwidth_bytes_per_s > 0:
            raise ValueError(f"storage {self.drive.name!r} has no write_bandwidth_bytes_per_s (NVMe offload writes "
                             "to it; give the drive's sequential write rate)")

    @property
    def read_bytes_per_s(self) -> float:
        """Sequential read bandwidth of the array, bytes/s: ``drives`` x the drive's."""
        return self.drives * self.drive.read_bandwidth_bytes_per_s

    @property
    def write_bytes_per_s(self) -> float:
        """Sequential write bandwidth of the array, bytes/s: ``drives`` x the drive's."""
        return self.drives * self.drive.write_bandwidth_bytes_per_s

    @property
    def fullest_uplink(self) -> int:
        """Drives behind the fullest upstream link (0 without one): ``min(drives, drives_per_uplink)``."""
        return min(self.drives, self.drives_per_uplink) if self.drives_per_uplink else 0

    @property
    def uplink_read_bytes_per_s(self) -> float:
        """What the upstream links let the striped array move per direction, bytes/s (inf without them): each drive
        carries ``1 / drives`` of a transfer, so the fullest link, of ``fullest_uplink`` drives, saturates first::

            drives x uplink_bytes_per_s / fullest_uplink
        """
        if not self.fullest_uplink:
            return math.inf
        return self.drives * self.uplink_bytes_per_s / self.fullest_uplink

    def busy_s(self, read_bytes: float, write_bytes: float, efficiency: float = 1.0) -> float:
        """Seconds the array needs to move ``read_bytes`` and ``write_bytes`` alone: the drives' time (reads and
        writes share it) at ``efficiency`` (in (0, 1]: the fraction of the sequential rates the I/O settings reach,
        ``hardware_models.aio``), ``(read / read_bw + write / write_bw) / efficiency``, or the upstream links' per
        direction when longer, ``max(read, write) / uplink_read_bytes_per_s``."""
        drives = (read_bytes / self.read_bytes_per_s + write_bytes / self.write_bytes_per_s) / efficiency
        return max(drives, max(read_bytes, write_bytes) / self.uplink_read_bytes_per_s)

    @property
    def write_cost(self) -> float:
        """Read-equivalent bytes of one written byte (``read_bw / write_bw``): a write flow of ``b`` bytes moves
        ``b x write_cost`` units over a link of the read bandwidth, so that the link is the drives' shared time."""
        return self.read_bytes_per_s / self.write_bytes_per_s


def load_nvme(storage: StorageSpec | str, drives: int = 1, source: str = "", **topology) -> NvmeArraySpec:
    """An array of ``drives`` drives of ``storage`` (a storage preset name or a spec); ``topology``: the host's
    ``bays``, ``drives_per_uplink``, ``uplink_bytes_per_s`` (``NvmeArraySpec``).

    Raises:
        ValueError: an unknown storage preset (``DataLoaderSpecError``), a drive without a write bandwidth, or a
            bad drive count (above the host's bays too).
    """
    from hardware_models.dataloader import load_storage_preset

    drive = load_storage_preset(storage) if isinstance(storage, str) else storage
    return NvmeArraySpec(drive, drives, source, **topology)


def host_nvme(name: str) -> NvmeArraySpec | None:
    """The NVMe array of host preset ``name`` (its ``nvme: {storage, drives}`` block), or None when it names none.

    Raises:
        ValueError: a bad block (``presets.PresetError``, naming the preset), or as ``load_nvme``.
    """
    from hardware_models import presets, units

    block = presets.read("hosts", name).get("nvme")
    if block is None:
        return None
    sources: dict[str, str] = {}
    clean = presets.strip_sources(block, sources)
    where = f"preset hosts/{name}.nvme"
    if not isinstance(clean, dict) or set(clean) - {"storage", "drives", *TOPOLOGY} or "storage" not in clean:
        raise presets.PresetError(f"{where}: expected a mapping {{storage: <storage preset>, drives: N, and optionally "
                                  f"{', '.join(TOPOLOGY)}}}")
    try:
        topo = {k: clean[k] for k in TOPOLOGY if k in clean}
        if "uplink_bytes_per_s" in topo:
            topo["uplink_bytes_per_s"] = units.parse_quantity(topo["uplink_bytes_per_s"], "bytes_per_s")
        return load_nvme(clean["storage"], clean.get("drives", 1),
                         "; ".join(v for k, v in sources.items() if k in ("storage", "drives")), **topo)
    except ValueError as exc:
        raise presets.PresetError(f"{where}: {exc}") from None
