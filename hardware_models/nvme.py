"""NVMe storage attached to a host: one drive model striped over several drives (RAID-0), for ZeRO-Infinity offload.

The drive is the storage spec the dataloader reads from (``hardware_models.dataloader.StorageSpec``, presets under
``presets/storage``): one device model for both. An array stripes ``drives`` of them (Linux md RAID-0, as NVIDIA's
DGX systems configure their data drives at ``/raid``: DGX A100 / DGX H100 User Guides, "Internal storage"); its
sequential bandwidth is taken as ``drives`` times the drive's (inferred: large sequential requests spread evenly
over the stripes; measured arrays fall short of it when the host's PCIe switches or the md layer limit them, so a
measured figure, ``fio --rw=read --bs=1M --iodepth=32`` on the array, is the better input).

The array is shared by every rank of the node that swaps to it; a read and a write share the drives' time (a
drive busy writing is not reading: ``NvmeArraySpec.busy_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hardware_models.dataloader import StorageSpec

#: Most drives of one array (a sanity bound: 8 on DGX systems; 24 U.2 bays on the largest 2U servers).
MAX_DRIVES = 64


@dataclass(frozen=True, slots=True)
class NvmeArraySpec:
    """NVMe drives striped as one array (RAID-0).

    Attributes:
        drive: One drive (needs ``read_bandwidth_bytes_per_s`` and ``write_bandwidth_bytes_per_s``).
        drives: Drives striped, 1..``MAX_DRIVES``.
        source: Where the drive count comes from (a host preset's citation, or "scenario").

    Raises:
        ValueError: no drive write bandwidth, or a drive count outside 1..``MAX_DRIVES``.
    """

    drive: StorageSpec
    drives: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        """Raises: ValueError: see the class docstring."""
        if isinstance(self.drives, bool) or not isinstance(self.drives, int) or not 1 <= self.drives <= MAX_DRIVES:
            raise ValueError(f"drives must be an integer in 1..{MAX_DRIVES}, got {self.drives!r}")
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

    def busy_s(self, read_bytes: float, write_bytes: float) -> float:
        """Seconds the array is busy moving ``read_bytes`` and ``write_bytes`` alone (reads and writes share the
        drives' time): ``read / read_bw + write / write_bw``."""
        return read_bytes / self.read_bytes_per_s + write_bytes / self.write_bytes_per_s

    @property
    def write_cost(self) -> float:
        """Read-equivalent bytes of one written byte (``read_bw / write_bw``): a write flow of ``b`` bytes moves
        ``b x write_cost`` units over a link of the read bandwidth, so that the link is the drives' shared time."""
        return self.read_bytes_per_s / self.write_bytes_per_s


def load_nvme(storage: StorageSpec | str, drives: int = 1, source: str = "") -> NvmeArraySpec:
    """An array of ``drives`` drives of ``storage`` (a storage preset name or a spec).

    Raises:
        ValueError: an unknown storage preset (``DataLoaderSpecError``), a drive without a write bandwidth, or a
            bad drive count.
    """
    from hardware_models.dataloader import load_storage_preset

    drive = load_storage_preset(storage) if isinstance(storage, str) else storage
    return NvmeArraySpec(drive, drives, source)


def host_nvme(name: str) -> NvmeArraySpec | None:
    """The NVMe array of host preset ``name`` (its ``nvme: {storage, drives}`` block), or None when it names none.

    Raises:
        ValueError: a bad block (``presets.PresetError``, naming the preset), or as ``load_nvme``.
    """
    from hardware_models import presets

    block = presets.read("hosts", name).get("nvme")
    if block is None:
        return None
    sources: dict[str, str] = {}
    clean = presets.strip_sources(block, sources)
    where = f"preset hosts/{name}.nvme"
    if not isinstance(clean, dict) or set(clean) - {"storage", "drives"} or "storage" not in clean:
        raise presets.PresetError(f"{where}: expected a mapping {{storage: <storage preset>, drives: N}}")
    try:
        return load_nvme(clean["storage"], clean.get("drives", 1), "; ".join(sources.values()))
    except ValueError as exc:
        raise presets.PresetError(f"{where}: {exc}") from None
