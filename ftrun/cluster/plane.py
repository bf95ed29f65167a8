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
from typing import TYPE_CHECKING, Protocol

from ftrun.adapters.etcd_conf import EtcdConf
from ftrun.cluster.etcd_keys import (
    GENERATION_KEY,
    LEADER_PREFIX,
    NODES_PREFIX,
    STORE_KEY,
    generation_value,
    store_value,
)
from ftrun.cluster.link import Endpoint
from ftrun.core import timeouts
from ftrun.core.errors import Deposed, FtrunError, SteppingDown, first_line
from ftrun.protocol.rendezvous import Generation
from ftrun.protocol.status import ControlPlane, EtcdMember, Leader

if TYPE_CHECKING:
    from ftrun.cluster.etcd_reads import JobRecords

Notice = Callable[[str], None]


def _quiet(text: str) -> None:
    pass


class Plane(Protocol):
    backend: str
    leader_changes: int
    ousted: str | None  # why this agent's leadership ended while the control plane answers

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
    def describe(self) -> ControlPlane:
        """`control_plane` in `ftrun status --json`."""
    def close(self) -> None: ...


class C10dPlane:
    """torchrun's c10d backend: the endpoint's host coordinates for the whole run."""

    backend = "c10d"
    leader_changes = 0
    ousted: str | None = None  # the endpoint's host coordinates for the whole run

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

    def describe(self) -> ControlPlane:
        return ControlPlane(backend=self.backend, endpoints=(str(self.ep),),
                            leader=Leader(node=0, host=self.ep.host, since=self.since),
                            leader_changes=0, up=True, members=())

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
        from ftrun.cluster.etcd_reads import JobRecords

        self.conf = conf
        self.host = host
        self.client = EtcdClient(conf)
        self.lease = grant(self.client, conf.lease_ttl)
        self.election = Election(self.client, conf.prefix + LEADER_PREFIX, self.lease, node,
                                 host)
        self.records: JobRecords = JobRecords(self.client, conf.prefix, notice)
        self.leader_changes = 0
        self.index: int | None = None  # this agent's node, once it joined the job
        self.ousted: str | None = None  # why its leadership ended while etcd answers
        self.deposed_after_s = conf.outage_timeout
        self._lapsed_at: float | None = None
        self._asked_at = -math.inf  # when a leader whose lease may have lapsed asked etcd
        self._health: tuple[float, tuple[EtcdMember, ...]] = (-math.inf, ())
        self._health_pool = ThreadPoolExecutor(1, thread_name_prefix="etcd-health")
        self._health_asked: Future[tuple[float, tuple[EtcdMember, ...]]] | None = None

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
                self.ousted = (f"this agent lost the leadership before generation {number} "
                               "was written: etcd refused it (another agent coordinates the "
                               "job)")
                raise SteppingDown(self.ousted, hint="its workers stop; the job goes on under "
                                                     "the new leader")
            except EtcdError as exc:
                if time.monotonic() >= deadline:
                    raise Deposed(f"etcd did not take generation {number} within "
                                  f"{self.deposed_after_s:g} s ({exc.message})",
                                  hint="bring the etcd majority back") from None
            time.sleep(timeouts.ETCD_RETRY_S)

    # -- what the leader in office wrote (etcd_reads) --------------------------------------
    def store_now(self) -> Endpoint | None:
        """The store of the leader in office now, or None (no leader, or not published)."""
        return self.records.store_now()

    def held_generation(self) -> Generation | None:
        """The newest generation a leader of this job wrote (checked), or None."""
        return self.records.held_generation()

    def registered(self) -> set[int]:
        """The nodes whose agents' leases live."""
        return self.records.registered()

    def revoke_leader_of(self, ep: Endpoint) -> str:
        """End the lease of the lost leader that published `ep` (never another's)."""
        return self.records.revoke_leader_of(ep, self.election.key)

    # -- this agent's seat -----------------------------------------------------------------
    def took_office(self) -> None:
        """This agent took over from a lost coordinator (`leader_changes` in the status)."""
        self.leader_changes += 1

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

    def deposed(self) -> str | None:
        """Why this agent may no longer act for the job, or None. A leader whose lease may
        have lapsed asks etcd at once (back from a pause, it must not decide before it knows);
        one that etcd says lost it is `ousted`. Otherwise lapsed for a while (not at the first
        unanswered refresh: while etcd elects a raft leader of its own, refreshes go
        unanswered for seconds and etcd then extends every lease)."""
        if self._won():
            self._ask_if_lapsed()
            if self.lease.lost:
                self.ousted = self.ousted or self._lease_ended()
                return self.ousted
        elif self.lease.lost:
            try:  # a follower's keep-alive may have starved: a new lease if etcd answers
                self._renew_if_lost()
            except FtrunError:
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

    def _ask_if_lapsed(self) -> None:
        """At most once per refresh interval, a short question (an etcd outage costs the
        coordinator's loop ETCD_LEASE_ASK_S each time, no more)."""
        now = time.monotonic()
        if (self.lease.lapsed and not self.lease.lost
                and now - self._asked_at >= self.lease.every):
            self._asked_at = now
            self.lease.ask(timeouts.ETCD_LEASE_ASK_S)

    def _lease_ended(self) -> str:
        """What ended a leader's lease while etcd answers (it said the lease is gone)."""
        away = self.lease.away_s()
        if away >= self.lease.every:
            return (f"its etcd lease expired while this agent did not run for {away:.1f} s "
                    "(paused, or starved of CPU); etcd answers, so another agent may lead the "
                    "job by now")
        return ("etcd no longer knows its lease (its refreshes did not reach etcd in time, or "
                "another agent revoked it); etcd answers, so another agent may lead the job "
                "by now")

    def up(self) -> bool:
        return not self.lease.lapsed

    def describe(self) -> ControlPlane:
        """The leader's own view (the coordinator writes the job's status)."""
        leader = None
        if self.election.since is not None and self.index is not None:
            leader = Leader(node=self.index, host=self.host, since=self.election.since)
        return ControlPlane(backend=self.backend, endpoints=tuple(self.conf.endpoints),
                            leader=leader, leader_changes=self.leader_changes, up=self.up(),
                            members=self._members())

    def _members(self) -> tuple[EtcdMember, ...]:
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

    def _ask_health(self) -> tuple[float, tuple[EtcdMember, ...]]:
        try:
            rows = tuple(EtcdMember(endpoint=h.endpoint, up=h.up, leader=h.is_leader,
                                    raft_term=h.raft_term, error=h.error)
                         for h in self.client.health(timeouts.ETCD_STATUS_S))
        except Exception as exc:  # a status never fails on the control plane's state
            rows = tuple(EtcdMember(endpoint=e, up=False, leader=False, raft_term=0,
                                    error=first_line(exc)) for e in self.conf.endpoints)
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


def deposed(plane: Plane, text: str) -> Deposed:
    """The error that ends a coordinator's decisions: `SteppingDown` when another agent
    leads while the control plane answers (this one will follow it), else `Deposed`."""
    if plane.ousted is not None:
        return SteppingDown(text, hint="it stops its workers and joins the job again as a "
                                       "follower of the new leader")
    return Deposed(text)


def agent_name() -> tuple[str, str]:
    """(candidate name, host) of this agent: host and pid (several agents may share a host)."""
    host = socket.gethostname()
    return f"{host}.{os.getpid()}", host
