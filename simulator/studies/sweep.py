"""Parameter sweeps: a grid of ``--set`` overrides, one run per point, one DataFrame back.

Points run in a local process pool (``workers`` > 1) with a progress bar, or on a Dask cluster
(``client``: a ``dask.distributed.Client``; ``sweep_dask.local_cluster`` makes a local one with the settings
that keep Dask's own cost per point small; the scheduler re-runs a batch whose worker was lost). Either way
points go in small batches of consecutive points, one task each (``point_batches``), and a batch's rows are
recorded when it finishes.
With ``out_dir`` each point writes its own output folder (named after its values, sanitised so
that no value can name a path outside ``out_dir``) and the sweep is **resumable**: every finished
point is appended, as it completes, to ``out_dir/index.jsonl`` (one JSON line: folder, hash of the
point's resolved scenario and hardware, simulator version, its table row). Re-running the same
sweep skips the points recorded with the same hash and version whose folder is still there, and
recomputes the others (a changed scenario invalidates exactly the points whose resolved scenario
changed; failed points are always recomputed). ``out_dir/sweep.json`` names the scenario file the
folder belongs to: a folder holding another scenario's sweep is refused. The table of all points
goes to ``out_dir/results.csv`` (and ``results.parquet`` when pyarrow or fastparquet is
installed). A failed point becomes a row with its error instead of stopping the sweep. An
interrupted sweep (Ctrl-C) raises ``SweepInterrupted`` carrying the points that finished; what it
had recorded stays recorded. A cluster or pool that fails mid-sweep (the Dask scheduler lost, a worker process
killed) raises ``SweepFailed`` (a ``ScenarioError``: one line, exit 2) the same way.

What a point costs beside its simulation is paid once per worker process where the result cannot differ: the
scenario file and the ``--set`` values are parsed once (``safe_yaml.loads`` remembers texts), and points with the
same ``TransformerSpec`` (differing only in hardware, clocks, dataloader, policies...) share one built step graph
(``api.reusing_graphs``), and points whose graph policies also read the same settings share the rewritten graph
(``api.policy_graph``: the dataloader's input ops, not rebuilt per point of a ``dataloader.num_workers`` or
clock sweep); every row equals a fresh ``simulate run`` of its point (``tests/simulator/studies/test_sweep_reuse.py``,
``test_sweep_backends.py``). ``run_sweep`` itself imports the simulation (``simulator.api``) only where it runs
points, not in the parent of a pool or a cluster.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pandas as pd

from hardware_models import safe_yaml
from simulator.config.errors import ScenarioError

RESULTS_FILE = "results.csv"
PARQUET_FILE = "results.parquet"
INDEX_FILE = "index.jsonl"
SWEEP_FILE = "sweep.json"
SEARCH_FILE = "search.csv"  # simulator.studies.search: every point of a layout search, refused and pruned ones too
#: layout of ``index.jsonl`` / ``sweep.json``; a folder written with another one is recomputed
INDEX_SCHEMA = 1
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+,-]+")
_MAX_NAME = 120  # bytes; file systems allow 255
_NESTED_KEY = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep. ``table`` holds the finished points (``run_sweep``'s columns), ``total``
    the number of points in the grid."""

    def __init__(self, table: pd.DataFrame, total: int):
        super().__init__(f"sweep interrupted after {len(table)} of {total} points")
        self.table, self.total = table, total


class SweepFailed(ScenarioError):
    """The cluster or process pool running a sweep failed (a lost Dask scheduler, a killed worker process) after
    ``len(table)`` of ``total`` points finished; what finished stays recorded (``out_dir``: index and table).
    The message is one line naming what failed, how many points finished and where they are.

    Attributes:
        table: The finished points' rows (``run_sweep``'s columns), in point order.
        total: Points of the sweep.
        positions: Each row's position among the sweep's points (``table`` row ``j`` is point ``positions[j]``).
        cause: What failed, one line (``--dask-scheduler: the Dask cluster failed (FutureCancelledError: ...)``):
            the message's head, for a caller that words its own (``search.run_search``).
    """

    def __init__(self, message: str, table: pd.DataFrame, total: int, positions: list[int] | None = None,
                 cause: str = ""):
        super().__init__(message)
        self.table, self.total = table, total
        self.positions = list(range(len(table))) if positions is None else positions
        self.cause = cause or message


