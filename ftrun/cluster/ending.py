"""How the coordinator lets the other nodes go: the job's end, a stop, or stepping down.

Owns: `Ending`: at the run's end every live node is sent `End` with the run's code and its
goodbye waited for (followers disconnect before the store goes: c10d prints a stack trace if
not); a stop of the attempt's workers on every node of the attempt and on this one, waited
for until their exits came or the grace is over; and the nodes passed over meanwhile: one
whose heartbeat is silent past the node timeout will not answer (it follows another leader,
or is cut off). When this node drained on the etcd control plane (`drained.stepping_down`),
the others are neither stopped nor ended: they go on under the next leader.
Must not import: the agent's node, the coordinating cluster, typer, rich, the CLI, the worker
library.
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Callable

from ftrun.adapters.store import HostedStore
from ftrun.agent.cluster import StopLocal
from ftrun.agent.jobview import Node
from ftrun.agent.roster import RunResult
from ftrun.cluster.drained import NodeDrains
from ftrun.cluster.jobnodes import NodeTable
from ftrun.cluster.messages import Bye, End, Left, Report, Stop
from ftrun.cluster.nodewatch import NodeWatch
from ftrun.cluster.remotes import RemoteWorkers
from ftrun.core import timeouts
from ftrun.core.spec import RunSpec

Inbox = queue.SimpleQueue[Report | str]


class Ending:
    def __init__(self, spec: RunSpec, nodes: dict[int, Node], workers: RemoteWorkers,
                 watch: NodeWatch, table: NodeTable, rdzv: HostedStore, inbox: Inbox,
                 drain_inbox: Callable[[], None], drained: NodeDrains,
                 lost_after_s: float) -> None:
        """The coordinating cluster's own parts; `drain_inbox`: act on its reports now."""
        self.spec = spec
        self.nodes = nodes
        self.workers = workers
        self.watch = watch
        self.table = table
        self.rdzv = rdzv
        self.inbox = inbox
        self.drain_inbox = drain_inbox
        self.drained = drained
        self.lost_after_s = lost_after_s

    def end_nodes(self, result: RunResult | None) -> None:
        """Every live node ends with the run's code (None: the coordinator failed)."""
        code = result.exit_code if result is not None else 1
        reason = result.reason if result is not None else "the coordinator failed"
        ending = self.table.alive()
        for node in ending:
            self.table.send(node, End(code=code, reason=reason, lost=False, refused=False))
        self._await_byes({n.index for n in ending})

    def _await_byes(self, nodes: set[int]) -> None:
        deadline = time.monotonic() + timeouts.THREAD_JOIN_S + self.spec.shutdown_timeout
        while nodes and time.monotonic() < deadline:
            try:
                msg = self.inbox.get(timeout=0.05)
            except queue.Empty:
                nodes -= self.drop_silent()
                continue
            if isinstance(msg, (Bye, Left)):
                nodes.discard(msg.node)

    def stop_workers(self, sig: int, grace: float, stop_local: StopLocal) -> int | None:
        if self.drained.stepping_down is not None:  # the others go on under the next leader
            return stop_local(sig, grace)
        for node in [n for n in self.table.alive() if n.in_attempt]:
            self.table.send(node, Stop(signal=int(sig), grace=grace))
            node.left_attempt()
        deadline = time.monotonic() + grace + timeouts.KILL_REAP_S
        received = stop_local(sig, grace)
        while time.monotonic() < deadline and any(
                w.alive and self.nodes[w.node].alive for w in self.workers.by_id.values()):
            self.drain_inbox()
            self.drop_silent()
            time.sleep(0.02)
        return received

    def drop_silent(self) -> set[int]:
        """A node whose heartbeat is silent past the node timeout will not answer (it follows
        another leader, or is cut off), so it is not waited for; the silent ones."""
        try:
            ages = self.watch.beats.ages(self.rdzv.store)
        except Exception:  # the store itself is gone: nothing to wait for through it
            ages = {n.index: math.inf for n in self.table.alive()}
        silent = {i for i, age in ages.items() if age > self.lost_after_s}
        for index in silent & set(self.nodes):
            self.nodes[index].gone()
        return silent
