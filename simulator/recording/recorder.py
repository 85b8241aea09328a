"""Record spans (as plain tuples) and counters (as columns) during a run; build DataFrames once at the end."""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import pandas as pd

SPAN_COLUMNS = [
    "step", "op_id", "name", "stream", "kind", "phase", "layer", "cost_class",
    "start_s", "end_s", "flops", "bytes",
]
COUNTER_COLUMNS = ["t_s", "scope", "metric", "value"]


class Recorder:
    """Collects spans (op executions) and counter samples (memory, clock, power levels).

    The samples are kept as four columns (``COUNTER_COLUMNS``: lists of times, scopes, metrics, values), not one
    tuple each: a run's thousands of power levels would otherwise be as many tuples for the cyclic garbage
    collector to traverse after the run (its first pass once ``engine.run.gc_paused`` ends, ~1 ms for ~6,100).
    """

    def __init__(self) -> None:
        self._spans: list[tuple] = []
        #: the samples' columns ``(t_s, scope, metric, value)``, in recording order
        self._counter_cols: tuple[list, list, list, list] = ([], [], [], [])
        #: each counter's last row, by ``(scope, metric)``
        self._last: dict[tuple[str, str], int] = {}
        #: ``(rows, row count, SpanColumns)`` of the last ``span_columns`` call
        self._span_cols: tuple | None = None

    def span(self, step: int, op, start_s: float, end_s: float, stream: str | None = None) -> None:
        """Record that ``op`` ran from ``start_s`` to ``end_s`` (seconds) in ``step``."""
        self._spans.append((step, op, start_s, end_s, stream))

    def span_writer(self):
        """The span rows' own ``append``, for a hot loop (``engine.executor``): ``w((step, op, start_s, end_s,
        stream))`` records what ``span(step, op, start_s, end_s, stream)`` does, without a method call per span.
        Valid until ``release`` (which starts a new list)."""
        return self._spans.append

    @property
    def spans(self) -> list[tuple]:
        """Spans as tuples in ``SPAN_COLUMNS`` order."""
        return [
            (step, op.id, op.name, stream or op.stream, op.kind.value, op.phase.value, op.layer,
             op.cost_class.value, s, e, op.flops, op.bytes_moved)
            for step, op, s, e, stream in self._spans
        ]

    def counter(self, t_s: float, scope: str, metric: str, value: float) -> None:
        """Record a level sample (the value holds from ``t_s`` until the next sample).

        Several samples of one counter at the same instant keep only the last.
        """
        key = (scope, metric)
        i = self._last.get(key)
        t, sc, m, v = self._counter_cols
        if i is not None and t[i] == t_s:
            t[i], sc[i], m[i], v[i] = t_s, scope, metric, value
            return
        self._last[key] = len(t)
        t.append(t_s)
        sc.append(scope)
        m.append(metric)
        v.append(value)

    def counter_series(self, times: list[float], scope: str, metric: str, values: list[float]) -> None:
        """Samples of one counter at increasing instants ``times`` (seconds; ``values`` of the same length):
        ``counter`` of the first (which may replace a sample at that instant), the rest appended as they are (each
        at a later instant than the one before, so none replaces another)."""
        if not times:
            return
        self.counter(times[0], scope, metric, values[0])
        if len(times) > 1:
            t, sc, m, v = self._counter_cols
            t.extend(times[1:])
            sc.extend(repeat(scope, len(times) - 1))
            m.extend(repeat(metric, len(times) - 1))
            v.extend(values[1:])
            self._last[(scope, metric)] = len(t) - 1

    @property
    def counters(self) -> list[tuple]:
        """The samples so far as rows ``(t_s, scope, metric, value)`` (``COUNTER_COLUMNS`` order), in recording
        order (a new list: recording goes through ``counter``)."""
        return list(zip(*self._counter_cols))

    def counter_columns(self) -> tuple[list, list, list, list]:
        """The samples' columns ``(t_s, scope, metric, value)`` as recorded (the recorder's own lists, which later
        samples extend until ``release``)."""
        return self._counter_cols

    def samples(self, scope: str, metric: str) -> list[tuple[float, float]]:
        """``(t_s, value)`` of counter ``(scope, metric)`` as recorded so far, in recording order (the counter's rows
        of ``counters_frame``, in its order when they were recorded in time order, as ``counter`` calls are)."""
        return [(t, v) for t, sc, m, v in zip(*self._counter_cols) if m == metric and sc == scope]

    def release(self) -> None:
        """Drop the recorded rows (the frames built from them stay valid); later calls record afresh.

        ``engine.run.run_ranks`` calls it once the run's frames are built: the rows (one tuple per span
        and sample) would otherwise wait for the cyclic garbage collector with the run's other objects
        (the runtime components hold the recorder) and make its next pass slower."""
        self._spans = []
        self._counter_cols = ([], [], [], [])
        self._last = {}
        self._span_cols = None

    def span_columns(self) -> SpanColumns:
        """The recorded spans as columns with their distinct ops (``SpanColumns``), built once per set of spans (the
        power meter's ``levels`` after the run and ``spans_frame`` share them); an empty recorder gives None.

        Rebuilt when a span was recorded since (the row count changed) or the rows were released."""
        spans = self._spans
        cached = self._span_cols
        if cached is not None and cached[0] is spans and cached[1] == len(spans):
            return cached[2]
        cols = span_columns(spans)
        self._span_cols = (spans, len(spans), cols)
        return cols

    def spans_frame(self) -> pd.DataFrame:
        """Spans as a DataFrame with ``SPAN_COLUMNS`` (times in seconds).

        Built column by column: an op's attributes are read once however many steps it ran in (a column
        of the distinct ops, then taken by each span's op index); the dtypes are those pandas infers
        from the values (``column_array``), as for a frame built from the rows.
        """
        if not self._spans:
            df = pd.DataFrame(self.spans, columns=SPAN_COLUMNS)
            df["duration_s"] = df["end_s"] - df["start_s"]
            return df
        steps, ops, starts, ends, streams, uniq, pos = self.span_columns()
        # one column per attribute over the distinct ops (``_value_``: an enum member's value without the ``value``
        # descriptor call, the same object), then taken by each span's op index, unless every span is its own op
        # (``pos`` is then ``0..n-1``: the take would copy the column as it is)
        per_op = [list(map(get, uniq)) for get in _PER_OP]
        distinct = len(uniq) == len(ops)
        op_id, name, op_stream, kind, phase, layer, cost_class, flops, nbytes = (
            column_array(v) if distinct else column_array(v).take(pos) for v in per_op)
        if all(streams):  # every span names its stream (the executor's)
            stream = string_column([streams], [len(streams)])
        elif any(streams):
            stream = column_array([s or d for s, d in zip(streams, np.asarray(per_op[2], dtype=object)[pos].tolist())])
        else:
            stream = op_stream
        start, end = column_array(starts), column_array(ends)
        cols = {"step": column_array(steps), "op_id": op_id, "name": name, "stream": stream, "kind": kind,
                "phase": phase, "layer": layer, "cost_class": cost_class, "start_s": start,
                "end_s": end, "flops": flops, "bytes": nbytes}
        if isinstance(start, np.ndarray) and isinstance(end, np.ndarray):  # the column pandas' subtraction gives
            cols["duration_s"] = end - start
            return pd.DataFrame(cols)  # in SPAN_COLUMNS order, then duration_s
        df = pd.DataFrame(cols)
        df["duration_s"] = df["end_s"] - df["start_s"]
        return df

    def counters_frame(self, extra: tuple[list, list, list, list] | None = None,
                       parts: list[tuple] | None = None) -> pd.DataFrame:
        """Counter samples as a DataFrame with ``COUNTER_COLUMNS``, in time order (stable: samples at one
        instant keep their recording order).

        Args:
            extra: More samples after the recorded ones, as columns ``(t_s, scope, metric, value)`` (lists of one
                length): the frame is the one the recorded rows followed by these would give.
            parts: More samples after those, as blocks ``(t_s, scope, metric, value)``: ``t_s`` and ``value`` lists
                of one length, ``scope`` and ``metric`` each a list of that length or one string for every row of
                the block (``System.memory_counter_parts``); the same frame as their rows in order.

        The columns are built block by block: numbers as arrays concatenated (the dtype the rows would give,
        ``numeric_column``), strings as one object array (``string_column``).
        """
        return counter_frame(self._counter_cols, extra, parts)


