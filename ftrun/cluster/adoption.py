"""A new coordinator adopting the attempt that runs (etcd): its nodes, workers and generation.

Owns: `adopt`, run by the agent elected after the coordinator's host was lost. It waits (a
bounded while) for the nodes whose agents still hold their etcd leases to join it with the
workers they run, rebuilds the membership from the newest generation this node's relay
holds (its members, and every other live worker as a ready spare), and hands the members
that ran on nodes that did not come back to `Recovery` as a node loss: the next generation,
published on the new store and naming it, brings the survivors together there. With no
member lost (the coordinator's node drained before it stepped down), that generation is a
planned one with the same members: they move to the new store at a step boundary.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from ftrun.adapters.report import WorkerExit
from ftrun.adapters.store import HostedStore
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import RemoteWorker
from ftrun.cluster.coordinating import Coordinating
from ftrun.cluster.link import NODE_COUNTER
from ftrun.core import timeouts
from ftrun.core.events import notice
from ftrun.core.membership import Membership, View
from ftrun.protocol.rendezvous import Generation, node_of

FollowRelay = Callable[[str, int], None]  # this node's relay: copy from this store now


def adopt(coord: Coordinating, workers_store: HostedStore, held: Generation,
          registered: set[int], follow_relay: FollowRelay, lost_at: float) -> Recovery:
    host = coord.host
    follow_relay(host.attempt.master_addr, workers_store.port)  # this node's workers watch it
    _await_nodes(coord, registered - {coord.index}, timeouts.ETCD_REJOIN_WAIT_S)
    alive = {w.worker_id for w in host.runtime.workers.alive()} | {
        w.worker_id for w in coord.workers.by_id.values() if w.alive}
    spares = [w for w in sorted(alive) if w not in held.members]
    rec = Recovery(host.runtime.port, workers_store.store,
                   Membership.adopted(View(held.number, held.members), spares),
                   store_at=f"{host.attempt.master_addr}:{workers_store.port}")
    coord.others.ranked_as(held)
    host.update_attempt(world_size=len(held.members),
                        group_world_size=1 + len(coord.others.other_nodes()))
    lost = [m for m in held.members if m not in alive]
    notice(host.emit, f"took over generation {held.number} of {len(alive)} "
                      f"live workers; {len(lost)} of its members are lost")
    for node in sorted({node_of(m) for m in lost}):
        gone = [_lost_worker(held, m, node, lost_at) for m in lost if node_of(m) == node]
        left = 1 + len(coord.others.other_nodes())
        coord.decided(rec.on_node_lost(node, f"node {node} (the coordinator's)", list(gone),
                                       left, lost_at))
    if not lost:  # no member lost (the coordinator's node had drained): the members move here
        rec.gens.publish(held.members, f"node {coord.index} coordinates the job now: the "
                         "members move to its workers' store at "
                         f"{host.attempt.master_addr}:{workers_store.port}", False)
    return rec


def _lost_worker(held: Generation, wid: int, node: int, at: float) -> RemoteWorker:
    rank = held.members.index(wid)
    return RemoteWorker(rank, -1, wid, node, exit=WorkerExit(
        rank=rank, local_rank=-1, pid=0, returncode=-int(signal.SIGKILL),
        detected_at=time.monotonic(), wall_time=at, error_file="", killed_by_launcher=False))


def _await_nodes(coord: Coordinating, nodes: set[int], timeout_s: float) -> None:
    """Until every node in `nodes` joined (or `timeout_s`): the survivors of the takeover,
    whose agents still hold their etcd leases. Nodes joining later get new indices."""
    deadline = time.monotonic() + timeout_s
    coord.rdzv.store.add(NODE_COUNTER, max(nodes | {coord.index}))
    while time.monotonic() < deadline and not nodes <= set(coord.nodes):
        coord.drain_inbox(running=False)
        coord.host.runtime.wakeup.wait(0.05)
