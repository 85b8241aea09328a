"""The engine's per-run caches return what computing afresh returns: a kernel's duration beside the collectives in
flight (``System.interfered_kernel_s``) as the loads and the clocks change, the power meter's activities shared by
ops of one shape and its excess power per activity, and a tensor's memory category kept from its allocation to
its free across settles."""

from __future__ import annotations

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from hardware_models.power import generic_power_model
from simulator.cost.interference import CommLoad, kernel_share
from simulator.engine.memory import MemoryPool
from simulator.engine.system import System
from simulator.graph.op_graph import GraphBuilder
from simulator.graph.ops import CostClass, OpKind, PriceKeys, price_key
from simulator.policies.power_meter import PowerMeter
from simulator.recording.recorder import Recorder
from tests.conftest import make_hw


def _ops():
    """A 2-wave GEMM (100 tiles on 100 SMs of 1x1 tiles, 1 ms a wave) and a 1 GB memory-bound kernel (1 ms)."""
    b = GraphBuilder()
    b.add("G", OpKind.COMPUTE, "compute", cost_class=CostClass.GEMM, dtype="bf16", shape=(200, 1, 5_000_000_000))
    b.add("M", OpKind.COMPUTE, "compute", cost_class=CostClass.ELEMENTWISE, bytes_read=1e9)
    b.add("G2", OpKind.COMPUTE, "compute", cost_class=CostClass.GEMM, dtype="bf16", shape=(200, 1, 5_000_000_000))
    return b.build(samples_per_step=1.0).ops


_step = st.one_of(st.tuples(st.just("add"), st.integers(0, 60), st.floats(0, 2e12)), st.tuples(st.just("remove")),
                  st.tuples(st.just("clock"), st.sampled_from([1000.0, 800.0, 500.0]), st.sampled_from([1000.0, 600.0])),
                  st.tuples(st.just("price"), st.integers(0, 2)))


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(_step, max_size=30))
def test_interfered_duration_equals_pricing_afresh(steps):
    """After any sequence of collectives starting and ending and clock changes, the cached duration of each kernel
    equals ``cost.duration_s(op, state, *kernel_share(loads))`` computed now."""
    hw = make_hw()
    sys_ = System(simpy.Environment(), hw, Recorder())
    ops = _ops()
    for s in steps:
        if s[0] == "add":
            sys_._add_load(CommLoad(s[1], s[2]))
        elif s[0] == "remove" and sys_._loads:
            sys_._remove_load(sys_._loads[0])
        elif s[0] == "clock":
            sys_.state.sm_clock_mhz, sys_.state.mem_clock_mhz = s[1], s[2]
        elif s[0] == "price":
            op = ops[s[1]]
            share = kernel_share(sys_._loads, hw.gpu.sm_count, hw.gpu.hbm_bandwidth_bytes_per_s)
            assert sys_.interfered_kernel_s(op) == sys_.cost.duration_s(op, sys_.state, *share)


def test_interfered_gemm_hand_worked():
    """The 2-wave GEMM takes 2 ms alone, 3 ms beside a collective holding 10 SMs (200 tiles on 90 SMs: 3 waves),
    2 ms again once it ends, and 2.5 ms at 800 MHz (compute scales by 1000 / 800); the memory kernel keeps 1 ms
    beside SMs held and takes 2 ms with half the HBM bandwidth taken (0.5 TB/s of 1 TB/s)."""
    sys_ = System(simpy.Environment(), make_hw(), Recorder())
    g, m, _ = _ops()
    assert sys_.interfered_kernel_s(g) == pytest.approx(2e-3, rel=1e-12)
    load = CommLoad(10, 0.0)
    sys_._add_load(load)
    assert sys_.interfered_kernel_s(g) == pytest.approx(3e-3, rel=1e-12)
    assert sys_.interfered_kernel_s(m) == pytest.approx(1e-3, rel=1e-12)
    sys_._remove_load(load)
    assert sys_.interfered_kernel_s(g) == pytest.approx(2e-3, rel=1e-12)
    sys_._add_load(CommLoad(0, 0.5e12))
    assert sys_.interfered_kernel_s(m) == pytest.approx(2e-3, rel=1e-12)
    sys_._remove_load(sys_._loads[0])
    sys_.state.sm_clock_mhz = 800.0
    assert sys_.interfered_kernel_s(g) == pytest.approx(2.5e-3, rel=1e-12)


