"""Leader election over etcd (etcd's own election recipe) and the leader's fenced writes.

Owns: `Election`. Each candidate creates the key `<prefix><lease id>` on its lease; the key
with the lowest create revision leads; every other candidate watches only its predecessor
(the next lower create revision), so one departure wakes one candidate, not all of them. A
leader's key lives exactly as long as its lease: a leader whose agent died, froze or lost
etcd is deposed by etcd itself when the lease lapses. Every write the leader makes is a
transaction compared on its key's create revision: once the key is gone (lease lapsed,
resigned) the write is refused by etcd, whatever the deposed leader believes. A key that
once was the lowest stays the lowest while it exists (revisions only grow), so "my key is
still there" is exactly "I still lead". Each fenced write also puts the leader's own key again
(same value, same lease), so the key's history names every record its leader wrote: a record
whose revision is not one of those (`written_by`) was written by somebody else.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ftrun.adapters.etcd import (
    EtcdClient,
    EtcdError,
    KeyValue,
    compare_create,
    delete_op,
    header_revision,
    put_op,
    range_op,
)
from ftrun.adapters.etcd_lease import Lease
from ftrun.adapters.etcd_watch import Watch
from ftrun.core import timeouts


class LeaseLost(EtcdError):
    """The candidate's key is gone: its lease lapsed (or was revoked)."""


@dataclass(frozen=True)
class LeaderInfo:
    node: str
    host: str
    since: float | None  # wall-clock time it took office (None: first in line, not yet in)
    key: str
    create_revision: int
    lease: int


def _value(node: str, host: str, since: float | None) -> str:
    return json.dumps({"node": node, "host": host, "since": since})


def _info(kv: KeyValue) -> LeaderInfo:
    """The candidate a key names; a value not of ours (any etcd client may write one) names
    nobody, the key itself still holds its place."""
    try:
        fields = json.loads(kv.value or b"{}")
    except (ValueError, RecursionError):
        fields = {}
    fields = fields if isinstance(fields, dict) else {}
    since = fields.get("since")
    since = float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) \
        else None
    node, host = fields.get("node"), fields.get("host")
    return LeaderInfo(node if isinstance(node, str) else "",
                      host if isinstance(host, str) else "", since, kv.key,
                      kv.create_revision, kv.lease)


def _range_kvs(reply: dict[str, Any]) -> list[KeyValue]:
    rng = reply.get("responses", [{}])[0].get("response_range", {})
    return [KeyValue.from_json(kv) for kv in rng.get("kvs", [])]


