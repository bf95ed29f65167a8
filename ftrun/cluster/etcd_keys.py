"""What a job's keys in etcd hold, each value decoded strictly where it is read.

Owns: the job's key names under its prefix (`/ftrun/<rdzv-id>/`), the two decision records a
leader writes there and what binds each to it: `StoreRecord` (where the leader in office
serves the agents' store) and `BoundGeneration` (the newest generation it decided), both
naming the leader's election key and that key's create revision; their encoding; and their
strict decoding: any etcd client that reaches the prefix may write anything under it, so a
value that is not JSON, not an object, or lacks a field of its type, reads as absent with the
reason why (the caller says it once), never as an exception of another kind. The check that
the named leader really wrote a record is `etcd_election.written_by`.
Must not import: the agent's node, typer, rich, the CLI, the worker library, the etcd client.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ftrun.core import records
from ftrun.core.errors import FtrunError
from ftrun.protocol import member_runs
from ftrun.protocol.rendezvous import Generation, store_endpoint

STORE_KEY = "store"  # under the job's prefix: the agents' store of the leader in office
LEADER_PREFIX = "leader/"  # the election's keys
NODES_PREFIX = "nodes/"  # nodes/<index>: each node's agent, on its lease
GENERATION_KEY = "generation"  # the newest generation record, written under the leadership


@dataclass(frozen=True)
class StoreRecord:
    """The agents' store a leader serves, published under its leadership."""

    host: str
    port: int
    leader: str  # the leader's election key
    leader_revision: int  # ...and its create revision (a key name is reused by no other)


@dataclass(frozen=True)
class BoundGeneration:
    """A generation as the leader that decided it wrote it to etcd."""

    leader: str
    leader_revision: int
    generation: Generation


def store_value(host: str, port: int, leader: tuple[str, int]) -> str:
    return json.dumps(asdict(StoreRecord(host, port, *leader)))


def generation_value(gen: Generation, leader: tuple[str, int]) -> str:
    return json.dumps({"leader": leader[0], "leader_revision": leader[1],
                       "generation": gen.doc()})  # a large job's members as runs


def _members_listed(doc: object) -> object:
    """The record with its generation's `member_runs` (`Generation.doc`) expanded into
    `members`, for the strict decoding."""
    gen = doc.get("generation") if isinstance(doc, dict) else None
    if not isinstance(gen, dict) or "member_runs" not in gen:
        return doc
    members = member_runs.decode(gen["member_runs"], "the generation record")
    return {**doc, "generation": {**gen, "members": list(members)}}  # type: ignore[dict-item]


def _document(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return FtrunError(f"not JSON: {raw[:40]!r}")


def decode_store(raw: bytes) -> StoreRecord | str:
    """The store record `raw` holds, or why it is none."""
    doc = _document(raw)
    if isinstance(doc, FtrunError):
        return doc.message
    try:
        rec = records.from_json(StoreRecord, doc, "the store record")
        if not 0 < rec.port < 65536 or not rec.host:
            raise FtrunError(f"the store record: {rec.host}:{rec.port} is not HOST:PORT")
    except FtrunError as exc:
        return exc.message
    return rec


def decode_generation(raw: bytes) -> BoundGeneration | str:
    """The generation record `raw` holds, with the leader it names, or why it is none."""
    doc = _document(raw)
    if isinstance(doc, FtrunError):
        return doc.message
    try:
        rec = records.from_json(BoundGeneration, _members_listed(doc), "the generation record")
        if rec.generation.store:
            store_endpoint(rec.generation.store)
    except FtrunError as exc:
        return exc.message
    return rec


def node_index(key: str, prefix: str) -> int | None:
    """The node a key under NODES_PREFIX names (None: not a node's key)."""
    tail = key[len(prefix):]
    return int(tail) if key.startswith(prefix) and tail.isdigit() and tail.isascii() else None