def counter_frame(columns: tuple[list, list, list, list] | None, extra: tuple[list, list, list, list] | None = None,
                  parts: list[tuple] | None = None) -> pd.DataFrame:
    """``Recorder.counters_frame`` of the recorded samples' ``columns`` (``Recorder.counter_columns``: ``(t_s, scope,
    metric, value)``, sequences of one length; None: none)."""
    blocks = [tuple(columns)] if columns is not None else []
    if extra is not None:
        blocks.append(tuple(extra))
    blocks += list(parts or ())
    blocks = [b for b in blocks if len(b[0])]
    if not blocks:
        return pd.DataFrame([], columns=COUNTER_COLUMNS)
    lengths = [len(b[0]) for b in blocks]
    t = numeric_column([b[0] for b in blocks])
    order = np.argsort(np.asarray(t), kind="stable")
    cols = {"t_s": t.take(order), "scope": string_column([b[1] for b in blocks], lengths).take(order),
            "metric": string_column([b[2] for b in blocks], lengths).take(order),
            "value": numeric_column([b[3] for b in blocks]).take(order)}
    return pd.DataFrame(cols)  # in COUNTER_COLUMNS order


def numeric_column(blocks: list) -> np.ndarray | pd.api.extensions.ExtensionArray:
    """``column_array`` of the blocks' values one after another (each a sequence), built block by block when they
    are Python ints and floats alone: each block's array, concatenated (``int64`` blocks with a ``float64`` one give
    ``float64``, each int converted as ``numpy.array`` of all the values converts it); otherwise ``column_array``."""
    types: set = set()
    for b in blocks:
        types.update(map(type, b))
    if types <= _NUMBERS:
        arrays = [np.array(b) for b in blocks if len(b)]  # (an empty block's array would be float64)
        if arrays and all(a.dtype.kind in "if" for a in arrays):
            return np.concatenate(arrays) if len(arrays) > 1 else arrays[0]
    return column_array([v for b in blocks for v in b])


