"""A follower whose coordinator is gone (etcd): take over, follow the new one, or fence.

Owns: `Leaderless` (the store of the coordinator was lost while this node's etcd lease
lives, so the coordinator's host, not this node, is the likely casualty) and `succeed`: stand
in the election until a leader holds office; if it is this agent, it coordinates the job from
here (`adoption`), keeping this node's workers; if it is another, this node joins the store
that one published, with its workers still running. A node that finds the same store as
before (the coordinator lives: only the link to it is cut), or none within
`ETCD_SUCCESSION_S`, fences as it would without etcd.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import errno
import functools
import time
from dataclasses import dataclass
from typing import Any

from ftrun.adapters.store import HostedStore
from ftrun.agent.cluster import Handover
from ftrun.cluster.adoption import adopt
from ftrun.cluster.coordinating import Coordinating
from ftrun.cluster.host import NodeHost
from ftrun.cluster.link import Endpoint, connect, reach
from ftrun.cluster.messages import workers_text
from ftrun.cluster.plane import EtcdPlane, Plane
from ftrun.cluster.relay import GenerationRelay, connector
from ftrun.cluster.stepdown import Follower, rejoin
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError, first_line
from ftrun.core.events import notice
from ftrun.protocol.rendezvous import Generation


@dataclass(frozen=True)
class Leaderless:
    why: str
    at: float  # wall clock: when this node lost the coordinator's store


@dataclass(frozen=True)
class Rejoin:
    """Join the new coordinator's store (`link`, at `ep`) with these workers running."""

    link: Any
    ep: Endpoint
    running: str


def leaderless(plane: Plane, relay: GenerationRelay | None, why: str) -> Leaderless | None:
    """etcd: the coordinator's store lost while this node's lease lives, with workers that
    follow generations through the relay: a new coordinator can adopt them. None: fence."""
    if plane.backend != "etcd" or relay is None or plane.deposed() is not None:
        return None
    return Leaderless(why, time.time())


def succeed(host: NodeHost, plane: Plane, index: int, old: Endpoint,
            relay: GenerationRelay | None, lost: Leaderless, follower: Follower
            ) -> Handover | Rejoin | str:
    """The coordinating role this agent plays on as (it won the election: the relay goes
    with it), a store to rejoin, or why this node must fence. `follower`: what this agent
    becomes if, coordinating, it is deposed in turn (`stepdown`)."""
    assert isinstance(plane, EtcdPlane) and relay is not None  # as `leaderless` found
    deadline = time.monotonic() + timeouts.ETCD_SUCCESSION_S
    _end_a_dead_leaders_lease(host, plane, old)
    while time.monotonic() < deadline and not host.runtime.wakeup.signals:
        try:
            if plane.lead(timeouts.ETCD_CAMPAIGN_TRY_S):
                return _take_over(host, plane, index, relay, lost, follower)
            ep = plane.store_now()
        except FtrunError as exc:
            return f"{lost.why}; etcd: {exc.message}"
        if ep is not None and ep != old:
            try:
                return Rejoin(connect(ep, timeouts.CONNECT_TRY_S), ep, running(host))
            except FtrunError as exc:
                return f"{lost.why}; the new coordinator's store at {ep}: {first_line(exc)}"
    return (f"{lost.why}; no new coordinator in etcd within {timeouts.ETCD_SUCCESSION_S:g} s"
            if not host.runtime.wakeup.signals else lost.why)


def _end_a_dead_leaders_lease(host: NodeHost, plane: EtcdPlane, old: Endpoint) -> None:
    """A refused connection means the coordinator's process is gone while its host answers
    (a crash, a kill): nobody is left to hold its lease, so it is revoked at once and the
    election goes on without waiting out the TTL. A silent host (or a cut link) is not
    proven dead: its lease lapses on its own. Every outcome is a notice: which of the two
    a succession took explains its time."""
    failed = probe_refusal(old)
    if failed is None or failed.errno != errno.ECONNREFUSED:
        how = "accepts connections" if failed is None else f"does not answer ({failed})"
        notice(host.emit, f"the coordinator's store at {old} {how}: its etcd "
                          "lease is left to lapse")
        return
    try:
        outcome = plane.revoke_leader_of(old)
    except FtrunError as exc:  # etcd busy or away: the lease lapses on its own
        notice(host.emit, f"the coordinator's store at {old} refuses "
                          f"connections; revoking its lease failed: {exc.message}")
        return
    notice(host.emit, f"the coordinator's store at {old} refuses connections: "
                      f"{outcome}")


def probe_refusal(old: Endpoint) -> OSError | None:
    """The first refusal at `old` within DEAD_STORE_PROBE_S, else the last probe's outcome
    (None: it accepted every probe). A dying process's listening socket may outlive its
    connections by a moment, so one accepted probe does not prove it alive."""
    deadline = time.monotonic() + timeouts.DEAD_STORE_PROBE_S
    while True:
        failed = reach(old, timeouts.CONNECT_TRY_S)
        if failed is not None and failed.errno == errno.ECONNREFUSED:
            return failed
        if failed is not None or time.monotonic() >= deadline:
            return failed  # silent (a timeout, unreachable), or alive all along
        time.sleep(timeouts.DEAD_STORE_PROBE_GAP_S)


def running(host: NodeHost) -> str:
    return workers_text((w.worker_id, w.local_rank, w.spawned.pid)
                        for w in host.runtime.workers.alive())


def _take_over(host: NodeHost, plane: EtcdPlane, index: int, relay: GenerationRelay,
               lost: Leaderless, follower: Follower) -> Handover:
    held = _held(relay, plane)
    if held is None:
        raise FtrunError("no generation to take over: neither etcd nor this node's relay "
                         "holds one", hint="the job had not started: start it again")
    hosted = HostedStore(0)  # a free port on every interface
    ep = Endpoint(host.runtime.spec.local_addr or plane.host, hosted.port)
    coord = Coordinating(host, hosted, ep, plane, index=index,
                         step_down=functools.partial(rejoin, host, plane, follower), relay=relay)
    registered = plane.registered()
    plane.took_office()
    notice(host.emit, f"the coordinator is gone ({lost.why}): node {index} "
                      f"coordinates the job now, its store at {ep}")

    def follow(addr: str, port: int) -> None:
        relay.follow(connector(f"{addr}:{port}"))

    return Handover(coord, lambda store: adopt(coord, store, held, registered, follow,
                                               lost.at))


def _held(relay: GenerationRelay, plane: EtcdPlane) -> Generation | None:
    """The generation to adopt: this node's relayed copy (what its workers hold, copied from
    the lost leader's own store), else the record the lost leader wrote to etcd before any
    worker saw it (read only if that leader wrote it: `EtcdPlane.held_generation`)."""
    written = plane.held_generation()  # read either way: a forged record is said, once
    relayed = relay.latest()
    return relayed if relayed is not None else written
