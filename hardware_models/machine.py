"""A whole machine as specs: one GPU with its efficiency profile, its host link and its host."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, NamedTuple

from hardware_models.collectives import CollectiveModel, NcclConfig
from hardware_models.fabrics import LinkSpec
from hardware_models.gpu import GpuSpec
from hardware_models.nvme import NvmeArraySpec
from hardware_models.host import HostCpuSpec, HostMemorySpec
from hardware_models.profile import EfficiencyProfile


#: Host time per eager PyTorch op when neither the scenario nor the host gives one, s. Assumed:
#: PyTorch eager dispatch plus ``cudaLaunchKernel`` costs ~5-20 us per op on server CPUs; the measured
#: H200 host takes 9.6 us for a tiny eager kernel (tests/data/h200/measurements.json
#: micro.memory.tiny_kernel_us_eager). Generic: calibrate the host (``simulate calibrate``).
GENERIC_LAUNCH_OVERHEAD_S = 10e-6


class LaunchOverhead(NamedTuple):
    """Host dispatch time per op in force, and where it came from.

    Attributes:
        per_op_s: Host time per launched op, s (phases not in ``by_phase_s``).
        by_phase_s: Phase (``fwd``/``bwd``/``opt``) -> host time per launched op, s.
        source: ``"scenario"``, ``"profile"`` (a trace-calibrated profile file), ``"host"`` or ``"generic"``.
        fixed_by_phase_s: Phase -> host time once per occurrence of the phase besides its launches, s
            (the optimizer step's Python work; ``HostCpuSpec.host_phase_fixed_s``); it comes with
            ``by_phase_s`` from the same source (a scenario override: none).
    """

    per_op_s: float
    by_phase_s: dict
    source: str
    fixed_by_phase_s: Mapping = MappingProxyType({})  # read-only: one default shared by every instance


def resolve_launch_overhead(override_s: float | None, host: HostCpuSpec, profile: EfficiencyProfile) -> LaunchOverhead:
    """The host dispatch time per op, chosen in one place.

    Order: the scenario's ``hardware.launch_overhead_s`` (every phase) > a trace fit carried by the
    profile (a file written by ``simulate calibrate`` on the traced host; shipped GPU profiles carry
    none) > the host preset's ``launch_overhead_s`` / ``launch_overhead_by_phase_s`` >
    ``GENERIC_LAUNCH_OVERHEAD_S``. The dispatch time is the host's: swapping the GPU keeps it.
    """
    if override_s is not None:
        return LaunchOverhead(float(override_s), {}, "scenario")
    def first(*values):
        return next((float(v) for v in values if v is not None), GENERIC_LAUNCH_OVERHEAD_S)

    if profile.launch_overhead_s is not None or profile.launch_overhead_by_phase_s:
        return LaunchOverhead(first(profile.launch_overhead_s, host.launch_overhead_s),
                              dict(profile.launch_overhead_by_phase_s), "profile", dict(profile.host_phase_fixed_s))
    if host.launch_overhead_s is not None or host.launch_overhead_by_phase_s:
        return LaunchOverhead(first(host.launch_overhead_s), dict(host.launch_overhead_by_phase_s), "host",
                              dict(host.host_phase_fixed_s))
    return LaunchOverhead(GENERIC_LAUNCH_OVERHEAD_S, {}, "generic")


class CopyRates(NamedTuple):
    """Host<->device copy rates in force, bytes/s, and where each came from.

    Attributes:
        h2d_bytes_per_s, d2h_bytes_per_s: Pinned copy rate per direction.
        duplex_bytes_per_s: Both directions together when both are busy.
        pageable_h2d_bytes_per_s, pageable_d2h_bytes_per_s: Driver staging cap of pageable copies
            (0: none, pageable copies run at the pinned rate).
        latency_s: Fixed latency per copy, s.
        sources: Field -> ``"profile"`` (measured on the GPU's host link), ``"link"`` (the link
            preset) or ``"derived"`` (duplex = the sum of the two directions).
    """

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    duplex_bytes_per_s: float
    pageable_h2d_bytes_per_s: float
    pageable_d2h_bytes_per_s: float
    latency_s: float
    sources: dict


#: The ``LinkSpec`` field each copy rate comes from (``resolve_copy_rates``'s ``overridden``).
LINK_FIELD = {"h2d_bytes_per_s": "bandwidth_bytes_per_s", "d2h_bytes_per_s": "bandwidth_bytes_per_s",
              "duplex_bytes_per_s": "duplex_bandwidth_bytes_per_s",
              "pageable_h2d_bytes_per_s": "pageable_h2d_bytes_per_s",
              "pageable_d2h_bytes_per_s": "pageable_d2h_bytes_per_s", "latency_s": "latency_s"}


def resolve_copy_rates(profile: EfficiencyProfile, link: LinkSpec, link_wins: bool = False,
                       overridden: frozenset[str] | tuple[str, ...] = ()) -> CopyRates:
    """The copy rates, chosen in one place: a value measured in the profile (non-zero) wins over
    the link preset's; a duplex limit neither gives is the sum of the two directions.

    With ``link_wins`` (the scenario named ``hardware.pcie`` itself, other than the link the profile was
    measured over: ``Hardware.pcie_explicit``) the priority is the other way round: the link preset's value
    wins where it states one (non-zero) and the profile's measured value fills only what the link leaves
    unstated (the presets' pageable staging caps, 0 there, are the host driver's, not the link's). The link's
    rates replace the measured ones rather than scale them: a measured rate belongs to one host's link, and
    scaling it by a ratio of nominal rates needs the nominal rate of the link it was measured over, which
    the profiles do not record; replacing gives the same copy rates on every GPU profile for one link
    preset, as a profile without measured rates (H100) already did.

    ``overridden``: ``LinkSpec`` fields the scenario overrode on the link the profile was measured over
    (``Hardware.pcie_overridden``): the link's value wins for those rates only (``LINK_FIELD``), the measured
    ones stay. A bandwidth override without a duplex one keeps the measured duplex's efficiency against the two
    directions' sum (``duplex x (h2d + d2h) / (measured h2d + measured d2h)``, source ``"scaled"``): a faster link
    would otherwise run both directions together slower than one alone.
    """
    sources: dict[str, str] = {}

    def pick(name: str, measured: float, spec: float) -> float:
        if link_wins or LINK_FIELD[name] in overridden:
            sources[name] = "link" if spec else "profile"
            return float(spec or measured)
        sources[name] = "profile" if measured else "link"
        return float(measured or spec)

    h2d = pick("h2d_bytes_per_s", profile.h2d_bytes_per_s, link.bandwidth_bytes_per_s)
    d2h = pick("d2h_bytes_per_s", profile.d2h_bytes_per_s, link.bandwidth_bytes_per_s)
    duplex = pick("duplex_bytes_per_s", profile.duplex_bytes_per_s, link.duplex_bandwidth_bytes_per_s)
    measured_sum = profile.h2d_bytes_per_s + profile.d2h_bytes_per_s
    if (not link_wins and "bandwidth_bytes_per_s" in overridden and "duplex_bandwidth_bytes_per_s" not in overridden
            and profile.duplex_bytes_per_s and profile.h2d_bytes_per_s and profile.d2h_bytes_per_s):
        duplex, sources["duplex_bytes_per_s"] = profile.duplex_bytes_per_s * (h2d + d2h) / measured_sum, "scaled"
    if not duplex:
        duplex, sources["duplex_bytes_per_s"] = h2d + d2h, "derived"
    return CopyRates(h2d, d2h, duplex,
                     pick("pageable_h2d_bytes_per_s", profile.pageable_h2d_bytes_per_s, link.pageable_h2d_bytes_per_s),
                     pick("pageable_d2h_bytes_per_s", profile.pageable_d2h_bytes_per_s, link.pageable_d2h_bytes_per_s),
                     pick("latency_s", profile.copy_latency_s, link.latency_s), sources)


@dataclass
class Hardware:
    """Specs of the simulated machine (one representative GPU and its host).

    Attributes:
        gpu: GPU spec.
        profile: Achieved-efficiency profile of that GPU and its host link.
        pcie: Host link spec (its bandwidths are used when the profile has none).
        pcie_explicit: The scenario named ``hardware.pcie`` itself (a link other than the one the profile's
            copy rates were measured over): the link's rates replace the profile's (``resolve_copy_rates``).
        pcie_overridden: ``LinkSpec`` fields ``hardware.pcie.overrides`` set on the link the profile's copy rates
            were measured over: only the rates from those fields replace the measured ones.
        host_cpu: Host CPU spec.
        host_memory: Host memory spec.
        launch_overhead_s: Scenario override of the host time per eager op launch, s (None: the
            host's, see ``launch``).
        collectives: NCCL cost model over the cluster topology (None: one GPU, no cluster).
        world_size: Ranks in the cluster (1 without one).
        dp_group: Global ranks of the representative rank's data-parallel group.
        tp_group: Global ranks of its tensor-parallel group (consecutive, inside one node).
        dp_shard_group: Its FSDP shard group: consecutive data-parallel ranks (HYBRID_SHARD: those of its node, or
            ``parallelism.data_parallel_shard_degree`` of them).
        dp_replicate_group: Its FSDP replicas: one rank of every shard group, strided by it (HSDP's all-reduce).
        dp_post_forward_group: FSDP2 with an int ``reshard_after_forward``: that many consecutive ranks of its shard
            group (the backward all-gather's group).
        pp_group: Global ranks of the representative rank of each pipeline stage, stage order.
        cp_group: Global ranks of its context-parallel group (``dp_group`` then spans data x context parallel).
        pp_rank: The pipeline stage this machine's representative rank belongs to.
        slowdown: Multiplier on every kernel's time of this rank (``rank_overrides``; 1: as priced).
        ep_group: Global ranks of its expert-parallel group (MoE all-to-alls; inside the data-parallel group).
        edp_group: Global ranks of its expert-data-parallel group (replicas of its experts: expert gradients).
        etp_group: Global ranks of its expert-tensor-parallel group (the ranks splitting its experts' width).
        nccl: NCCL overrides for every collective (None: NCCL's tuner).
        nvme: The host's NVMe array (``hardware_models.nvme``; None: none, or not needed by the run).
        pcie_switches: The host's PCIe switches (``hardware_models.pcie_switches.PcieSwitchTopology``; None: the
            host states none).
    """

    gpu: GpuSpec
    profile: EfficiencyProfile
    pcie: LinkSpec
    host_cpu: HostCpuSpec
    host_memory: HostMemorySpec
    launch_overhead_s: float | None = None
    collectives: CollectiveModel | None = None
    world_size: int = 1
    dp_group: tuple[int, ...] = (0,)
    tp_group: tuple[int, ...] = (0,)
    dp_shard_group: tuple[int, ...] = (0,)
    dp_replicate_group: tuple[int, ...] = (0,)
    dp_post_forward_group: tuple[int, ...] = (0,)
    pp_group: tuple[int, ...] = (0,)
    cp_group: tuple[int, ...] = (0,)
    pp_rank: int = 0
    slowdown: float = 1.0
    ep_group: tuple[int, ...] = (0,)
    edp_group: tuple[int, ...] = (0,)
    etp_group: tuple[int, ...] = (0,)
    nccl: NcclConfig | None = None
    pcie_explicit: bool = False
    pcie_overridden: frozenset[str] = frozenset()
    extra: dict = field(default_factory=dict)
    nvme: NvmeArraySpec | None = None
    pcie_switches: object = None

    @property
    def launch(self) -> LaunchOverhead:
        """Host dispatch time per op in force (``resolve_launch_overhead``)."""
        return resolve_launch_overhead(self.launch_overhead_s, self.host_cpu, self.profile)

    @property
    def copy(self) -> CopyRates:
        """Host<->device copy rates in force (``resolve_copy_rates``); on a cluster, on the cluster's GPU PCIe link.

        The profile's (or link preset's) pinned rates belong to the ``pcie`` link preset; a cluster preset
        states the GPU's PCIe link itself (``pcie_bytes_per_s``, which ``hardware.cluster.overrides`` may
        change), so there the pinned rates are scaled by ``pcie_bytes_per_s / pcie.bandwidth_bytes_per_s``
        (the copy's efficiency over its link kept, as ``host_links.UplinkShare.share_of`` assumes). Without
        this a slower cluster link left the copies at the preset's rate and, through ``share_of``, gave them
        a larger share of the switch uplink: copies got faster as the link got slower. Pageable staging caps
        (host-side) and the latency are not scaled.
        """
        topo = getattr(self.collectives, "topo", None)
        link = float(getattr(getattr(topo, "cluster", None), "pcie_bytes_per_s", 0.0) or 0.0)
        memo = self.__dict__.get("_copy_memo")  # (inputs, rates) of the last call: the rates are a pure function of them
        if (memo is not None and memo[0][0] is self.profile and memo[0][1] is self.pcie
                and memo[0][2:] == (self.pcie_explicit, self.pcie_overridden, link)):
            return memo[1]
        rates = self._copy_uncached(link)
        self.__dict__["_copy_memo"] = ((self.profile, self.pcie, self.pcie_explicit, self.pcie_overridden, link), rates)
        return rates

    def _copy_uncached(self, link: float) -> CopyRates:
        """``copy`` computed afresh (``link``: the cluster's GPU PCIe link rate, bytes/s; 0: none)."""
        rates = resolve_copy_rates(self.profile, self.pcie, link_wins=self.pcie_explicit,
                                   overridden=self.pcie_overridden)
        base = self.pcie.bandwidth_bytes_per_s
        if not link or not base or link == base:
            return rates
        k = link / base
        note = f", scaled x {k:.4g} to the cluster's PCIe link"
        return rates._replace(h2d_bytes_per_s=rates.h2d_bytes_per_s * k, d2h_bytes_per_s=rates.d2h_bytes_per_s * k,
                              duplex_bytes_per_s=rates.duplex_bytes_per_s * k,
                              sources={**rates.sources, **{f: rates.sources[f] + note for f in
                                                           ("h2d_bytes_per_s", "d2h_bytes_per_s", "duplex_bytes_per_s")}})

    def for_pipeline_rank(self, rank: int) -> "Hardware":
        """The machine of pipeline stage ``rank``'s representative: its global rank ``pp_group[rank]`` and the
        TP, DP (FSDP's shard, replicate and post-forward too), EP and expert-DP groups shifted by the same offset (Megatron tp-cp-ep-dp-pp rank order).

        Raises:
            IndexError: ``rank`` outside ``0..len(pp_group) - 1``.
        """
        base = self.pp_group[rank] - self.pp_group[0]
        shift = lambda g: tuple(r + base for r in g)  # noqa: E731
        return replace(self, pp_rank=rank, dp_group=shift(self.dp_group), tp_group=shift(self.tp_group),
                       ep_group=shift(self.ep_group), edp_group=shift(self.edp_group), cp_group=shift(self.cp_group),
                       etp_group=shift(self.etp_group), dp_shard_group=shift(self.dp_shard_group),
                       dp_replicate_group=shift(self.dp_replicate_group),
                       dp_post_forward_group=shift(self.dp_post_forward_group))

    def link_rate(self, kind: str, pinned: bool) -> tuple[float, float]:
        """``(bandwidth_bytes_per_s, cap_bytes_per_s)`` of a copy (``kind`` "memcpy_h2d" or "memcpy_d2h").

        Pinned copies run at the link rate; pageable copies are capped by the driver's staging rate.
        """
        c = self.copy
        if kind in ("h2d", "memcpy_h2d"):
            bw, pg = c.h2d_bytes_per_s, c.pageable_h2d_bytes_per_s
        else:
            bw, pg = c.d2h_bytes_per_s, c.pageable_d2h_bytes_per_s
        return bw, (0.0 if pinned or not pg else pg)


