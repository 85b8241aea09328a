"""Which GPUs, NICs and NVMe drives of a host sit behind each PCIe switch, and the switch's uplink to the CPU.

On HGX / DGX-class hosts the GPUs, their NICs and (where the chassis wires them so) the data drives share PCIe
switches whose single upstream link goes to the CPU's root complex. A host that states this topology
(``pcie_switches`` in its preset, or ``hardware.host.pcie_switches`` in a scenario) lets the NVMe swaps of
ZeRO-Infinity share those uplinks with the GPUs' host copies (``simulator.policies.offload_nvme``): an NVMe read
(drive to host memory) moves up the uplink like a GPU's D2H copy, a write down it like an H2D copy, and both count
against the link's two-way limit (PCIe is full duplex: a read and an H2D copy share only that limit; PCI Express
Base Specification: each direction its own lanes). The NICs are listed for the topology's check only: GPUDirect
RDMA traffic between a GPU and a NIC of its switch turns inside the switch (NCCL's ``PIX`` path) and does not load
the uplink.

A switch's uplink rate is per direction, bytes/s. Indices are the node's: GPU ``0..gpus_per_node-1``, NIC
``0..nics_per_node-1``, drive ``0..drives-1`` of the striped array; a device listed nowhere sits on a CPU root port.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: the device kinds a switch lists
KINDS = ("gpus", "nics", "drives")


@dataclass(frozen=True, slots=True)
class PcieSwitch:
    """One PCIe switch: the node's devices behind it and its uplink.

    Attributes:
        gpus, nics, drives: Node-local indices of the devices behind it.
        uplink_bytes_per_s: Its upstream link's rate per direction, bytes/s (> 0).
    """

    gpus: tuple[int, ...] = ()
    nics: tuple[int, ...] = ()
    drives: tuple[int, ...] = ()
    uplink_bytes_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PcieSwitchTopology:
    """A host's PCIe switches (module docstring).

    Attributes:
        switches: The switches, in the preset's order.
        source: Where the topology comes from (a preset's citation, or "scenario").

    Raises:
        ValueError: a device listed twice (in two switches or twice in one), a negative index, or an uplink that is
            not a positive finite rate (one line per problem, naming the switch).
    """

    switches: tuple[PcieSwitch, ...]
    source: str = ""

    def __post_init__(self) -> None:
        """Raises: ValueError: see the class docstring (every problem found, one line each)."""
        if problems := layout_problems(self.switches):
            raise ValueError("\n".join(problems))

    def check(self, gpus: int, nics: int | None = None, drives: int | None = None) -> None:
        """Check the indices against the node's devices (``None``: that count unknown, not checked).

        Raises:
            ValueError: an index of a device the node does not have (one line per index, naming the switch and
                the range).
        """
        if problems := range_problems(self.switches, gpus, nics, drives):
            raise ValueError("\n".join(problems))

    def switch_of(self, kind: str, index: int) -> int | None:
        """The switch holding device ``index`` of ``kind`` (``"gpus"``, ``"nics"``, ``"drives"``), None: none."""
        return next((j for j, sw in enumerate(self.switches) if index in getattr(sw, kind)), None)

    def gpu_groups(self) -> list[frozenset[int]]:
        """The GPUs behind each switch that has any (to compare with a cluster topology's placement)."""
        return [frozenset(sw.gpus) for sw in self.switches if sw.gpus]

    def drive_uplink(self, drives: int) -> tuple[int, float]:
        """``(drives_per_uplink, uplink_bytes_per_s)`` for ``hardware_models.nvme.NvmeArraySpec``: RAID-0 stripes every
        transfer evenly over the ``drives``, so the switch whose uplink carries the most per byte bounds the array,
        at ``min_k(drives x uplink_k / drives_k)``; given as its fullest count ``d_max`` and the rate that makes
        ``drives x rate / d_max`` that bound. ``(0, 0.0)`` when no switch lists a drive."""
        loads = [(len(sw.drives), sw.uplink_bytes_per_s) for sw in self.switches if sw.drives]
        if not loads:
            return 0, 0.0
        d_max = max(d for d, _ in loads)
        return d_max, d_max * min(u / d for d, u in loads)


def layout_problems(switches) -> list[str]:
    """One line per problem of ``switches`` (``PcieSwitch`` each) on their own: a device listed twice (in two
    switches or twice in one), an index that is not a non-negative int, an uplink that is not a positive finite rate.
    Raises nothing."""
    out = []
    for kind in KINDS:
        seen: dict[int, int] = {}
        for j, sw in enumerate(switches):
            for i in getattr(sw, kind):
                if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                    out.append(f"pcie_switches[{j}].{kind}: {i!r} is not a device index (allowed: 0, 1, ...)")
                elif i in seen:
                    where = "twice in it" if seen[i] == j else f"also in pcie_switches[{seen[i]}]"
                    out.append(f"pcie_switches[{j}].{kind}: {kind[:-1]} {i} is listed {where} (a device sits "
                               "behind one switch)")
                else:
                    seen[i] = j
    for j, sw in enumerate(switches):
        if not (sw.uplink_bytes_per_s > 0 and math.isfinite(sw.uplink_bytes_per_s)):
            out.append(f"pcie_switches[{j}].uplink_bytes_per_s must be a positive finite rate, got "
                       f"{sw.uplink_bytes_per_s!r}")
    return out


def range_problems(switches, gpus: int, nics: int | None = None, drives: int | None = None) -> list[str]:
    """One line per index of ``switches`` beyond the node's ``gpus`` / ``nics`` / ``drives`` (``None``: that count
    unknown, not checked), in kind then switch order; an index that is not an int is ``layout_problems``'.
    Raises nothing."""
    out = []
    for kind, n in zip(KINDS, (gpus, nics, drives)):
        if n is None:
            continue
        allowed = f"0..{n - 1}" if n else "none: the node has no " + kind
        for j, sw in enumerate(switches):
            for i in getattr(sw, kind):
                if isinstance(i, int) and not isinstance(i, bool) and i >= n:
                    out.append(f"pcie_switches[{j}].{kind}: {kind[:-1]} {i} does not exist (the node has {n}; "
                               f"allowed: {allowed})")
    return out


def parse_pcie_switches(value, source: str = "", counts: tuple | None = None) -> PcieSwitchTopology:
    """A topology from a list of mappings ``{gpus: [...], nics: [...], drives: [...], uplink_bytes_per_s: rate}`` (a
    rate with units, ``"63 GB/s"``, or bytes/s), as a host preset or a scenario writes it.

    ``counts``: the node's ``(gpus, nics, drives)`` (as ``PcieSwitchTopology.check``), checked with the layout so
    that one error tells every problem of both.

    Raises:
        ValueError: not such a list, an unknown key, or as ``PcieSwitchTopology`` (one line per problem, naming the
            switch).
    """
    from hardware_models import units

    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("pcie_switches: expected a list of {gpus: [..], nics: [..], drives: [..], "
                         f"uplink_bytes_per_s: rate}}, got {value!r}")
    out = []
    for j, sw in enumerate(value):
        if not isinstance(sw, dict) or set(sw) - {*KINDS, "uplink_bytes_per_s"} or "uplink_bytes_per_s" not in sw:
            raise ValueError(f"pcie_switches[{j}]: expected {{gpus, nics, drives (lists of indices), "
                             f"uplink_bytes_per_s}}, got {sw!r}")
        lists = {}
        for k in KINDS:
            v = sw.get(k, [])
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"pcie_switches[{j}].{k}: expected a list of device indices, got {v!r}")
            lists[k] = tuple(v)
        up = sw["uplink_bytes_per_s"]
        try:
            rate = units.parse_quantity(up, "bytes_per_s") if isinstance(up, str) else float(up)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"pcie_switches[{j}].uplink_bytes_per_s: {exc}") from None
        out.append(PcieSwitch(uplink_bytes_per_s=rate, **lists))
    if counts is not None and (problems := layout_problems(out) + range_problems(out, *counts)):
        raise ValueError("\n".join(problems))
    return PcieSwitchTopology(tuple(out), source)


def host_pcie_switches(name: str, counts: tuple | None = None) -> PcieSwitchTopology | None:
    """The PCIe switches host preset ``name`` states (its ``pcie_switches`` list), None when it states none.

    ``counts``: the node's ``(gpus, nics, drives)``, checked with the layout as ``parse_pcie_switches`` does (every
    problem of both in one error, as for a scenario's list).

    Raises:
        ValueError: a bad list (``presets.PresetError``, naming the preset; one line per problem).
    """
    from hardware_models import presets

    block = presets.read("hosts", name).get("pcie_switches")
    if block is None:
        return None
    sources: dict[str, str] = {}
    clean = presets.strip_sources(block, sources)
    try:
        return parse_pcie_switches(clean, "; ".join(sources.values()), counts)
    except ValueError as exc:
        raise presets.PresetError("\n".join(f"preset hosts/{name}.{line}" for line in str(exc).split("\n"))) from None