def string_column(blocks: list, lengths: list[int]) -> np.ndarray | pd.api.extensions.ExtensionArray:
    """``column_array`` of the blocks' values one after another, each block a sequence of ``lengths[i]`` values or
    one string for all of them: with strings alone, pandas' string array of every row (built from one object array:
    a one-string block filled without a list of its rows); otherwise ``column_array`` of every row."""
    arrays = []
    for b, n in zip(blocks, lengths, strict=True):
        if isinstance(b, str):
            arrays.append(np.full(n, b, dtype=object))
        elif set(map(type, b)) == _STR:
            arrays.append(np.array(b, dtype=object))
        else:
            return column_array([v for b_, n_ in zip(blocks, lengths) for v in ([b_] * n_ if isinstance(b_, str) else b_)])
    return pd.array(np.concatenate(arrays) if len(arrays) > 1 else arrays[0], dtype=_STR_DTYPE)


class SpanColumns(NamedTuple):
    """Span rows ``(step, op, start_s, end_s, stream)`` as columns (tuples, in recording order), with the distinct
    ops in first-span order (``uniq``) and each span's index into them (``pos``, an ``intp`` array)."""

    steps: tuple
    ops: tuple
    starts: tuple
    ends: tuple
    streams: tuple
    uniq: list
    pos: np.ndarray


def span_columns(spans: list[tuple]) -> SpanColumns | None:
    """``SpanColumns`` of span rows ``(step, op, start_s, end_s, stream)``; None for no rows."""
    if not spans:
        return None
    steps, ops, starts, ends, streams = zip(*spans)
    uniq = list({id(op): op for op in ops}.values())  # in first-span order
    if len(uniq) == len(ops):  # every span its own op (one step of a graph whose ops run once): in span order
        return SpanColumns(steps, ops, starts, ends, streams, uniq, np.arange(len(ops), dtype=np.intp))
    index = {id(op): i for i, op in enumerate(uniq)}
    pos = np.fromiter(map(index.__getitem__, map(id, ops)), dtype=np.intp, count=len(ops))
    return SpanColumns(steps, ops, starts, ends, streams, uniq, pos)


def column_array(values) -> np.ndarray | pd.api.extensions.ExtensionArray:
    """``values`` (a sequence) as the array pandas makes of it in a frame built from rows, with the dtype
    pandas infers: Python ints and floats alone convert directly (``int64``, or ``float64`` when any is a
    float, as pandas does); anything else (strings, None, bools) goes through pandas' own inference."""
    values = list(values)
    types = set(map(type, values))
    if types <= _NUMBERS:
        a = np.array(values)
        if a.dtype.kind in "if":
            return a
    if types == _STR:  # strings alone: pandas' string dtype without its inference pass
        return pd.array(values, dtype=_STR_DTYPE)
    return pd.Series(values).array


#: the op attributes of ``SPAN_COLUMNS`` ``op_id`` to ``bytes`` but the span's own ``start_s``/``end_s``
#: (``stream``: the op's, where a span names none), in that order
_PER_OP = tuple(map(attrgetter, ("id", "name", "stream", "kind._value_", "phase._value_", "layer",
                                 "cost_class._value_", "flops", "bytes_moved")))
_NUMBERS = {int, float}
_STR = {str}
#: the dtype pandas infers for a column of Python strings (``str``)
_STR_DTYPE = pd.Series(["a"]).dtype


