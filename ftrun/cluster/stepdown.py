"""A coordinator whose leadership ended while etcd answers goes on as a follower.

Owns: `rejoin`, the rest of the run of a deposed coordinator (`Plane.ousted`: its etcd lease
ended while it did not run, a pause or a starved host; or etcd refused its write) once its
attempt is over and its workers are stopped: the way a fenced follower comes back, within
`--rdzv-conf rejoin_timeout=` (0: it leaves with one line), it takes a new seat in etcd (a
new lease, a place in line), finds the store the new leader published, lets go of what it
served, and joins that store as a new node, whose new workers enter the running job (or wait
as spares) as a fenced follower's do. Nothing it decided before counts: etcd refused it.
Must not import: the agent's node, the following cluster (it is handed the class), typer,
rich, the CLI, the worker library.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ftrun.agent.cluster import Cluster, Handover
from ftrun.agent.roster import RunResult
from ftrun.cluster.host import NodeHost
from ftrun.cluster.link import Endpoint
from ftrun.cluster.plane import EtcdPlane, Plane, agent_name
from ftrun.core.errors import FtrunError
from ftrun.core.events import FailureFields, emit_as, notice

Follower = Callable[[NodeHost, Endpoint, Plane], Cluster]  # cluster.following.Following
CloseOld = Callable[[RunResult | None], None]  # the deposed coordinator's `close`


def rejoin(host: NodeHost, old: Plane, follower: Follower, result: RunResult,
           close_old: CloseOld) -> RunResult | Handover:
    """The follower of the new leader this node plays on as, or `result` (exit 1, saying
    why it could not rejoin) when no new leader's store is found within the rejoin window."""
    assert isinstance(old, EtcdPlane) and old.ousted is not None
    rejoin_s = host.runtime.spec.timings.rejoin_timeout
    if rejoin_s <= 0:
        return _ended(host, result, f"{old.ousted}; --rdzv-conf rejoin_timeout=0")
    notice(host.emit, "this agent coordinates the job no more; it joins the job "
                      "again as a follower of the new leader (trying for up to "
                      f"{rejoin_s:g} s)")
    name, hostname = agent_name()
    try:
        plane = EtcdPlane(old.conf, name, hostname, old.records.notice)
    except FtrunError as exc:
        return _ended(host, result, f"{old.ousted}; no new seat in etcd: {exc.message}")
    try:
        ep = plane.wait_store(rejoin_s, lambda: bool(host.runtime.wakeup.signals))
    except FtrunError as exc:
        plane.close()
        return _ended(host, result, f"{old.ousted}; {exc.message}")
    close_old(result)  # its store, its seat in etcd: the keys on its old lease go with it
    return Handover(follower(host, ep, plane))


def _ended(host: NodeHost, result: RunResult, reason: str) -> RunResult:
    emit_as(host.emit, FailureFields(reason))
    return dataclasses.replace(result, reason=reason)
