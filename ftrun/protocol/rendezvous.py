"""Generations: who is in the job now, under which ranks, and why. Shared by agent and workers.

Owns: the `Generation` record and its store keys, the worker->agent request queue (through the
same store) and its typed requests, the codec of every typed message on a store queue (the
agents' own in `ftrun.cluster.link` too), and the pure healing plan every member computes from the
members' committed steps.
Must not import: torch at module level, typer, rich, the agent or the worker library.
The store object is duck-typed (anything with set/get/add/wait/check, like c10d's TCPStore).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, ClassVar, Protocol, TypeVar, get_type_hints

from ftrun.core import records
from ftrun.core.errors import FtrunError
from ftrun.protocol import member_runs
from ftrun.protocol.fanout import RelayHop, relay_message, relay_queue

PREFIX = "ftrun/"
LATEST_KEY = PREFIX + "gen/latest"
REQUEST_QUEUE = PREFIX + "requests"
RELEASE_KEY = PREFIX + "released"  # set once every member's script ended: they may exit
WORKER_ID_STRIDE = 10_000  # node k's worker ids are k*STRIDE + n: unique across the job


def node_of(worker_id: int) -> int:
    return worker_id // WORKER_ID_STRIDE


def gen_key(number: int) -> str:
    return f"{PREFIX}gen/{number}"


def spare_group_key(worker_id: int) -> str:
    """A hot spare of a replica group (--shard-size): its group's worker ids, comma-separated,
    set by the agent before the spare starts."""
    return f"{PREFIX}spare-group/{worker_id}"


class Store(Protocol):
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...
    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class Generation:
    """One membership of the job. Rank r is `members[r]` (stable worker ids)."""

    number: int
    members: tuple[int, ...]
    reason: str = ""
    urgent: bool = False  # a member was lost: abandon in-flight collectives now
    published_at: float = 0.0  # wall clock, for recovery-latency phases
    fault_at: float = 0.0  # wall clock when the agent saw the fault (0 if none)
    joiners: tuple[int, ...] = field(default_factory=tuple)  # members that must heal
    store: str = ""  # "host:port" of the store this generation forms on; "": the previous one
    snapshot_first: bool = False  # members left out take a final snapshot, then leave

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def pg_prefix(self) -> str:
        """A store prefix never used before: stale keys of an older group can't leak in."""
        return f"{PREFIX}pg/{self.number}/"

    def rank_of(self, worker_id: int) -> int | None:
        try:
            return self.members.index(worker_id)
        except ValueError:
            return None

    def doc(self) -> dict[str, Any]:
        """The record as a JSON object: a large job's members as runs (`member_runs`)."""
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        if len(self.members) > member_runs.RUNS_FROM:
            doc["member_runs"] = member_runs.encode(self.members)
            del doc["members"]
        return doc

    def to_json(self) -> str:
        return json.dumps(self.doc())

    def encode(self) -> bytes:
        """The record as a store holds it (compressed when large: `member_runs.pack`)."""
        return member_runs.pack(self.to_json())

    @classmethod
    def from_json(cls, raw: str | bytes) -> Generation:
        """The record `raw` holds (as `encode` or `to_json` wrote it), every field checked
        against its type (a record written before a field existed reads with its default),
        or a one-line FtrunError."""
        what = "a generation record"
        try:
            doc = json.loads(member_runs.unpack(raw, what))
        except (ValueError, RecursionError):
            raise FtrunError(f"{what} is not JSON: {str(raw)[:60]!r}") from None
        return cls.from_doc(doc, what)

    @classmethod
    def from_doc(cls, doc: object, what: str) -> Generation:
        """The record a JSON object holds, members as a list or as runs."""
        if not isinstance(doc, dict) or "member_runs" not in doc:
            gen = records.from_json(cls, doc, what)
        else:  # the runs are checked as they expand; the ids they give need no second look
            members = member_runs.decode(doc["member_runs"], what)
            gen = replace(records.from_json(cls, {**doc, "members": []}, what),
                          members=members)
        if gen.store:
            store_endpoint(gen.store)
        return gen


