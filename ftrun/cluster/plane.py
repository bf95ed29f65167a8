"""The control plane a multi-node job's agents share: who coordinates, and where its store is.

Owns: `Plane`, what a coordinating or following cluster asks of it, and its two backends.
`C10dPlane`: torchrun's c10d rendezvous, where the agent that can bind `--rdzv-endpoint` is
the coordinator for the whole run (its host is the job's single point of failure).
`EtcdPlane` (`--rdzv-backend etcd`): every agent holds an etcd lease and stands in etcd's
election; the leader serves the agents' store on its own host and publishes its endpoint
with a write fenced on its leadership (a deposed leader's write is refused by etcd); the
others read the endpoint of the leader that holds office now, never a stale one, and only a
record that leader wrote (`etcd_keys`, `written_by`): a value under the job's prefix that is
malformed or was written by anyone else is passed over with one notice.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from ftrun.adapters.etcd_conf import EtcdConf
from ftrun.cluster.etcd_keys import (
    GENERATION_KEY,
    LEADER_PREFIX,
    NODES_PREFIX,
    STORE_KEY,
    StoreRecord,
    decode_generation,
    decode_store,
    generation_value,
    node_index,
    store_value,
)
from ftrun.cluster.link import Endpoint
from ftrun.core import timeouts
from ftrun.core.errors import Deposed, FtrunError, first_line
from ftrun.protocol.rendezvous import Generation

if TYPE_CHECKING:
    from ftrun.adapters.etcd import KeyValue
    from ftrun.adapters.etcd_election import LeaderInfo

Notice = Callable[[str], None]


def _quiet(text: str) -> None:
    pass


class Plane(Protocol):
    backend: str
    leader_changes: int

    def served(self, ep: Endpoint) -> None:
        """The coordinator serves the agents' store at `ep` now: say where."""
    def register(self, index: int) -> None:
        """This agent is node `index` of the job."""
    def store_now(self) -> Endpoint | None:
        """The store of the coordinator in office (None: none published, or it never moves)."""
    def record(self, gen: Generation) -> None:
        """Before `gen` is published: write it under this agent's leadership (etcd: a fenced
        write, retried through an outage; a deposed leader's raises)."""
    def deposed(self) -> str | None:
        """Why this agent may no longer decide for the job (its leadership lapsed), or None."""
    def up(self) -> bool:
        """Whether the control plane answers (a majority of etcd, or the store's host)."""
    def describe(self) -> dict[str, Any]:
        """`control_plane` in `ftrun status --json`."""
    def close(self) -> None: ...


class C10dPlane:
    """torchrun's c10d backend: the endpoint's host coordinates for the whole run."""

    backend = "c10d"
    leader_changes = 0

    def __init__(self, ep: Endpoint, leading: bool) -> None:
        self.ep = ep
        self.leading = leading
        self.since = time.time() if leading else None

    def served(self, ep: Endpoint) -> None:
        pass

    def register(self, index: int) -> None:
        pass

    def store_now(self) -> Endpoint | None:
        return None

    def record(self, gen: Generation) -> None:
        pass

    def deposed(self) -> str | None:
        return None

    def up(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "endpoints": [str(self.ep)],
                "leader": {"node": 0, "host": self.ep.host, "since": self.since},
                "leader_changes": 0, "up": True, "members": []}

    def close(self) -> None:
        pass