LAUNCH_COLUMNS = ["step", "op_id", "start_s", "end_s"]
#: columns a run of several simulated ranks adds to its frames: the rank's index (several classes), its
#: pipeline stage, its data-parallel class
RANK_COLUMNS = ("rank_class", "pp_rank", "dp_class")


def rank_column(frame) -> str | None:
    """The column naming which simulated rank a row belongs to: ``rank_class`` (several classes: the rank's
    index), ``pp_rank`` (one class per pipeline stage), or None (one rank)."""
    return next((c for c in RANK_COLUMNS[:2] if c in frame), None)
DEPENDENCY_COLUMNS = ["op_id", "dep_id", "step_lag"]
_ID_OF, _DEPS_OF = attrgetter("id"), attrgetter("deps")


def launches_frame(graph, launch_time: list[list[float | None]], launch_cost_s: list[float] | None) -> pd.DataFrame:
    """Host launch intervals of the launched ops (``LAUNCH_COLUMNS``, seconds).

    Args:
        graph: The step graph (its ops' ``launch`` flags).
        launch_time: ``[step][op_id]`` time the host finished launching the op (None: never launched).
        launch_cost_s: ``[op_id]`` host time one launch takes; None gives an empty frame.
    """
    if launch_cost_s is None:
        return pd.DataFrame(columns=LAUNCH_COLUMNS)
    return launch_intervals(launched_ids(graph), launch_time, launch_cost_s)


def launched_ids(graph) -> np.ndarray:
    """Ids of the graph's launched ops (``Op.launch``), in graph order (``intp``)."""
    return np.array([op.id for op in graph.ops if op.launch], dtype=np.intp)


def launch_intervals(launched: np.ndarray, launch_time: list[list[float | None]],
                     launch_cost_s: list[float] | None) -> pd.DataFrame:
    """``launches_frame`` of the launched ops' ids ``launched`` (``launched_ids``)."""
    if launch_cost_s is None:
        return pd.DataFrame(columns=LAUNCH_COLUMNS)
    steps = len(launch_time)
    if not len(launched) or not steps:
        return pd.DataFrame([], columns=LAUNCH_COLUMNS)
    end = np.array(launch_time, dtype=float)[:, launched]  # [step, launched op]; NaN: never launched
    ok = ~np.isnan(end)
    if not ok.any():
        return pd.DataFrame([], columns=LAUNCH_COLUMNS)
    step, k = np.nonzero(ok)  # row-major: step by step, ops in graph order
    op_id = launched[k]
    t = end[step, k]
    return pd.DataFrame({"step": step.astype(np.int64), "op_id": op_id.astype(np.int64),
                         "start_s": t - np.asarray(launch_cost_s, dtype=float)[op_id], "end_s": t})


def dependencies_frame(graph) -> pd.DataFrame:
    """The graph's dependency edges (``DEPENDENCY_COLUMNS``): ``dep_id`` must finish before ``op_id``
    starts, in the same step (``step_lag`` 0) or the previous one (1, ``meta["prev_step_deps"]``)."""
    return dependency_frame(dependency_columns(graph))


def dependency_columns(graph) -> dict[str, np.ndarray]:
    """``dependencies_frame``'s columns as arrays (``DEPENDENCY_COLUMNS``, in order; empty ones when the graph has
    no edge): what a frame built later needs without holding the graph (``api.simulate_graph``)."""
    ops = graph.ops
    # the same-step edges op by op (each op's id repeated once per dependency), then the previous step's
    ids = np.fromiter(map(_ID_OF, ops), dtype=np.int64, count=len(ops))
    counts = np.fromiter(map(len, map(_DEPS_OF, ops)), dtype=np.intp, count=len(ops))
    op_id = [np.repeat(ids, counts)]
    dep_id = [np.fromiter(chain.from_iterable(map(_DEPS_OF, ops)), dtype=np.int64, count=int(counts.sum()))]
    n_same = len(dep_id[0])
    for op in ops:
        prev = op.meta.get("prev_step_deps") if op.meta else None
        if prev:
            op_id.append(np.full(len(prev), op.id, dtype=np.int64))
            dep_id.append(np.asarray(prev, dtype=np.int64))
    op_id, dep_id = np.concatenate(op_id), np.concatenate(dep_id)
    lag = np.zeros(len(op_id), dtype=np.int64)
    lag[n_same:] = 1
    return {"op_id": op_id, "dep_id": dep_id, "step_lag": lag}


def dependency_frame(columns: dict[str, np.ndarray]) -> pd.DataFrame:
    """``dependencies_frame`` of its columns (``dependency_columns``)."""
    if not len(columns["op_id"]):
        return pd.DataFrame([], columns=DEPENDENCY_COLUMNS)
    return pd.DataFrame(columns)
