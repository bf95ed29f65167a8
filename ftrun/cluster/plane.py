"""The control plane a multi-node job's agents share: who coordinates, and where its store is.

Owns: `Plane`, what a coordinating or following cluster asks of it, and its two backends.
`C10dPlane`: torchrun's c10d rendezvous, where the agent that can bind `--rdzv-endpoint` is
the coordinator for the whole run (its host is the job's single point of failure).
`EtcdPlane` (`--rdzv-backend etcd`): every agent holds an etcd lease and stands in etcd's
election; the leader serves the agents' store on its own host and publishes its endpoint
with a write fenced on its leadership (a deposed leader's write is refused by etcd); the
others read the endpoint of the leader that holds office now, never a stale one.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from ftrun.adapters.etcd_conf import EtcdConf
from ftrun.cluster.link import Endpoint
from ftrun.core import timeouts
from ftrun.core.errors import Deposed, FtrunError, first_line

STORE_KEY = "store"  # under the job's prefix: the agents' store of the leader in office
LEADER_PREFIX = "leader/"  # the election's keys
NODES_PREFIX = "nodes/"  # nodes/<index>: each node's agent, on its lease
GENERATION_KEY = "generation"  # the newest generation record, written under the leadership


class Plane(Protocol):
    backend: str
    leader_changes: int

    def served(self, ep: Endpoint) -> None:
        """The coordinator serves the agents' store at `ep` now: say where."""
    def register(self, index: int) -> None:
        """This agent is node `index` of the job."""
    def store_now(self) -> Endpoint | None:
        """The store of the coordinator in office (None: none published, or it never moves)."""
    def record(self, number: int, record: str) -> None:
        """Before generation `number` is published: write it under this agent's leadership
        (etcd: a fenced write, retried through an outage; a deposed leader's raises)."""
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

    def record(self, number: int, record: str) -> None:
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

    def __init__(self, conf: EtcdConf, node: str, host: str) -> None:
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
        value = json.dumps({"host": ep.host, "port": ep.port, "leader": self.election.key})
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

    def record(self, number: int, record: str) -> None:
        """A generation is written under this agent's leadership before any worker sees it:
        refused (deposed), it never reaches them. Through an etcd outage the write is retried
        (the job's other work goes on meanwhile) until the conf's outage_timeout."""
        from ftrun.adapters.etcd import EtcdError

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

    def held_generation(self) -> str | None:
        """The newest generation a leader wrote (the JSON record), or None."""
        kv = self.client.get(self.conf.prefix + GENERATION_KEY)
        return None if kv is None else kv.value.decode()

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
        kvs = self.client.get_prefix(self.conf.prefix + NODES_PREFIX)
        return {int(kv.key.rsplit("/", 1)[1]) for kv in kvs}

    def store_now(self) -> Endpoint | None:
        """The store of the leader in office now, or None (no leader, or not published)."""
        leader = self.election.leader()
        kv = self.client.get(self.conf.prefix + STORE_KEY)
        if leader is None or kv is None:
            return None
        doc = json.loads(kv.value or b"{}")
        if doc.get("leader") != leader.key:
            return None
        return Endpoint(str(doc["host"]), int(doc["port"]))

    def revoke_leader_of(self, ep: Endpoint) -> str:
        """The leader that published `ep` is gone (its port refuses connections: its process
        died, its host answers): end its lease now rather than wait for it to lapse. Never
        another leader's: only the one whose published store is `ep`. Returns what was done."""
        from ftrun.adapters.etcd import EtcdError

        leader = self.election.leader()
        kv = self.client.get(self.conf.prefix + STORE_KEY)
        if leader is None or kv is None:
            return "no leader holds office, nothing to revoke"
        doc = json.loads(kv.value or b"{}")
        if (leader.key == self.election.key or doc.get("leader") != leader.key
                or Endpoint(str(doc["host"]), int(doc["port"])) != ep):
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