def test_power_meter_activity_shared_by_shape_and_excess_per_activity_equal_afresh():
    """Two GEMMs of one shape share their activity; each op's activity and excess power equal those computed
    afresh by a new meter, at the maximum clock and after a clock change (the caches are keyed by the clocks)."""
    hw = make_hw()
    sys_ = System(simpy.Environment(), hw, Recorder())
    model = generic_power_model(hw.gpu)
    meter = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
    g, m, g2 = _ops()
    for sm in (1000.0, 500.0, 1000.0):
        sys_.state.sm_clock_mhz = sm
        fresh = PowerMeter(model, hw.gpu, sys_.state, sys_.cost)
        assert meter.activity(g) is meter.activity(g2)
        for op in (g, m, g2):
            a = fresh.activity(op)
            assert meter.activity(op) == a
            want = max(0.0, model.power_of((a,), sm, 1000.0) - model.power_of((), sm, 1000.0))
            assert meter.excess_w(op) == want
    # the GEMM is compute-bound (no memory part), the elementwise kernel memory-bound
    assert (meter.activity(g).compute, meter.activity(g).memory) == (1.0, 0.0)
    assert (meter.activity(m).compute, meter.activity(m).memory) == (0.0, 1.0)


def test_tensor_category_kept_from_alloc_to_free_across_settles():
    """A tensor allocated before one settle and freed after it leaves its own category (params 1 MB, activations
    3 MB, then activations 0 after the free), whatever was allocated in between."""
    t = [0.0]
    pool = MemoryPool("hbm", 1e12, lambda: t[0])
    pool.alloc("params.L0.w", 1_000_000, 0.0)
    pool.alloc("act.L0.x", 3_000_000, 0.0)
    assert dict(pool.by_category) == {"params": 1_000_000, "activations": 3_000_000}  # settles
    t[0] = 1.0
    pool.alloc("grad.L0.w", 2_000_000, 1.0)
    pool.free("act.L0.x")
    pool.free("never.allocated")
    assert dict(pool.by_category) == {"params": 1_000_000, "activations": 0, "grad": 2_000_000}
    assert pool.peak == 6_000_000 and pool.live == 3_000_000
    assert pool.category_timeline == [(0.0, "params", 1_000_000), (0.0, "activations", 3_000_000),
                                      (1.0, "grad", 2_000_000), (1.0, "activations", 0)]


def test_pricing_key_shared_by_ops_that_price_alike_and_kernel_s_equal_afresh():
    """Ops of one cost split share a pricing key whatever their names and ids; any field that prices a kernel
    (kind, fixed duration, cost class, shape, flops, bytes, dtype) separates them; ``kernel_s`` by the key equals
    ``cost.duration_s`` computed afresh (GEMM 2 ms, memory kernel 1 ms, 2.5 ms for the GEMM at 800 MHz)."""
    from dataclasses import replace

    g, m, g2 = _ops()
    keys = PriceKeys()
    assert g.id != g2.id and keys.of(g) == keys.of(g2) != keys.of(m)
    for change in ({"kind": OpKind.COLLECTIVE}, {"fixed_duration_s": 1e-3}, {"cost_class": CostClass.ELEMENTWISE},
                   {"shape": (100, 1, 5_000_000_000)}, {"flops": 1.0}, {"bytes_read": 1.0}, {"bytes_written": 1.0},
                   {"dtype": "fp32"}):
        assert price_key(replace(g, **change)) != price_key(g), change
    assert price_key(replace(g, name="other", id=7, layer=3)) == price_key(g)
    sys_ = System(simpy.Environment(), make_hw(), Recorder())
    assert sys_.kernel_s(g) == pytest.approx(2e-3, rel=1e-12) and sys_.kernel_s(m) == pytest.approx(1e-3, rel=1e-12)
    assert sys_.kernel_s(g2) == sys_.kernel_s(g) == sys_.cost.duration_s(g2, sys_.state)
    sys_.state.sm_clock_mhz = 800.0
    assert sys_.kernel_s(g2) == pytest.approx(2.5e-3, rel=1e-12) == sys_.cost.duration_s(g2, sys_.state)
    assert sys_.kernel_s(m) == sys_.cost.duration_s(m, sys_.state)


def test_pricing_key_of_a_block_follows_its_parts_and_folded_collectives():
    """A block's key is its parts' signature (``meta["fused_key"]``) plus each folded TP collective's
    (collective, group, bytes, pipeline ranks): blocks alike share it, a folded all-reduce of other bytes does
    not."""
    from dataclasses import replace

    g, m, _ = _ops()
    ar = replace(m, kind=OpKind.COLLECTIVE, meta={"collective": "all_reduce", "group": "tp", "bytes": 1024})
    block = replace(g, meta={"fused": (g, m), "fused_key": ("sig",)})
    assert price_key(block) == price_key(replace(block, id=9, flops=3.0)) == ("fused", ("sig",))
    folded = replace(block, folded_comm=(ar,))
    assert price_key(folded) == ("fused", ("sig",), ("all_reduce", "tp", 1024, None))
    assert price_key(replace(block, folded_comm=(replace(ar, meta={**ar.meta, "bytes": 2048}),))) != price_key(folded)


