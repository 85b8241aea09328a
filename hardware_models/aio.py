"""The rate DeepSpeed's aio swapper achieves on an NVMe array, from its ``aio`` settings (queueing physics).

DeepSpeed's aio handle (deepspeedai/DeepSpeed@02fa6329 csrc/aio/common/deepspeed_aio_common.cpp,
deepspeedai/DeepSpeed@135cf4b8 csrc/aio/py_lib/deepspeed_py_io_handle.cpp) splits each transfer over
``thread_count`` threads (``intra_op_parallelism``), each with its own libaio context of ``queue_depth`` requests
of ``block_size`` bytes (O_DIRECT). With ``overlap_events`` a thread keeps ``queue_depth`` requests in flight
(``do_aio_operation_overlap``: it refills as soon as one completes); without it, it submits ``queue_depth``
requests and waits for all of them before the next batch (``do_aio_operation_sequential``).

That is a closed queueing network (Lazowska, Zahorjan, Graham, Sevcik, *Quantitative System Performance*, 1984,
ch. 6; exact Mean Value Analysis, Reiser & Lavenberg, JACM 27(2), 1980): a fixed number of customers (requests in
flight, or batches) cycle through a delay station, the drive's fixed request latency ``Z`` (command processing and
the NAND read, paid in parallel by every outstanding request), and one queueing station, the array's transfer at
its sequential rate (service demand ``D = request bytes / array bandwidth``). MVA gives the throughput ``X(N)``;
the array then moves ``X x D`` of its sequential rate (:func:`aio_efficiency`). At light load this is ``N x bytes
/ (Z + D)`` (Little's law: outstanding bytes over latency), at heavy load the array's rate.

Customers: every rank of the node that swaps at the same time (``ranks``) runs its own handle, so
``ranks x thread_count x queue_depth`` requests of ``block_size`` (overlap) or ``ranks x thread_count`` batches of
``queue_depth x block_size`` (no overlap). The striped array is taken as one server of its summed rate (each request
spread over the drives: RAID-0 with a chunk of at most ``block_size / drives``; with larger chunks each drive sees
fewer requests and the rate at low depth is below this).

Fitted and checked against one published sweep (``tests/hardware_models/test_aio.py``): axboe/fio#406 (dublio,
2017-07-18), Intel DC P3600 2 TB, ``fio --ioengine=libaio --direct=1 --rw=read --bs=512k --numjobs=1`` at iodepth 1
to 128. ``Z`` is fitted from the iodepth-1 row and the rate from the iodepth-128 row; the six other rows are
predicted within 1.1 %.

Not priced (the run's warnings say so): ``single_submit``, the writes' own latency (the drive's read latency stands
for both), and threads that interfere beyond adding requests (the same fio issue reports QD-1 jobs topping out below
one job at QD >= 4). ``single_submit`` changes only the system calls: both modes prepare the same iocbs and reap them
alike; ``_do_io_submit_block`` hands a batch's ``n`` iocbs to one ``io_submit(ctx, n, iocbs)``,
``_do_io_submit_singles`` loops ``io_submit(ctx, 1, iocbs + i)`` (deepspeedai/DeepSpeed@02fa6329
csrc/aio/common/deepspeed_aio_common.cpp, in both ``do_aio_operation_sequential`` and ``do_aio_operation_overlap``):
``n - 1`` more syscall entries per batch, the per-iocb work in the kernel (bio build, queue insertion) being the same
in both. Its price would be the fixed part of one ``io_submit`` call, apart from its iocbs; the published submission
latencies found (fio ``slat`` per request, e.g. 1.65-24.66 us on ext4 in the 2012 LKML thread "Make io_submit
non-blocking", lwn.net/Articles/508064) include each request's own submission and do not separate it, and DeepSpeed
records its ``submit_times`` but publishes none, so it stays unpriced.
"""

from __future__ import annotations

import math

#: MVA iterations at most (customers beyond this: the array is saturated long before; see ``aio_efficiency``)
MAX_CUSTOMERS = 1 << 16


def mva_throughput(customers: int, demand_s: float, delay_s: float) -> float:
    """Exact MVA of a closed network of one queueing station and one delay station, customers/s.

    Args:
        customers: Customers circulating, >= 1.
        demand_s: Service demand per visit at the queueing station, s (> 0).
        delay_s: Time per visit at the delay station, s (>= 0).

    Returns:
        Throughput ``X(customers)``, visits/s (at most ``1 / demand_s``). Iterates ``n = 1..customers``
        (``R = D (1 + Q(n-1))``, ``X = n / (R + Z)``, ``Q(n) = X R``), stopping once ``X x D`` rounds to 1.

    Raises:
        ValueError: customers < 1, demand <= 0 or delay < 0 (not finite).
    """
    if customers < 1 or not (demand_s > 0 and math.isfinite(demand_s)) or not (delay_s >= 0 and math.isfinite(delay_s)):
        raise ValueError(f"MVA needs customers >= 1, demand > 0, delay >= 0; got {customers}, {demand_s}, {delay_s}")
    q = x = 0.0
    for n in range(1, min(customers, MAX_CUSTOMERS) + 1):
        r = demand_s * (1.0 + q)
        x = n / (r + delay_s)
        if x * demand_s >= 1.0:
            return 1.0 / demand_s
        q = x * r
    return x


def aio_efficiency(block_size: int, queue_depth: int, thread_count: int, overlap_events: bool,
                   array_bytes_per_s: float, latency_s: float, ranks: int = 1) -> float:
    """Fraction of the array's sequential rate DeepSpeed's aio handles achieve (module docstring), in (0, 1].

    Args:
        block_size: Bytes per request (aio.block_size).
        queue_depth: Requests per thread (aio.queue_depth).
        thread_count: Threads per handle (aio.thread_count, DeepSpeed's intra_op_parallelism).
        overlap_events: Keep the queue full (True) or wait for each batch (False).
        array_bytes_per_s: The array's sequential rate, bytes/s (> 0).
        latency_s: The drive's fixed request latency, s (>= 0; 0: every setting saturates the array).
        ranks: Handles swapping at the same time on the array (the node's ranks).

    Returns:
        ``X x D``: 1.0 where the outstanding requests saturate the array.

    Raises:
        ValueError: as ``mva_throughput``.
    """
    if overlap_events:
        customers, request = ranks * thread_count * queue_depth, block_size
    else:
        customers, request = ranks * thread_count, queue_depth * block_size
    demand = request / array_bytes_per_s
    return min(1.0, mva_throughput(customers, demand, latency_s) * demand)
