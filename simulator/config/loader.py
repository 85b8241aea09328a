"""YAML -> dict -> ``--set`` overrides -> validated ``ScenarioConfig`` -> resolved hardware.

Every failure becomes one ``ScenarioError`` line: ``FILE: key.path: problem (allowed: ...)``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from hardware_models import presets, safe_yaml
from hardware_models.fabrics import LinkSpec
from hardware_models.gpu import GpuSpec
from hardware_models.machine import Hardware
from hardware_models.presets import PresetError
from hardware_models.profile import EfficiencyProfile, GemmEfficiency
from hardware_models.units import short_repr
from simulator.config.errors import ScenarioError, ScenarioWarning
from simulator.config.foreign_keys import deepspeed_key_problems, foreign_key_hint, hf_auto_note
from simulator.config.hf_config import hf_origin
from simulator.config.overrides import apply_overrides, null_override_notes
from simulator.config.preset_names import READ_BY_CHECKS, pcie_link_problem, preset_name_problems
from simulator.config.schema import PresetRef, ScenarioConfig


def read_yaml(path: str | Path) -> dict:
    """Read a scenario YAML mapping with ``hardware_models.safe_yaml`` (bounded, strict YAML 1.2).

    Raises:
        ScenarioError: missing file, not a regular file, over ``MAX_FILE_BYTES``, not UTF-8, a
            syntax error (with line), a duplicate key, an unsupported tag, too deep or too many
            values, or not a mapping.
    """
    p = Path(path)
    try:
        return safe_yaml.load_mapping(p, "a mapping of scenario keys (see scenarios/README.md)")
    except safe_yaml.YamlInputError as exc:
        raise ScenarioError(f"{p}: {exc}") from None


def _model_at(model: type[BaseModel], loc: tuple) -> Any:
    """The model holding the field at ``loc`` (walking nested models; None if ``loc`` leaves them)."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        fields = getattr(cur, "model_fields", {})
        if part not in fields:
            return None
        ann = fields[part].annotation
        cur = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)),
                   ann)
    return cur


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names allowed at ``loc`` (walking nested models)."""
    return sorted(getattr(_model_at(model, loc), "model_fields", {}))


def _choices(model: type[BaseModel], loc: tuple) -> list[str]:
    """The values a ``Literal`` field at ``loc`` allows (empty for other fields)."""
    import typing

    field = getattr(_model_at(model, loc), "model_fields", {}).get(loc[-1]) if loc else None
    ann = getattr(field, "annotation", None)
    return [repr(v) for v in typing.get_args(ann)] if typing.get_origin(ann) is typing.Literal else []


#: pydantic error types of a union's scalar branch refusing a value of another type
_SCALAR_BRANCH = frozenset({"bool_type", "bool_parsing", "string_type", "int_type", "int_parsing", "float_type",
                            "float_parsing", "literal_error"})
#: location tags pydantic gives a union's scalar branches (``hardware.host.str``)
_UNION_TAGS = frozenset({"bool", "str", "int", "float", "none"})
_KEYED = re.compile(r"^([a-z_]+)(\.[a-z0-9_]+|\[\d+\])*:? ")


def _model_names(model: type[BaseModel], seen: set[str] | None = None) -> set[str]:
    """Class names of every pydantic model reachable from ``model`` (pydantic puts a union member's
    class name in an error's location: ``hardware.gpu.PresetRef.preset``)."""
    seen = set() if seen is None else seen
    if model.__name__ in seen:
        return seen
    seen.add(model.__name__)
    for f in model.model_fields.values():
        for a in getattr(f.annotation, "__args__", (f.annotation,)):
            if isinstance(a, type) and issubclass(a, BaseModel):
                _model_names(a, seen)
    return seen


@functools.lru_cache(maxsize=None)
def _names_of(model: type[BaseModel]) -> frozenset[str]:
    """``_model_names`` of ``model``, computed once."""
    return frozenset(_model_names(model))


#: problems of one file shown (one line each) before ``... and N more``
MAX_PROBLEMS_SHOWN = 20
#: sections named by an unknown key's "did you mean" when its name is a key there (more: too vague to help,
#: ``preset`` is in four)
MAX_ELSEWHERE = 3
#: what a value of a union's branch must be, by the pydantic error type refusing it
_EXPECTED = {"model_type": None, "dataclass_type": None, "model_attributes_type": None, "string_type": "a string",
             "bool_type": "true or false", "bool_parsing": "true or false", "int_type": "an integer",
             "int_parsing": "an integer", "float_type": "a number", "float_parsing": "a number",
             "dict_type": "a mapping", "list_type": "a list"}


def format_validation_error(exc: ValidationError | list[dict], source: str, model: type[BaseModel],
                            cap: int = MAX_PROBLEMS_SHOWN) -> str:
    """Every problem of a pydantic ``ValidationError`` (or of its ``errors()``), one line each
    (``FILE: key.path: problem``), joined by newlines: unknown keys first, then bad values (and the checks
    between settings, ``scenario_errors``), then missing keys; at most ``cap`` lines, then one
    ``FILE: ... and N more``. The errors pydantic gives for one value (a union's branches: ``hardware.gpu``
    refused as a preset name and as ``{preset, overrides}``) make one line, naming the user's key path and what
    it allows, never the schema's class names.

    An unknown key is reported before anything else: a misspelt required key also makes that key
    "missing", and the typo is what the user must fix; a bad value is reported before a missing key.
    """
    if not isinstance(model, type):  # a model's title only (``ValidationError.title``): no keys to list
        model = BaseModel
    groups = errors_by_key(exc, model)
    # a misspelt required key is also "missing": its unknown-key line already names it ("did you mean ...")
    suggested = {(*loc[:-1], close) for loc, errs in groups.items()
                 if loc and any(e["type"] == "extra_forbidden" for e in errs) and (close := _close_key(model, loc))}
    groups = {loc: errs for loc, errs in groups.items()
              if not (loc in suggested and all(e["type"] == "missing" for e in errs))}
    # the checks between settings refuse with their own words, several at one key path (the scenario's): one line each
    lines = sorted((_problem(one, loc, source, model) for loc, errs in groups.items()
                    for one in (_own_words(errs) or [errs])), key=lambda r: r[0])
    out = [line for _, line in dict.fromkeys(lines)]
    if len(out) > cap:
        out = [*out[:cap], f"{source}: ... and {len(out) - cap} more"]
    return "\n".join(out)


def _own_words(errs: list[dict]) -> list[list[dict]]:
    """Each validator refusal (``value_error``) among ``errs`` alone, when there is more than one."""
    own = [[e] for e in errs if e["type"] == "value_error"]
    return own if len(own) > 1 else []


def errors_by_key(exc: ValidationError | list[dict], model: type[BaseModel]) -> dict[tuple, list[dict]]:
    """The errors of ``exc`` (a ``ValidationError`` or its ``errors()``) grouped by the user's key path (a tuple of
    keys and list indices, without the schema's class names, union tags and validator names), in order;
    ``problem_line`` words each group."""
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    # a mapping given for a union of a scalar and a model (``fsdp.cpu_offload: bool | {...}``): the scalar branch's
    # complaint that a mapping is not a bool / string / literal says nothing; the model branch's errors do
    errors = [e for e in errors if not (isinstance(e.get("input"), dict) and e["type"] in _SCALAR_BRANCH)] or errors
    names = _names_of(model)
    groups: dict[tuple, list[dict]] = {}
    for e in errors:
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and (
            p[:1].isupper() and "[" in p or p in names or p in _UNION_TAGS or p.startswith(("literal[", "function-")))))
        groups.setdefault(loc, []).append(e)
    return groups


