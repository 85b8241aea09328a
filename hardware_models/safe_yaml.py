"""Strict, bounded YAML reading for every input file (scenarios, presets, profiles, power models).

PyYAML's ``safe_load`` is safe against code execution but not against bad input: it reads YAML
1.1 (``yes``/``on`` are booleans, ``1:30`` is 90, ``2001-12-14`` a date), silently keeps the last
of duplicate keys, recurses once per nesting level (``RecursionError`` at a few thousand levels),
expands aliases without bound when the result is walked (the "billion laughs"), and raises
``ValueError``/``KeyError`` for some tags. This module reads a subset instead:

* the YAML 1.2 core schema for plain scalars: ``true``/``false``, ``null``/``~``, decimal, ``0x``
  and ``0o`` integers, decimal floats with ``.inf``/``.nan``; everything else is a string
  (``1:30``, ``yes``, ``2001-12-14`` stay strings);
* duplicate keys are an error naming the key and its line;
* at most ``MAX_DEPTH`` levels of nesting and ``MAX_NODES`` nodes after alias expansion;
* integers of at most ``MAX_INT_DIGITS`` digits (64-bit integers have 19);
* files of at most ``MAX_FILE_BYTES`` bytes, regular files only (no FIFO, device or folder),
  UTF-8 text.

Every problem is a ``YamlInputError`` with one line of text that never quotes the file's content
beyond a key name (which the caller may prefix with the file name).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml

#: Largest input file, bytes. Scenario and preset files are a few kB; a calibrated profile is
#: under 50 kB. PyYAML's pure-Python parser needs about 1 s per 100 kB, so 2 MiB is seconds.
MAX_FILE_BYTES = 2 * 2**20
#: Deepest nesting of mappings/sequences (the deepest shipped file has 5 levels).
MAX_DEPTH = 64
#: Most nodes in the document with every alias expanded (shipped files have under 2,000; 100,000 take about 2 s).
MAX_NODES = 100_000
#: Most digits of an integer literal (2**63 has 19 digits).
MAX_INT_DIGITS = 19


class YamlInputError(ValueError):
    """A YAML text or file that this reader refuses; the message is one line."""


_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")


class _Resolver(yaml.resolver.BaseResolver):
    """YAML 1.2 core schema for plain scalars (no YAML 1.1 booleans, sexagesimals, timestamps)."""


for _tag, _rx, _first in (
    ("tag:yaml.org,2002:bool", _BOOL, list("tTfF")),
    ("tag:yaml.org,2002:int", _INT, list("-+0123456789")),
    ("tag:yaml.org,2002:float", _FLOAT, list("-+.0123456789")),
    ("tag:yaml.org,2002:null", _NULL, ["~", "n", "N", ""]),
):
    _Resolver.add_implicit_resolver(_tag, _rx, _first)


def _line(node) -> str:
    mark = getattr(node, "start_mark", None)
    return f"line {mark.line + 1}" if mark is not None else "an unknown line"


def _key_text(key: Any) -> str:
    text = repr(key) if not isinstance(key, str) else key
    return text if len(text) <= 60 else text[:57] + "..."


def _node_path(root, target) -> str:
    """The dotted key path of ``target`` under ``root`` (``training.micro_batch_size``, a list item as ``[i]``;
    ``""`` for the root itself or a node not found), found depth-first over the composed nodes."""
    stack = [(root, "")]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if node is target:
            return path
        if id(node) in seen:  # an alias: its node was walked already
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = _key_text(k.value) if isinstance(k, yaml.ScalarNode) else "?"
                stack.append((v, f"{path}.{key}" if path else key))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node.value))
    return ""


class _Constructor(yaml.constructor.SafeConstructor):
    """Safe constructor with duplicate-key detection and bounded integers."""

    def construct_document(self, node):
        self._root = node  # for ``_where``
        return super().construct_document(node)

    def _where(self, node) -> str:
        """``line N`` of ``node`` and, under a mapping, its key path: ``line 18: training.micro_batch_size``."""
        path = _node_path(getattr(self, "_root", None), node)
        return f"{_line(node)}: {path}" if path else _line(node)

    def construct_yaml_int(self, node):
        text = str(node.value).replace("_", "")
        digits = text.lstrip("+-")
        if len(digits) > MAX_INT_DIGITS + 2:  # 0x / 0o prefixes
            raise YamlInputError(f"{self._where(node)}: integer with {len(digits)} digits is out of range "
                                 f"(at most {MAX_INT_DIGITS} digits, i.e. 64-bit)")
        value = int(digits, 0) if digits[:2] in ("0x", "0o") else int(digits)
        value = -value if text.startswith("-") else value
        if not -(2**63) <= value < 2**63:
            raise YamlInputError(f"{self._where(node)}: integer out of the 64-bit range")
        return value

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep=deep)
        except (YamlInputError, yaml.YAMLError):
            raise
        except (ValueError, TypeError, KeyError, OverflowError):
            raise YamlInputError(f"{self._where(node)}: value does not match its tag "
                                 f"{_key_text(node.tag)!r}") from None

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    raise YamlInputError(f"{_line(key_node)}: a mapping key must be a plain value, "
                                         f"not a list or mapping") from None
                if key in seen:
                    raise YamlInputError(f"{_line(key_node)}: duplicate key {_key_text(key)!r} "
                                         f"(first given at {seen[key]})")
                seen[key] = _line(key_node)
        return super().construct_mapping(node, deep=deep)


_Constructor.add_constructor("tag:yaml.org,2002:int", _Constructor.construct_yaml_int)
_Constructor.add_constructor("tag:yaml.org,2002:map", _Constructor.construct_yaml_map)
# no timestamps, no Python objects: unknown tags are refused below
_Constructor.yaml_constructors.pop("tag:yaml.org,2002:timestamp", None)


def _unknown_tag(loader, node):
    raise YamlInputError(f"{_line(node)}: YAML tag {_key_text(node.tag)!r} is not supported "
                         f"(plain values, lists and mappings only)")


_Constructor.add_constructor(None, _unknown_tag)
for _t in ("set", "omap", "pairs", "binary", "timestamp"):
    _Constructor.add_constructor(f"tag:yaml.org,2002:{_t}", _unknown_tag)


class _Loader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser, yaml.composer.Composer,
              _Constructor, _Resolver):
    """Bounded loader: depth and expanded node count are checked while composing."""

    def __init__(self, stream):
        yaml.reader.Reader.__init__(self, stream)
        yaml.scanner.Scanner.__init__(self)
        yaml.parser.Parser.__init__(self)
        yaml.composer.Composer.__init__(self)
        _Constructor.__init__(self)
        _Resolver.__init__(self)
        self._depth = 0
        self._sizes: dict[int, int] = {}

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlInputError(f"{_line(self.peek_event())}: nesting deeper than {MAX_DEPTH} levels")
            alias = self.check_event(yaml.events.AliasEvent)
            mark = self.peek_event().start_mark if alias else None
            node = super().compose_node(parent, index)
            if alias and id(node) not in self._sizes:  # the anchor is still being composed: a cycle
                raise YamlInputError(f"line {mark.line + 1}: an alias refers to the list or mapping that contains "
                                     "it (a recursive structure)")
        finally:
            self._depth -= 1
        size = self._sizes.get(id(node))
        if size is None:  # a new node (an alias returns a node already sized)
            if isinstance(node, yaml.MappingNode):
                size = 1 + sum(self._sizes.get(id(k), 1) + self._sizes.get(id(v), 1) for k, v in node.value)
            elif isinstance(node, yaml.SequenceNode):
                size = 1 + sum(self._sizes.get(id(v), 1) for v in node.value)
            else:
                size = 1
            self._sizes[id(node)] = size  # every node stays referenced by the tree: ids are unique
        if size > MAX_NODES:
            raise YamlInputError(f"{_line(node)}: more than {MAX_NODES:,} values once aliases are expanded")
        return node


#: Most distinct texts whose parse ``loads`` keeps (a sweep re-reads one scenario and the same ``--set``
#: values for every point: PyYAML's pure-Python parser takes ~0.1-3 ms each), and the longest text kept,
#: characters (shipped scenario and preset files are under 20 kB; a longer text is parsed every time), so the
#: cache holds at most 16 MiB of text; a cached parse is handed out as a fresh copy
LOADS_CACHE_SIZE = 256
LOADS_CACHE_MAX_TEXT = 64 * 1024
_LOADS_CACHE: dict[str, Any] = {}


def loads(text: str) -> Any:
    """Parse one YAML document with the rules above.

    The parse is a pure function of ``text``: the last ``LOADS_CACHE_SIZE`` distinct texts (of at most
    ``LOADS_CACHE_MAX_TEXT`` characters) that parsed are remembered, and a repeat gets a deep copy of the earlier
    result (the caller may change it). Texts that fail are parsed (and refused) every time.

    Raises:
        YamlInputError: syntax error (with line and column), duplicate key, unsupported tag,
            too deep, too many values, or an integer out of the 64-bit range.
    """
    if len(text) > LOADS_CACHE_MAX_TEXT:
        return _parse(text)
    hit = _LOADS_CACHE.get(text, _MISSING)
    if hit is _MISSING:
        hit = _parse(text)
        if len(_LOADS_CACHE) >= LOADS_CACHE_SIZE:
            del _LOADS_CACHE[next(iter(_LOADS_CACHE))]  # the oldest
        _LOADS_CACHE[text] = hit
    return _copy(hit)


_MISSING = object()


def _copy(value: Any) -> Any:
    """A copy of a parse result sharing nothing mutable with it (scalars are immutable; aliases become
    separate copies, which no reader here tells apart)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, tuple):  # !!omap / !!pairs items
        return tuple(_copy(v) for v in value)
    if isinstance(value, set):  # !!set (of hashable, hence immutable, keys)
        return set(value)
    return value


