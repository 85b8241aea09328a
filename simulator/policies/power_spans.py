"""Power pricing of a graph's spans on arrays: what the power-limit watch reads for every span in its window.

One job: price each op of a graph once per distinct pricing key (``graph.ops.PriceKeys``), as arrays by op id
(``SpanPricing``), and sum those prices over the spans of one evaluation window (``WindowSpans``) with numpy, in
place of a Python call per span (a 175B step has ~55,000 spans per rank, each visited in two or three windows).
What the power is comes from the meter (``power_meter``); what the sums decide, from the firmware's watch
(``power_firmware.PowerLimitFirmware.watch``).
"""

from __future__ import annotations

from operator import attrgetter, itemgetter

import numpy as np

_ID = attrgetter("id")
_OP, _START, _END = itemgetter(1), itemgetter(2), itemgetter(3)


class SpanPricing:
    """The power prices of a graph's ops at the meter's current clocks, by op id: one meter evaluation per distinct
    pricing key (ops with equal keys price alike: ``PowerMeter.excess_parts_w`` and ``activity_row`` are cached by
    it), taken by each op's key.

    Args:
        meter: The run's ``PowerMeter`` (its clocks must not change while the table is read: an offline-metered run).
        ops: The graph's ops, ``ops[i].id == i`` (``OpGraph``).

    Attributes:
        excess, share: ``(n,)`` float arrays, W: each op's ``excess_parts_w`` excess and additive share.
        kernel: ``(n,)`` bool array: the op is a kernel drawing the SM floor (``excess_parts_w``'s flag).
        rows: ``(n, 4)`` float array: each op's ``activity_row`` (zeros where it draws no power).
        has: ``(n,)`` bool array: the op draws power (``activity_row`` is not None).
        by_id: every span of the graph's run prices as the graph's op of its id (no op carries folded TP collectives,
            whose spans carry the block's id), so ``PowerMeter.levels`` may read ``rows`` by a span's op id.
    """

    def __init__(self, meter, ops) -> None:
        keys = meter.price_keys
        of, hits = keys.of, map(keys.by_op.get, map(id, ops))  # (most ops' keys are interned by the executor)
        codes = np.fromiter((of(op) if h is None else h[1] for h, op in zip(hits, ops)), dtype=np.intp, count=len(ops))
        _keys, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        reps = [ops[i] for i in first.tolist()]  # one op per distinct key
        parts = [meter.excess_parts_w(op) for op in reps]
        rows = [meter.activity_row(op) for op in reps]
        self.excess = np.array([p[0] for p in parts], dtype=float)[inverse]
        self.share = np.array([p[1] for p in parts], dtype=float)[inverse]
        self.kernel = np.array([p[2] for p in parts], dtype=bool)[inverse]
        self.has = np.array([r is not None for r in rows], dtype=bool)[inverse]
        self.rows = np.array([r if r is not None else (0.0, 0.0, 0.0, 0.0) for r in rows], dtype=float)[inverse]
        self.by_id = not any(op.folded_comm for op in ops)


class WindowSpans:
    """The recorded spans that end inside the watch's window, as arrays in recording order, taken up as the recorder
    grows (``advance``), with the sums of their prices over the window (``bounds``).

    Args:
        spans: The recorder's span rows ``(step, op, start_s, end_s, stream)`` (the list it appends to).
        pricing: The graph's ``SpanPricing`` (a span is priced as the graph's op of its id).
    """

    def __init__(self, spans: list, pricing: SpanPricing) -> None:
        self.spans, self.pricing = spans, pricing
        self.seen = 0
        self.index = np.zeros(0, dtype=np.intp)  # each kept span's place in ``spans``
        self.start = np.zeros(0)
        self.end = np.zeros(0)
        self.op_id = np.zeros(0, dtype=np.intp)

    def advance(self, lo: float) -> None:
        """Take up the spans recorded since the last call, then keep those ending after ``lo``, s."""
        spans, seen = self.spans, self.seen
        n = len(spans)
        if n > seen:
            new = spans[seen:n]
            m = n - seen
            self.index = np.concatenate((self.index, np.arange(seen, n, dtype=np.intp)))
            self.start = np.concatenate((self.start, np.fromiter(map(_START, new), dtype=float, count=m)))
            self.end = np.concatenate((self.end, np.fromiter(map(_END, new), dtype=float, count=m)))
            self.op_id = np.concatenate((self.op_id, np.fromiter(map(_ID, map(_OP, new)), dtype=np.intp, count=m)))
            self.seen = n
        keep = self.end > lo
        if not keep.all():
            self.index, self.start, self.end, self.op_id = (a[keep] for a in (self.index, self.start, self.end,
                                                                             self.op_id))

    def rows(self) -> list:
        """The kept spans' rows, in recording order."""
        spans = self.spans
        return [spans[i] for i in self.index.tolist()]

    def bounds(self, running: list, t: float, lo: float) -> tuple[float, float, float, float]:
        """``(inst, avg_hi, lin, kernel_s)`` over the kept spans, then ``running`` (rows ``(step, op, start_s, t,
        stream)``, each running until ``t``), each span priced by ``SpanPricing`` and cut to the window ``[lo, t]``
        (``d = min(end, t) - max(start, lo)``): the sums of ``excess``, W; ``excess * d``, J; ``share * d``, J; and
        ``d`` over kernels, s. Summed one term after another in that order (``numpy.cumsum``), so each is the float a
        Python loop adding the terms of the ops that draw power gives (the other terms are zeros)."""
        p = self.pricing
        s0, s1, ids = self.start, self.end, self.op_id
        if running:
            s0 = np.concatenate((s0, np.fromiter(map(_START, running), dtype=float, count=len(running))))
            s1 = np.concatenate((s1, np.full(len(running), t)))
            ids = np.concatenate((ids, np.fromiter(map(_ID, map(_OP, running)), dtype=np.intp, count=len(running))))
        if not len(ids):
            return 0.0, 0.0, 0.0, 0.0
        e = p.excess[ids]
        d = np.minimum(s1, t) - np.maximum(s0, lo)
        terms = np.stack((e, e * d, p.share[ids] * d, np.where(p.kernel[ids], d, 0.0)))
        inst, avg_hi, lin, kernel_s = np.cumsum(terms, axis=1)[:, -1].tolist()
        return inst, avg_hi, lin, kernel_s