def problem_line(errs: list[dict], loc: tuple, source: str, model: type[BaseModel]) -> str:
    """One group of ``errors_by_key``: ``SOURCE: key.path: problem (got VALUE)``."""
    return _problem(errs, loc, source, model)[1]


def _close_key(model: type[BaseModel], loc: tuple) -> str | None:
    """The allowed key nearest the unknown key at ``loc`` (difflib's closest match), or None."""
    import difflib

    close = difflib.get_close_matches(str(loc[-1]), _allowed_keys(model, loc), n=1) if loc else []
    return close[0] if close else None


def _problem(errs: list[dict], loc: tuple, source: str, model: type[BaseModel]) -> tuple[int, str]:
    """``(rank, line)`` for the errors pydantic gives at one key path ``loc`` (rank 0: an unknown key, 1: a bad
    value, 2: a missing key; the order ``format_validation_error`` shows them in). A refused value ``"auto"`` (a
    Hugging Face Trainer ds_config's placeholder) ends with ``foreign_keys.HF_AUTO_NOTE``."""
    rank, line = _problem_words(errs, loc, source, model)
    auto = next((note for e in errs if e["type"] != "missing" and (note := hf_auto_note(e.get("input")))), None)
    return rank, line + (f"; {auto}" if auto else "")


def _problem_words(errs: list[dict], loc: tuple, source: str, model: type[BaseModel]) -> tuple[int, str]:
    """``_problem`` without the note on ``"auto"``."""
    err = next((e for e in errs if e["type"] == "extra_forbidden"),
               next((e for e in errs if e["type"] != "missing"), errs[0]))  # a bad value before a missing key
    path = key_path(loc)
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(model, loc)
        close = _close_key(model, loc)
        hint = f"; did you mean {close!r}?" if close else ""
        elsewhere = _keys_named(ScenarioConfig, str(loc[-1])) if loc else []  # a key of another section, as written
        if 0 < len(elsewhere) <= MAX_ELSEWHERE:
            hint = f"; did you mean {' or '.join(elsewhere)}?"
        if (foreign := foreign_key_hint(path)) is not None:  # a framework's key: where it lives here, or why not
            hint = f"; {foreign}"
        return 0, f"{source}: {path}: unknown key (allowed: {', '.join(allowed)}){hint}"
    if kind == "missing":
        choices = _choices(model, loc)
        return 2, f"{source}: {path}: required key is missing" + (f" (allowed: {', '.join(choices)})" if choices
                                                                  else "")
    value = err.get("input")
    shown = str(value).lower() if isinstance(value, bool) else short_repr(value)  # booleans as YAML writes them
    got = f" (got {shown})" if "input" in err and not isinstance(err["input"], (dict, list)) else ""
    own_words = kind in ("value_error", "assertion_error")  # a validator's message, which may name the value
    if kind in _EXPECTED and any(e["type"] in ("model_type", "dataclass_type", "model_attributes_type")
                                 for e in errs):  # "a valid dictionary or instance of TrainingConfig": its keys
        keys = ", ".join(_allowed_keys(model, (*loc, "")))
        ways = sorted((_EXPECTED[e["type"]] or f"a mapping of keys ({keys})" for e in errs if e["type"] in _EXPECTED),
                      key=lambda w: w.startswith("a mapping of keys"))  # the scalar first, then the mapping
        return 1, f"{source}: {path}: expected {' or '.join(dict.fromkeys(ways))}{got}"
    msg = msg.replace("Value error, ", "")
    keyed = _KEYED.match(msg)
    if path == "(top level)" and keyed and keyed.group(1) in model.model_fields:  # a cross-field check naming its key
        return 1, f"{source}: {msg}"
    section = _model_at(model, (*loc, "")) if loc else None
    if keyed and keyed.group(1) in getattr(section, "model_fields", {}) and msg[len(keyed.group(1))] in ":.[":
        return 1, f"{source}: {path}.{msg}"  # a section's check naming its key: model.vocab_size (--set matches it)
    # pydantic's own messages never name the value ("greater than 0": a 0 given must still be shown)
    return 1, f"{source}: {path}: {msg}{got if not own_words or shown not in msg else ''}"


def key_path(loc: tuple) -> str:
    """A pydantic error location as the user writes the key: ``rank_overrides[0].slowdown`` (list indices in
    brackets, as the schema's own messages name them); long or odd parts shortened (``short_repr``)."""
    out = ""
    for p in loc:
        if isinstance(p, int) and not isinstance(p, bool):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + (p if isinstance(p, str) and len(p) <= 60 else short_repr(p))
    return out or "(top level)"


def _keys_named(model: type[BaseModel], name: str, prefix: str = "", depth: int = 0) -> list[str]:
    """Dotted paths of every field called ``name`` in any section of ``model`` (lists of models as ``KEY[i]``):
    where an unknown key exists elsewhere (``model.sequence_parallel`` -> ``parallelism.sequence_parallel``)."""
    import typing

    out: list[str] = []
    if depth > 6:  # the schema is 4 levels deep; a guard against a self-referencing model
        return out
    for fname, field in model.model_fields.items():
        path = f"{prefix}{fname}"
        if fname == name:
            out.append(path)
        stack, subs, is_list = [field.annotation], [], False
        while stack:  # unions, lists and optionals of sections
            a = stack.pop()
            if isinstance(a, type) and issubclass(a, BaseModel):
                subs.append(a)
            else:
                is_list = is_list or typing.get_origin(a) is list
                stack.extend(typing.get_args(a))
        for sub in dict.fromkeys(subs):
            out += _keys_named(sub, name, f"{path}[i]." if is_list else f"{path}.", depth + 1)
    return list(dict.fromkeys(out))


