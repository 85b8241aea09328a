"""The PCIe path from a GPU to host memory, and which of the job's GPUs share it.

On HGX boards several GPUs sit behind one PCIe switch whose single uplink goes to the CPU's root
complex (DGX H100 / A100: 2 GPUs and 2 NICs per switch, ``presets/clusters``), so host<->device
copies that the GPUs of one switch issue at the same time share the uplink. GPUs on their own CPU
root ports (``pcie_switches: 0``) share nothing before the root complex. Beyond it, the DMA traffic
lands in host DRAM: in offload runs the copies also cross the rank's ``host.dram`` link, shared with the
CPU step's streams (``simulator.policies.offload_optimizer.OffloadSummary``,
``hardware_models.host_kernels.host_dram_share``).

Under rank folding (one representative rank stands for its symmetric peers, ``simulator.engine``)
the peers behind the same switch copy exactly when the representative does, so the representative's
copy gets ``1 / sharers`` of the uplink: :func:`uplink_share`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UplinkShare:
    """This rank's PCIe switch uplink and the job's ranks behind it.

    Attributes:
        uplink: Topology edge name of the switch's uplink towards the CPU (``"n0.pcie0->n0.cpu0"``).
        sharers: Ranks of the job (this rank's pipeline stage) behind that switch, this rank included (>= 1).
        uplink_bytes_per_s: The uplink's datasheet rate per direction, bytes/s.
        gpu_link_bytes_per_s: The GPU's own PCIe link's datasheet rate per direction, bytes/s.
    """

    uplink: str
    sharers: int
    uplink_bytes_per_s: float
    gpu_link_bytes_per_s: float

    def share_of(self, gpu_link_rate_bytes_per_s: float) -> float:
        """The rate this rank's copies get through the uplink while every sharer copies, bytes/s.

        ``gpu_link_rate_bytes_per_s``: the rate the copy reaches alone on the GPU's link (the copy
        profile's measured rate); the uplink runs at the same efficiency of its own datasheet rate
        (the same PCIe generation and protocol overheads), split evenly among the ``sharers``
        symmetric flows (max-min fair share of equal flows on one link)::

            share = rate x (uplink_bytes_per_s / gpu_link_bytes_per_s) / sharers
        """
        return gpu_link_rate_bytes_per_s * (self.uplink_bytes_per_s / self.gpu_link_bytes_per_s) / self.sharers


def _switch_of(topo, rank: int) -> tuple[str | None, str | None]:
    """(PCIe switch node, GPU->switch edge name) of ``rank``'s GPU; (None, None) on a CPU root port."""
    gpu = topo.gpu(rank)
    for v, d in topo.out_links(gpu):
        if topo.kind(v) == "pcie_switch":
            return v, d["name"]
    return None, None


def uplink_share(topo, rank: int, ranks) -> UplinkShare | None:
    """The uplink of ``rank``'s PCIe switch and how many of ``ranks`` sit behind it.

    Args:
        topo: The cluster topology (``hardware_models.topology.Topology``).
        rank: Global rank of the representative GPU.
        ranks: Global ranks whose host copies run at the same time as ``rank``'s (its folded peers).

    Returns:
        None when the GPU sits on a CPU root port (no switch), else an :class:`UplinkShare`.
    """
    sw, gpu_edge = _switch_of(topo, rank)
    if sw is None:
        return None
    up = next((d for v, d in topo.out_links(sw) if topo.kind(v) == "cpu"), None)
    if up is None:
        return None
    node = topo.node_of(rank)
    sharers = sum(1 for r in set(ranks) | {rank} if topo.node_of(r) == node and _switch_of(topo, r)[0] == sw)
    return UplinkShare(up["name"], sharers, float(up["capacity_bytes_per_s"]),
                       float(topo.link(gpu_edge)["capacity_bytes_per_s"]))
