"""DataLoader mechanism: hand-computed timings on tiny setups, properties, bad input."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.dataloader import (
    CpuPool,
    DataLoaderModel,
    DataLoaderSpec,
    DataLoaderSpecError,
    OversubscribedCpuWarning,
    RemoteSpec,
    SampleCost,
    StorageSpec,
    load_storage_preset,
    simulate_loader,
)

MS = 1e-3


def spec(workers=2, cost_s=10 * MS, batch=2, **kw) -> DataLoaderSpec:
    if workers and "prefetch_factor" not in kw:
        kw["prefetch_factor"] = 2
    return DataLoaderSpec(batch_size=batch, num_workers=workers, sample_cost=SampleCost(mean_s=cost_s), **kw)


def received(recs):
    return [round(r.received_s / MS, 6) for r in recs]


# -- exact timings --------------------------------------------------------------------------
def test_two_workers_hand_computed():
    # 2 workers, 10 ms/sample, batch 2 -> 20 ms per batch per worker; training step 5 ms.
    # Worker 0 builds batches 0, 2, 4 ... back to back (0-20, 20-40, 40-60 ms), worker 1 builds 1, 3, 5.
    # next() at 0 waits for batch 0 (20 ms); step to 25; batch 1 is ready -> 25..30; batch 2 ready at 40:
    # waits 10 ms; ... the loop runs at two batches per 20 ms: steps alternate 25/5, then 15/5 ms.
    recs = simulate_loader(spec(), consumer_s=5 * MS, batches=8)
    assert received(recs) == [20, 25, 40, 45, 60, 65, 80, 85]
    assert [round(r.wait_s / MS, 6) for r in recs] == [20, 0, 10, 0, 10, 0, 10, 0]
    assert [r.worker for r in recs] == [0, 1, 0, 1, 0, 1, 0, 1]


def test_round_robin_order_even_when_a_later_batch_is_ready_first():
    # batch 0 has one 50 ms sample; batch 1 (worker 1) is ready at 2 ms but must wait its turn
    cost = SampleCost("empirical", samples_s=(1.0,))  # overwritten below through the cost cache
    s = DataLoaderSpec(batch_size=1, num_workers=2, prefetch_factor=1, sample_cost=cost)
    env = simpy.Environment()
    ld = DataLoaderModel(env, s, CpuPool(env, 8), np.random.default_rng(0))
    ld._costs = np.array([50 * MS, 2 * MS, 2 * MS, 2 * MS])
    out = []

    def loop():
        for _ in range(4):
            out.append((yield from ld.next_batch()))

    env.run(env.process(loop()))
    assert [r.index for r in out] == [0, 1, 2, 3]
    assert out[1].ready_s == pytest.approx(2 * MS) and out[1].received_s == pytest.approx(50 * MS)
    # batch 2 goes to worker 0 and is sent only once batch 0 is received (prefetch_factor 1): 50 -> 52 ms
    assert out[2].start_s == pytest.approx(50 * MS) and out[2].received_s == pytest.approx(52 * MS)


def test_prefetch_bound_limits_outstanding_batches():
    # slow consumer (100 ms): 2 workers x prefetch 2 = 4 batches in flight. Batch 4 (worker 0) is sent
    # when batch 0 is received (20 ms) and starts when worker 0 finishes batch 2 (40 ms); batch 5 is
    # sent when batch 1 is received (20 + 100 = 120 ms); batch 6 when batch 2 is received (220 ms).
    recs = simulate_loader(spec(), consumer_s=100 * MS, batches=8)
    starts = [round(r.start_s / MS, 6) for r in recs]
    assert starts == [0, 0, 20, 20, 40, 120, 220, 320]
    assert all(r.wait_s == 0 for r in recs[1:])


def test_zero_workers_serialises_loading_with_training():
    # no workers: every next() builds the batch in the training thread: 20 ms + 5 ms step, always
    recs = simulate_loader(spec(workers=0), consumer_s=5 * MS, batches=4)
    assert received(recs) == [20, 45, 70, 95]
    assert all(math.isclose(r.wait_s, 20 * MS) for r in recs)


def test_pin_memory_and_collate_copy_at_memcpy_bandwidth():
    # 1 MB per sample, batch 2: collate copies 2 MB (4 MB read+written at 4 GB/s = 1 ms), pinning too
    s = spec(workers=0, sample_bytes=1e6, pin_memory=True)
    recs = simulate_loader(s, consumer_s=0, batches=1, memcpy_bandwidth_bytes_per_s=4e9)
    assert recs[0].wait_s == pytest.approx(22 * MS)


def test_processor_sharing_when_cores_are_short():
    # 4 workers on 2 cores (training thread blocked in next): each runs at half speed -> 40 ms per batch
    with pytest.warns(OversubscribedCpuWarning, match="exceed the host's 2 cores"):
        recs = simulate_loader(spec(workers=4), consumer_s=0, batches=4, cores=2)
    assert received(recs) == [40, 40, 40, 40]


def test_storage_read_adds_latency_and_shares_bandwidth():
    # 2 workers each read a 1 MB sample at once over 1 GB/s after 1 ms latency: 1 + 2 ms, then 10 ms CPU
    st_ = StorageSpec("toy", 1e9, 1 * MS)
    s = spec(batch=1, sample_read_bytes=1e6)
    recs = simulate_loader(s, consumer_s=0, batches=2, storage=st_)
    assert received(recs) == pytest.approx([13, 13])


def test_worker_startup_delays_only_the_first_batches():
    recs = simulate_loader(spec(worker_startup_s=50 * MS), consumer_s=5 * MS, batches=4)
    assert received(recs) == [70, 75, 90, 95]


def test_epochs_restart_non_persistent_workers():
    # 4 samples per epoch, batch 2 -> 2 batches/epoch; non-persistent workers pay start-up again
    base = dict(dataset_size=4, worker_startup_s=10 * MS)
    rp = simulate_loader(spec(persistent_workers=True, **base), consumer_s=5 * MS, batches=4)
    rn = simulate_loader(spec(**base), consumer_s=5 * MS, batches=4)
    assert received(rp) == [30, 35, 60, 65]  # epoch 2 starts at 40: builds 40-60
    assert received(rn) == [30, 35, 70, 75]  # ... plus 10 ms start-up
    assert [r.epoch for r in rn] == [0, 0, 1, 1]


def test_drop_last_and_partial_batch():
    keep = simulate_loader(spec(workers=0, dataset_size=5), consumer_s=0, batches=3)
    drop = simulate_loader(spec(workers=0, dataset_size=5, drop_last=True), consumer_s=0, batches=3)
    assert [r.samples for r in keep] == [2, 2, 1]
    assert [r.samples for r in drop] == [2, 2, 2] and [r.epoch for r in drop] == [0, 0, 1]


def test_remote_workers_send_batches_over_the_network():
    # remote: 2 workers on 2 remote cores, 1 MB batches over 1 GB/s + 1 ms: 20 ms build + 1 ms + 2 ms shared
    s = spec(sample_bytes=0.5e6, remote=RemoteSpec(cores=2, bandwidth_bytes_per_s=1e9, latency_s=1 * MS))
    recs = simulate_loader(s, consumer_s=0, batches=2, cores=1)  # the local host's one core is not used
    assert received(recs) == pytest.approx([23, 23])


# -- properties -------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(workers=st.integers(1, 6), cost_ms=st.floats(0.5, 20), batch=st.integers(1, 4),
       consumer_ms=st.floats(0, 30), prefetch=st.integers(1, 3))
def test_more_workers_never_slower_when_cores_suffice(workers, cost_ms, batch, consumer_ms, prefetch):
    def total(n):
        s = spec(workers=n, cost_s=cost_ms * MS, batch=batch, prefetch_factor=prefetch)
        return simulate_loader(s, consumer_ms * MS, batches=12, cores=64)[-1].received_s

    assert total(workers + 1) <= total(workers) + 1e-9


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), workers=st.integers(0, 4))
def test_same_seed_same_result(seed, workers):
    kw = {"prefetch_factor": 2} if workers else {}
    s = DataLoaderSpec(batch_size=3, num_workers=workers, sample_cost=SampleCost("lognormal", 5 * MS, 0.5), **kw)
    a = simulate_loader(s, 2 * MS, 10, cores=8, seed=seed)
    b = simulate_loader(s, 2 * MS, 10, cores=8, seed=seed)
    c = simulate_loader(s, 2 * MS, 10, cores=8, seed=seed + 1)
    assert received(a) == received(b)
    assert received(a) != received(c)


def test_random_cost_without_a_generator_is_refused():
    s = DataLoaderSpec(batch_size=1, num_workers=0, sample_cost=SampleCost("lognormal", 5 * MS, 0.5))
    env = simpy.Environment()
    with pytest.raises(DataLoaderSpecError, match="needs the run's random generator"):
        DataLoaderModel(env, s, CpuPool(env, 8))


def test_lognormal_mean_is_the_given_mean():
    c = SampleCost("lognormal", 6 * MS, 0.8)
    assert c.draw(np.random.default_rng(1), 200_000).mean() == pytest.approx(6 * MS, rel=0.02)


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("make, message", [
    (lambda: DataLoaderSpec(batch_size=2, num_workers=-1), "num_workers option should be non-negative"),
    (lambda: DataLoaderSpec(batch_size=2, num_workers=0, prefetch_factor=2),
     "prefetch_factor option could only be specified in multiprocessing"),
    (lambda: SampleCost("lognormal", 5 * MS, 0.0), "lognormal sample cost needs sigma > 0"),
    (lambda: SampleCost("lognormal", 5 * MS, -1.0), "lognormal sample cost needs sigma > 0"),
    (lambda: SampleCost("empirical", samples_s=()), "non-empty samples_s"),
    (lambda: SampleCost("gamma", 1.0), "must be one of"),
    (lambda: DataLoaderSpec(batch_size=0), "batch_size should be a positive integer"),
    (lambda: DataLoaderSpec(batch_size=2, persistent_workers=True), "persistent_workers option needs num_workers > 0"),
])
def test_bad_input_one_clear_message(make, message):
    with pytest.raises(DataLoaderSpecError, match=message) as ei:
        make()
    assert "\n" not in str(ei.value)


def test_prefetch_factor_message_says_pytorch_rejects_it_too():
    with pytest.raises(DataLoaderSpecError, match="PyTorch's DataLoader rejects it too"):
        DataLoaderSpec(batch_size=2, num_workers=0, prefetch_factor=2)


def test_more_workers_than_cores_warns_and_runs():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        recs = simulate_loader(spec(workers=20), consumer_s=0, batches=2, cores=16)
    assert any(issubclass(x.category, OversubscribedCpuWarning) and "exceed the host's 16 cores" in str(x.message)
               for x in w)
    assert len(recs) == 2


def test_storage_presets_load_with_sources():
    for name in ("local-nvme-pm9a3", "aws-efs-elastic"):
        s = load_storage_preset(name)
        assert s.read_bandwidth_bytes_per_s > 0 and s.sources
    with pytest.raises(DataLoaderSpecError, match="unknown storage preset 'nope'; known: "):
        load_storage_preset("nope")