class Election:
    """One candidate (`node` on `host`) for the leadership under `prefix`, on `lease`."""

    def __init__(self, client: EtcdClient, prefix: str, lease: Lease, node: str,
                 host: str) -> None:
        self.client = client
        self.prefix = prefix
        self.lease = lease
        self.node = node
        self.host = host
        self.key = f"{prefix}{lease.id:016x}"
        self.revision = 0  # our key's create revision once in line (0: not in line)
        self.since: float | None = None  # when we took office
        self.last_write_revision = 0
        self._won = False

    @property
    def leading(self) -> bool:
        """We won and our lease has not lapsed: false while it may have (see etcd_lease),
        which a deposed leader must take as deposed; etcd has the last word on each write."""
        return self._won and not self.lease.lapsed

    def campaign(self, timeout: float = timeouts.ETCD_CAMPAIGN_S) -> bool:
        """Get in line (once) and wait up to `timeout` for every candidate ahead to go;
        True once we lead, False if others still lead (call again: our place is kept).
        Each request has the client's own deadline. Raises LeaseLost if our key is gone."""
        deadline = time.monotonic() + timeout
        if self.leading:
            return True
        if self.lease.lost:
            raise LeaseLost("this candidate's lease is gone: it cannot campaign",
                            hint="grant a new lease and campaign again")
        if not self.revision:
            self._get_in_line()
        while True:
            reply = self.client.txn(
                [compare_create(self.key, self.revision)],
                [range_op(self.prefix, prefix=True, sort_order="DESCEND",
                          sort_target="CREATE", max_create_revision=self.revision - 1,
                          limit=1)])
            if not reply.get("succeeded"):
                self.revision = 0
                raise LeaseLost("this candidate's key is gone: its lease lapsed",
                                hint="grant a new lease and campaign again")
            ahead = _range_kvs(reply)
            if not ahead:
                return self._take_office()
            if not self._wait_deleted(ahead[0].key, header_revision(reply) + 1, deadline):
                return False

    def _get_in_line(self) -> None:
        reply = self.client.txn([compare_create(self.key, 0)],
                                [put_op(self.key, _value(self.node, self.host, None),
                                        self.lease.id)],
                                [range_op(self.key)])
        if reply.get("succeeded"):
            self.revision = header_revision(reply)
            return
        mine = _range_kvs(reply)  # a retried request that had been applied: it is ours
        if not mine:
            raise LeaseLost("this candidate's key vanished as it was created")
        self.revision = mine[0].create_revision

    def _wait_deleted(self, key: str, from_revision: int, deadline: float) -> bool:
        watch = Watch(self.client, key, start_revision=from_revision)
        try:
            while (left := deadline - time.monotonic()) > 0:
                event = watch.get(left)
                if event is not None and event.kind == "delete":
                    return True
            return False
        finally:
            watch.stop()

    def _take_office(self) -> bool:
        since = time.time()
        if not self._fenced([], None, since):
            self.revision = 0
            raise LeaseLost("this candidate's key is gone: its lease lapsed")
        self._won, self.since = True, since
        return True

    @property
    def writer(self) -> tuple[str, int]:
        """Our key and its create revision: what a record we write names as its writer."""
        return self.key, self.revision

    def leader(self, timeout: float | None = None) -> LeaderInfo | None:
        """Who leads now (the lowest create revision under the prefix), or None."""
        return leader_of(self.client, self.prefix, timeout)

    def resign(self, timeout: float | None = None) -> bool:
        """Leave the line (and the office): our key is deleted if it is still ours."""
        if not self.revision:
            return False
        reply = self.client.txn([compare_create(self.key, self.revision)],
                                [delete_op(self.key)], timeout=timeout)
        self._won, self.revision, self.since = False, 0, None
        return bool(reply.get("succeeded"))

    def write(self, puts: Mapping[str, str | bytes] | None = None,
              deletes: Iterable[str] = (), delete_prefixes: Iterable[str] = (),
              timeout: float | None = None) -> bool:
        """Apply the puts and deletes in one transaction only if we still lead; False (and
        nothing written) once we are deposed. etcd decides, not our view of the lease: a
        deposed leader that has not noticed yet is refused all the same. A timeout raises
        EtcdError: the outcome is then unknown, read it back."""
        if not self._won:
            return False
        ops = ([put_op(k, v) for k, v in (puts or {}).items()]
               + [delete_op(k) for k in deletes]
               + [delete_op(p, prefix=True) for p in delete_prefixes])
        return self._fenced(ops, timeout)

    def _fenced(self, ops: list[dict[str, Any]], timeout: float | None,
                since: float | None = None) -> bool:
        """`ops` if our key is still ours, with our key put again in the same revision (its
        history so names this write as ours: `written_by`)."""
        value = _value(self.node, self.host, self.since if since is None else since)
        reply = self.client.txn([compare_create(self.key, self.revision)],
                                [put_op(self.key, value, self.lease.id), *ops], timeout=timeout)
        applied = bool(reply.get("succeeded"))
        if applied:
            self.last_write_revision = header_revision(reply)
        else:
            self._won = False
        return applied


def written_by(client: EtcdClient, record: KeyValue, key: str, create_revision: int,
               timeout: float | None = None) -> bool | None:
    """Whether the leader whose election key was `key` (created at `create_revision`) wrote
    `record` in office: the key, as it was at the record's revision, was put in that very
    revision (a fenced write puts it with every record) after it was created. None: etcd
    compacted that revision away, nobody can tell any more."""
    try:
        then = client.get(key, timeout, revision=record.mod_revision)
    except EtcdError as exc:
        if "compacted" in exc.message:
            return None
        raise
    return (then is not None and then.create_revision == create_revision
            and then.mod_revision == record.mod_revision != create_revision)


def leader_of(client: EtcdClient, prefix: str, timeout: float | None = None
              ) -> LeaderInfo | None:
    """Who leads the election under `prefix` (for `ftrun status`, from any node)."""
    reply = client.request("kv/range", {**range_op(prefix, prefix=True, sort_order="ASCEND",
                                                   sort_target="CREATE", limit=1)
                                        ["request_range"]}, timeout)
    kvs = reply.get("kvs", [])
    return _info(KeyValue.from_json(kvs[0])) if kvs else None
