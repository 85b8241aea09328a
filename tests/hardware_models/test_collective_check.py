"""``CollectiveModel.check`` raises exactly what ``price`` raises (the loader checks the world all-reduce with it:
at 16,384 GPUs pricing that group searched every ring hop)."""

from __future__ import annotations

import pytest

from hardware_models.collectives import CollectiveError, CollectiveModel, NcclConfig, load_collective_profile
from hardware_models.topology import Topology, build_topology
from tests.hardware_models.test_collectives import prof, tiny

CONFIGS = [None, NcclConfig(algo="ring", proto="simple"), NcclConfig(algo="nvls"), NcclConfig(algo="nvlstree"),
           NcclConfig(proto="ll128"), NcclConfig(algo="tree", proto="ll128"), NcclConfig(algo="nvls", proto="ll"),
           NcclConfig(nvls_enable=False, algo="nvls"), NcclConfig(nchannels=4), NcclConfig(algo="tree")]


def _models():
    yield CollectiveModel(Topology(tiny()), prof())  # NVSwitch without in-switch reduction, no channel rate
    yield CollectiveModel(Topology(tiny("pcie")), prof())  # no NVLink: no LL128
    yield CollectiveModel(build_topology("dgx-h100", nodes=2), load_collective_profile("dgx-h100"))


def _outcome(fn):
    try:
        fn()
    except CollectiveError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("cfg", CONFIGS, ids=repr)
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "send_recv"])
def test_check_raises_what_price_raises(op, cfg):
    seen_error = False
    for m in _models():
        group = tuple(range(min(m.topo.world_size, 16))) if op != "send_recv" else (0, 1)
        want = _outcome(lambda: m.price(op, group, 1 << 20, cfg))
        assert _outcome(lambda: m.check(op, group, 1 << 20, cfg)) == want
        seen_error |= want is not None
    if cfg is not None and (cfg.algo in ("nvls", "nvlstree") or cfg.nchannels) and op != "send_recv":
        assert seen_error  # the cases above include the errors, not only passes