def load_scenario(path: str | Path, overrides: list[str] | None = None,
                  set_by: dict[str, str] | None = None) -> ScenarioConfig:
    """Load, override and validate a scenario, and check its presets resolve.

    The warnings validation gives (``ScenarioWarning``: a setting with no effect, an override far from its
    preset) are printed only once the scenario is valid: an invalid one gets its error alone; then one per
    ``--set KEY=null`` the user gave (not a key of ``set_by``) naming the value the key took
    (``overrides.null_override_notes``).

    Args:
        path: Scenario YAML file.
        overrides: ``dotted.key=value`` strings (``--set``).
        set_by: Key of an override -> who set it when not the user (``"set by the search for
            micro_batch_size=64"``): a problem with that key says so instead of ``from the command line``.

    Raises:
        ScenarioError: anything wrong, one line per problem naming the file and key.
    """
    data = apply_overrides(read_yaml(path), list(overrides or []))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # kept, then shown through the caller's filters if the scenario is valid
        try:
            cfg = scenario_from_dict(data, str(path))
        except ScenarioError as exc:  # a value that came from --set is named as such, not blamed on the file
            keys = [o.split("=", 1)[0].strip() for o in overrides or []]
            lines = [_from_command_line(line, keys, set_by or {}) for line in str(exc).split("\n")]
            if lines == str(exc).split("\n"):
                raise
            raise ScenarioError("\n".join(lines)) from None
        try:
            resolve_hardware(cfg, str(path), warn_every_time=True)  # validate presets now, with the file name in the error
        except ScenarioError:  # every unknown preset name at once (preset_names), not the first one found
            names = preset_name_problems(data)
            if len(names) < 2:
                raise
            raise ScenarioError("\n".join(f"{path}: {key_path(loc)}: {msg}" for loc, msg in names)) from None
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_SHOWN)
    mine = [o for o in overrides or [] if o.split("=", 1)[0].strip() not in (set_by or {})]  # not the program's
    for note in null_override_notes(cfg, mine):  # what a removed key became (the default taken)
        warnings.warn(note, ScenarioWarning, stacklevel=2)
    return cfg


#: ``warnings`` registry of the warnings ``load_scenario`` re-emits (each shown once, as the default filter does)
_SHOWN: dict = {}


def _from_command_line(line: str, keys: list[str], set_by: dict[str, str]) -> str:
    """``line`` (one problem) marked ``(from the command line: KEY=...)`` when it names a ``--set`` key of ``keys``
    (``(SET_BY)`` for a key of ``set_by``: one the program set, not the user)."""
    hit = next((k for k in reversed(keys) if any(f": {k}{c}" in line for c in ": .[")), None)
    if hit is None:
        return line
    return f"{line} ({set_by[hit]})" if hit in set_by else f"{line} (from the command line: {hit}=...)"


def scenario_from_dict(data: dict, source: str = "<scenario>") -> ScenarioConfig:
    """Validate a scenario dict.

    Raises:
        ScenarioError: every validation error, one line each (``format_validation_error``).
    """
    data = with_hf_path(data, source)
    try:
        return ScenarioConfig.model_validate(data)
    except ValidationError as exc:
        errors = scenario_errors(data, exc.errors())
    raise ScenarioError("\n".join(_name_hf_keys(line, data) for line in
                                  format_validation_error(errors, source, ScenarioConfig).split("\n"))) from None


def _dp_inputs_bad(bad: set[tuple]) -> bool:
    """Whether a key path of ``bad`` is one ``ScenarioConfig._resolve_data_parallel`` reads (the cluster, tp, pp,
    cp) or holds one."""
    inputs = [("hardware", "cluster"), *(("parallelism", k) for k in _DP_INPUTS)]
    return bool(bad & {("hardware",), ("parallelism",)}) or any(loc[:len(i)] == i for loc in bad for i in inputs)


def _written(data: Any, path: tuple) -> bool:
    """Whether the mapping ``data`` has a value at key path ``path``."""
    for p in path:
        if not isinstance(data, dict) or p not in data:
            return False
        data = data[p]
    return True


#: parallelism keys ``ScenarioConfig._resolve_data_parallel`` reads besides ``hardware.cluster``
_DP_INPUTS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")


def scenario_errors(data: dict, errors: list[dict] | None = None) -> list[dict]:
    """Every problem of a scenario mapping that fails validation, as pydantic-style error dicts: the bad keys and
    values, and every check between settings whose inputs are valid (``cross_checks.cross_setting_errors``), so
    that one run names them all.

    An unknown preset name of ``hardware`` (``preset_names.preset_name_problems``, the line ``resolve_hardware``
    gives a valid scenario) is one of the problems; with an unknown cluster preset the checks reading the world
    size (or the data-parallel size derived from it) are skipped, as with a bad ``hardware.cluster``.

    ``ScenarioConfig``'s before-validator refusing ``parallelism.data_parallel_size`` (pydantic then reports
    nothing else) is kept, the fields validated without that key and the key taken as unknown by the other checks;
    the refusal is dropped when one of its inputs (the cluster, tp, pp, cp) is itself bad.

    Every problem of the DeepSpeed keys that before-validator reads (``foreign_keys.deepspeed_key_problems``: a
    modelled key at another value, an fp16 loss-scaling value DeepSpeed refuses, ``gradient_clipping`` beside another
    ``training.clip_grad``) is one of them too, the rest validated without those keys; a refusal of the
    ``training.clip_grad`` that ``gradient_clipping`` set names ``gradient_clipping``, the key written.

    Args:
        data: The scenario mapping (after ``with_hf_path``).
        errors: ``ValidationError.errors()`` of validating ``data``, when known (else validated here).
    """
    from simulator.config.cross_checks import cross_setting_errors

    (before,) = [d.func for d in ScenarioConfig.__pydantic_decorators__.model_validators.values()
                 if d.info.mode == "before"]
    first: list[dict] = []
    keyed: list[dict] = []  # the DeepSpeed keys' problems (a key accepted at its default only, at another value, ...)
    clip_moved = False  # DeepSpeed's gradient_clipping is training.clip_grad: that field's refusal names it
    if isinstance(data, dict):
        tr = data.get("training")
        clip_moved = "gradient_clipping" in data and isinstance(tr, dict) and tr.get("clip_grad") is None
        data, problems = deepspeed_key_problems(data)  # every one, each key dropped, the rest validated
        keyed = [{"type": "value_error", "loc": tuple(p.key.split(".")), "msg": f"Value error, {p.detail}"}
                 for p in problems]
        try:
            before(data)
        except ValueError as exc:  # the data-parallel size against the cluster
            first = [{"type": "value_error", "loc": (), "msg": f"Value error, {exc}"}]
            par = data.get("parallelism")
            data = {**data, "parallelism": {k: v for k, v in par.items() if k != "data_parallel_size"}}
    if first or keyed or errors is None:
        try:
            ScenarioConfig.model_validate(data)
            errors = []
        except ValidationError as exc:
            errors = exc.errors()
    if first:  # the scenario's own checks ran with a derived data_parallel_size: cross_setting_errors runs them
        errors = [e for e in errors if e["loc"] != ()]
    bad = set()
    for loc, errs in errors_by_key(errors, ScenarioConfig).items():
        bad.add(loc)
        if all(e["type"] == "extra_forbidden" for e in errs) and loc:  # a misspelt key: the one meant, if not
            meant = [(*loc[:-1], k) for k in [_close_key(ScenarioConfig, loc)] if k]  # written too, is unknown
            meant += [tuple(p.split(".")) for p in _keys_named(ScenarioConfig, str(loc[-1])) if "[" not in p]
            bad.update(m for m in meant if not _written(data, m))
    names = [{"type": "value_error", "loc": loc, "msg": f"Value error, {msg}"}  # resolve_hardware's, in this round
             for loc, msg in preset_name_problems(data, bad)]
    unread = {e["loc"] for e in names} & READ_BY_CHECKS  # an unknown cluster: the world size is unknown
    if unread:  # the scenario's checks ran on a world of 1 GPU: cross_setting_errors runs them again
        bad.update(unread)
        errors = [e for e in errors if e["loc"] != ()]
    if first:
        bad.add(("parallelism", "data_parallel_size"))
        if _dp_inputs_bad(bad):
            first = []
    if not isinstance(data, dict):
        return keyed + errors
    par = data.get("parallelism")
    if not (isinstance(par, dict) and "data_parallel_size" in par) and _dp_inputs_bad(bad):
        bad.add(("parallelism", "data_parallel_size"))  # derived from a cluster or sizes that are bad: unknown
    out = keyed + first + errors + names + cross_setting_errors(ScenarioConfig, before(data), bad)
    if clip_moved:
        out = [{**e, "loc": ("gradient_clipping",)} if tuple(e["loc"]) == ("training", "clip_grad") else e
               for e in out]
    return out