def point_folder_names(points: list[dict]) -> list[str]:
    """One folder name per point, e.g. ``micro_batch_size=8_seq_length=512``: unique, and a single
    path component (characters other than letters, digits and ``._=+,-`` become ``_``; no leading
    dot, so ``..`` cannot climb out; long names are shortened with a hash)."""
    names: list[str] = []
    seen: set[str] = set()
    for i, point in enumerate(points):
        raw = "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())
        name = _UNSAFE.sub("_", raw).lstrip(".") or "point"
        if len(name.encode()) > _MAX_NAME:
            name = name[:_MAX_NAME - 9] + "-" + hashlib.sha1(raw.encode()).hexdigest()[:8]
        if name in seen:
            name = f"{name}-{i}"
        seen.add(name)
        names.append(name)
    return names


#: headline metrics, first in the table (every other scalar of the summary follows them)
SUMMARY_COLUMNS = ("step_time_s", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes", "data_stall_s",
                   "energy_j_per_step", "avg_power_w", "oom")
#: top-level summary keys whose values are dicts of scalars (flattened to ``key.sub`` columns)
NESTED_METRICS = ("phase_s", "utilisation", "comm_s_by_group", "peak_memory_by_category_bytes", "memory_overheads",
                  "breakdown_s")
#: ``SimulationResult.breakdown`` components -> ``breakdown_s.<key>`` columns (``run_sweep(breakdown=True)``)
BREAKDOWN_KEYS = {"compute (fwd/bwd kernels)": "compute", "optimizer": "optimizer", "exposed copies": "exposed_copies",
                  "data wait": "data_wait", "waiting for other stages (bubble + imbalance)": "pipeline_wait",
                  "host-bound gaps / idle": "idle"}
#: top-level scalar summary keys (``simulator.analysis.summary.summarize``); what ``--plot`` accepts
SCALAR_METRICS = tuple(c for c in SUMMARY_COLUMNS if c != "oom") + (  # "oom" is a message, not a number
    "step_latency_s", "model_flops_per_step", "peak_memory_allocated_bytes", "peak_memory_reserved_bytes",
    "peak_device_memory_bytes", "gpu_memory_capacity_bytes", "peak_host_pinned_bytes", "peak_host_pageable_bytes",
    "exposed_comm_s", "world_size", "data_parallel_size", "num_ops", "energy_per_token_j", "energy_per_sample_j",
    "host_avg_power_w", "host_energy_j_per_step", "avg_sm_clock_mhz", "clock_switches", "power_limit_w", "gpu_busy")


def check_sweep_folder(out_dir: str | Path) -> None:
    """Refuse an ``--out`` folder that holds anything but a sweep's own files, before running.

    Allowed: the table, index and plots this module writes, and point folders (each with the
    ``manifest.json`` a run writes, or a hidden temporary folder of an interrupted write).

    Raises:
        ScenarioError: a foreign file or folder in ``out_dir`` (named), e.g. one run's outputs.
    """
    p = Path(out_dir)
    if not p.is_dir():
        return
    own = {RESULTS_FILE, PARQUET_FILE, INDEX_FILE, SWEEP_FILE, SEARCH_FILE}
    foreign = sorted(c.name for c in p.iterdir()
                     if not (c.name in own or c.name.startswith(".")
                             or (c.is_file() and c.name.startswith("sweep_") and c.suffix == ".png")
                             or (c.is_dir() and (c / "manifest.json").is_file())))
    if foreign:
        raise ScenarioError(f"--out {out_dir}: holds files that are not this sweep's ({', '.join(foreign[:5])}"
                            f"{', ...' if len(foreign) > 5 else ''}); choose a new or empty folder")


