"""The coordinator's node drains: a node that will be taken hands its ranks over, then ends.

Owns: `NodeDrains`. A follower's `Draining` (its agent received a notice) starts a drain of
that node's members (`agent.drains`: spares on other nodes take their ranks at a step
boundary, or the job shrinks as it would for a lost node; when fewer than --nnodes MIN nodes
would be left, every member leaves: the job snapshots and requeues). Once that drain is done
the node is ended cleanly: `End` with code 0, no fault, its heartbeat no longer watched, its
spares out of the membership (its agent stops them). This node's own notice on the etcd
control plane (`agent.node`): once its members are served elsewhere, `stepping_down` says
why, and the coordinator lets go of its leadership and its store without ending the other
nodes: etcd elects the next agent in line, which adopts the running attempt (`adoption`).
Under c10d the store goes with this node: its notice requeues the whole job.
Must not import: the agent's node, the coordinating cluster, typer, rich, the CLI, the worker
library.
"""

from __future__ import annotations

import time

from ftrun.agent.drains import Drain
from ftrun.agent.jobview import Node
from ftrun.cluster.admission import Waiting
from ftrun.cluster.host import NodeHost
from ftrun.cluster.jobnodes import NodeTable
from ftrun.cluster.messages import Draining, End
from ftrun.cluster.nodewatch import NodeWatch
from ftrun.cluster.remotes import RemoteWorkers
from ftrun.core.drains import DrainRequest, DrainState
from ftrun.core.events import notice
from ftrun.core.policy import Action, Decision
from ftrun.protocol.rendezvous import node_of


def is_notice(req: DrainRequest, node: int) -> bool:
    """A notice's drain of `node` (agent/notices.py): its node leaves, and no `ftrun drain`
    follows it (no token)."""
    return req.node_leaves and req.node == node and not req.token


class NodeDrains:
    def __init__(self, host: NodeHost, index: int, backend: str, nodes: dict[int, Node],
                 workers: RemoteWorkers, watch: NodeWatch, table: NodeTable,
                 waiting: Waiting) -> None:
        """The coordinating cluster's own node table, workers, watch and waiting line."""
        self.host = host
        self.index = index
        self.backend = backend
        self.nodes = nodes
        self.workers = workers
        self.watch = watch
        self.table = table
        self.waiting = waiting
        self._asked: dict[int, Drain] = {}  # node -> the drain its notice started
        self.stepping_down: str | None = None  # why: this node drained, another one leads

    # ------------------------------------------------------------ a follower's notice
    def asked(self, msg: Draining) -> None:
        node, rec = self.nodes[msg.node], self.host.recovery
        if node.index in self._asked:
            return
        self._say(f"{node.label} will be taken ({msg.reason}): its ranks are handed over "
                  f"within {msg.window_s:g} s")
        if rec is None or not rec.uses_api:
            self._say(f"{node.label}: the job does not recover in-process; the node leaves at "
                      "its window's end")
            return
        members = tuple(m for m in rec.membership.live() if node_of(m) == node.index)
        if not node.in_attempt or not members:
            self.end(node, f"node {node.index} held no rank of the job")
            return
        others = [n for n in self.nodes.values()
                  if n.alive and n.in_attempt and n.index != node.index]
        what = f"node {node.index} ({msg.reason})"
        least = self.host.runtime.spec.nnodes_min
        if 1 + len(others) < least:  # the job cannot go on without it
            members = rec.membership.live()
            what += f", below --nnodes minimum {least} without it: every member leaves"
        req = DrainRequest(what, members, time.time() + max(0.0, msg.window_s),
                           node_leaves=True, node=node.index)
        self._asked[node.index] = rec.drains.start(req)

    def tick(self) -> Decision | None:
        """End the nodes whose drain is done; SUCCEED once this node's own is (etcd)."""
        for index, drain in list(self._asked.items()):
            node = self.nodes[index]
            if not node.alive:  # lost meanwhile (its window ran out, its link went down)
                del self._asked[index]
            elif drain.state is DrainState.DONE:
                del self._asked[index]
                self.end(node, drain.reason)
            elif drain.state is DrainState.REFUSED:
                del self._asked[index]
                self._say(f"{node.label} cannot be drained ({drain.reason}); it leaves at its "
                          "window's end, as a lost node")
        return self._own_done()  # REQUEUE: the recovery ends the attempt for its scheduler

    def end(self, node: Node, why: str) -> None:
        """`node` leaves the job cleanly: no fault; its agent stops what is left there."""
        node.gone()
        self.watch.forget(node.index)
        self.waiting.forget(node.index)
        left = self.workers.lost(node.index, drained=True)  # its reports of them: expected
        rec = self.host.recovery
        if rec is not None:
            rec.membership.leave(w.worker_id for w in left)
            rec.spares.forget_node(node.index)
        self.table.send(node, End(code=0, reason=why, lost=False, refused=False))
        self._say(f"{node.label} drained; it leaves the job ({why})")

    # ------------------------------------------------------------ this node's own notice
    def _own_done(self) -> Decision | None:
        rec = self.host.recovery
        if self.backend != "etcd" or self.stepping_down is not None or rec is None:
            return None
        own = [d for d in rec.drains.all if is_notice(d.request, self.index)]
        if not own or own[-1].state is not DrainState.DONE:
            return None
        self.stepping_down = (f"node {self.index} drained ({own[-1].reason}); this agent "
                              "lets go of the coordinator's role: etcd elects the next agent "
                              "in line, which adopts the running job")
        self._say(self.stepping_down)
        return Decision(Action.SUCCEED, self.stepping_down)

    def _say(self, text: str) -> None:
        notice(self.host.emit, text)
