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
        clocks: ``(SM clock, memory clock)`` the prices are at, MHz (``PowerMeter.levels`` reads them only there).
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
        self.clocks = (meter.state.sm_clock_mhz, meter.state.mem_clock_mhz)


class WindowSpans:
    """The recorded spans that end inside the watch's window, as one array in recording order, taken up as the
    recorder grows (``advance``), with the sums of their prices over the window (``bounds``).

    Args:
        spans: The recorder's span rows ``(step, op, start_s, end_s, stream)`` (the list it appends to).
        pricing: The graph's ``SpanPricing`` (a span is priced as the graph's op of its id).

    Attributes:
        kept: ``(n, 6)`` float array, one row per kept span: start, s; end, s; its op's ``excess``, W, ``share``, W,
            and ``kernel`` (1.0 / 0.0); its place in ``spans``.
    """

    def __init__(self, spans: list, pricing: SpanPricing) -> None:
        self.spans, self.pricing = spans, pricing
        self.seen = 0
        self.kept = np.zeros((0, 6))
        self._parts = np.column_stack((pricing.excess, pricing.share, pricing.kernel.astype(float)))

    def advance(self, lo: float) -> None:
        """Take up the spans recorded since the last call, then keep those ending after ``lo``, s."""
        spans, seen = self.spans, self.seen
        n = len(spans)
        kept = self.kept
        if n > seen:
            new = spans[seen:n]
            m = n - seen
            block = np.empty((m, 6))
            block[:, 0] = np.fromiter(map(_START, new), dtype=float, count=m)
            block[:, 1] = np.fromiter(map(_END, new), dtype=float, count=m)
            block[:, 2:5] = self._parts[np.fromiter(map(_ID, map(_OP, new)), dtype=np.intp, count=m)]
            block[:, 5] = np.arange(seen, n)
            kept = np.concatenate((kept, block))
            self.seen = n
        keep = kept[:, 1] > lo
        self.kept = kept if keep.all() else kept[keep]

    def rows(self) -> list:
        """The kept spans' rows, in recording order."""
        spans = self.spans
        return [spans[i] for i in self.kept[:, 5].astype(np.intp).tolist()]

    def bounds(self, running: list, t: float, lo: float) -> tuple[float, float, float, float]:
        """``(inst, avg_hi, lin, kernel_s)`` over the kept spans, then ``running`` (rows ``(step, op, start_s, t,
        stream)``, each running until ``t``), each span priced by ``SpanPricing`` and cut to the window ``[lo, t]``
        (``d = min(end, t) - max(start, lo)``): the sums of ``excess``, W; ``excess * d``, J; ``share * d``, J; and
        ``d`` over kernels, s. Summed one term after another in that order (``numpy.cumsum`` over the kept spans, then
        the running ops one by one), so each is the float a Python loop adding the terms of the ops that draw power
        gives (the other terms are zeros)."""
        kept = self.kept
        if len(kept):
            d = np.minimum(kept[:, 1], t) - np.maximum(kept[:, 0], lo)
            terms = np.empty((len(kept), 4))
            terms[:, 0] = kept[:, 2]
            np.multiply(kept[:, 2:5], d[:, None], out=terms[:, 1:])
            inst, avg_hi, lin, kernel_s = np.cumsum(terms, axis=0)[-1].tolist()
        else:
            inst = avg_hi = lin = kernel_s = 0.0
        if running:
            p = self.pricing
            for _st, op, s0, _t, _stream in running:
                e = float(p.excess[op.id])
                if e:
                    inst += e
                    d = t - (lo if lo > s0 else s0)
                    avg_hi += e * d
                    lin += float(p.share[op.id]) * d
                    if p.kernel[op.id]:
                        kernel_s += d
        return inst, avg_hi, lin, kernel_s
