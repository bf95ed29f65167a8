"""What `ftrun report` accepts of a line of a run's event log or timeline, as pure checks.

A log directory may come from anyone (a copied run, a crafted file): every line is checked,
field by field, for what the report and the journal's replay read of it before either sees
it, and a line that fails is left out and counted, with the first reason. Nothing of a
rejected line reaches a number, a picture or a page.

Owns: `line_problem` (None: keep the line; else why it is left out), the field table per
event kind and for a timeline sample, and `Skipped`, the count per file.
Must not import: anything beyond the standard library, core.events and core.errors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ftrun.core.errors import FtrunError
from ftrun.core.events import FIELDS, Event, fields_of

Check = Callable[[object], bool]
EPOCH_MAX_S = 1e11  # a wall-clock time past this (year 5138) is not a time a run logged
NUMBER_MAX = 1e15  # milliseconds and counts beyond this are not measurements
RANK_KEY = re.compile(r"-?[0-9]{1,9}")  # a timeline's per-rank key: str(rank)


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2 ** 63


def _number(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v) and abs(v) < NUMBER_MAX)


def _time(v: object) -> bool:
    return _number(v) and 0 <= v < EPOCH_MAX_S  # type: ignore[operator]


def _scalar(v: object) -> bool:
    """Text shown as it is (a reason, a kind): no list or object, no NaN."""
    return v is None or isinstance(v, (str, bool, int)) or _number(v)


def _maybe(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _steps(v: object) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and RANK_KEY.fullmatch(k) and _int(s) for k, s in v.items())


REQUIRED, OPTIONAL = True, False
Fields = Mapping[str, tuple[Check, bool]]
EVENT_FIELDS: dict[str, Fields] = {
    "fault": {"worker": (_int, REQUIRED), "rank": (_int, REQUIRED),
              "decision": (_scalar, REQUIRED), "reason": (_scalar, REQUIRED),
              "why": (_scalar, OPTIONAL), "detected_at": (_time, OPTIONAL),
              "committed_before": (_int, OPTIONAL), "rolled_back_to": (_int, OPTIONAL),
              "lost_from": (_time, OPTIONAL), "recovered_at": (_time, OPTIONAL),
              "decided_with": (_int, OPTIONAL)},
    "injected": {"worker": (_int, REQUIRED), "kind": (_scalar, REQUIRED),
                 "at": (_time, REQUIRED)},
    "failure": {"rank": (_maybe(_int), OPTIONAL), "reason": (_scalar, REQUIRED)},
    "started": {"world_size": (_int, OPTIONAL)},
    "restart": {"attempt": (_maybe(_int), OPTIONAL), "reason": (_scalar, OPTIONAL)},
    "resumed": {"step": (_int, REQUIRED), "taken_at": (_time, REQUIRED),
                "loaded_at": (_time, REQUIRED)},
    "generation": {"generation": (_int, REQUIRED), "world_size": (_int, REQUIRED),
                   "published_at": (_time, REQUIRED), "urgent": (_scalar, OPTIONAL),
                   "forwarded": (_int, OPTIONAL)},
    "recovered": {"generation": (_int, REQUIRED), "rebuilt": (_maybe(_time), OPTIONAL),
                  "healed": (_maybe(_time), OPTIONAL),
                  "first_commit": (_maybe(_time), OPTIONAL), "step": (_maybe(_int), OPTIONAL),
                  "redone_s": (_maybe(_number), OPTIONAL)},
    "trained": {"step": (_int, REQUIRED), "worker": (_int, OPTIONAL)},
    "snapshot": {"step": (_int, OPTIONAL), "blocking_ms": (_maybe(_number), OPTIONAL),
                 "write_ms": (_maybe(_number), OPTIONAL)},
    "straggler": {"worker": (_maybe(_int), OPTIONAL), "reason": (_scalar, OPTIONAL),
                  "evicted": (_scalar, OPTIONAL)},
    "gpu": {"uuid": (_scalar, OPTIONAL), "health": (_scalar, OPTIONAL),
            "reason": (_scalar, OPTIONAL)},
}
TIMELINE_FIELDS: Fields = {"world_size": (_int, OPTIONAL), "steps": (_steps, OPTIONAL),
                           "step_max": (_maybe(_int), OPTIONAL),
                           "step_min": (_maybe(_int), OPTIONAL)}


def line_problem(line: object, timeline: bool) -> str | None:
    """Why a parsed line of the event log (or, `timeline`, of the timeline) is left out, or
    None. Kinds of events this version does not know are kept: the replay skips them."""
    if not isinstance(line, dict):
        return f"not a JSON object but {type(line).__name__}"
    if not _time(line.get("t")):
        return f"'t' is not a time in seconds: {_short(line.get('t'))}"
    if timeline:
        return _fields_problem(line, TIMELINE_FIELDS)
    kind = line.get("event")
    if not isinstance(kind, str):
        return f"'event' is not a name: {_short(kind)}"
    return _fields_problem(line, EVENT_FIELDS.get(kind, {})) or _record_problem(kind, line)


def _record_problem(kind: str, line: Mapping[str, object]) -> str | None:
    """The replay reads a line of a kind it folds as its record (`core.events`): a line that
    is none is left out here, not an error that ends the report."""
    if kind not in FIELDS:
        return None  # a kind this version does not know: the replay skips it
    try:
        fields_of(Event(kind), {k: v for k, v in line.items() if k not in ("t", "event")})
    except FtrunError as exc:
        return exc.message
    return None


def _fields_problem(line: Mapping[str, object], fields: Fields) -> str | None:
    for name, (check, required) in fields.items():
        if name not in line:
            if required:
                return f"no '{name}'"
        elif not check(line[name]):
            return f"'{name}' is not what it should be: {_short(line[name])}"
    return None


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Skipped:
    """Lines of one file left out: how many, and the first one's number and reason."""

    count: int = 0
    first: str = ""

    def add(self, number: int, why: str) -> None:
        if not self.count:
            self.first = f"line {number}: {why}"
        self.count += 1
