"""How a setting is declared once and read, checked and documented from that one declaration.

A config dataclass declares each of its settings as a field whose default is
:func:`setting` (``http_port: int = setting(8000, "the HTTP port", lo=0, hi=65535)``): the
field's name is the TOML key, its default the dataclass default, ``lo`` / ``hi`` / ``choices``
the bounds the parser checks and its error messages quote, ``doc`` the docs table's
description.  :func:`read_settings` parses a table by the declaration and
:func:`settings_table` writes the docs table from it (``python -m lumen_core.config.docs``), so
a setting added to the dataclass is parsed, checked and documented without another edit.

:class:`Reader` is the typed access to one TOML table all parsing goes through: every error
is ``source: key: problem`` (``lumen.toml: tasks[0].batching.max_batch_size: must be an
integer >= 1, got -1``) because a server that refuses to start must say which line to fix.

:class:`Option` is the same idea for the ``[tasks.options]`` keys a backend declares (its
``options_schema``), read by ``lumen_core.config.read_options``.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from ..errors import ConfigError


class Reader:
    """Typed access to one TOML table that reports ``source: key: problem``.

    ``base_dir`` is the config file's folder (relative paths resolve against it); ``used``
    collects the keys read so far, so :meth:`finish` can name an unknown one."""

    def __init__(self, source: str, prefix: str, table: Any, base_dir: Optional[str] = None):
        self.source = source
        self.prefix = prefix
        self.base_dir = base_dir
        if not isinstance(table, Mapping):
            raise ConfigError(source, prefix or "<root>", f"must be a table, got {type(table).__name__}")
        self.table = table
        self.used: set = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def err(self, name: str, problem: str) -> ConfigError:
        return ConfigError(self.source, self.key(name), problem)

    def get(self, name: str, kind: type, default: Any, *, lo: Optional[int] = None,
            hi: Optional[int] = None, choices: Optional[tuple] = None) -> Any:
        """The value of ``name`` checked against ``kind`` (and bounds), ``default`` when absent;
        ``kind`` ``object`` takes any value (the caller checks it)."""
        self.used.add(name)
        if name not in self.table:
            return default
        v = self.table[name]
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise self.err(name, f"must be an integer, got {v!r}")
            if lo is not None and v < lo:
                raise self.err(name, f"must be an integer >= {lo}, got {v}")
            if hi is not None and v > hi:
                raise self.err(name, f"must be an integer <= {hi}, got {v}")
        elif kind is bool:
            if not isinstance(v, bool):
                raise self.err(name, f"must be true or false, got {v!r}")
        elif kind is str:
            if not isinstance(v, str):
                raise self.err(name, f"must be a string, got {v!r}")
            if choices is not None and v not in choices:
                raise self.err(name, f"must be one of {', '.join(choices)}, got {v!r}")
        elif kind is dict:
            if not isinstance(v, Mapping):
                raise self.err(name, f"must be a table, got {v!r}")
            v = dict(v)
        elif kind is list:
            if not isinstance(v, list):
                raise self.err(name, f"must be an array, got {v!r}")
        return v

    def sub(self, name: str) -> "Reader":
        self.used.add(name)
        return Reader(self.source, self.key(name), self.table.get(name, {}), self.base_dir)

    def finish(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise self.err(unknown[0], f"unknown key (known: {', '.join(sorted(self.used))})")


def resolve_path(path: str, base_dir: Optional[str]) -> str:
    """``path`` with ``~`` expanded, relative to ``base_dir`` (the config file's folder)."""
    if not path:
        return path
    path = os.path.expanduser(path)
    if base_dir and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    return path


#: a further check of a setting's value once its type and bounds hold:
#: ``check(reader, name, value, values read so far) -> the value to keep`` (or a ConfigError)
Check = Callable[[Reader, str, Any, dict], Any]
#: a bound is a number or the name of an earlier setting of the same table
Bound = Union[int, float, str, None]

#: the docs table's word for each kind
KIND_NAMES = {int: "integer", bool: "boolean", str: "string", float: "number", list: "array"}


@dataclass(frozen=True)
class Setting:
    """One key of a config table: its name, kind, default, bounds and what it is (``doc``).

    ``kind`` is ``int``, ``bool``, ``str``, ``list`` (checked by :meth:`Reader.get`) or
    ``object`` (any value: ``check`` does all the checking; ``kind_doc`` names it for the docs).
    ``lo`` / ``hi`` bound an ``int``; a bound that is a string names an earlier setting whose
    value is the bound (``default_priority_level <= priority_levels``).  ``default_doc`` is the
    docs' text for a default the code derives (``None``, a backend's own), ``range_doc`` for
    bounds that ``check`` enforces.  ``required`` (what to write) makes the key required: its
    ``default`` is then only the dataclass's."""

    name: str
    kind: type
    default: Any
    doc: str
    lo: Bound = None
    hi: Bound = None
    choices: Optional[tuple] = None
    check: Optional[Check] = None
    kind_doc: str = ""
    default_doc: str = ""
    range_doc: str = ""
    required: str = ""

    def read(self, r: Reader, values: Mapping, default: Any = dataclasses.MISSING) -> Any:
        """This setting's value in ``r``'s table: its default when absent (``default`` when
        given: a backend's own), else the value checked against kind, bounds and ``check``."""
        fallback = self.default if default is dataclasses.MISSING else default
        present = self.name in r.table
        if self.required and not present:
            raise r.err(self.name, f"is required: {self.required}")
        v = r.get(self.name, self.kind, fallback, lo=_bound(self.lo, values),
                  hi=_bound(self.hi, values), choices=self.choices)
        if present and self.check is not None:
            v = self.check(r, self.name, v, dict(values))
        return v

    def kind_name(self) -> str:
        return self.kind_doc or KIND_NAMES.get(self.kind, self.kind.__name__)

    def bounds_doc(self) -> str:
        if self.range_doc:
            return self.range_doc
        if self.choices is not None:
            return "one of " + ", ".join(f"`{c}`" for c in self.choices)
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            return f"{lo}..{hi}"
        if lo is not None:
            return f">= {lo}"
        return f"<= {hi}" if hi is not None else ""

    def default_text(self) -> str:
        if self.required:
            return "required"
        if self.default_doc:
            return self.default_doc
        return "`" + toml_literal(self.default) + "`"


def _bound(b: Bound, values: Mapping) -> Any:
    return values[b] if isinstance(b, str) else b


def toml_literal(v: Any) -> str:
    """``v`` as it is written in a TOML file (the docs show defaults this way)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_literal(x) for x in v) + "]"
    return repr(v)


def setting(default: Any, doc: str, *, kind: Optional[type] = None, lo: Bound = None,
            hi: Bound = None, choices: Optional[tuple] = None, check: Optional[Check] = None,
            kind_doc: str = "", default_doc: str = "", range_doc: str = "",
            required: str = "") -> Any:
    """A dataclass field that declares a setting (its name is the field's).

    ``kind`` defaults to the type of ``default`` (a tuple default: ``list``, the TOML array it
    is read from).  The field's default is ``default``; its metadata carries the
    :class:`Setting` that :func:`read_settings` and :func:`settings_table` use."""
    if kind is None:
        kind = list if isinstance(default, tuple) else type(default)
    if kind not in (int, bool, str, list, object):
        raise TypeError(f"setting kind must be int, bool, str, list or object, got {kind!r}")
    if isinstance(default, (list, dict, set)):
        raise TypeError("a setting's default must be immutable (a tuple for an array)")
    spec = Setting("", kind, default, doc, lo, hi, choices, check, kind_doc, default_doc,
                   range_doc, required)
    return dataclasses.field(default=default, metadata={"setting": spec})


def settings_of(cls: type) -> tuple:
    """The :class:`Setting` of each field of dataclass ``cls`` declared by :func:`setting`,
    in field order, named after its field."""
    return tuple(dataclasses.replace(f.metadata["setting"], name=f.name)
                 for f in dataclasses.fields(cls) if "setting" in f.metadata)


def read_settings(r: Reader, cls: type, defaults: Optional[Mapping] = None) -> dict:
    """The values of ``cls``'s settings in ``r``'s table, in field order (so a bound may name
    an earlier one), as keyword arguments of ``cls``; ``defaults`` overrides declared defaults
    (a backend's own).  Keys ``cls`` does not declare are left for :meth:`Reader.finish`."""
    defaults = defaults or {}
    values: dict = {}
    for s in settings_of(cls):
        values[s.name] = s.read(r, values, defaults.get(s.name, dataclasses.MISSING))
    return values


def default_of(cls: type, name: str) -> Any:
    """The declared default of setting ``name`` of ``cls`` (to name it as a constant)."""
    for s in settings_of(cls):
        if s.name == name:
            return s.default
    raise KeyError(f"{cls.__name__} declares no setting {name!r}")


def settings_table(cls: type) -> str:
    """The Markdown table of ``cls``'s settings (docs/configuration.md holds one per table)."""
    rows = ["| Key | Type | Default | Bounds | What it is |", "|---|---|---|---|---|"]
    for s in settings_of(cls):
        doc = " ".join(s.doc.split()).replace("|", "\\|")
        rows.append(f"| `{s.name}` | {s.kind_name()} | {s.default_text()} | "
                    f"{s.bounds_doc()} | {doc} |")
    return "\n".join(rows) + "\n"


#: the value types an :class:`Option` may declare (``list``: a list of non-empty strings;
#: ``float``: a finite number, an integer accepted)
OPTION_KINDS = (int, float, bool, str, list)


@dataclass(frozen=True)
class Option:
    """One ``[tasks.options]`` key a backend declares (``TaskBackend.options_schema``).

    ``kind`` is ``int``, ``float``, ``bool``, ``str`` or ``list`` (a list of non-empty strings;
    a single string stands for a list of one).  ``lo`` / ``hi`` bound an ``int`` or ``float``; ``choices`` lists the
    values a ``str`` may take; a ``str`` is never empty.  ``default`` is what a task that leaves
    the key out gets (``None``: the backend derives it, e.g. from the model, as ``doc`` says).
    ``doc`` says what the value is, as a noun phrase; error messages quote it.
    """

    name: str
    kind: type
    default: Any
    doc: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    choices: Optional[tuple] = None

    def __post_init__(self) -> None:
        if self.kind not in OPTION_KINDS:
            raise TypeError(f"option {self.name!r}: kind must be one of {OPTION_KINDS}")

    def read(self, r: Reader) -> Any:
        """The option's value in ``r``'s table (its default when absent), or a ConfigError."""
        r.used.add(self.name)
        if self.name not in r.table:
            return self.default
        v = r.table[self.name]
        if self.kind is int:
            if (isinstance(v, bool) or not isinstance(v, int)
                    or (self.lo is not None and v < self.lo)
                    or (self.hi is not None and v > self.hi)):
                raise r.err(self.name, f"must be an integer{self._range()}, got {v!r}")
        elif self.kind is float:
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or (self.lo is not None and v < self.lo)
                    or (self.hi is not None and v > self.hi)):
                raise r.err(self.name, f"must be a number{self._range()} ({self.doc}), "
                                       f"got {v!r}")
            v = float(v)
        elif self.kind is bool:
            if not isinstance(v, bool):
                raise r.err(self.name, f"must be true or false, got {v!r}")
        elif self.kind is str:
            if not isinstance(v, str) or not v:
                raise r.err(self.name, f"must be a non-empty string ({self.doc}), got {v!r}")
            if self.choices is not None and v not in self.choices:
                raise r.err(self.name, f"must be one of {', '.join(self.choices)} ({self.doc}), "
                                       f"got {v!r}")
        else:
            items = [v] if isinstance(v, str) else v
            if (not isinstance(items, list) or not items
                    or not all(isinstance(x, str) and x for x in items)):
                raise r.err(self.name, f"must be a list of non-empty strings ({self.doc}), "
                                       f"got {v!r}")
            v = tuple(items)
        return v

    def _range(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f" in {self.lo}..{self.hi}"
        if self.lo is not None:
            return f" >= {self.lo}"
        return f" <= {self.hi}" if self.hi is not None else ""
