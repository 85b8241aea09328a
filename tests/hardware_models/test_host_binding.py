"""Core binding off (``hardware.host.bind_cores_to_rank: false``): several ranks' CPU steps on one host without
DeepSpeed's ``--bind_cores_to_rank``, worked by hand on the round host of test_host_kernels.py (2 NUMA nodes x 4
cores, 16 GB/s sustained per node, 5 GB/s per core).

Three ranks of 2 threads each (a rank's streams capped at 2 x 5 = 10 GB/s):

* bound (ranks in blocks: ranks 0 and 1 on node 0, rank 2 on node 1): node 0's 16 GB/s split by two, 8 GB/s for
  the slowest rank;
* not bound: the memory interleaved over both nodes, one 32 GB/s pool for three flows capped at 10 GB/s: 10 GB/s each.

Four ranks, threads not set: bound, each gets 8 cores / 4 = 2 threads; not bound, each pool has all 8 threads, 32 on
8 cores, time-sliced to 2 cores' worth each: the same 2 (and a warning saying it is oversubscribed).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from hardware_models.host_kernels import host_dram_share, shared_stream_bandwidth
from simulator.policies.offload_optimizer import cpu_threads, oversubscribed_threads
from tests.hardware_models.test_host_kernels import ROUND

UNBOUND = dataclasses.replace(ROUND, bind_cores_to_rank=False)


def test_bound_and_unbound_memory_bandwidth_by_hand():
    assert shared_stream_bandwidth(ROUND, 3, threads=2) == pytest.approx(8e9)
    assert shared_stream_bandwidth(UNBOUND, 3, threads=2) == pytest.approx(10e9)
    # the rank's DRAM share its copies also cross: bound the crowded node's half, unbound a third of the host
    assert host_dram_share(ROUND, 3) == pytest.approx(8e9)
    assert host_dram_share(UNBOUND, 3) == pytest.approx(32e9 / 3)
    # ranks spread evenly over the nodes: the same figure either way (no remote-access cost in the model)
    assert shared_stream_bandwidth(UNBOUND, 4, threads=2) == shared_stream_bandwidth(ROUND, 4, threads=2) == 8e9
    # one rank: binding changes nothing
    assert shared_stream_bandwidth(UNBOUND, 1) == shared_stream_bandwidth(ROUND, 1) == 32e9


def _hw(cpu):
    return SimpleNamespace(host_cpu=cpu)


def test_oversubscribed_pools_are_time_sliced_by_hand():
    assert cpu_threads(_hw(ROUND), ranks=4) == cpu_threads(_hw(UNBOUND), ranks=4) == 2
    assert oversubscribed_threads(_hw(ROUND), 4) is None
    note = oversubscribed_threads(_hw(UNBOUND), 4)
    assert note.startswith("hardware.host.bind_cores_to_rank false with threads not set (8, torch's default pool) x 4 "
                           "ranks = 32 CPU-step threads on 8 cores: oversubscribed, so each rank's CPU step is priced "
                           "time-sliced on 2 cores' worth")
    assert "no extra cost for remote accesses" in note and "lower bound" in note
    # torchrun's OMP_NUM_THREADS=1, not bound: 4 threads on 8 cores, not oversubscribed
    one = dataclasses.replace(UNBOUND, threads_used=1)
    assert cpu_threads(_hw(one), ranks=4) == 1 and oversubscribed_threads(_hw(one), 4) is None