def _name_hf_keys(message: str, data: dict) -> str:
    """``message`` with the config.json name of each model key it mentions that came from ``model.from_hf``
    (``moe_router_topk`` is ``num_experts_per_tok`` there), so the user knows what to edit."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or "from_hf" not in model:
        return message
    notes = [f"{k} is {o}" for k in dict.fromkeys(re.findall(r"[a-z][a-z0-9_]+", message))
             if (o := hf_origin(model, k)) is not None]
    return message + (f" ({'; '.join(notes)})" if notes else "")


def with_hf_path(data: dict, source: str) -> dict:
    """``data`` with a relative ``model.from_hf`` that is not found from the current folder taken from the
    folder of the scenario file ``source``.

    Raises:
        ScenarioError: a relative path found in neither folder (naming both).
    """
    m = data.get("model") if isinstance(data, dict) else None
    hf = m.get("from_hf") if isinstance(m, dict) else None
    if isinstance(hf, str) and hf.startswith(("./", "../")) and not Path(hf).exists() and Path(source).is_file():
        there = Path(source).resolve().parent / hf  # relative: the scenario's folder
        if not there.exists():
            raise ScenarioError(f"{source}: model.from_hf: {hf} not found (looked for {Path(hf).resolve()} from the "
                                f"current folder and {there.resolve()} from the scenario's folder)")
        data = {**data, "model": {**m, "from_hf": str(there)}}
    return data


#: HostRef's what-if keys: scenario key -> the host CPU spec field it sets
_HOST_WHATIFS = {"threads": "threads_used", "numa_node": "numa_node", "bind_cores_to_rank": "bind_cores_to_rank"}
#: spec fields that label a preset (its product name, its citations): not numbers the simulation uses, so an
#: override of them would only relabel the output; refused
NOT_OVERRIDABLE = ("name", "sources")


def _ref(ref: PresetRef | str) -> tuple[str, dict]:
    """``(preset name, overrides)`` of a hardware reference (a name alone: no overrides)."""
    return (ref, {}) if isinstance(ref, str) else (ref.preset, dict(ref.overrides))


def _whatifs(ref: PresetRef | str) -> dict[str, Any]:
    """The host CPU spec fields a ``HostRef`` sets by its own keys (``threads`` -> ``threads_used``)."""
    return {f: getattr(ref, k) for k, f in _HOST_WHATIFS.items() if getattr(ref, k, None) is not None}


def check_override_keys(cls: type, over: dict, where: str, extra: tuple[str, ...] = ()) -> None:
    """Refuse a key of ``over`` that is not a field of the spec dataclass ``cls`` (nor in ``extra``), or that
    only labels the preset (``NOT_OVERRIDABLE``).

    Raises:
        PresetError: ``WHERE: unknown key(s) K (allowed: ...)``, the allowed keys without the labels.
    """
    import dataclasses

    allowed = sorted({f.name for f in dataclasses.fields(cls)} - set(NOT_OVERRIDABLE) | set(extra))
    bad = sorted(k for k in over if k not in allowed)
    if bad:
        why = (f"; {', '.join(NOT_OVERRIDABLE)} label the preset and are not overridable"
               if set(bad) & set(NOT_OVERRIDABLE) else "")
        raise PresetError(f"{where}: unknown key(s) {', '.join(bad)} (allowed: {', '.join(allowed)}){why}")


def _merged(data: dict, over: dict) -> dict:
    """``data`` with ``over`` applied; a mapping-valued field (``peak_flops_per_s``) is merged key by
    key, so overriding one dtype keeps the others."""
    out = dict(data)
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _name_key(ref: PresetRef | str, key: str) -> str:
    """The key path of the preset name of ``ref`` at ``key``: ``key`` for a name, ``KEY.preset`` for a mapping
    (as ``preset_names.preset_name_problems`` names it)."""
    return key if isinstance(ref, str) else f"{key}.preset"


def _with_overrides(family: str, ref, cls, key: str, source: str, warn_every_time: bool = True):
    name, over = _ref(ref)
    try:
        if family == "hosts":
            cpu, mem = presets.get(family, name)
            whatif = _whatifs(ref)
            if over or whatif:
                check_override_keys(type(cpu), over, "overrides", extra=("memory",))
                data = presets.raw(family, name)
                data.pop("nvme", None)  # the host's NVMe drives: resolve_nvme
                mem_over = over.pop("memory", {})
                if not isinstance(mem_over, dict):
                    raise PresetError(f"overrides.memory: expected a mapping of host memory fields "
                                      f"(capacity_bytes, pinned_limit_bytes), got {presets._kind(mem_over)}")
                check_override_keys(type(mem), mem_over, "overrides.memory")
                data_mem = _merged(data.pop("memory", {}), mem_over)
                base_cpu, base_mem = cpu, mem
                cpu = presets.build_spec(type(cpu), _merged(data, over), "overrides")
                mem = presets.build_spec(type(mem), data_mem, "overrides.memory")
                _warn_far_from_preset(base_cpu, cpu, over, f"{key}.overrides", warn_every_time)  # as a GPU's
                scaled = _sustained_follows_peak(base_cpu, cpu, over, f"{key}.overrides", warn_every_time)
                if scaled:  # the explicit peak moves the sustained figure the CPU kernels use
                    over = {**over, "stream_bandwidth_bytes_per_s": scaled}
                    cpu = presets.build_spec(type(cpu), _merged(data, over), "overrides")
                _warn_far_from_preset(base_mem, mem, mem_over, f"{key}.overrides.memory", warn_every_time)
                if whatif:  # the preset with its overrides is valid: an error now is in threads / numa_node
                    cpu = _host_whatif(type(cpu), _merged(data, {**over, **whatif}), ref, key, source)
            return cpu, mem
        spec = presets.get(family, name)
        if over:
            check_override_keys(cls, over, "overrides")
            base, spec = spec, presets.build_spec(cls, _merged(presets.raw(family, name), over), "overrides")
            _warn_far_from_preset(base, spec, over, f"{key}.overrides", warn_every_time)
        return spec
    except PresetError as exc:  # an unknown name is the name's key's (hardware.gpu.preset in a mapping)
        where = key if name in presets.list_presets(family)[family] else _name_key(ref, key)
        raise ScenarioError(f"{source}: {where}: {exc}") from None


#: host CPU fields that set the sustained (STREAM) DRAM bandwidth themselves (``HostCpuSpec
#: .sustained_bandwidth_bytes_per_s``): an override of any of them keeps ``memory_bandwidth_bytes_per_s`` from moving it
_SUSTAINED_FIELDS = ("stream_bandwidth_bytes_per_s", "memory_channels_per_socket", "memory_rate_mt_per_s",
                     "sustained_bandwidth_fraction", "sockets")


def _sustained_follows_peak(base, cpu, over: dict, where: str, every_time: bool = True) -> float:
    """The sustained DRAM bandwidth (bytes/s) an override of ``memory_bandwidth_bytes_per_s`` alone implies, 0: none.

    ``memory_bandwidth_bytes_per_s`` is the host's bandwidth field that ``simulate presets`` shows, but a preset with
    a fitted ``stream_bandwidth_bytes_per_s`` or DRAM channels x MT/s takes its sustained figure (the CPU optimizer
    step, host-side copies: ``hardware_models.host_kernels``) from those, so the override alone would change
    nothing there. Read as a what-if about the host's memory, it scales the preset's sustained figure by the same
    factor (keeping the preset's sustained / ``memory_bandwidth`` ratio), with one warning saying so. Nothing when
    the override also sets a field of ``_SUSTAINED_FIELDS`` (those win) or when the preset's sustained figure is
    ``memory_bandwidth_bytes_per_s`` itself (it follows already). Warned each time, or (``every_time`` false) once
    per process and value, as ``_warn_far_from_preset``."""
    if "memory_bandwidth_bytes_per_s" not in over or any(k in over for k in _SUSTAINED_FIELDS):
        return 0.0
    old_peak, old_sus = base.memory_bandwidth_bytes_per_s, base.sustained_bandwidth_bytes_per_s
    new_peak = cpu.memory_bandwidth_bytes_per_s
    if old_sus == old_peak or new_peak == old_peak:
        return 0.0
    new_sus = old_sus * (new_peak / old_peak)
    name = f"{where}.memory_bandwidth_bytes_per_s"
    if not every_time and (name + " sustained", repr(new_sus)) in _WARNED:
        return new_sus
    _WARNED.add((name + " sustained", repr(new_sus)))
    warnings.warn(f"{name}: the host's sustained streaming bandwidth (CPU optimizer "
                  f"step, host copies) scales with it: {old_sus / 1e9:.4g} GB/s x {new_peak / 1e9:.4g} / "
                  f"{old_peak / 1e9:.4g} = {new_sus / 1e9:.4g} GB/s (the preset's sustained / memory_bandwidth "
                  f"ratio {old_sus / old_peak:.3g}); set {where}.stream_bandwidth_bytes_per_s to set it on its own",
                  ScenarioWarning, stacklevel=4)
    return new_sus


def _host_whatif(cls: type, data: dict, ref, key: str, source: str):
    """The host CPU spec with ``ref``'s ``threads`` / ``numa_node`` applied (``data``: preset, overrides and them).

    Raises:
        ScenarioError: naming ``hardware.host.threads`` (or ``.numa_node`` when only it is given or the
            problem is the NUMA node).
    """
    given = [k for k in _HOST_WHATIFS if getattr(ref, k, None) is not None]
    try:
        return presets.build_spec(cls, data, "")
    except PresetError as exc:
        msg = str(exc).removeprefix(": ")
        bad = given[0] if len(given) == 1 else ("numa_node" if msg.startswith("numa_node") else "threads")
        raise ScenarioError(f"{source}: {key}.{bad}: {msg}") from None


#: An override more than this factor away from the preset's value is printed as a warning: likely a
#: unit slip ("4.8 TB/h" for "4.8 TB/s" is 3,600x), still allowed for deliberate what-ifs.
FAR_FROM_PRESET = 100.0


def _warn_far_from_preset(base, spec, over: dict, where: str, every_time: bool = True) -> None:
    """Warn (``ScenarioWarning``) for each overridden number ``FAR_FROM_PRESET`` x away from the preset's, named
    ``{where}.{field}`` (``where``: ``hardware.gpu.overrides``): each time, or (``every_time`` false:
    ``resolve_hardware``'s) once per process, as the profile warning."""
    for field_name in over:
        a, b = getattr(base, field_name, None), getattr(spec, field_name, None)
        name = f"{where}.{field_name}"
        if (isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
                and a > 0 and b > 0 and max(a / b, b / a) > FAR_FROM_PRESET
                and (every_time or (name, repr(b)) not in _WARNED)):
            _WARNED.add((name, repr(b)))
            warnings.warn(f"{name}: {b:.4g} is {max(a / b, b / a):,.0f}x "
                          f"{'below' if b < a else 'above'} the preset's {a:.4g} (SI units); check the unit",
                          ScenarioWarning, stacklevel=3)


def default_profile_for(gpu: GpuSpec, gpu_name: str, pcie: LinkSpec) -> EfficiencyProfile:
    """The GPU preset ``gpu_name``'s shipped profile (the shortest name starting with it:
    ``h200-sxm-141gb`` before ``h200-sxm-141gb-micro``), else ``generic_profile``."""
    shipped = [p for p in presets.list_presets("profiles")["profiles"] if p.startswith(gpu_name)]
    return presets.get("profiles", min(shipped, key=len)) if shipped else generic_profile(gpu, pcie, gpu_name)


def generic_profile(gpu: GpuSpec, pcie: LinkSpec, name: str) -> EfficiencyProfile:
    """A profile for a GPU with no measurements: documented typical fractions of the peaks.

    GEMM at 70% of peak and memory-bound kernels at 80% of HBM bandwidth are typical of large
    GEMMs and streaming kernels on recent NVIDIA GPUs (NVIDIA *Matrix Multiplication Background
    User's Guide*; the H200 microbenchmarks in tests/data/h200 reach 72-79% and 86%); flash
    attention at 35%/30% as in the H200 micro profile. Calibrate for real predictions.
    """
    bw = 0.8 * gpu.hbm_bandwidth_bytes_per_s
    return EfficiencyProfile(
        name=f"generic:{name}", gpu=name,
        gemm={"bf16": GemmEfficiency(0.7), "fp16": GemmEfficiency(0.7), "fp32": GemmEfficiency(0.7)},
        attention_efficiency={"fwd": 0.35, "bwd": 0.30},
        memory_bandwidth_bytes_per_s={"elementwise": bw},
        kernel_fixed_s=2e-6,  # host dispatch time: the host's (hardware_models.machine.resolve_launch_overhead)
        h2d_bytes_per_s=pcie.bandwidth_bytes_per_s, d2h_bytes_per_s=pcie.bandwidth_bytes_per_s,
        pageable_h2d_bytes_per_s=pcie.pageable_h2d_bytes_per_s, pageable_d2h_bytes_per_s=pcie.pageable_d2h_bytes_per_s,
        duplex_bytes_per_s=pcie.duplex_bandwidth_bytes_per_s, copy_latency_s=pcie.latency_s,
        provenance={"source": "generic defaults (simulator.config.loader.generic_profile)"},
    )


#: the warnings ``resolve_hardware`` gave once per process: (profile, GPU) and (override key, value)
_WARNED: set[tuple[str, str]] = set()


def resolve_hardware(cfg: ScenarioConfig, source: str = "<scenario>", *, warn_every_time: bool = False) -> Hardware:
    """Turn the hardware section into specs.

    A profile fitted for another GPU, and an override far from its preset's value, warn (``ScenarioWarning``) once
    per process, or on every call with ``warn_every_time`` (``load_scenario``: each loaded scenario, so each sweep
    point, records its own warnings; the run's own resolve then says nothing more).

    Raises:
        ScenarioError: unknown presets, bad overrides or a missing profile file.
    """
    hwc = cfg.hardware
    gpu = _with_overrides("gpus", hwc.gpu, GpuSpec, "hardware.gpu", source, warn_every_time)
    pcie_name, pcie_over = _ref(hwc.pcie)
    if (why := pcie_link_problem(pcie_name)) is not None:
        raise ScenarioError(f"{source}: {_name_key(hwc.pcie, 'hardware.pcie')}: {why}")
    pcie = _with_overrides("links", hwc.pcie, LinkSpec, "hardware.pcie", source, warn_every_time)
    cpu, mem = _with_overrides("hosts", hwc.host, None, "hardware.host", source, warn_every_time)
    gpu_name = _ref(hwc.gpu)[0]
    if cfg.training.fp8 is not None and "fp8" not in gpu.peak_flops_per_s:
        raise ScenarioError(f"{source}: training.fp8: {gpu.name} has no fp8 tensor-core rate (Hopper and later have "
                            "one; allowed: null on this GPU)")
    if cfg.training.precision == "tf32" and "tf32" not in gpu.peak_flops_per_s:
        raise ScenarioError(f"{source}: training.precision: tf32 needs TF32 tensor cores, which {gpu.name} has not "
                            "(Ampere and later have them; allowed: fp32, fp16 on this GPU)")
    fsdp_bf16 = cfg.fsdp is not None and "bf16" in cfg.fsdp.dtypes  # FSDP MixedPrecision gathers / reduces in bf16
    if fsdp_bf16 and "bf16" not in gpu.peak_flops_per_s:
        raise ScenarioError(f"{source}: fsdp.mixed_precision: {cfg.fsdp.mixed_precision} computes in bf16, which needs "
                            f"bf16 tensor cores, which {gpu.name} has not (Ampere and later have them; allowed: "
                            "FULL or {param_dtype: fp32, reduce_dtype: fp32} on this GPU)")
    if cfg.training.precision == "bf16" and "bf16" not in gpu.peak_flops_per_s:
        # as tf32 above: no bf16 tensor cores before Ampere (NVIDIA V100 / Turing datasheets list fp16 only);
        # a bf16 job there runs emulated or fails, so pricing it at the fp16 rate would be silently wrong.
        # (amp_fp32_params stands for autocast(fp16) on such a GPU: a run warning says so, simulator.api.run_warnings)
        raise ScenarioError(f"{source}: training.precision: bf16 needs bf16 tensor cores, which {gpu.name} has not "
                            "(Ampere and later have them; allowed: fp16, amp_fp32_params, fp32 on this GPU)")
    if cfg.training.precision == "fp32" and "fp32" not in gpu.peak_flops_per_s:
        raise ScenarioError(f"{source}: training.precision: fp32: {gpu.name} lists no fp32 rate "
                            "(hardware.gpu peak_flops_per_s.fp32)")
    prof_name = hwc.profile

    def default_profile() -> EfficiencyProfile:
        return default_profile_for(gpu, gpu_name, pcie)

    try:
        if prof_name is None:
            profile = default_profile()
        elif presets.is_file_reference(prof_name):  # ./x.yaml, ../x.yaml, /abs/x.yaml: a file
            p = Path(prof_name)
            base = Path(source).parent if not p.is_absolute() and Path(source).is_file() else Path(".")
            profile = presets.load_profile_file(p if p.is_absolute() or p.exists() else base / p)
        else:
            profile = presets.get("profiles", prof_name)
    except PresetError as exc:
        raise ScenarioError(f"{source}: hardware.profile: {exc}") from None
    if profile.gpu != gpu_name and not profile.name.startswith("generic:"):
        fallback = default_profile()
        if warn_every_time or (profile.name, gpu_name) not in _WARNED:  # once per process, not once per resolve
            _WARNED.add((profile.name, gpu_name))
            warnings.warn(f"hardware.profile {profile.name!r} was fitted for {profile.gpu!r}, not "
                          f"{gpu_name!r}; using {fallback.name!r} instead", ScenarioWarning, stacklevel=2)
        profile = fallback
    # an explicit hardware.pcie other than the link the profile's copies were measured over replaces its rates;
    # overrides of that link itself replace only the rates of the fields they set
    pcie_explicit = "pcie" in hwc.model_fields_set and pcie_name != profile.copy_link
    overridden = frozenset(pcie_over) if "pcie" in hwc.model_fields_set and not pcie_explicit else frozenset()
    nvme, cluster = resolve_nvme(cfg, source), resolve_cluster(cfg, source, gpu_name, warn_every_time)
    switches = resolve_pcie_switches(cfg, source, nvme, cluster.get("collectives"))
    if switches is not None and nvme is not None:  # the declared switches say where the drives attach
        d, up = switches.drive_uplink(nvme.drives)
        nvme = dataclasses.replace(nvme, drives_per_uplink=d, uplink_bytes_per_s=up)
    return Hardware(gpu, profile, pcie, cpu, mem, hwc.launch_overhead_s, pcie_explicit=pcie_explicit,
                    nvme=nvme, pcie_overridden=overridden, pcie_switches=switches, **cluster)


def resolve_pcie_switches(cfg: ScenarioConfig, source: str, nvme, collectives):
    """The host's PCIe switches (``hardware_models.pcie_switches.PcieSwitchTopology``): ``hardware.host.pcie_switches``
    if given, else the host preset's; None when neither states them.

    Checked against the node: GPU indices below its GPUs (1 without a cluster), NIC indices below its NICs (with a
    cluster), drive indices below the NVMe array's drives (when the run has one); with a cluster, the GPUs behind
    each switch must be those the cluster preset puts behind one (``pcie_switches`` count, GPUs spread evenly) at
    the cluster's uplink rate.

    Raises:
        ScenarioError: one line naming the key: a device in two switches, an index the node does not have, or a
            topology the cluster preset contradicts.
    """
    from hardware_models.pcie_switches import host_pcie_switches, parse_pcie_switches
    from simulator.config.schema import HostRef

    ref = cfg.hardware.host
    name = _ref(ref)[0]
    given = isinstance(ref, HostRef) and ref.pcie_switches is not None
    key = "hardware.host.pcie_switches" if given else f"hardware.host {name!r} (its preset's pcie_switches)"
    try:
        c = collectives.topo.cluster if collectives is not None else None
        counts = (c.gpus_per_node if c is not None else 1, c.nics_per_node if c is not None else None,
                  nvme.drives if nvme is not None else None)
        if given:  # every problem of the list at once, layout and ranges (the preset's the same)
            topo = parse_pcie_switches([sw.model_dump() for sw in ref.pcie_switches], "scenario", counts)
        else:
            topo = host_pcie_switches(name, counts)
        if topo is None:
            return None
        if c is not None:
            _check_against_cluster(topo, c)
    except ValueError as exc:
        raise ScenarioError("\n".join(f"{source}: {key}: {line}" for line in str(exc).split("\n"))) from None
    return topo


def _check_against_cluster(topo, c) -> None:
    """Raise ValueError when ``topo`` puts the GPUs behind switches other than the cluster preset ``c`` does
    (``hardware_models.topology``: ``c.pcie_switches`` switches, GPU ``i`` behind ``i * switches // gpus``) or gives
    a switch with GPUs another uplink rate."""
    n, k = c.gpus_per_node, c.pcie_switches
    placed = {frozenset(i for i in range(n) if i * k // n == j) for j in range(k)} if k else set()
    for j, sw in enumerate(topo.switches):
        if not sw.gpus:
            continue
        group = frozenset(sw.gpus)
        if group not in placed:
            first = min(group)
            where = (f"the cluster preset {c.name!r} puts GPU {first} behind one with GPUs "
                     f"{sorted(next(g for g in placed if first in g))}" if k else
                     f"the cluster preset {c.name!r} has its GPUs on CPU root ports (pcie_switches: 0)")
            raise ValueError(f"pcie_switches[{j}].gpus: {sorted(group)} behind one switch, but {where}")
        if sw.uplink_bytes_per_s != c.pcie_switch_uplink_bytes_per_s:
            raise ValueError(f"pcie_switches[{j}].uplink_bytes_per_s: {sw.uplink_bytes_per_s / 1e9:g} GB/s, but the "
                             f"cluster preset {c.name!r} gives its switch uplinks "
                             f"{c.pcie_switch_uplink_bytes_per_s / 1e9:g} GB/s")


def resolve_nvme(cfg: ScenarioConfig, source: str = "<scenario>"):
    """The host's NVMe array (``hardware_models.nvme.NvmeArraySpec``): ``hardware.nvme`` if given (a key it leaves out
    taken from the host preset's ``nvme`` block; ``drives`` 1 when the host names none), else that block; None when
    the run swaps nothing to NVMe and ``hardware.nvme`` is not given.

    Raises:
        ScenarioError: an NVMe device in ``zero_optimization`` on a host without drives, or a bad ``hardware.nvme``
            (a drive without a write rate, no storage on a host without drives); one line naming the key.
    """
    from hardware_models.dataloader import StorageSpec
    from hardware_models.nvme import TOPOLOGY, host_nvme, load_nvme

    z, given = cfg.zero_optimization, cfg.hardware.nvme
    users = [f"zero_optimization.{k}.device" for k in ("offload_optimizer", "offload_param")
             if getattr(z, k).device == "nvme"]
    if given is None and not users:
        return None
    host = _ref(cfg.hardware.host)[0]
    try:  # the host preset's drives fill the gaps; its bays and upstream links hold for any drives
        preset = host_nvme(host)
    except ValueError as exc:
        raise ScenarioError(f"{source}: hardware.host: {exc}") from None
    if given is None:
        if preset is None:
            raise ScenarioError(f"{source}: {users[0]}: nvme needs NVMe drives, and hardware.host {host!r} names none "
                                "(allowed: a host preset with an nvme block such as dgx-h100-host, or hardware.nvme: "
                                "{storage: <storage preset>, drives: N})")
        return preset
    st = given.storage
    if st is None and preset is None:
        raise ScenarioError(f"{source}: hardware.nvme.storage: needed, hardware.host {host!r} names no NVMe drive "
                            "(allowed: a storage preset such as samsung-pm1733-3.84tb, or an inline "
                            "{name, read_bandwidth_bytes_per_s, write_bandwidth_bytes_per_s})")
    try:
        if st is None:
            drive = preset.drive
        else:
            drive = st if isinstance(st, str) else StorageSpec(st.name, st.read_bandwidth_bytes_per_s, st.read_latency_s,
                                                                write_bandwidth_bytes_per_s=st.write_bandwidth_bytes_per_s)
        drives = given.drives if given.drives is not None else preset.drives if preset is not None else 1
        from_preset = [k for k, v in (("storage", st), ("drives", given.drives)) if v is None and preset is not None]
        where = "scenario hardware.nvme" + (f"; {', '.join(from_preset)} from the host preset ({preset.source})"
                                            if from_preset else "")
        topology = {k: getattr(preset, k) for k in TOPOLOGY} if preset is not None else {}
        return load_nvme(drive, drives, where, **topology)
    except ValueError as exc:
        raise ScenarioError(f"{source}: hardware.nvme: {exc}" + (f" (hardware.host {host!r})" if preset is not None
                                                                 and preset.bays else "")) from None


def _fsdp_groups(cfg, node_ranks: int) -> tuple[int, int]:
    """``(shard, post_forward)``: ranks (of the gradient-reduce group, dp x cp) in the representative rank's FSDP shard
    group (``fsdp.fsdp_mesh``: consecutive, HYBRID_SHARD's replicas strided by it; without fsdp the node's ranks, the
    group HYBRID_SHARD's defaults gave) and in its post-forward group (an int ``fsdp.reshard_after_forward``: that
    many consecutive shard ranks, PyTorch ``_get_post_forward_mesh_info``'s ``mesh.view(-1, r)``; else 1)."""
    from simulator.config.sections.fsdp import fsdp_mesh

    p, f = cfg.parallelism, cfg.fsdp
    dp, cp = p.data_parallel_size or 1, p.context_parallel_size
    if f is None:
        return min(node_ranks, dp * cp), 1
    shard, _ = fsdp_mesh(f, dp, cp, node_ranks, p.data_parallel_shard_degree, p.data_parallel_replicate_degree)
    raf = f.reshard_after_forward
    post = raf if isinstance(raf, int) and not isinstance(raf, bool) else 1
    return shard, post


def resolve_cluster(cfg: ScenarioConfig, source: str, gpu_name: str, warn_every_time: bool = True) -> dict:
    """The cluster side of the machine: topology, collective model, data-parallel group, NCCL settings.

    Returns the ``Hardware`` keyword arguments ``collectives``, ``world_size``, ``dp_group``, ``tp_group``,
    ``pp_group``, ``cp_group``, ``ep_group``, ``edp_group``, ``etp_group``, ``nccl`` (an empty dict without ``hardware.cluster``:
    one GPU; with context parallelism ``dp_group`` is the data x context parallel group the gradients are
    reduced over).
    Ranks are numbered node by node in Megatron's default order (tp-cp-ep-dp-pp, tensor-parallel fastest:
    ``initialize_model_parallel``; cp = 1), so the representative rank 0 has the TP group ``0..tp-1``
    (inside its node), the DP group ``0, tp, 2 tp, ..., (dp - 1) tp``, the expert-parallel group
    ``0, etp, ..., (ep - 1) etp``, the expert-data-parallel group ``0, etp ep, 2 etp ep, ...`` (tp dp / (ep etp)
    ranks: the replicas of its experts) and the expert-tensor-parallel group ``0..etp-1`` (Megatron's expert grid
    etp-ep-edp-pp over the same ranks, ``initialize_model_parallel``; etp defaults to tp) and the pipeline group
    ``0, tp dp, 2 tp dp, ...`` (``Hardware.for_pipeline_rank`` gives the other stages' representatives).

    Raises:
        ScenarioError: an unknown cluster/network/profile preset, a bad override, a cluster GPU that is
            not ``hardware.gpu``, a ``data_parallel_size`` that does not match the world size, or an
            invalid ``nccl`` setting; one line naming the key.
    """
    from hardware_models.collectives import CollectiveModel, NcclConfig, load_collective_profile
    from hardware_models.topology import NetworkSpec, build_topology, load_cluster, load_network

    c = cfg.hardware.cluster
    if c is None:
        return {}
    try:
        spec = load_cluster(c.preset)
    except PresetError as exc:
        raise ScenarioError(f"{source}: hardware.cluster.preset: {exc}") from None
    if c.overrides:  # the preset loads alone: an error now is in what the scenario overrides
        try:
            check_override_keys(type(spec), c.overrides, f"preset clusters/{c.preset}")
            base, spec = spec, load_cluster(c.preset, c.overrides)
        except PresetError as exc:
            raise ScenarioError(f"{source}: hardware.cluster.overrides: {exc}") from None
        _warn_far_from_preset(base, spec, c.overrides, "hardware.cluster.overrides", warn_every_time)
    net = c.network or (spec.network if c.nodes > 1 else None)
    if net and c.network_overrides:  # as the cluster: the preset alone, then with the scenario's fields
        loaded = []  # the preset's, then with the overrides
        for key, over in (("network", None), ("network_overrides", c.network_overrides)):
            try:
                if over:
                    check_override_keys(NetworkSpec, over, f"preset networks/{net}")
                loaded.append(load_network(net, over))
            except PresetError as exc:
                raise ScenarioError(f"{source}: hardware.cluster.{key}: {exc}") from None
        _warn_far_from_preset(*loaded, c.network_overrides, "hardware.cluster.network_overrides", warn_every_time)
    if spec.gpu != gpu_name:
        raise ScenarioError(f"{source}: hardware.gpu: {gpu_name!r} is not the GPU of cluster {c.preset!r} "
                            f"(allowed: {spec.gpu!r}, or another hardware.cluster.preset)")
    try:
        topo = build_topology(spec, nodes=c.nodes, network=c.network, network_overrides=c.network_overrides or None)
    except PresetError as exc:
        key = "network" if "network" in str(exc) else "nodes"
        raise ScenarioError(f"{source}: hardware.cluster.{key}: {exc}") from None
    try:
        model = CollectiveModel(topo, load_collective_profile(c.collective_profile or spec.collective_profile))
    except PresetError as exc:
        raise ScenarioError(f"{source}: hardware.cluster.collective_profile: {exc}") from None
    world = topo.world_size
    par = cfg.parallelism
    dp, tp, pp = par.data_parallel_size, par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    cp = par.context_parallel_size
    if dp * tp * pp * cp != world:  # the schema checked this already unless its preset lookup failed
        raise ScenarioError(f"{source}: parallelism.data_parallel_size: {dp} does not match the world size {world} "
                            f"of hardware.cluster / (tp {tp} x pp {pp} x cp {cp}) (allowed: "
                            f"{world // (tp * pp * cp)})")
    n = cfg.nccl
    try:
        nccl = NcclConfig(algo=n.algo, proto=n.proto, nvls_enable=n.nvls_enable, nchannels=n.nchannels,
                          interference=n.interference)
        if world > 1:
            model.check("all_reduce", tuple(range(world)), 1 << 20, nccl)  # an algorithm the fabric cannot run
    except PresetError as exc:
        raise ScenarioError(f"{source}: {exc}") from None
    per_node = world // c.nodes
    stage = tp * cp * dp  # ranks per pipeline stage (tp-cp-ep-dp-pp order: the stages are the outermost)
    ep = cfg.parallelism.expert_model_parallel_size
    et = cfg.parallelism.expert_tensor_parallel_size or tp  # Megatron: expert_tensor_parallel_size defaults to tp
    # the gradient all-reduce group spans data and context parallelism (Megatron's data-parallel group with
    # context parallelism): every stride-tp rank of the stage; the CP group is its first cp ranks
    shard, post = _fsdp_groups(cfg, per_node // tp)
    return {"collectives": model, "world_size": world, "dp_group": tuple(range(0, stage, tp)),
            "cp_group": tuple(range(0, tp * cp, tp)),
            "tp_group": tuple(range(tp)), "dp_shard_group": tuple(range(0, tp * shard, tp)),
            "dp_replicate_group": tuple(range(0, stage, tp * shard)), "dp_post_forward_group": tuple(range(0, tp * post, tp)),
            "pp_group": tuple(range(0, world, stage)),
            "ep_group": tuple(range(0, ep * et, et)), "edp_group": tuple(range(0, stage, et * ep)),
            "etp_group": tuple(range(et)), "nccl": nccl}