def store_endpoint(addr: str) -> tuple[str, int]:
    """A generation's `store`, "host:port" ("[v6]:port" too), as (host, port)."""
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise FtrunError(f"generation store {addr[:80]!r} is not HOST:PORT")
    return host, int(port)


def publish(store: Store, gen: Generation, relays: Iterable[int | RelayHop] = ()) -> None:
    """The record first, then the pointer: a reader of `latest` always finds the record.
    Then each node of `relays` is pushed the record (a push each, answered by no one:
    microseconds); a `RelayHop` with children, the record and whom to forward it to
    (`protocol.fanout.relay_plan`)."""
    record = gen.encode()
    store.set(gen_key(gen.number), record)
    store.set(LATEST_KEY, str(gen.number))
    message = relay_message(gen.number, record)
    for hop in relays:
        node, children = (hop, ()) if isinstance(hop, int) else (hop.node, hop.children)
        store.queue_push(relay_queue(node),  # type: ignore[attr-defined]
                         relay_message(gen.number, record, children) if children else message)


def read_generation(store: Store, number: int, timeout_s: float) -> Generation:
    store.wait([gen_key(number)], timedelta(seconds=timeout_s))
    return Generation.from_json(store.get(gen_key(number)))


def latest_number(store: Store, timeout_s: float) -> int:
    store.wait([LATEST_KEY], timedelta(seconds=timeout_s))
    return int(store.get(LATEST_KEY))


class Message(Protocol):
    """A frozen dataclass of scalar fields that travels on a store queue as one JSON object,
    {"kind": kind, field: value, ...} in field order."""

    kind: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]


M = TypeVar("M", bound=Message)

# fields that name a worker or a node: an id, never negative
_IDS = ("worker", "node")


def to_fields(msg: Message) -> dict[str, Any]:
    """The message as its JSON object: "kind" first, then the fields in order."""
    return {"kind": msg.kind, **{f.name: getattr(msg, f.name) for f in fields(msg)}}


def encode(msg: Message) -> str:
    return json.dumps(to_fields(msg))


def decode(raw: str | bytes, kinds: Mapping[str, type[M]]) -> M | str:
    """The message `raw` carries, or the one-line reason it is refused. Anything may arrive on
    a queue (any process that reaches the store can push), so every field is checked against
    its dataclass here, where it enters: present (or given a default: a sender older than
    the field), of its type (no bool for an int, a finite float, an int for a float), an id
    not negative. Unknown fields are dropped."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    kind = doc.get("kind")
    cls = kinds.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return f"unknown kind {str(kind)[:40]!r}"
    schema = _schema(cls)
    optional = {f.name for f in fields(cls) if f.default is not MISSING}
    for name, want in schema.items():
        if name not in doc and name not in optional:
            return f"{kind}: no {name!r}"
        if name not in doc:
            continue
        if not _is_a(doc[name], want):
            return f"{kind}: {name!r} is {str(doc[name])[:40]!r}, not {want.__name__}"
    for name in _IDS:
        if name in schema and doc[name] < 0:
            return f"{kind}: {name} {doc[name]} is negative"
    return cls(**{name: doc[name] for name in schema if name in doc})


@functools.cache
def _schema(cls: type) -> dict[str, type]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _is_a(value: object, want: type) -> bool:
    if want is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, want)


# ---------------------------------------------------------------- worker -> agent requests
@dataclass(frozen=True)
class Hello:
    """A worker is up (a spare: ready to be called in)."""

    kind: ClassVar[str] = "hello"
    worker: int
    pid: int
    spare: bool


@dataclass(frozen=True)
class CommFailed:
    """A collective of generation `generation` failed on this worker."""

    kind: ClassVar[str] = "comm_failed"
    worker: int
    generation: int
    error: str


@dataclass(frozen=True)
class Suspect:
    """A peer's connection broke: the agents should check their nodes now."""

    kind: ClassVar[str] = "suspect"
    worker: int
    generation: int


