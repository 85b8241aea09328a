"""Layout search: which parallel layout (TP / PP / micro-batch / ZeRO ...) trains a scenario fastest, and
what limits each layout.

``run_search(scenario, {"parallelism.tensor_model_parallel_size": [1, 2, 4, 8], ...})``:

1. **Checks the space** before anything runs: every key must exist in the scenario schema
   (``parallelism.data_parallel_size`` is refused: it is derived from the world size, ``world / (tp x pp)``),
   every value must be one its field accepts on its own (type, range); an empty space or a key without
   values is refused. These raise ``ScenarioError`` (``simulate search``: one line, exit 2).
2. **Enumerates** the product of the values. A point the schema refuses as a combination (Megatron's
   divisibility rules, tp x pp not dividing the world, a global batch that micro-batch x dp does not
   divide, ZeRO-2 with pipelining...) is recorded as ``refused`` with the schema's message.
3. **Prunes by memory** without simulating: ``memory_estimate.estimate_memory`` per point; a point whose
   estimate exceeds the GPU's memory even at the low end of the estimate's stated error
   (``MemoryEstimate.surely_over``) is ``pruned`` with its shortfall. Points it cannot estimate (offload)
   are simulated.
4. **Simulates** the survivors with ``sweep.run_sweep`` (process pool, a Dask cluster, resumable ``out_dir``),
   with each point's step breakdown. A survivor that runs out of memory in the simulation is ``oom``. A cluster
   or pool lost mid-search raises ``SearchFailed`` (one line, exit 2) with the finished simulations ranked and kept.
5. **Ranks** the layouts that fit by the objective (``tokens_per_s`` and ``mfu``: higher is better;
   ``step_time_s``: lower) and says what bounds each (``bounds``): the compute share of the step, the
   exposed communication of each process group, the pipeline bubble / idle time, the optimizer, and the
   memory headroom.

The global batch stays fixed across layouts (tokens per step are then the same, so tokens/s compares
like with like): the scenario's ``training.global_batch_size``, else its ``micro_batch_size x
data_parallel_size``, set on every point (``SearchResult.notes`` says which).
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from pydantic import BaseModel, ValidationError

from simulator.config.errors import ScenarioError

#: objective -> "max" (higher is better) or "min"
OBJECTIVES = {"tokens_per_s": "max", "step_time_s": "min", "mfu": "max"}
#: keys a search may not vary, with the reason
DERIVED_KEYS = {"parallelism.data_parallel_size": "derived from the world size (hardware.cluster nodes x GPUs per node "
                "/ (tp x pp)); vary hardware.cluster.nodes or the tp/pp sizes instead"}
STATUSES = ("ok", "oom", "pruned", "refused", "error")
#: a layout with less free memory than this share of the GPU is also called memory-bound
MEMORY_BOUND_SHARE = 0.05
_DP_DERIVED = "parallelism.data_parallel_size=null"


class SearchFailed(ScenarioError):
    """The cluster or process pool simulating a search's points failed (a lost Dask scheduler, a killed worker
    process: ``sweep.SweepFailed``). ``result`` holds every point: the finished simulations ranked as usual, the
    survivors not simulated as ``unfinished`` (``UNFINISHED``); with ``out_dir`` it is also in ``search.csv``
    beside the sweep's ``index.jsonl`` and ``results.csv``, from which the same search resumes. The message is one
    line: what failed, how many of the simulations finished, the best finished layout, where they are kept."""

    def __init__(self, message: str, result: SearchResult):
        super().__init__(message)
        self.result = result


#: status of a point that was to be simulated when the cluster or pool failed (``SearchFailed``'s table only)
UNFINISHED = "unfinished"


class NothingFits(ScenarioError):
    """No point of the space fits in GPU memory (or none is accepted by the schema); ``result`` holds them all."""

    def __init__(self, message: str, result: SearchResult):
        super().__init__(message)
        self.result = result


@dataclass
class SearchResult:
    """Every point of a layout search.

    Attributes:
        table: One row per point in product order: the space's keys, ``data_parallel_size``,
            ``micro_batches`` (per step), ``status`` (one of ``STATUSES``; ``UNFINISHED`` too in a
            ``SearchFailed``'s), ``reason`` (refused: the schema's
            message; pruned: the estimate against the capacity; oom: the simulator's message),
            ``est_peak_device_bytes``, ``gpu_memory_capacity_bytes``, and for simulated points the sweep's
            columns (``tokens_per_s``, ``step_time_s``, ``mfu``, ``peak_device_memory_bytes``,
            ``breakdown_s.*``...) plus ``bounds``' columns and ``rank`` (1 = best; fitting points only).
        objective: The ranking metric.
        keys: The space's keys, in order.
        global_batch_size: Samples per step of every point.
        notes: One line each: what was assumed (the global batch), what could not be estimated.
        warnings: Each distinct warning of the simulated points (what their runs assumed or did not model, as
            ``simulate run`` prints them) -> the ``table`` positions of the points that gave it
            (``sweep.point_warnings``), in order of first appearance.
    """

    table: pd.DataFrame
    objective: str
    keys: list[str]
    global_batch_size: int
    notes: list[str] = field(default_factory=list)
    warnings: dict[str, list[int]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        """Points per status (every status present, zeros included)."""
        vc = self.table["status"].value_counts()
        return {s: int(vc.get(s, 0)) for s in STATUSES}

    def best(self, n: int = 10) -> pd.DataFrame:
        """The ``n`` best fitting layouts, best first."""
        ok = self.table[self.table["status"] == "ok"]
        return ok.sort_values("rank").head(n)


def parse_space(texts: list[str]) -> dict[str, list]:
    """``["parallelism.tensor_model_parallel_size=1,2,4"]`` -> ``{key: [1, 2, 4]}`` (values read as ``--set`` reads them).

    Raises:
        ScenarioError: no ``--space``, a text without ``=`` or without values, a key given twice, a value
            repeated.
    """
    from simulator.studies.sweep import parse_factor

    if not texts:
        raise ScenarioError("search: empty space (give at least one --space dotted.key=v1,v2,...)")
    space: dict[str, list] = {}
    for text in texts:
        try:
            key, values = parse_factor(text)
        except ScenarioError as exc:
            raise ScenarioError(str(exc).replace("--factor", "--space", 1)) from None
        if key in space:
            raise ScenarioError(f"--space {key}: given more than once; list all its values in one --space ({key}=v1,v2,...)")
        dup = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if dup is not None:
            raise ScenarioError(f"--space {key}: value {dup!r} given more than once")
        space[key] = values
    return space


def _models_of(annotation) -> list[type[BaseModel]]:
    args = typing.get_args(annotation) or (annotation,)
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]


def check_key(key: str) -> None:
    """Raise unless ``key`` names a field of the scenario schema (a free-form mapping such as
    ``hardware.gpu.overrides`` takes any key below it).

    Raises:
        ScenarioError: an unknown key (with the keys allowed there and the closest one), a key below a plain
            value, or a derived key (``DERIVED_KEYS``).
    """
    from simulator.config.schema import ScenarioConfig

    if key in DERIVED_KEYS:
        raise ScenarioError(f"--space {key}: not a search key: {DERIVED_KEYS[key]}")
    parts = key.split(".")
    model: type[BaseModel] = ScenarioConfig
    for i, part in enumerate(parts):
        fields = model.model_fields
        where = ".".join(parts[:i]) or "the top level"
        if part not in fields:
            close = difflib.get_close_matches(part, list(fields), n=1)
            raise ScenarioError(f"--space {key}: unknown key {part!r} under {where} (allowed: {', '.join(sorted(fields))})"
                                + (f"; did you mean {close[0]!r}?" if close else ""))
        if i == len(parts) - 1:
            return
        ann = fields[part].annotation
        subs = _models_of(ann)
        if subs:
            model = subs[0]
            continue
        if any(typing.get_origin(a) is dict or a is dict for a in (typing.get_args(ann) or (ann,))):
            return
        raise ScenarioError(f"--space {key}: {'.'.join(parts[:i + 1])} is a value, not a section")


def check_values(scenario: str | Path, space: dict[str, list], base_overrides: list[str],
                 flag: str = "--space") -> None:
    """Raise if a value is one its field refuses by itself (wrong type, out of range, a preset name not in the
    catalogue: ``preset_names.preset_name_problems``), whatever the other keys: each value is validated on the base
    scenario with only that key changed. ``flag``: the option
    that gave the values (``--space``; ``simulate fit``'s ``--largest`` / ``--smallest``).

    Raises:
        ScenarioError: one line per refused value of every key, in the order given:
            ``FILE: FLAG KEY=VALUE: key.path: problem (got VALUE)`` (``loader.problem_line``).
    """
    from simulator.config.loader import errors_by_key, problem_line, read_yaml, with_hf_path
    from simulator.config.overrides import apply_overrides
    from simulator.config.preset_names import preset_name_problems
    from simulator.config.schema import ScenarioConfig

    base = read_yaml(scenario)
    problems: list[str] = []
    for key, values in space.items():
        want = tuple(key.split("."))
        for v in values:
            data = with_hf_path(apply_overrides(base, [*base_overrides, f"{key}={v}"]), str(scenario))
            try:
                ScenarioConfig.model_validate(data)
            except ValidationError as exc:
                # the value's own first problem (an unknown key is the loader's line)
                problems.extend(next(([problem_line(errs, loc, f"{scenario}: {flag} {key}={v}", ScenarioConfig)]
                                      for loc, errs in errors_by_key(exc, ScenarioConfig).items()
                                      if loc[:len(want)] == want and all(e["type"] != "extra_forbidden" for e in errs)),
                                     []))
                continue
            # a preset name the catalogue does not hold (a typo, not a layout the schema refuses): bad input too
            problems.extend(f"{scenario}: {flag} {key}={v}: {'.'.join(loc)}: {why}"
                            for loc, why in preset_name_problems(data) if loc[:len(want)] == want)
    if problems:
        raise ScenarioError("\n".join(problems))


def bounds(row: dict | pd.Series) -> dict:
    """What bounds a simulated layout, from its sweep row (``breakdown_s.*`` columns, s per step).

    Returns:
        ``compute_share`` (compute kernels / step), ``exposed_<group>_share`` per process group,
        ``idle_share`` (the compute stream idle with nothing in flight and nothing launched: host-bound gaps;
        with rank classes the straggler is named beside it), with pp > 1 ``pipeline_wait_share`` (the stages'
        waits for each other, bubble and imbalance: ``pipeline bubble``), ``optimizer_share`` (the optimizer's
        kernels; its exposed collectives, e.g. the ZeRO parameter all-gather, count in their group's
        ``exposed_<group>_share``), ``headroom_bytes`` (GPU memory minus the simulated
        peak) and ``bound``: the largest share that is not compute, as ``"tp comm 18%"`` /
        ``"pipeline bubble 12%"``, with ``"; memory (x GB free)"`` when the headroom is under
        ``MEMORY_BOUND_SHARE`` of the GPU.
    """
    step = float(row.get("step_time_s") or 0.0)
    parts = {k.split(".", 1)[1]: float(v) for k, v in dict(row).items()
             if isinstance(k, str) and k.startswith("breakdown_s.") and v is not None and not _isnan(v)}
    window = sum(parts.values()) or step or 1.0
    out: dict = {"compute_share": parts.get("compute", 0.0) / window}
    pp = int(row.get("pipeline_parallel_size") or 1) if not _isnan(row.get("pipeline_parallel_size")) else 1
    labels = {}
    for k, v in parts.items():
        if k.startswith("exposed_comm_"):
            g = k[len("exposed_comm_"):]
            out[f"exposed_{g}_share"] = v / window
            labels[f"exposed_{g}_share"] = f"{g} comm"
    out["idle_share"] = parts.get("idle", 0.0) / window
    labels["idle_share"] = "host-bound / idle"
    if pp > 1 or "pipeline_wait" in parts:
        out["pipeline_wait_share"] = parts.get("pipeline_wait", 0.0) / window
        labels["pipeline_wait_share"] = "pipeline bubble"
    straggler = row.get("straggler")
    if isinstance(straggler, str) and straggler:  # rank classes differ: the others' idle time waits for it
        for k in ("idle_share", "pipeline_wait_share"):
            if k in labels:
                labels[k] += f" (straggler {straggler})"
    out["optimizer_share"] = parts.get("optimizer", 0.0) / window
    labels["optimizer_share"] = "optimizer"
    for k, name, label in (("data_wait", "data_wait_share", "data wait"), ("exposed_copies", "copies_share", "copies")):
        if k in parts:
            out[name] = parts[k] / window
            labels[name] = label
    cap, peak = row.get("gpu_memory_capacity_bytes"), row.get("peak_device_memory_bytes")
    out["headroom_bytes"] = float(cap) - float(peak) if cap is not None and peak is not None else math.nan
    worst = max(labels, key=lambda k: out[k]) if labels else None
    bound = f"{labels[worst]} {out[worst] * 100:.0f}%" if worst and out[worst] > 0.005 else "compute"
    if cap and not _isnan(out["headroom_bytes"]) and out["headroom_bytes"] < MEMORY_BOUND_SHARE * float(cap):
        bound += f"; memory ({out['headroom_bytes'] / 1e9:.1f} GB free)"
    out["bound"] = bound
    return out


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _reason(exc: Exception, scenario: str | Path) -> str:
    """The refusal ``exc`` for a table cell: its problems (one a line) joined by ``; ``, without the file name."""
    prefix = f"{scenario}: "
    return "; ".join(line[len(prefix):] if line.startswith(prefix) else line for line in str(exc).split("\n"))


def run_search(scenario: str | Path, space: dict[str, list], base_overrides: list[str] | None = None,
               objective: str = "tokens_per_s", workers: int = 1, out_dir: str | Path | None = None,
               client=None, progress: bool = True, log=None, tolerance: float | None = None) -> SearchResult:
    """Search the product of ``space`` over ``scenario`` (module docstring).

    Args:
        scenario: Scenario YAML path (its ``hardware.cluster`` gives the world size).
        space: Dotted key -> values (``parse_space``).
        base_overrides: ``--set`` strings applied to every point.
        objective: One of ``OBJECTIVES``.
        workers, out_dir, client, progress, log: As ``sweep.run_sweep`` (``out_dir`` also gets ``search.csv``,
            every point with its status).
        tolerance: Relative error allowed to the memory estimate before a point is pruned (default
            ``memory_estimate.TOLERANCE``).

    Returns:
        The ``SearchResult``.

    Raises:
        ScenarioError: an empty space, an unknown or derived key, a value its field refuses, an unknown
            objective, a base scenario that does not load.
        NothingFits: no point is accepted by the schema, or none fits in GPU memory (the message names the
            smallest shortfall).
        SweepInterrupted: Ctrl-C during the simulations.
        SearchFailed: the cluster or process pool failed during the simulations; it carries every point (the
            finished ones ranked), also written to ``out_dir/search.csv``.
    """
    from simulator.config.loader import load_scenario
    from simulator.studies.memory_estimate import TOLERANCE, NotEstimated, estimate_memory, stage_capacities
    from simulator.studies.sweep import SEARCH_FILE, SweepFailed, grid, run_sweep

    if objective not in OBJECTIVES:
        raise ScenarioError(f"--objective {objective}: unknown (allowed: {', '.join(OBJECTIVES)})")
    if not space or any(not v for v in space.values()):
        raise ScenarioError("search: empty space (every --space needs a key and at least one value)")
    tol = TOLERANCE if tolerance is None else tolerance
    keys = list(space)
    for k in keys:
        check_key(k)
    base_ov = [*(base_overrides or []), _DP_DERIVED]
    set_by = {_DP_DERIVED.split("=")[0]: "derived by the search: world size / (tp x pp x cp)"}
    base = load_scenario(scenario, base_ov, set_by=set_by)
    check_values(scenario, space, base_ov)
    notes = []
    gbs = base.training.global_batch_size
    if "training.global_batch_size" not in space and gbs is None:
        gbs = base.training.micro_batch_size * (base.parallelism.data_parallel_size or 1)
        notes.append(f"global batch fixed at {gbs} samples (the scenario's micro_batch_size x data_parallel_size; "
                     "set training.global_batch_size to choose another)")
        base_ov.append(f"training.global_batch_size={gbs}")  # else the scenario's (or --set's) stays on every point
        set_by["training.global_batch_size"] = (f"set by the search to the scenario's micro_batch_size x "
                                                f"data_parallel_size, {gbs}, for every point; --set "
                                                "training.global_batch_size=N to choose another")
    points = grid({k: space[k] for k in keys})
    rows, survivors, not_estimated, found = [], [], set(), {}
    for pt in points:
        row: dict = {**pt, "status": None, "reason": None}
        try:
            cfg = load_scenario(scenario, base_ov + [f"{k}={v}" for k, v in pt.items()],
                                set_by={**set_by, **{k: f"from --space: {k}={v}" for k, v in pt.items()}})
        except ScenarioError as exc:
            row.update(status="refused", reason=_reason(exc, scenario))
            rows.append(row)
            continue
        dp = cfg.parallelism.data_parallel_size or 1
        row["data_parallel_size"] = dp
        row["micro_batches"] = (cfg.training.global_batch_size or cfg.training.micro_batch_size * dp) // (
            cfg.training.micro_batch_size * dp)
        caps = stage_capacities(cfg)  # per stage, its smallest GPU (rank_overrides gpu)
        row["gpu_memory_capacity_bytes"] = cap = min(caps)
        try:
            est = estimate_memory(cfg)
        except NotEstimated as exc:
            not_estimated.add(str(exc))
            est = None
        if est is not None:
            row["est_peak_device_bytes"] = est.peak_device_bytes
            if est.surely_over(tol):
                b = est.binding_pp_rank
                row.update(status="pruned", reason=f"estimated {est.stages[b].total_bytes / 1e9:.2f} GB on pipeline "
                           f"stage {b} > {caps[b] / 1e9:.2f} GB (+{tol * 100:.0f}% margin)")
        if row["status"] is None:
            survivors.append(len(rows))
        rows.append(row)
    notes += [f"{m}: those points were simulated without pruning" for m in sorted(not_estimated)]
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    failed = None
    if survivors:
        try:
            df = run_sweep(scenario, space, base_overrides=base_ov, workers=workers, out_dir=out_dir,
                           progress=progress, client=client, log=log, points=[points[i] for i in survivors],
                           breakdown=True, set_by=set_by)
            ran = survivors  # sweep row j is the point ran[j]
        except SweepFailed as exc:  # the finished simulations are ranked and written as usual, the others unfinished
            failed, df = exc, exc.table
            ran = [survivors[j] for j in exc.positions]
            for i in sorted(set(survivors) - set(ran)):
                rows[i].update(status=UNFINISHED, reason=f"not simulated: {exc.cause}")
        for text, where in (df.attrs.get("warnings") or {}).items():
            found[text] = [ran[j] for j in where]
        for i, sim in zip(ran, df.to_dict("records")):
            row = rows[i]
            row.update({k: v for k, v in sim.items() if k not in space})
            if sim.get("error") is not None:
                row.update(status="error", reason=sim["error"])
            elif isinstance(sim.get("oom"), str) and sim["oom"]:
                row.update(status="oom", reason=sim["oom"])
            else:
                row["status"] = "ok"
                row.update(bounds(row))
    table = pd.DataFrame(rows)
    for c in ("data_parallel_size", "micro_batches"):  # integers, missing on refused points
        if c in table:
            table[c] = table[c].astype("Int64")
    ok = table["status"] == "ok"
    table["rank"] = pd.NA
    if ok.any():
        order = table.loc[ok, objective].rank(method="first", ascending=OBJECTIVES[objective] == "min")
        table.loc[ok, "rank"] = order.astype(int)
    result = SearchResult(table, objective, keys, int(gbs) if gbs else 0, notes, found)
    if out_dir is not None:
        from simulator.recording.writers import atomic_write_text

        atomic_write_text(Path(out_dir) / SEARCH_FILE, table.to_csv(index=False))
    if failed is not None:
        raise SearchFailed(_failed_line(result, failed, len(survivors), out_dir), result)
    if not ok.any():
        _raise_nothing_fits(result)
    return result


def _failed_line(result: SearchResult, failed, simulations: int, out_dir: str | Path | None) -> str:
    """``SearchFailed``'s message: ``failed.cause`` (``sweep.SweepFailed``), the finished simulations of the
    ``simulations`` to run, the best finished layout by the objective, where the finished ones are kept."""
    from simulator.studies.sweep import INDEX_FILE, RESULTS_FILE, SEARCH_FILE

    best = result.best(1)
    top = ""
    if len(best):
        names, r = short_names(result.keys), best.iloc[0]
        top = (f" (best finished: {' '.join(f'{names[k]}={r[k]}' for k in result.keys)}, "
               f"{result.objective} {r[result.objective]:.4g})")
    kept = (f"kept in {out_dir} ({INDEX_FILE}, {RESULTS_FILE}, {SEARCH_FILE}); the same command resumes from them"
            if out_dir is not None else "not kept (give --out DIR to keep finished simulations)")
    return f"{failed.cause}; {len(failed.table)} of {simulations} simulations finished{top}, {kept}"


#: distinct refusals named when the schema accepts no point of the space (the rest are counted)
REFUSED_SHOWN = 5


def _raise_nothing_fits(result: SearchResult) -> None:
    """Raise ``NothingFits`` when no point was accepted or none fits (not when the simulations only failed)."""
    t, c = result.table, result.counts
    n = len(t)
    if c["refused"] == n:
        reasons = list(dict.fromkeys(t["reason"]))  # distinct, in the space's order
        more = f"; and {len(reasons) - REFUSED_SHOWN} more" if len(reasons) > REFUSED_SHOWN else ""
        raise NothingFits(f"search: none of the {n} points is accepted by the schema: "
                          f"{'; '.join(reasons[:REFUSED_SHOWN])}{more}", result)
    if c["error"]:
        return
    over = []
    for _, r in t.iterrows():
        cap = r.get("gpu_memory_capacity_bytes")
        if r["status"] == "pruned":
            over.append((r["est_peak_device_bytes"] - cap, "estimated", r))
        elif r["status"] == "oom":
            over.append((r["peak_device_memory_bytes"] - cap, "simulated", r))
    short, how, r = min(over, key=lambda o: o[0])
    names = short_names(result.keys)
    where = ", ".join(f"{names[k]}={r[k]}" for k in result.keys)
    raise NothingFits(f"search: no point of the space fits in GPU memory ({c['pruned']} pruned by the memory estimate, "
                      f"{c['oom']} out of memory when simulated, {c['refused']} refused by the schema); the smallest "
                      f"shortfall is {short / 1e9:.2f} GB ({how}, {where})", result)


#: column labels of the usual layout keys
SHORT_NAMES = {"parallelism.tensor_model_parallel_size": "tp", "parallelism.pipeline_model_parallel_size": "pp",
               "parallelism.virtual_pipeline_model_parallel_size": "vpp", "parallelism.sequence_parallel": "sp",
               "parallelism.pipeline_schedule": "schedule", "training.micro_batch_size": "mbs",
               "training.global_batch_size": "gbs", "training.recompute_granularity": "recompute",
               "zero_optimization.stage": "zero", "hardware.cluster.nodes": "nodes"}


def short_names(keys: list[str]) -> dict[str, str]:
    """Column labels for the keys: ``SHORT_NAMES``, else their last component unless two keys share it."""
    last = [SHORT_NAMES.get(k, k.split(".")[-1]) for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


#: the text report's line above its table: what its short columns are, with their units
SEARCH_LEGEND = ("columns: dp = data-parallel size (ranks); m = micro-batches per step (global batch / (micro-batch "
                 "size x dp), the gradient-accumulation count, not memory); peak GB / free GB = device memory per GPU "
                 "at its peak / left of its capacity (1 GB = 1e9 bytes); ms = milliseconds; each % a share of the "
                 "step time (MFU: of the GPUs' peak FLOP/s); limited by = the largest share of the step that is not "
                 "compute kernels (exposed communication by group, pipeline bubble, host-bound idle, optimizer, ...; "
                 f"'compute' when each is under 0.5%), plus memory when under {MEMORY_BOUND_SHARE:.0%} of the GPU is "
                 "free")


def format_search(result: SearchResult, top: int = 10) -> str:
    """The text report: the counts, the refusals by reason, the best ``top`` layouts with what bounds them."""
    t, c = result.table, result.counts
    lines = [f"search: {len(t)} points: {c['refused']} refused by the schema, {c['pruned']} pruned by the memory "
             f"estimate, {c['ok'] + c['oom'] + c['error']} simulated ({c['oom']} out of memory, {c['error']} failed); "
             f"global batch {result.global_batch_size} samples on every point"]
    lines += [f"note: {n}" for n in result.notes]
    names = short_names(result.keys)
    for status in ("refused", "pruned", "oom", "error"):
        sub = t[t["status"] == status]
        for reason, n in sub["reason"].value_counts().head(5).items():
            which = sub[sub["reason"] == reason].head(3)  # the layouts it names (the first three)
            points = "; ".join(" ".join(f"{names[k]}={r[k]}" for k in result.keys) for _, r in which.iterrows())
            lines.append(f"{status} ({n}: {points}{'; ...' if n > 3 else ''}): {reason}")
    best = result.best(top)
    if best.empty:
        return "\n".join(lines)
    groups = sorted(c[len("exposed_"):-len("_share")] for c in t.columns
                    if c.startswith("exposed_") and c.endswith("_share") and t.loc[best.index, c].notna().any())
    shown = pd.DataFrame({"rank": best["rank"].astype(int)})
    for k in result.keys:
        shown[names[k]] = best[k]
    shown["dp"] = best["data_parallel_size"].astype(int)
    shown["m"] = best["micro_batches"].astype(int)
    shown["tokens/s"] = best["tokens_per_s"].map(lambda v: f"{v:,.0f}")
    shown["step ms"] = (best["step_time_s"] * 1e3).map(lambda v: f"{v:.1f}")
    shown["MFU %"] = (best["mfu"] * 100).map(lambda v: f"{v:.1f}")
    shown["peak GB"] = (best["peak_device_memory_bytes"] / 1e9).map(lambda v: f"{v:.1f}")
    shown["free GB"] = (best["headroom_bytes"] / 1e9).map(lambda v: f"{v:.1f}")
    shown["compute %"] = (best["compute_share"] * 100).map(lambda v: f"{v:.0f}")
    for g in groups:
        shown[f"{g} %"] = (best[f"exposed_{g}_share"].fillna(0.0) * 100).map(lambda v: f"{v:.0f}")
    if "pipeline_wait_share" in best and best["pipeline_wait_share"].notna().any():
        shown["bubble %"] = (best["pipeline_wait_share"].fillna(0.0) * 100).map(lambda v: f"{v:.0f}")
    shown["host/idle %"] = (best["idle_share"] * 100).map(lambda v: f"{v:.0f}")
    shown["opt %"] = (best["optimizer_share"] * 100).map(lambda v: f"{v:.0f}")
    shown["limited by"] = best["bound"]
    lines.append(f"best {len(best)} by {result.objective} ({'higher' if OBJECTIVES[result.objective] == 'max' else 'lower'}"
                 " is better; shares of the step: compute, exposed communication per group, pipeline bubble (the stages' "
                 "waits for each other), host-bound gaps / idle, optimizer kernels):")
    lines.append(SEARCH_LEGEND)
    lines.append(shown.to_string(index=False))
    lines += _shown_warnings(result, best)
    return "\n".join(lines)


def _shown_warnings(result: SearchResult, best: pd.DataFrame) -> list[str]:
    """One line per distinct warning of the layouts shown (``best``), each once, with the ranks that gave it."""
    rank = {i: int(r) for i, r in best["rank"].items()}
    out = []
    for text, where in result.warnings.items():
        ranks = sorted(rank[i] for i in where if i in rank)
        if ranks:
            who = "every layout shown" if len(ranks) == len(best) else "rank " + ", ".join(map(str, ranks))
            out.append(f"warning ({who}): {text}")
    return out


def search_json(result: SearchResult, top: int = 10) -> dict:
    """The result as one JSON-ready object: ``objective``, ``global_batch_size``, ``counts``, ``notes``,
    ``best`` (the ``top`` best rows) and ``points`` (every row); each row's ``warnings`` a list (``[]``: none), as
    ``run --json``'s (``sweep.row_warnings``; the table and results.csv keep the ``"; "``-joined string)."""
    from simulator.studies.sweep import _json_safe, row_warnings

    lists = row_warnings(result.warnings, len(result.table))  # by table position (= its index label)

    def rows(df: pd.DataFrame) -> list[dict]:
        out = [_json_safe({k: (None if v is pd.NA else v) for k, v in r.items()}) for r in df.to_dict("records")]
        if "warnings" in df:
            for r, i in zip(out, df.index):
                r["warnings"] = lists[i]
        return out

    return {"objective": result.objective, "global_batch_size": result.global_batch_size, "counts": result.counts,
            "notes": result.notes, "best": rows(result.best(top)), "points": rows(result.table)}