def test_power_levels_give_a_folded_collective_span_its_block_activity():
    """A TP collective folded into a block carries the block's op id; its span is metered at the block's
    activity (``PriceKeys`` gives it the block's key, as the per-op-id activity cache gave it the block's activity
    before: results unchanged), the same levels as the block's own span over that interval."""
    from dataclasses import replace

    hw = make_hw()
    sys_ = System(simpy.Environment(), hw, Recorder())
    meter = PowerMeter(generic_power_model(hw.gpu), hw.gpu, sys_.state, sys_.cost)
    g, m, _ = _ops()
    block = replace(g, meta={"fused": (g, m), "fused_key": tuple((p.cost_class, p.shape, p.flops, p.bytes_read,
                                                                  p.bytes_written, p.dtype) for p in (g, m))})
    ar = replace(m, id=block.id, kind=OpKind.COLLECTIVE, stream="compute",
                 meta={"collective": "all_reduce", "group": "tp", "bytes": 1024})
    assert PowerMeter(meter.model, hw.gpu, sys_.state, sys_.cost).activity(ar) != meter.activity(block)
    block = replace(block, folded_comm=(ar,))
    assert meter.activity(block) == meter.activity(ar)  # once the block is keyed
    got = meter.levels([(0, block, 0.0, 3e-3, "compute"), (0, ar, 3e-3, 4e-3, "compute")])
    want = meter.levels([(0, block, 0.0, 3e-3, "compute"), (0, block, 3e-3, 4e-3, "compute")])
    (t_got, p_got, _), (t_want, p_want, _) = got, want
    assert list(t_got) == list(t_want) == [0.0, 3e-3, 4e-3] and list(p_got) == list(p_want)


def test_price_keys_intern_block_parts_and_folded_collectives_by_value():
    """``PriceKeys.of``: blocks whose parts' signature (``meta["fused_key"]``) and folded collectives are equal but
    distinct objects share one int, as ``price_key`` equality says; a different part or collective size another."""
    from dataclasses import replace as rep

    from simulator.graph.ops import Op, OpKind, PriceKeys, price_key

    ar = Op(id=0, name="tp.ar", kind=OpKind.COLLECTIVE, stream="comm.tp",
            meta={"collective": "all_reduce", "bytes": 1024, "group": "tp"})

    def block(i, sig, nbytes):
        return Op(id=i, name=f"b{i}", kind=OpKind.COMPUTE, stream="compute", layer=0,
                  folded_comm=(rep(ar, id=i, meta={**ar.meta, "bytes": nbytes}),),
                  meta={"fused": (), "fused_key": tuple(list(sig)), "launches": 1})

    sig = (("gemm", (8, 8, 8), 1.0, 2.0, 3.0, "bf16"),)
    other = (("gemm", (8, 8, 16), 1.0, 2.0, 3.0, "bf16"),)
    ops = [block(0, sig, 1024), block(1, sig, 1024), block(2, other, 1024), block(3, sig, 2048)]
    keys = PriceKeys()
    ids = [keys.of(op) for op in ops]
    assert ids == [0, 0, 1, 2]
    assert len(keys._fused) == 2 and len(keys._comms) == 4  # each signature hashed once by value; metas by id
    for a, b in [(0, 1), (0, 2), (0, 3)]:
        assert (ids[a] == ids[b]) == (price_key(ops[a]) == price_key(ops[b]))


def test_timelines_handed_over_are_the_changes_so_far_and_the_pool_records_afresh():
    """``take_timelines`` gives the timelines of the changes before it, built when read (two allocations at t=0,
    150 MB; a free at t=1 leaves 50 MB; a change at one instant keeps the last value), and the pool's own then
    start empty and go on from its live bytes (60 MB at t=2); the figures are untouched (peak 150 MB). The
    category given with a change (the executor's ``writer`` entries) is the one its name gives."""
    t = [0.0]
    pool = MemoryPool("hbm", 1e12, lambda: t[0])
    pool.alloc("params.w", 100_000_000, 0.0)
    pool.writer()((0.0, "act.x", 50_000_000, 0.0, "activations"))
    assert pool.live == 150_000_000  # settled: the samples wait for the timelines
    t[0] = 1.0
    pool.free("params.w")
    taken = pool.take_timelines()
    t[0] = 2.0
    pool.alloc("grad.w", 10_000_000, 2.0)
    assert pool.timeline == [(2.0, 60_000_000)]
    assert pool.category_timeline == [(2.0, "grad", 10_000_000)]
    (tl_t, tl_v), (ct_t, ct_c, ct_v) = taken.columns()
    assert list(zip(tl_t, tl_v)) == [(0.0, 150_000_000), (1.0, 50_000_000)]
    assert list(zip(ct_t, ct_c, ct_v)) == [(0.0, "params", 100_000_000), (0.0, "activations", 50_000_000),
                                          (1.0, "params", 0)]
    assert pool.peak == 150_000_000 and pool.live == 60_000_000
