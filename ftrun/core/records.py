"""Frozen dataclasses as JSON objects: one strict codec for every typed document ftrun writes
and reads back (the status document, a node's heartbeat payload, event fields).

Owns: `to_json` (a record as its JSON object: tuples as lists, enums as their values, nested
records as objects, a field made with `absent()` left out while it is None) and `from_json`
(the record a JSON object holds, every field checked against its type hint where it enters:
present unless `absent()` or defaulted, of its type (no bool for an int, a finite number for a
float, an int stays an int so the JSON reads back the same), a union tried member by member;
keys the record does not know are dropped, as a newer writer may add some). A bad document is
one FtrunError naming the path (`status: workers[2].rank is 'x', not int`).
Must not import: anything outside the standard library and `ftrun.core`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import Any, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from ftrun.core.errors import FtrunError

T = TypeVar("T")
_OMIT = "ftrun.omit_if_none"
_NONE = type(None)


def absent() -> Any:
    """A field whose key the JSON object leaves out while its value is None (a part that only
    some documents have: a multi-node job's `nodes`, a written snapshot's `step`)."""
    return field(default=None, metadata={_OMIT: True})


def to_json(record: Any) -> dict[str, Any]:
    """`record` (a dataclass instance) as its JSON object, fields in declaration order."""
    out: dict[str, Any] = {}
    for name, omit, encode in _encoders(type(record)):  # type: ignore[arg-type]
        value = getattr(record, name)
        if value is None:
            if not omit:
                out[name] = None
        else:
            out[name] = value if encode is None else encode(value)
    return out


def replaced(record: T, **changes: Any) -> T:
    """`dataclasses.replace(record, **changes)`, for a record that `from_json` makes without
    its __init__ (a plain frozen dataclass) a copy of its fields with `changes`, ~0.7 µs, not
    ~8: a job's status re-labels every worker row (32,768 at 4,096 nodes: 0.26 s through
    `replace`, on the coordinator's status thread). Others, and an unknown field, go through
    `replace` (which says what is wrong)."""
    cls: Any = type(record)
    if not _decoders(cls)[2] or not changes.keys() <= _names(cls):
        return cast(T, dataclasses.replace(cast(Any, record), **changes))
    copy = object.__new__(cls)
    copy.__dict__.update(record.__dict__)
    copy.__dict__.update(changes)
    return copy


@functools.cache
def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


Encode = Callable[[Any], Any]
Decode = Callable[[object], object]


@functools.cache
def _encoders(cls: type) -> tuple[tuple[str, bool, Encode | None], ...]:
    """Per field: its name, whether None leaves it out, how its value becomes JSON (None:
    as it is, a scalar). Made once per class: a job's document has thousands of rows."""
    return tuple((f.name, bool(f.metadata.get(_OMIT)), _encoder(hint))
                 for f, hint in _schema(cls))


def _encoder(hint: Any) -> Encode | None:
    origin = get_origin(hint)
    members = get_args(hint) if origin in (Union, types.UnionType) else (hint,)
    if all(m in _SCALARS for m in members):
        return None
    return _plain


_SCALARS = (int, float, str, bool, _NONE)


