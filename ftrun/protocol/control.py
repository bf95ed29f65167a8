"""The replies of the control channel, typed: what a job answers `ftrun status` and `ftrun
inject-fault` (the requests are `protocol.control_ops`'s).

Owns: the reply records (`Injected`, `GpuInjected`, `NetDowned`; a status reply is the
`protocol.status.Status` document), `reply()`, the JSON object a record goes back as
(`{"ok": true, ...its fields}`), and `read_reply()`, the record a client reads back, strictly.
A refusal is `{"ok": false, "error", "hint"}`, written and read by `adapters.control`.
Must not import: torch, typer, rich, the agent, the worker library, the CLI (`ftrun status`
imports this module, and must stay light).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from ftrun.core import records
from ftrun.core.records import absent

T = TypeVar("T")


@dataclass(frozen=True)
class Injected:
    """A drill on a worker: which one took it (its rank now)."""

    worker: int
    pid: int
    rank: int


@dataclass(frozen=True)
class GpuInjected:
    """A fault of a simulated GPU."""

    gpu: int
    uuid: str


@dataclass(frozen=True)
class NetDowned:
    """A net-down drill: the node whose link goes down, for how long; `device` when the
    answering agent cuts its own link, `host` when it sends the drill to that node."""

    node: int
    duration: float
    device: str | None = absent()
    host: str | None = absent()


@dataclass(frozen=True)
class Preempted:
    """A preempt drill: the agent (its pid) sent itself its notice; it hands its node's ranks
    over within `window_s`."""

    pid: int
    window_s: float


@dataclass(frozen=True)
class DrainQueued:
    """A drain the job took: `token` names it in `ftrun status`'s drains; `what` leaves."""

    token: str
    what: str
    leavers: tuple[int, ...]


def reply(record: Any) -> dict[str, Any]:
    """What the server sends for `record` (a reply record or a status document)."""
    return {"ok": True, **records.to_json(record)}


def read_reply(cls: type[T], doc: object) -> T:
    """The `cls` reply a job sent (its "ok" is the channel's, not the record's)."""
    return records.from_json(cls, doc, f"the job's reply ({cls.__name__})",
                             hint="the job runs another ftrun version; use that version's "
                                  "ftrun command")
