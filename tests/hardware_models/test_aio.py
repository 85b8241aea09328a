"""DeepSpeed's aio settings as a closed queueing network (``hardware_models.aio``): exact MVA worked by hand, the
NVMe link it sets (``simulator.policies.offload_nvme.nvme_links``), and predicted vs published sweeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hardware_models.aio import aio_efficiency, mva_throughput
from hardware_models.dataloader import StorageSpec
from hardware_models.nvme import NvmeArraySpec
from simulator.config.sections.nvme import AioConfig
from simulator.policies.offload_nvme import NVME_LINK, nvme_links

MiB = 1 << 20


def test_mva_by_hand():
    # D = Z = 1 s: n=1: R = 1, X = 1/2, Q = 1/2; n=2: R = 1.5, X = 2 / 2.5 = 0.8; n=3: Q = 1.2, R = 2.2, X = 3/3.2
    assert mva_throughput(1, 1.0, 1.0) == 0.5
    assert mva_throughput(2, 1.0, 1.0) == pytest.approx(0.8, rel=1e-15)
    assert mva_throughput(3, 1.0, 1.0) == pytest.approx(3 / 3.2, rel=1e-15)
    assert mva_throughput(1, 2.0, 0.0) == 0.5  # no latency: one request keeps the server busy
    with pytest.raises(ValueError):
        mva_throughput(0, 1.0, 1.0)


def test_overlap_keeps_the_queue_full_batches_wait_for_the_last_request():
    # a request of D = 100 us on the array against Z = 100 us: queue_depth 2 overlapped is MVA(2) = 0.8 of the
    # rate; in batches one thread has one batch of 2 x D = 200 us in flight: 200 / (200 + 100) = 2/3
    kw = {"array_bytes_per_s": 7e9, "latency_s": 100e-6}
    assert aio_efficiency(700_000, 2, 1, True, **kw) == pytest.approx(0.8, rel=1e-12)
    assert aio_efficiency(700_000, 2, 1, False, **kw) == pytest.approx(2 / 3, rel=1e-12)
    # threads and ranks add requests alike: 2 threads x depth 1 = 1 thread x depth 2 = 2 ranks x depth 1
    assert aio_efficiency(700_000, 1, 2, True, **kw) == aio_efficiency(700_000, 2, 1, True, **kw)
    assert aio_efficiency(700_000, 1, 1, True, ranks=2, **kw) == aio_efficiency(700_000, 2, 1, True, **kw)


def test_the_nvme_link_runs_at_the_aio_settings_rate():
    drive = StorageSpec("d", 7e9, read_latency_s=100e-6, write_bandwidth_bytes_per_s=3.5e9)
    hw = SimpleNamespace(nvme=NvmeArraySpec(drive, 1), collectives=None, world_size=1)
    aio = AioConfig(block_size=700_000, queue_depth=2)
    assert nvme_links(hw, aio)[NVME_LINK] == pytest.approx(0.8 * 7e9, rel=1e-12)
    # DeepSpeed's defaults (1 MiB x 8 overlapped, D = 150 us): 1 - 5e-7 of the datasheet rate on one rank; the 64
    # requests of a DGX node's 8 ranks saturate it exactly (the bundled NVMe scenario is unchanged)
    assert nvme_links(hw, AioConfig())[NVME_LINK] == pytest.approx(7e9 * (1 - 5.0e-7), rel=1e-7)
    assert aio_efficiency(1 << 20, 8, 1, True, 7e9, 100e-6, ranks=8) == 1.0


#: axboe/fio#406 (dublio, 2017-07-18): Intel DC P3600 2 TB, fio --ioengine=libaio --direct=1 --rw=read --bs=512k
#: --numjobs=1, MiB/s by iodepth
P3600_512K = {1: 1563, 2: 2477, 4: 2948, 8: 3012, 16: 3004, 32: 2983, 64: 2987, 128: 3015}


def test_queue_depth_sweep_predicted_from_two_fitted_rows():
    """Fitted: the array rate from the iodepth-128 row, the request latency from the iodepth-1 row (Z = 154 us).
    Predicted: iodepth 2..64, each within 3 % (measured errors -0.5 % at depth 2, +1.0 % at 4, <= +1.1 % beyond)."""
    bs, peak = 512 * 1024, P3600_512K[128] * MiB
    z = bs / (P3600_512K[1] * MiB) - bs / peak  # Little's law at one request in flight: bs / (Z + D)
    assert z * 1e6 == pytest.approx(154.06, abs=0.01)
    for depth, measured in P3600_512K.items():
        predicted = aio_efficiency(bs, depth, 1, True, peak, z) * peak / MiB
        assert abs(predicted / measured - 1) <= 0.03, (depth, predicted, measured)
    # the knee itself: depth 2 is 0.82 of the rate (a queue of one request would stay at 0.52)
    assert aio_efficiency(bs, 2, 1, True, peak, z) == pytest.approx(2463.8 / 3015, abs=1e-3)


def test_deepspeed_aio_sweep_top_rows_saturate_the_drive():
    """deepspeedai/DeepSpeed#998 (stas00, 2021-04-30): Seagate FireCuda 510 2 TB (advertised 3.45 GB/s read), the
    aio read sweep's top rows, e.g. ('read', 'single', 'overlap', 8 processes, 1 thread, depth 32, 524288) =
    3.184 GB/s. At those settings any request latency up to 1 ms saturates the drive: the prediction is the
    advertised rate, +8.4 % (tolerance 15 %, the datasheet's own error: the settings are not what is missed)."""
    for z in (20e-6, 100e-6, 1e-3):
        assert aio_efficiency(524288, 32, 1, True, 3.45e9, z, ranks=8) == 1.0
    assert abs(3.45 / 3.184 - 1) <= 0.15


def test_settings_below_saturation_slow_the_swaps_and_say_so():
    """The bundled NVMe scenario (8 ranks on 8 x PM1733, 100 us request latency) at queue depth 1 of 128 KiB in
    batches: 8 batches of D = 128 KiB / 56 GB/s = 2.34 us in flight against 100 us -> MVA 0.182 of the drives'
    rate; the defaults (64 requests of 1 MiB) saturate them (the scenario's result unchanged)."""
    from simulator import load_scenario, run_scenario
    from tests.conftest import ROOT

    path = ROOT / "scenarios/cluster/gpt_1p3b_dgx_h100_zero3_nvme.yaml"
    assert aio_efficiency(131072, 1, 1, False, 56e9, 100e-6, ranks=8) == pytest.approx(0.182, abs=5e-4)
    slow = run_scenario(load_scenario(path, ["aio.queue_depth=1", "aio.block_size=131072",
                                             "aio.overlap_events=false"])).summary
    base = run_scenario(load_scenario(path)).summary
    assert any("aio settings reach 18.2% of the drives' rate" in w and "below saturation" in w
               for w in slow["warnings"])
    assert any("aio settings reach 100.0%" in w and "below saturation" not in w for w in base["warnings"])
    # NVMe-bound: the drives' time alone grows by 1 / 0.182
    assert slow["nvme_bound_s"] == pytest.approx(base["nvme_bound_s"] / aio_efficiency(
        131072, 1, 1, False, 56e9, 100e-6, ranks=8), rel=1e-9)