def _parse(text: str) -> Any:
    """``loads`` without the cache."""
    loader = None
    try:
        loader = _Loader(text)
        return loader.get_single_data()
    except YamlInputError:
        raise
    except yaml.reader.ReaderError as exc:
        raise YamlInputError(f"YAML error: control character 0x{exc.character:02x} at position "
                             f"{exc.position} is not allowed") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = (exc.problem or exc.context or "invalid YAML").split("\n")[0]
        raise YamlInputError(f"YAML syntax error{where}: {problem}") from None
    except (yaml.YAMLError, ValueError, KeyError, TypeError, OverflowError) as exc:
        raise YamlInputError(f"YAML error: {type(exc).__name__}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_text(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes`` bytes.

    Raises:
        YamlInputError: missing, not a regular file (folder, FIFO, device), too large, unreadable,
            or not UTF-8.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise YamlInputError("file not found") from None
    except OSError as exc:
        raise YamlInputError(f"cannot read the file ({exc.strerror or type(exc).__name__})") from None
    if stat.S_ISDIR(st.st_mode):
        raise YamlInputError("is a directory, expected a YAML file")
    if not stat.S_ISREG(st.st_mode):
        raise YamlInputError("is not a regular file (a FIFO, socket or device), expected a YAML file")
    if st.st_size > max_bytes:
        raise YamlInputError(f"file is {st.st_size:,} bytes; at most {max_bytes:,} bytes are read")
    try:
        with open(p, "rb") as fh:
            raw = fh.read(max_bytes + 1)
    except OSError as exc:
        raise YamlInputError(f"cannot read the file ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > max_bytes:
        raise YamlInputError(f"file is over {max_bytes:,} bytes; at most {max_bytes:,} bytes are read")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise YamlInputError(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line})") from None


def load_file(path: str | Path) -> Any:
    """``loads(read_text(path))``. A ``.json`` file is read the same way (JSON is YAML 1.2) and its
    syntax errors say JSON.

    Raises:
        YamlInputError: see ``read_text`` and ``loads``.
    """
    text = read_text(path)
    try:
        return loads(text)
    except YamlInputError as exc:
        if str(path).lower().endswith(".json") and str(exc).startswith("YAML "):
            raise YamlInputError("JSON " + str(exc)[len("YAML "):]) from None
        if str(exc).startswith("YAML syntax error") and (hint := toml_hint(text)):
            raise YamlInputError(f"{exc}; {hint}") from None
        raise


_TOML_HEADER = re.compile(r"^\s*\[\s*([A-Za-z_][\w.\-]*)\s*\]\s*(#.*)?$")
_TOML_KEY = re.compile(r"^\s*([A-Za-z_][\w\-]*)\s*=\s*(.*?)\s*(#.*)?$")


def toml_hint(text: str) -> str:
    """A hint for a YAML syntax error in ``text`` whose lines look like TOML (a ``[section]`` header and a
    ``key = value`` line, as torchtitan's job configs are written), built from the first section and its first key:
    ``[activation_checkpoint]`` / ``mode = "selective"`` -> ``activation_checkpoint: {mode: selective}``; "" when
    the text does not look like TOML."""
    section, key = None, None
    for line in text.splitlines():
        if section is None and (m := _TOML_HEADER.match(line)):
            section = m.group(1)
        elif section is not None and (m := _TOML_KEY.match(line)):
            key = m.group(1), m.group(2).strip("\"'") or "..."
            break
    if section is None or key is None:
        return ""
    return (f"it looks like TOML ([{section}] headers, key = value lines): write it as a YAML mapping, "
            f"{section}: {{{key[0]}: {key[1]}}}")


def load_mapping(path: str | Path, what: str = "a mapping of keys") -> dict:
    """A YAML file whose top level must be a mapping.

    Raises:
        YamlInputError: see ``load_file``; also an empty file or another top-level type.
    """
    data = load_file(path)
    if data is None:
        raise YamlInputError(f"the file is empty; expected {what}")
    if not isinstance(data, dict):
        raise YamlInputError(f"expected {what} at the top level, got a {type(data).__name__}")
    return data