def is_metric_name(name: str) -> bool:
    """True if ``name`` can be a numeric column of a sweep table: a scalar summary key
    (``step_time_s``) or ``nested.key`` under one of ``NESTED_METRICS`` (``phase_s.fwd_s``)."""
    head, dot, rest = name.partition(".")
    return name in SCALAR_METRICS or (bool(dot) and head in NESTED_METRICS and bool(_NESTED_KEY.fullmatch(rest)))


def flatten_summary(summary: dict) -> dict:
    """The scalar metrics of a run summary as one flat dict: nested dicts become ``outer.inner``
    keys (``phase_s.fwd_s``, ``utilisation.compute``, ``comm_s_by_group.dp``), lists of dicts one key per item
    and field (``pipeline.stages.0.step_time_s``), lists of scalars (``warnings``) one ``"; "``-joined string; ``SUMMARY_COLUMNS`` first, then in summary order."""
    flat: dict = {}

    def put(key: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{key}.{k}", v)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):  # per-stage / per-class rows: ``pipeline.stages.0.step_time_s``
                put(f"{key}.{i}", v)
        elif isinstance(value, (list, tuple)):
            flat[key] = "; ".join(str(v) for v in value) if value else None
        else:
            flat[key] = value

    for k in SUMMARY_COLUMNS:
        if k in summary:
            put(k, summary[k])
    for k, v in summary.items():
        if k not in SUMMARY_COLUMNS:
            put(k, v)
    return flat


def grid(factors: dict[str, list]) -> list[dict]:
    """Every point of the full grid of ``factors`` (dotted key -> values), the last factor fastest."""
    keys = list(factors)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(factors[k] for k in keys))]


def point_settings(point: dict) -> list[str]:
    """``KEY=VALUE`` per swept key of a point, as ``--set`` and ``--factor`` take them (a null value as ``null``,
    which ``--set`` reads as "the key not written", not as Python's ``None``)."""
    return [f"{k}={'null' if v is None else v}" for k, v in point.items()]


def point_overrides(base_overrides: list[str] | None, point: dict) -> list[str]:
    """The ``--set`` strings of one point: ``base_overrides`` then its ``point_settings`` (applied last)."""
    return list(base_overrides or []) + point_settings(point)


def parse_factor(text: str) -> tuple[str, list]:
    """``"training.micro_batch_size=4,8,16"`` -> ``("training.micro_batch_size", [4, 8, 16])``.

    Raises:
        ScenarioError: no ``=``, no values, or a value ``hardware_models.safe_yaml`` refuses.
    """
    key, sep, vals = text.partition("=")
    if not sep or not key.strip() or not vals.strip():
        raise ScenarioError(f"--factor {text!r}: expected dotted.key=v1,v2,...")
    try:  # the same YAML 1.2 reader as --set: "1:30" stays a string, "yes" is not a boolean
        return key.strip(), [safe_yaml.loads(v) if v.strip() else "" for v in vals.split(",")]
    except safe_yaml.YamlInputError as exc:
        raise ScenarioError(f"--factor {key.strip()}: {exc}") from None


