"""A Dask cluster for sweep points: the settings that keep Dask's own work per point small, and a LocalCluster
made with them.

A sweep point costs 15-25 ms of CPU (``benchmarks/bench_sweep.py``), so what Dask's processes do on their own
timers shows in the cost per point. Measured on a 2-worker LocalCluster (distributed 2026.8.0, this 2-core
machine): with the defaults the scheduler process and the two workers burn about 10% of a core while idle, and
the workers' statistical profiler (it samples each worker thread's stack every 10 ms for the dashboard's profile
page) adds about 3 ms of CPU to each point; with ``SWEEP_DASK_CONFIG`` the idle cost falls to about 2% of a core
and the profiler's share to nothing. A worker process is spawned afresh (``distributed.worker.multiprocessing-method``
spawn), not forked like the process pool's: it imports the simulation (``simulator.api``, about 0.9 s of CPU) at
start-up (``distributed.worker.preload``), while the cluster starts, not inside the first batch of the first sweep.
None of these settings changes what a point computes.

Source of the keys and their defaults: ``distributed/distributed.yaml`` of dask/distributed 2026.8.0
(``distributed.worker.profile.*``: the profiler started by ``distributed/core.py`` ``Server.__init__`` and
``distributed/worker.py`` ``Worker.__init__``; ``distributed.admin.tick.interval`` "time between event loop health
checks"; ``distributed.worker.preload``: modules a worker imports before it joins the scheduler
(``distributed/preloading.py``); ``distributed.admin.system-monitor.interval``: the CPU / memory / network readings
shown on the dashboard; ``distributed.worker.memory.monitor-interval``: how often the nanny and the worker read the
worker's memory to spill, pause or restart it).
"""

from __future__ import annotations

#: Dask settings for the processes that run sweep points (see the module docstring): the profiler off, the
#: event-loop health check every 500 ms (default 20 ms), the dashboard's system readings every 2 s (default
#: 500 ms), the memory limits checked every 500 ms (default 100 ms: a point's memory does not grow that fast), the
#: simulation imported as a worker starts (default: no preload).
SWEEP_DASK_CONFIG = {
    "distributed.worker.profile.enabled": False,
    "distributed.worker.preload": ["simulator.api"],
    "distributed.admin.tick.interval": "500ms",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.memory.monitor-interval": "500ms",
}


def local_cluster(n_workers: int = 2):
    """A ``dask.distributed.LocalCluster`` for a sweep and a ``Client`` of it.

    ``n_workers`` worker processes of one thread each (a point holds the GIL throughout, so more threads per
    process would not run more points at once), no dashboard, started under ``SWEEP_DASK_CONFIG`` (a
    LocalCluster's nannies hand the settings in force to the worker processes they start): it returns once the
    workers have imported the simulation. The caller closes both (``client.close(); cluster.close()``).

    Args:
        n_workers: Worker processes (>= 1).

    Returns:
        ``(cluster, client)``.

    Raises:
        ImportError: dask.distributed is not installed (``pip install -e '.[dask]'``).
    """
    import dask
    from dask.distributed import Client, LocalCluster

    with dask.config.set(SWEEP_DASK_CONFIG):
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
    return cluster, client