class EtcdPlane:
    """This agent's seat in the etcd control plane of its job."""

    backend = "etcd"

    def __init__(self, conf: EtcdConf, node: str, host: str, notice: Notice = _quiet) -> None:
        """`notice`: says, once each, why a value read from etcd was passed over."""
        from ftrun.adapters.etcd import EtcdClient
        from ftrun.adapters.etcd_election import Election
        from ftrun.adapters.etcd_lease import grant

        self.conf = conf
        self.host = host
        self.client = EtcdClient(conf)
        self.lease = grant(self.client, conf.lease_ttl)
        self.election = Election(self.client, conf.prefix + LEADER_PREFIX, self.lease, node,
                                 host)
        self.leader_changes = 0
        self.notice = notice
        self._said: set[tuple[str, int]] = set()  # (key, revision) passed over with a notice
        self._bound: set[tuple[str, int]] = set()  # (key, revision) its leader wrote
        self.followed: LeaderInfo | None = None  # whose store this agent found last
        self.index: int | None = None  # this agent's node, once it joined the job
        self.deposed_after_s = conf.outage_timeout
        self._lapsed_at: float | None = None
        self._health: tuple[float, list[dict[str, Any]]] = (-math.inf, [])
        self._health_pool = ThreadPoolExecutor(1, thread_name_prefix="etcd-health")
        self._health_asked: Future[tuple[float, list[dict[str, Any]]]] | None = None

    def lead(self, timeout: float) -> bool:
        """Stand for the leadership; True once this agent leads (within `timeout`)."""
        self._renew_if_lost()
        return self.election.campaign(timeout)

    def served(self, ep: Endpoint) -> None:
        value = store_value(ep.host, ep.port, self.election.writer)
        if not self.election.write({self.conf.prefix + STORE_KEY: value}):
            raise FtrunError("this agent lost the leadership before it could publish its "
                             "store", hint="another agent coordinates the job: start again")

    def wait_store(self, timeout: float, interrupted: Callable[[], bool]) -> Endpoint:
        """The store of the leader in office (published under its own election key)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not interrupted():
            if (ep := self.store_now()) is not None:
                return ep
            time.sleep(timeouts.ETCD_STORE_POLL_S)
        raise FtrunError(f"no coordinator published its store in etcd at {self.conf.where} "
                         f"within {timeout:g} s", hint="start the other agents with the same "
                         "--rdzv-endpoint and --rdzv-id, or raise --rdzv-conf join_timeout")

    def register(self, index: int) -> None:
        """This agent is node `index` of the job, for as long as its lease lives."""
        self.index = index
        self._renew_if_lost()
        self.client.put(f"{self.conf.prefix}{NODES_PREFIX}{index}", self.host, self.lease.id)

    def record(self, gen: Generation) -> None:
        """A generation is written under this agent's leadership before any worker sees it:
        refused (deposed), it never reaches them. Through an etcd outage the write is retried
        (the job's other work goes on meanwhile) until the conf's outage_timeout. The record
        names this leader (`etcd_keys.BoundGeneration`)."""
        from ftrun.adapters.etcd import EtcdError

        number = gen.number
        record = generation_value(gen, self.election.writer)
        deadline = time.monotonic() + self.deposed_after_s
        while True:
            try:
                if self.election.write({self.conf.prefix + GENERATION_KEY: record}):
                    return
                raise Deposed(f"this agent lost the leadership before generation {number} "
                              "was written: etcd refused it (another agent coordinates the job)",
                              hint="its workers stop; the job goes on under the new leader")
            except EtcdError as exc:
                if time.monotonic() >= deadline:
                    raise Deposed(f"etcd did not take generation {number} within "
                                  f"{self.deposed_after_s:g} s ({exc.message})",
                                  hint="bring the etcd majority back") from None
            time.sleep(timeouts.ETCD_RETRY_S)

    def held_generation(self) -> Generation | None:
        """The newest generation a leader of this job wrote, or None: none, or the record is
        malformed or not that leader's (each passed over with one notice). Where etcd has
        compacted the history that would prove its writer, the record counts only if it names
        the leader this agent followed."""
        key = self.conf.prefix + GENERATION_KEY
        kv = self.client.get(key)
        if kv is None:
            return None
        bound = decode_generation(kv.value)
        if isinstance(bound, str):
            self._pass_over(kv, f"malformed ({bound})")
            return None
        writer = (bound.leader, bound.leader_revision)
        followed = self.followed
        if not self._written_by(kv, writer, followed is not None and followed.key == writer[0]
                                and followed.create_revision == writer[1]):
            self._pass_over(kv, f"generation {bound.generation.number} was not written by "
                                f"the leader it names ({bound.leader})")
            return None
        return bound.generation

    def _written_by(self, kv: KeyValue, writer: tuple[str, int], if_unknown: bool) -> bool:
        """Whether the leader `writer` (election key, create revision) wrote `kv` in office;
        `if_unknown`: the answer when etcd compacted the revision that would tell."""
        from ftrun.adapters.etcd_election import written_by

        if (kv.key, kv.mod_revision) in self._bound:
            return True
        wrote = written_by(self.client, kv, *writer)
        if wrote is None:
            wrote = if_unknown
        if wrote:
            self._bound.add((kv.key, kv.mod_revision))
        return wrote

    def _pass_over(self, kv: KeyValue, why: str) -> None:
        """A value read from etcd is not taken: say so once per value (its revision)."""
        if (kv.key, kv.mod_revision) not in self._said:
            self._said.add((kv.key, kv.mod_revision))
            self.notice(f"ignored {kv.key} in etcd: {why}")

    def _won(self) -> bool:
        return self.election.since is not None

    def _renew_if_lost(self) -> None:
        """A follower whose lease etcd dropped (its keep-alive starved on a loaded host)
        takes a new one and its place in line again; a leader's lost lease deposes it."""
        if not self.lease.lost or self._won():
            return
        from ftrun.adapters.etcd_election import Election
        from ftrun.adapters.etcd_lease import grant

        self.lease.stop()
        self.lease = grant(self.client, self.conf.lease_ttl)
        self.election = Election(self.client, self.election.prefix, self.lease,
                                 self.election.node, self.host)

    def registered(self) -> set[int]:
        """The nodes whose agents' leases live."""
        prefix = self.conf.prefix + NODES_PREFIX
        nodes = set()
        for kv in self.client.get_prefix(prefix):
            index = node_index(kv.key, prefix)
            if index is None:
                self._pass_over(kv, "not a node's key (nodes/<index>)")
            else:
                nodes.add(index)
        return nodes

    def store_now(self) -> Endpoint | None:
        """The store of the leader in office now, or None (no leader, or not published)."""
        published = self._published()
        if published is None:
            return None
        self.followed = published[0]
        return Endpoint(published[1].host, published[1].port)

    def _published(self) -> tuple[LeaderInfo, StoreRecord] | None:
        """The leader in office and the store record it wrote, or None: no leader, no record,
        or a record that is malformed or another's (a record of a leader gone is no news)."""
        leader = self.election.leader()
        kv = self.client.get(self.conf.prefix + STORE_KEY)
        if leader is None or kv is None:
            return None
        doc = decode_store(kv.value)
        if isinstance(doc, str):
            self._pass_over(kv, f"malformed ({doc})")
            return None
        writer = (leader.key, leader.create_revision)
        if (doc.leader, doc.leader_revision) != writer:
            return None  # the leader in office has not published its store yet
        if not self._written_by(kv, writer, True):
            self._pass_over(kv, f"not written by the leader it names ({doc.leader})")
            return None
        return leader, doc

    def revoke_leader_of(self, ep: Endpoint) -> str:
        """The leader that published `ep` is gone (its port refuses connections: its process
        died, its host answers): end its lease now rather than wait for it to lapse. Never
        another leader's: only the one whose published store is `ep`. Returns what was done."""
        from ftrun.adapters.etcd import EtcdError

        published = self._published()
        if published is None:
            return "no store of a leader in office is published, nothing to revoke"
        leader, doc = published
        if leader.key == self.election.key or Endpoint(doc.host, doc.port) != ep:
            return "another agent leads already, nothing to revoke"
        try:
            self.client.request("lease/revoke", {"ID": leader.lease})
        except EtcdError as exc:
            if "lease not found" not in exc.message:
                raise
            return "its lease has ended already (another survivor revoked it)"
        return "its lease is revoked"

    def deposed(self) -> str | None:
        """Lapsed for a while (not at the first unanswered refresh: while etcd elects a
        raft leader of its own, refreshes go unanswered for seconds and etcd then extends
        every lease), or gone for good."""
        if self.lease.lost and not self._won():
            try:  # a follower's keep-alive may have starved: a new lease if etcd answers
                self._renew_if_lost()
            except FtrunError:
                return "its etcd lease is gone (cut off from the etcd majority)"
        if self.lease.lost:
            return "its etcd lease is gone (cut off from the etcd majority)"
        if not self.lease.lapsed:
            self._lapsed_at = None
            return None
        self._lapsed_at = self._lapsed_at or time.monotonic()
        grace = 0.0 if self._won() else timeouts.ETCD_OUTAGE_FOLLOWER_GRACE_S
        if time.monotonic() - self._lapsed_at >= self.deposed_after_s + grace:
            return (f"the etcd majority at {self.conf.where} did not answer for "
                    f"{self.deposed_after_s:g} s (--rdzv-conf outage_timeout=)")
        return None

    def up(self) -> bool:
        return not self.lease.lapsed

    def describe(self) -> dict[str, Any]:
        """The leader's own view (the coordinator writes the job's status)."""
        leader = None
        if self.election.since is not None and self.index is not None:
            leader = {"node": self.index, "host": self.host, "since": self.election.since}
        return {"backend": self.backend, "endpoints": list(self.conf.endpoints),
                "leader": leader, "leader_changes": self.leader_changes, "up": self.up(),
                "members": self._members()}

    def _members(self) -> list[dict[str, Any]]:
        """Each member's health, asked at most every few seconds (a status per second) from a
        thread of its own: a silent member costs its timeout there, not in the coordinator's
        loop, which decides faults. The rows are the newest answer (empty before the first)."""
        if self._health_asked is not None and self._health_asked.done():
            self._health = self._health_asked.result()
            self._health_asked = None
        if (self._health_asked is None
                and time.monotonic() - self._health[0] >= timeouts.ETCD_HEALTH_EVERY_S):
            self._health_asked = self._health_pool.submit(self._ask_health)
        return self._health[1]

    def _ask_health(self) -> tuple[float, list[dict[str, Any]]]:
        try:
            rows = [{"endpoint": h.endpoint, "up": h.up, "leader": h.is_leader,
                     "raft_term": h.raft_term, "error": h.error}
                    for h in self.client.health(timeouts.ETCD_STATUS_S)]
        except Exception as exc:  # a status never fails on the control plane's state
            rows = [{"endpoint": e, "up": False, "leader": False, "raft_term": 0,
                     "error": first_line(exc)} for e in self.conf.endpoints]
        return time.monotonic(), rows

    def close(self) -> None:
        try:
            if self.election.leading:
                self.election.resign(timeout=timeouts.ETCD_STATUS_S)
            self.lease.revoke(timeout=timeouts.ETCD_STATUS_S)
        except Exception:  # etcd gone: the lease lapses on its own within its TTL
            self.lease.stop()
        finally:
            self._health_pool.shutdown(wait=False, cancel_futures=True)
            self.client.close()


def agent_name() -> tuple[str, str]:
    """(candidate name, host) of this agent: host and pid (several agents may share a host)."""
    host = socket.gethostname()
    return f"{host}.{os.getpid()}", host