@dataclass(frozen=True)
class Corruption:
    """Silent corruption found at committed step `step` (#53). `found`: "state" (the
    replicas' fingerprints differed: every member rolled back to `verified`, the last step
    they agreed on) or "gradient" (one rank's local gradient, caught before the commit: the
    step was repeated). `blamed`: the worker the majority blames ("": two replicas, or a
    split: no one to blame). A blamed worker tells this itself, then leaves with
    EXIT_CORRUPT; otherwise the lowest rank tells it and nobody leaves. `tensor`: the first
    state tensor that differed. Wall clock: found, state restored (or the repeat done), and
    when the verified state was kept (what the rollback lost is counted from there)."""

    kind: ClassVar[str] = "corruption"
    worker: int
    generation: int
    step: int
    verified: int
    blamed: str
    tensor: str
    found: str = "state"
    found_at: float = 0.0
    restored_at: float = 0.0
    verified_at: float = 0.0


@dataclass(frozen=True)
class Recovered:
    """A worker's first commit in generation `generation`, with its recovery's phases (wall
    clock), and the work of the broken step it redid, job-wide: samples (-1: not known: the
    script cut its batches itself, or the worker entered in this recovery) and the fraction of
    the step (--redo lost: the lost share; --redo step: 1.0; 0 when no step broke)."""

    kind: ClassVar[str] = "recovered"
    worker: int
    generation: int
    fault_at: float
    published_at: float
    noticed: float
    rebuilt: float
    healed: float
    step: int
    first_commit: float
    redone_samples: int = 0
    redone_fraction: float = 0.0
    redone_s: float = 0.0  # the seconds the redo took: the make-up pass, or the repeated step


@dataclass(frozen=True)
class Resumed:
    """A worker started with no live replica loaded a snapshot (wall clock times)."""

    kind: ClassVar[str] = "resumed"
    worker: int
    step: int
    source: str
    taken_at: float
    loaded_at: float
    load_ms: float


@dataclass(frozen=True)
class Stage:
    """Where a member's script is, past training: `trained` (it left ft.steps() with the
    final state), `training` (it entered ft.steps() again), `ended` (its script ended well;
    it waits, serving a replacement if one comes, until every member's has)."""

    kind: ClassVar[str] = "stage"
    worker: int
    generation: int
    step: int
    stage: str


@dataclass(frozen=True)
class Healed:
    """A member received a heal: `nbytes` from `sources` up-to-date members (their ranks,
    comma-separated) in `seconds`, in chunks of `chunk_mb`."""

    kind: ClassVar[str] = "healed"
    worker: int
    generation: int
    step: int
    nbytes: int
    seconds: float
    sources: int
    source_ranks: str
    chunk_mb: float


@dataclass(frozen=True)
class StateSize:
    """The bytes of a member's registered state (what a heal of it moves), once it is whole
    (after its first commit)."""

    kind: ClassVar[str] = "state_size"
    worker: int
    nbytes: int


STAGES = ("trained", "training", "ended")
Request = (Hello | CommFailed | Suspect | Recovered | Resumed | Stage | Healed | StateSize
           | Corruption)
REQUESTS: dict[str, type[Request]] = {c.kind: c for c in (Hello, CommFailed, Suspect, Recovered,
                                                          Resumed, Stage, Healed, StateSize,
                                                          Corruption)}


def send_request(store: Any, req: Request) -> None:
    """Worker -> agent, through the store's queue (one atomic push: a worker killed midway
    leaves no hole for the reader to wait on)."""
    store.queue_push(REQUEST_QUEUE, encode(req))


def parse_request(raw: str | bytes) -> Request | str:
    """A worker request as the agent may act on it, or the one-line reason it is refused."""
    return decode(raw, REQUESTS)
