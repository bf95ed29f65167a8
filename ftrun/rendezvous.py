"""Generations: who is in the job now, under which ranks, and why. Shared by agent and workers.

Owns: the `Generation` record and its store keys, the worker->agent request queue (through the
same store), and the pure healing plan every member computes from the members' committed steps.
Must not import: torch at module level, typer, rich, the agent or the worker library.
The store object is duck-typed (anything with set/get/add/wait/check, like c10d's TCPStore).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Protocol

PREFIX = "ftrun/"
LATEST_KEY = PREFIX + "gen/latest"
REQUEST_QUEUE = PREFIX + "requests"
WORKER_ID_STRIDE = 10_000  # node k's worker ids are k*STRIDE + n: unique across the job


def node_of(worker_id: int) -> int:
    return worker_id // WORKER_ID_STRIDE


def gen_key(number: int) -> str:
    return f"{PREFIX}gen/{number}"


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

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Generation:
        doc = json.loads(raw)
        doc["members"] = tuple(doc["members"])
        doc["joiners"] = tuple(doc.get("joiners", ()))
        return cls(**doc)


def publish(store: Store, gen: Generation) -> None:
    """The record first, then the pointer: a reader of `latest` always finds the record."""
    store.set(gen_key(gen.number), gen.to_json())
    store.set(LATEST_KEY, str(gen.number))


def read_generation(store: Store, number: int, timeout_s: float) -> Generation:
    store.wait([gen_key(number)], timedelta(seconds=timeout_s))
    return Generation.from_json(store.get(gen_key(number)))


def latest_number(store: Store, timeout_s: float) -> int:
    store.wait([LATEST_KEY], timedelta(seconds=timeout_s))
    return int(store.get(LATEST_KEY))


def post_request(store: Any, kind: str, **fields_: Any) -> None:
    """Worker -> agent, through the store's queue (one atomic push: a worker killed midway
    leaves no hole for the reader to wait on)."""
    store.queue_push(REQUEST_QUEUE, json.dumps({"kind": kind, **fields_}))


# what each request kind must carry: field -> type (float fields also take ints)
REQUEST_FIELDS: dict[str, dict[str, type]] = {
    "hello": {"worker": int, "pid": int, "spare": bool},
    "comm_failed": {"worker": int, "generation": int, "error": str},
    "suspect": {"worker": int, "generation": int},
    "recovered": {"worker": int, "generation": int, "fault_at": float, "published_at": float,
                  "noticed": float, "rebuilt": float, "healed": float, "step": int,
                  "first_commit": float},
}


def parse_request(raw: str | bytes, extra_kinds: frozenset[str] = frozenset()
                  ) -> dict[str, Any] | str:
    """A worker request as the agent may act on it, or the one-line reason it is refused.
    Anything may arrive on the queue (any process that reaches the store can push), so every
    field is checked here, where it enters."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return "not JSON"
    if not isinstance(doc, dict):
        return f"a JSON {type(doc).__name__}, not an object"
    kind = doc.get("kind")
    if kind in extra_kinds:
        return doc
    if kind not in REQUEST_FIELDS:
        return f"unknown kind {str(kind)[:40]!r}"
    for name, want in REQUEST_FIELDS[kind].items():
        if name not in doc:
            return f"{kind}: no {name!r}"
        if not _is_a(doc[name], want):
            return f"{kind}: {name!r} is {str(doc[name])[:40]!r}, not {want.__name__}"
    if doc["worker"] < 0:
        return f"{kind}: worker {doc['worker']} is negative"
    return doc


def _is_a(value: object, want: type) -> bool:
    if want is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, want)


def heal_plan(committed: list[int]) -> dict[int, int]:
    """Ranks behind the highest committed step -> the up-to-date rank each heals from.

    Sources are spread round-robin over the up-to-date ranks so that several joiners do not
    all pull from one peer. Pure and deterministic: every member computes the same plan.
    """
    if not committed:
        return {}
    best = max(committed)
    sources = [r for r, s in enumerate(committed) if s == best]
    behind = [r for r, s in enumerate(committed) if s < best]
    return {dst: sources[i % len(sources)] for i, dst in enumerate(behind)}