def simulator_version() -> str:
    """The installed ``trainsim-des`` version (``"unknown"`` when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainsim-des")
    except PackageNotFoundError:
        return "unknown"


def point_hash(scenario: str | Path, overrides: list[str]) -> str:
    """SHA-256 (hex) of a point's resolved scenario (after ``overrides``) and its resolved hardware
    (so an edited preset invalidates the points that use it).

    Raises:
        ScenarioError: the point's scenario does not load.
    """
    from simulator.config.loader import load_scenario, resolve_hardware

    with warnings.catch_warnings():  # each point's warnings come with its row (``_run_point``), not from its hash
        warnings.simplefilter("ignore")
        cfg = load_scenario(scenario, overrides)
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, default=str) + stable_repr(resolve_hardware(cfg))
    return hashlib.sha256(text.encode()).hexdigest()


def stable_repr(obj, depth: int = 0) -> str:
    """``repr`` that is the same in every process: dataclasses field by field, mappings sorted, and objects
    with the default ``repr`` (which shows a memory address: a cluster's ``CollectiveModel``, ``Topology``)
    by their public attributes."""
    import dataclasses

    if depth > 8:
        return type(obj).__name__
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return f"{type(obj).__name__}(" + ", ".join(
            f"{f.name}={stable_repr(getattr(obj, f.name), depth + 1)}" for f in dataclasses.fields(obj)) + ")"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{k!r}: {stable_repr(v, depth + 1)}"
                               for k, v in sorted(obj.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(stable_repr(v, depth + 1) for v in obj) + "]"
    if hasattr(obj, "__dict__") and type(obj).__repr__ is object.__repr__:
        return f"{type(obj).__name__}(" + ", ".join(
            f"{k}={stable_repr(v, depth + 1)}" for k, v in sorted(vars(obj).items()) if not k.startswith("_")) + ")"
    return repr(obj)


def breakdown_columns(result) -> dict:
    """``breakdown_s.<component>`` (s per step) of ``result.breakdown()``: ``compute``, ``optimizer``,
    ``exposed_comm_<group>``, ``exposed_copies``, ``data_wait``, ``pipeline_wait`` (a pipeline run: the stages'
    waits for each other, bubble and imbalance; the components are the mean over its stages), ``idle``
    (host-bound gaps)."""
    out = {}
    for comp, sec in result.breakdown().itertuples(index=False):
        key = BREAKDOWN_KEYS.get(comp) or "exposed_comm_" + _UNSAFE.sub("_", comp.split("(", 1)[-1].rstrip(")"))
        out[f"breakdown_s.{key}"] = float(sec)
    return out


def _run_points(jobs: list) -> list[dict]:
    """``_run_point`` of each job in order: one pool or cluster task for a batch of points (``point_batches``)."""
    return [_run_point(job) for job in jobs]


#: batches per worker process or cluster thread (``point_batches``): enough for the pool or scheduler to even out
#: the load and a lost worker to cost little, few enough that per-task costs do not show
BATCHES_PER_WORKER = 8
#: most points in one task (a finished batch is recorded at once: bounds what a crash or Ctrl-C can lose)
BATCH_MAX = 32


def point_batches(todo: list[int], workers: int) -> list[list[int]]:
    """Split the point indices ``todo`` into consecutive batches, one process-pool or cluster task each.

    Every task costs the parent and the worker time beside its points (pickling it and its rows, the pool's queue
    thread, Dask's scheduler and client): with one task per point of about 20 ms, a 2-worker LocalCluster gave
    26% lower throughput than the local pool of 2 processes on 10,000 points (``benchmarks/bench_sweep.py``).
    So points go ``ceil(len(todo) / (workers * BATCHES_PER_WORKER))`` to a task, at most ``BATCH_MAX`` and at
    least 1.

    Args:
        todo: Point indices to run, in order.
        workers: Worker processes of the pool, or worker threads of the cluster (>= 1; fewer is treated as 1).

    Returns:
        Batches covering ``todo`` in order, each non-empty.
    """
    size = max(1, min(BATCH_MAX, math.ceil(len(todo) / (max(workers, 1) * BATCHES_PER_WORKER))))
    return [todo[i:i + size] for i in range(0, len(todo), size)]


def _cluster_threads(client) -> int:
    """Worker threads of ``client``'s cluster now (1 when it cannot tell)."""
    try:
        return max(1, sum(client.nthreads().values()))
    except Exception:  # a client without that call (or not connected yet): one point per task at worst
        return 1


def _run_point(args) -> dict:
    scenario, overrides, point, folder = args[:4]
    breakdown = len(args) > 4 and args[4]
    set_by = args[5] if len(args) > 5 else None
    from simulator.config.loader import load_scenario
    from simulator.api import reusing_graphs, run_scenario
    from simulator.recording.writers import write_outputs

    row = dict(point)
    try:
        # the scenario's own (a setting with no effect) and the run's (the DataLoader's threads beyond the host's
        # cores): each UserWarning a `simulate run` of the point prints comes with its row
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            cfg = load_scenario(scenario, overrides, set_by=set_by)
            with reusing_graphs():  # points that differ only in what the graph builder does not read share its graph
                res = run_scenario(cfg)
        for w in caught:  # others are shown as before
            if not issubclass(w.category, UserWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        # busy fraction of the GPU's compute stream: well below 1 means a host-bound step
        row["gpu_busy"] = (res.summary.get("utilisation") or {}).get("compute", float("nan"))
        # "profile" = "generic:..." marks an unfitted GPU profile (see the summary's warnings)
        row.update(flatten_summary(res.summary))
        # each warning whole (the table joins them; ``point_warnings`` numbers the distinct ones)
        row["warnings"] = list(dict.fromkeys([str(w.message) for w in caught if issubclass(w.category, UserWarning)]
                                             + [str(w) for w in res.summary.get("warnings") or []])) or None
        if breakdown:
            row.update(breakdown_columns(res))
        if folder:
            write_outputs(res, folder, overrides=overrides, scenario=scenario, plots=False)
    except Exception as exc:  # one bad point must not lose the others
        row["error"] = str(exc)
    return row


def _json_safe(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        if hasattr(v, "item"):  # numpy scalar
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = None if math.isnan(v) else str(v)
        out[k] = v
    return out


class _Index:
    """``out_dir/index.jsonl``: finished points, appended one line at a time (a line is written
    with a single ``write`` and flushed to disk; a torn last line from a crash is ignored)."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / INDEX_FILE
        self.done: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and rec.get("schema") == INDEX_SCHEMA and "folder" in rec:
                    self.done[rec["folder"]] = rec

    def lookup(self, folder: Path, digest: str, version: str) -> dict | None:
        rec = self.done.get(folder.name)
        if (rec and rec.get("hash") == digest and rec.get("version") == version and rec.get("error") is None
                and (folder / "manifest.json").is_file()):
            return rec["row"]
        return None

    def append(self, folder: Path, digest: str, version: str, row: dict) -> None:
        rec = {"schema": INDEX_SCHEMA, "folder": folder.name, "hash": digest, "version": version,
               "error": row.get("error"), "row": _json_safe(row)}
        line = (json.dumps(rec, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)


def _claim(out_dir: Path, scenario: str | Path) -> str | None:
    """Tie ``out_dir`` to ``scenario`` (``sweep.json``). Returns a note when earlier results there
    cannot be reused (older layout) and will be recomputed.

    Raises:
        ScenarioError: ``out_dir`` holds the sweep of another scenario file.
    """
    from simulator.recording.writers import atomic_write_text

    meta_path = out_dir / SWEEP_FILE
    mine = str(Path(scenario).resolve())
    note = None
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, OSError):
            meta = {}
        if meta.get("scenario") not in (None, mine):
            raise ScenarioError(f"--out {out_dir}: holds the sweep of another scenario ({meta['scenario']}); "
                                "give a new folder for this one")
        if meta.get("schema") != INDEX_SCHEMA:
            note = f"{out_dir}: sweep written by another version of the index (schema {meta.get('schema')}); recomputing"
    elif (out_dir / RESULTS_FILE).exists():
        note = f"{out_dir}/{RESULTS_FILE}: written without a resume index (older simulator); recomputing every point"
    if note and (out_dir / INDEX_FILE).exists():
        os.replace(out_dir / INDEX_FILE, out_dir / f"{INDEX_FILE}.old")
    atomic_write_text(meta_path, json.dumps({"schema": INDEX_SCHEMA, "scenario": mine}, indent=2))
    return note


def run_sweep(scenario: str | Path, factors: dict[str, list], base_overrides: list[str] | None = None,
              workers: int = 1, out_dir: str | Path | None = None, progress: bool = True, client=None,
              log=None, points: list[dict] | None = None, breakdown: bool = False,
              set_by: dict[str, str] | None = None) -> pd.DataFrame:
    """Run the full grid of ``factors`` over ``scenario`` (resuming a previous run in ``out_dir``).

    Args:
        scenario: Scenario YAML path.
        factors: Dotted key -> list of values.
        base_overrides: ``--set`` strings applied to every point.
        workers: Local processes.
        out_dir: If set, each point writes its outputs to a sub-folder (``point_folder_names``,
            column ``folder``), finished points are recorded in ``out_dir/index.jsonl`` and reused
            by the next run, and the table goes to ``out_dir/results.csv`` (+ ``results.parquet``).
        progress: Show a tqdm progress bar on stderr.
        client: Optional ``dask.distributed.Client`` to run the points on a cluster.
        log: ``callable(str)`` for one-line notes (skipped/computed counts, no parquet writer);
            default: print to stderr.
        points: Run these points (dicts of ``factors``' keys) instead of the full grid (a layout search's
            survivors).
        breakdown: Add each point's step breakdown (``breakdown_columns``).
        set_by: Key of a ``base_overrides`` entry the program wrote, not the user -> who set it
            (``load_scenario``'s ``set_by``): its ``=null`` notes stay silent, its problems name who set it.

    Returns:
        One row per point, in grid order: the swept keys, ``gpu_busy``, every scalar of the
        summary (``flatten_summary``), ``error`` (None when the point ran) and, with ``out_dir``,
        ``folder``. ``df.attrs["skipped"]`` / ``df.attrs["computed"]`` count reused and run points;
        ``df.attrs["warnings"]`` (when any point warned: the scenario's load warnings and the run's) maps each
        distinct warning to the rows that gave it. ``run_sweep`` itself does not check the points first
        (a refused one is a row with its error); ``simulate sweep`` does (``sweep_check.check_points``).

    Raises:
        ScenarioError: the grid is empty, or ``out_dir`` holds another scenario's sweep.
        SweepInterrupted: Ctrl-C; it carries the finished points (also written to results.csv).
    """
    from tqdm import tqdm

    log = log or (lambda msg: print(msg, file=sys.stderr))
    keys = list(factors)
    if not keys or any(not factors[k] for k in keys):
        raise ScenarioError("sweep: empty grid (every --factor needs at least one value)")
    if points is None:
        points = grid(factors)
    elif not points:
        raise ScenarioError("sweep: no point to run")
    out = Path(out_dir) if out_dir else None
    folders = [out / n for n in point_folder_names(points)] if out else [None] * len(points)
    jobs = [(str(scenario), point_overrides(base_overrides, p), p, str(f) if f else None, breakdown, set_by)
            for p, f in zip(points, folders)]
    done: dict[int, dict] = {}
    index, digests, version = None, {}, simulator_version()
    if out:
        out.mkdir(parents=True, exist_ok=True)
        note = _claim(out, scenario)
        if note:
            log(note)
        index = _Index(out)
        for i, (job, folder) in enumerate(zip(jobs, folders)):
            try:
                digests[i] = point_hash(scenario, job[1]) + ("+breakdown" if breakdown else "")
            except ScenarioError:  # this point's values are refused: it runs, and its row holds the error
                digests[i] = "refused"
                continue
            row = index.lookup(folder, digests[i], version)
            if row is not None:
                done[i] = row
    skipped = len(done)
    todo = [i for i in range(len(jobs)) if i not in done]

    def finish(i: int, row: dict) -> None:
        done[i] = row
        if index is not None:
            index.append(folders[i], digests[i], version, row)

    def finish_batch(batch: list[int], rows: list[dict], bar) -> None:
        for i, row in zip(batch, rows):
            finish(i, row)
        bar.update(len(batch))

    try:
        if client is not None and todo:
            from dask.distributed import as_completed as dask_completed

            batches = point_batches(todo, _cluster_threads(client))
            pending: dict = {}  # key -> future of the batches not yet recorded
            try:
                futures = client.map(_run_points, [[jobs[i] for i in b] for b in batches], pure=False)
                where = {f.key: b for f, b in zip(futures, batches)}
                pending = {f.key: f for f in futures}
                completed = dask_completed(futures)
                del futures  # a recorded batch's future is dropped at once: its worker frees the rows (Future.release)
                with tqdm(total=len(todo), disable=not progress, desc="sweep") as bar:
                    for fut in completed:
                        finish_batch(where[fut.key], fut.result(), bar)
                        pending.pop(fut.key).release()
            except KeyboardInterrupt:
                client.cancel(list(pending.values()))
                raise
            except Exception as exc:  # a point's own failure is a row: this is the cluster (scheduler lost, worker killed)
                failed = _failed(done, jobs, folders, out, log, "--dask-scheduler", "the Dask cluster failed", exc)
                raise failed from None
        elif workers > 1 and len(todo) > 1:
            from concurrent.futures import as_completed

            procs = min(workers, len(todo))
            with ProcessPoolExecutor(procs) as pool, tqdm(total=len(todo), disable=not progress, desc="sweep") as bar:
                futures = {pool.submit(_run_points, [jobs[i] for i in b]): b for b in point_batches(todo, procs)}
                try:
                    for fut in as_completed(futures):
                        finish_batch(futures[fut], fut.result(), bar)
                except KeyboardInterrupt:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
                except BrokenProcessPool as exc:  # a worker process killed (out of host memory, a signal)
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise _failed(done, jobs, folders, out, log, "--workers", "a worker process died", exc) from None
        else:
            for i in tqdm(todo, disable=not progress, desc="sweep"):
                finish(i, _run_point(jobs[i]))
    except KeyboardInterrupt:
        order = sorted(done)
        table = _table([done[i] for i in order], [folders[i] for i in order], out, log)
        raise SweepInterrupted(table, len(jobs)) from None
    finally:
        api = sys.modules.get("simulator.api")  # imported here only when this process ran points (workers=1)
        if api is not None:
            api.forget_graphs()  # the graphs they kept
    if out:
        log(f"sweep: {skipped} of {len(jobs)} points already done and unchanged (skipped), {len(todo)} computed")
    df = _table([done[i] for i in range(len(jobs))], folders, out, log)
    df.attrs.update(skipped=skipped, computed=len(todo))
    return df


def _failed(done: dict[int, dict], jobs: list, folders: list, out: Path | None, log, option: str, what: str,
            exc: BaseException) -> SweepFailed:
    """``SweepFailed`` for a pool or cluster that failed with ``exc`` after the points ``done``: their table is
    written (``out``) and carried; the message says how many finished, where they are and how to resume."""
    order = sorted(done)
    table = _table([done[i] for i in order], [folders[i] for i in order], out, log)
    reason = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    kept = (f"kept in {out} ({INDEX_FILE}, {RESULTS_FILE}); the same command resumes from them" if out
            else "not kept (give --out DIR to keep finished points)")
    cause = f"{option}: {what} ({type(exc).__name__}: {reason})"
    return SweepFailed(f"{cause}; {len(done)} of {len(jobs)} points finished, {kept}", table, len(jobs), order, cause)


def point_warnings(rows: list[dict]) -> dict[str, list[int]]:
    """Each distinct warning of the rows (a row's ``warnings``: a list, or a ``"; "``-joined string from an
    index written before the list was kept, taken whole) -> the positions of the rows that gave it, in order of
    first appearance."""
    found: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        ws = r.get("warnings")
        for w in (ws if isinstance(ws, list) else [ws] if isinstance(ws, str) and ws else []):
            found.setdefault(w, []).append(i)
    return found


def row_warnings(found: dict[str, list[int]], n: int) -> list[list[str]]:
    """Each of ``n`` rows' warnings as a list (``[]``: none), from ``point_warnings``' map (a table's
    ``attrs["warnings"]``): what ``--json`` gives per point, a list as ``run --json``'s ``warnings`` (the table and
    results.csv keep the ``"; "``-joined string); within a row in their order of first appearance over the rows."""
    out: list[list[str]] = [[] for _ in range(n)]
    for text, where in found.items():
        for i in where:
            out[i].append(text)
    return out


def json_records(df: pd.DataFrame, found: dict[str, list[int]] | None = None) -> list[dict]:
    """A sweep's (or search's) table as JSON-ready records (``DataFrame.to_json`` values), with each row's
    ``warnings`` a list (``row_warnings``; ``found`` defaults to ``df.attrs["warnings"]``, positions of ``df``'s rows)."""
    recs = json.loads(df.to_json(orient="records"))
    if "warnings" in df:
        lists = row_warnings(df.attrs.get("warnings") or {} if found is None else found, len(df))
        for r, ws in zip(recs, lists):
            r["warnings"] = ws
    return recs


def parquet_engine() -> str | None:
    """``"pyarrow"`` or ``"fastparquet"``, whichever is importable first; None when neither is."""
    import importlib.util

    return next((m for m in ("pyarrow", "fastparquet") if importlib.util.find_spec(m) is not None), None)


def _table(rows: list[dict], folders: list, out: Path | None, log) -> pd.DataFrame:
    """The sweep's table; with ``out`` also written to ``out/results.csv`` and ``results.parquet``. Its
    ``warnings`` column joins each point's warnings with ``"; "``; ``df.attrs["warnings"]`` (when a point
    warned) maps each distinct warning to the positions of the rows that gave it (``point_warnings``)."""
    found = point_warnings(rows)
    rows = [{**r, "warnings": "; ".join(r["warnings"])} if isinstance(r.get("warnings"), list) else r for r in rows]
    df = pd.DataFrame(rows)
    if "error" not in df:
        df["error"] = None
    df["error"] = df["error"].astype(object).where(df["error"].notna(), None)
    df = df[[c for c in df.columns if c != "error"] + ["error"]]
    if out:
        from simulator.recording.writers import atomic_write_bytes, atomic_write_text

        df["folder"] = [f.name for f in folders]
        atomic_write_text(out / RESULTS_FILE, df.to_csv(index=False))
        engine = parquet_engine()
        if engine is None:
            log(f"note: {out / PARQUET_FILE} not written (needs pyarrow or fastparquet: pip install 'trainsim-des[parquet]')")
        else:
            import io

            buf = io.BytesIO()
            flat = df.astype({c: str for c in df.columns if df[c].dtype == object}).where(df.notna(), None)
            if found:  # the file's metadata keeps the table's attrs (pandas writes them)
                flat.attrs["warnings"] = found
            flat.to_parquet(buf, engine=engine, index=False)
            atomic_write_bytes(out / PARQUET_FILE, buf.getvalue())
    if found:  # last: pandas deep-copies attrs into the result of every operation above
        df.attrs["warnings"] = found
    return df


def plot_factor(table: pd.DataFrame, factors: list[str]) -> tuple[str, list[str]]:
    """The factor for a sweep curve's x axis (the first whose values are all numbers, else the
    first) and the others (one series per combination)."""
    numeric = [f for f in factors if pd.to_numeric(table[f], errors="coerce").notna().all()]
    x = numeric[0] if numeric else factors[0]
    return x, [f for f in factors if f != x]


def write_sweep_plots(table: pd.DataFrame, factors: list[str], metrics: list[str], out_dir: str | Path) -> list[Path]:
    """``out_dir/sweep_<metric>.png`` for each metric: ``recording.plots.sweep_curves`` of the
    metric against ``plot_factor``'s x, one series per combination of the other factors.

    Raises:
        ScenarioError: a metric is not a column of ``table`` with at least one value.
    """
    from simulator.recording.plots import render_png, sweep_curves
    from simulator.recording.writers import atomic_write_bytes

    for m in metrics:
        if m not in table or pd.to_numeric(table[m], errors="coerce").isna().all():
            have = [c for c in table.columns if c not in factors and is_metric_name(c)]
            raise ScenarioError(f"--plot {m}: no values of it in this sweep's table; columns with numbers: "
                                f"{', '.join(have[:12])}{', ...' if len(have) > 12 else ''}")
    x, by = plot_factor(table, factors)
    return [atomic_write_bytes(Path(out_dir) / f"sweep_{m}.png", render_png(sweep_curves, table, x, m, by=by))
            for m in metrics]