def _plain(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Bad(Exception):
    """Why a value is refused, and where (built from the inside out)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(why)
        self.path, self.why = path, why


def from_json(cls: type[T], doc: object, what: str, hint: str = "") -> T:
    """The `cls` record `doc` holds, or a one-line FtrunError (`what`: the document's name)."""
    try:
        return _record(cls, doc)
    except _Bad as bad:
        where = f"{bad.path.lstrip('.')} " if bad.path else ""
        raise FtrunError(f"{what}: {where}{bad.why}",
                         hint=hint or "the writer and the reader of this document differ: "
                                      "run the same ftrun version on both sides") from None


def _record(cls: Any, doc: object) -> Any:
    if not isinstance(doc, Mapping):
        raise _Bad("", f"is {_show(doc)}, not an object")
    plan, defaults, direct = _decoders(cls)
    values = dict(defaults)
    name = ""
    try:
        for name, required, decode in plan:
            if name in doc:
                values[name] = decode(doc[name])
            elif required:
                raise _Bad("", f"has no {name!r}")
    except _Bad as bad:
        raise _Bad(f".{name}{bad.path}" if name in doc else "", bad.why) from None
    if not direct:
        return cls(**values)
    record = object.__new__(cls)  # what the frozen __init__ does, at a third of its cost
    record.__dict__.update(values)
    return record


@functools.cache
def _decoders(cls: type) -> tuple[tuple[tuple[str, bool, Decode], ...], dict[str, object],
                                   bool]:
    """Per field: its name, whether the object must have it, its check and conversion; the
    defaults; whether a record may be made without its __init__ (a plain frozen dataclass
    whose defaults are constants)."""
    plan, defaults, direct = [], {}, not hasattr(cls, "__post_init__")
    for f, hint in _schema(cls):
        plan.append((f.name, f.default is MISSING and f.default_factory is MISSING,
                     _decoder(hint)))
        if f.default is not MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not MISSING:
            direct = False
    if getattr(cls, "__slots__", None):
        direct = False
    return tuple(plan), defaults, direct


@functools.cache
def _schema(cls: Any) -> tuple[tuple[Field[Any], object], ...]:
    hints = get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in fields(cls))


@functools.cache
def _decoder(hint: Any) -> Decode:
    """The check and conversion of one type hint, made once per hint."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        members = get_args(hint)
        if all(m in _SCALARS for m in members):
            return _scalar(tuple(m for m in members if m is not _NONE), _NONE in members)
        return _union(tuple(members))
    if origin is tuple:
        return _items(_decoder(get_args(hint)[0]))
    if origin in (dict, Mapping):
        return _mapping(_decoder(get_args(hint)[1]))
    if isinstance(hint, type) and is_dataclass(hint):
        return functools.partial(_record, hint)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint)
    return _scalar((hint,), False)


def _scalar(wants: tuple[type, ...], nullable: bool) -> Decode:
    """A JSON scalar of one of `wants` (exactly: no bool for an int; an int is a float too,
    and stays an int), or null if `nullable`."""
    exact = set(wants) | ({int} if float in wants else set()) | ({_NONE} if nullable else set())
    name = " or ".join(w.__name__ for w in wants)

    def check(value: object) -> object:
        kind = type(value)
        if kind in exact:
            if kind is float and not math.isfinite(value):  # type: ignore[arg-type]
                raise _Bad("", f"is {_show(value)}, not a finite number")
            return value
        if str in wants and isinstance(value, str):  # a str enum's member
            return value
        raise _Bad("", f"is {_show(value)}, not {name}")
    return check


def _enum(want: type[enum.Enum]) -> Decode:
    def check(value: object) -> object:
        try:
            return want(value)
        except ValueError:
            raise _Bad("", f"is {_show(value)}, not a {want.__name__}") from None
    return check


def _union(members: tuple[Any, ...]) -> Decode:
    nullable = _NONE in members
    choices = tuple(_decoder(m) for m in members if m is not _NONE)

    def check(value: object) -> object:
        if value is None:
            if nullable:
                return None
            raise _Bad("", "is null")
        bad = _Bad("", "")
        for choice in choices:
            try:
                return choice(value)
            except _Bad as exc:  # the next member may fit; else the last reason stands
                bad = exc
        raise bad
    return check


def _items(item: Decode) -> Decode:
    def check(value: object) -> object:
        if not isinstance(value, (list, tuple)):
            raise _Bad("", f"is {_show(value)}, not a list")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(item(v))
            except _Bad as bad:
                raise _Bad(f"[{i}]{bad.path}", bad.why) from None
        return tuple(out)
    return check


def _mapping(item: Decode) -> Decode:
    def check(value: object) -> object:
        if not isinstance(value, Mapping):
            raise _Bad("", f"is {_show(value)}, not an object")
        out = {}
        for key, v in value.items():
            try:
                out[str(key)] = item(v)
            except _Bad as bad:
                raise _Bad(f"[{str(key)[:40]!r}]{bad.path}", bad.why) from None
        return out
    return check


def _show(value: object) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return repr(value)[:40] if value is not None else "null"
