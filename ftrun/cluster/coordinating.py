"""The coordinating agent of a multi-node job: it serves the rendezvous store and decides.

Owns: the node table (who joined; which are lost, as `nodewatch` judges them: all of those
lost in one pass are dropped together, and told so), global rank assignment (nodes in join
order, this node first, ranks contiguous per node as torchrun assigns them), the remote
workers as this agent knows them from their node's reports, starting, stopping and ending
the other nodes' workers through their command queues, and admitting a node into a running
job (a fenced node comes back this way, as a new node). What the job shows of the other
nodes lives in `jobnodes`, how they are let go in `ending`, their planned leaves (notices)
in `drained`; generations and fault decisions stay with `Recovery` and the pure policy.
`Coordinating` is the `agent.cluster.Cluster` an agent is given on the node that serves the
store: it reaches the agent through `NodeHost`, never by subclassing it.
Must not import: typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Callable
from typing import Any

from ftrun.adapters.store import HostedStore, QueueReader
from ftrun.agent.cluster import Handover, StopLocal
from ftrun.agent.jobview import Node
from ftrun.agent.node_losses import NodeLoss
from ftrun.agent.roster import RemoteWorker, RunResult, Worker
from ftrun.cluster.admission import Waiting, gathered, why_refused, why_wait
from ftrun.cluster.directory import JobDirectory
from ftrun.cluster.drained import NodeDrains
from ftrun.cluster.ending import Ending
from ftrun.cluster.host import NodeHost
from ftrun.cluster.jobnodes import NodeTable
from ftrun.cluster.link import AGENT_QUEUE, Endpoint, connect
from ftrun.cluster.messages import (
    Bye,
    Draining,
    End,
    Exited,
    Join,
    Left,
    Pong,
    Report,
    Spawned,
    parse_report,
)
from ftrun.cluster.nodewatch import NodeWatch, Verdict
from ftrun.cluster.plane import C10dPlane, Plane, deposed
from ftrun.cluster.relay import GenerationRelay
from ftrun.cluster.remotes import RemoteWorkers
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError
from ftrun.core.events import notice
from ftrun.core.membership import WorkerRole
from ftrun.core.node_flags import shared_flags
from ftrun.core.policy import Decision, find_lost_nodes
from ftrun.core.states import NodeRole
from ftrun.protocol.rendezvous import Generation
from ftrun.protocol.status import Status

# (the result this coordinator ends with, its `close`) -> the follower it plays on as
StepDown = Callable[[RunResult, Callable[[RunResult | None], None]], RunResult | Handover]


class Coordinating:
    remembered = True  # the job's run: `ftrun report --last` shows it
    role = NodeRole.COORDINATING

    def __init__(self, host: NodeHost, rdzv: HostedStore, ep: Endpoint,
                 plane: Plane | None = None, index: int = 0,
                 step_down: StepDown | None = None, relay: GenerationRelay | None = None
                 ) -> None:
        """`index`: this node's (0, unless it took over from a coordinator that is gone);
        `step_down`: the rest of the run once this agent's leadership ended while the control
        plane answers (it follows the new leader: `cluster.stepdown`); `relay`: its workers'
        generation relay, when it took over as the follower it was (they watch it to the end)."""
        self.host = host
        self.index = index
        self.step_down = step_down
        self.relay = relay
        self._pending: Decision | None = None  # decided while adopting a running attempt
        self.plane = plane or C10dPlane(ep, leading=True)
        self.spec = spec = host.runtime.spec
        self.rdzv = rdzv
        self.ep = ep
        self.nodes: dict[int, Node] = {}
        self.workers = RemoteWorkers()
        self._inbox: queue.SimpleQueue[Report | str] = queue.SimpleQueue()
        self.beat_s = spec.timings.heartbeat
        self.lost_after_s = spec.timings.node_timeout
        self.watch = NodeWatch.from_timings(spec.timings)
        self._reader: QueueReader | None = None
        self._lost_nodes: list[tuple[int, str, float]] = []  # node, why, silent for (s)
        self._waiting = Waiting()  # nodes that joined a running job and wait for room
        self._last_refusal = ""  # named when too few nodes joined: a refused one may be why
        self.table = NodeTable(host, rdzv, ep, self.nodes, self.watch, self.beat_s)
        self.others = JobDirectory(self.nodes, self.workers, self.table)
        self.drained = NodeDrains(host, index, self.plane.backend, self.nodes, self.workers,
                                  self.watch, self.table, self._waiting)  # planned leaves
        self.ending = Ending(spec, self.nodes, self.workers, self.watch, self.table, rdzv,
                             self._inbox, lambda: self.drain_inbox(running=False),
                             self.drained, self.lost_after_s)

    # ----------------------------------------------------------------- lifecycle
    def drive(self, attempts: Callable[[], RunResult]) -> RunResult | Handover:
        result = attempts()
        if self.plane.ousted is None or self.step_down is None:
            return result
        return self.step_down(result, self.close)

    def close(self, result: RunResult | None) -> None:
        """End every other node, or (this node drained, etcd) leave them to the next leader:
        the leadership goes first, so that it is elected as soon as they see the store go."""
        stepping_down = self.drained.stepping_down is not None
        if self.relay is not None:  # its source, the workers' store, has closed
            self.relay.close(link_works=False)
        if stepping_down:
            self.plane.close()
        if self._reader is not None:  # the store was served
            if not stepping_down:
                self.ending.end_nodes(result)
            self._reader.close(self.rdzv.store)
        self.table.close()
        self.rdzv.close()
        if not stepping_down:
            self.plane.close()

    def prepare(self) -> None:
        """After the guardian is forked (no thread may exist before): serve the store."""
        # every follower reached the store through the endpoint host: their workers can too
        self.host.update_attempt(master_addr=self.spec.local_addr or self.ep.host)
        self.rdzv.serve()
        self.plane.served(self.ep)
        self.plane.register(self.index)
        self.rdzv.count_requests()
        self._reader = QueueReader(lambda: connect(self.ep, timeouts.STORE_CLIENT_CONNECT_S),
                                   AGENT_QUEUE, self._deliver, lambda why: None, "ftrun-agents")

    def _deliver(self, raw: str | bytes) -> None:  # reader thread
        self._inbox.put(parse_report(raw))
        self.host.runtime.wakeup.wake()

    # ----------------------------------------------------------------- rendezvous
    def start_group(self, restarts: int, hosted: HostedStore,
                    start_local: Callable[[], None]) -> None:
        self._gather_nodes()
        # in join order, up to --nnodes MAX; the rest wait for room (a node lost)
        order = sorted(self.table.alive(), key=lambda n: n.index)[:self.spec.nnodes_max - 1]
        span = max(1, self.spec.shard_size // self.spec.nproc)  # nodes a replica group spans
        order = order[:len(order) - (1 + len(order)) % span]  # whole groups; the rest wait
        self.host.update_attempt(group_world_size=1 + len(order),
                                 world_size=self.spec.nproc + sum(n.nproc for n in order))
        self.workers.new_attempt()  # nothing of an earlier attempt
        start_local()
        members = list(range(self.spec.nproc))
        for position, node in enumerate(order, start=1):
            members += self._start_node(node, len(members), position)
        self.others.started(tuple(members))

    def _start_node(self, node: Node, base_rank: int, group_rank: int,
                    spare: bool = False) -> list[int]:
        """Tell `node` to start its workers (ranks from `base_rank`; -1: joiners or spares)."""
        ids = self.workers.start(node.index, node.nproc, base_rank)
        self.table.start(node, base_rank, group_rank, ids[0], spare, adopt=False)
        node.entered_attempt()
        return ids

    def _gather_nodes(self) -> None:
        """Wait for the nodes of this attempt: MAX, or MIN and then a last call for more."""
        t, start, enough_at = self.spec.timings, time.monotonic(), None
        while True:
            self.drain_inbox(running=False)
            for index, why in find_lost_nodes(self.watch.beats.ages(self.rdzv.store),
                                              self.lost_after_s):
                self._node_lost(self.nodes[index], why, time.time())  # no attempt runs
            count, now = 1 + len(self.table.alive()), time.monotonic()
            if count >= self.spec.nnodes_min:
                enough_at = enough_at or now
            verdict = gathered(count, (self.spec.nnodes_min, self.spec.nnodes_max), now - start,
                               None if enough_at is None else now - enough_at,
                               t.join_timeout, t.last_call_timeout)
            if verdict is True:
                return
            if verdict:
                raise FtrunError(f"{verdict} at {self.ep} within {t.join_timeout:g} s" + (
                    f" ({self._last_refusal})" if self._last_refusal else ""),
                    hint="start ftrun on the other nodes with the same --rdzv-endpoint and "
                         "flags, or lower --nnodes")
            if self.host.runtime.wakeup.pop_signal() is not None:
                raise FtrunError("interrupted while waiting for nodes to join")
            self.host.runtime.wakeup.wait(self.beat_s)  # a join wakes it at once

    def drain_inbox(self, running: bool) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            match msg:
                case str():
                    notice(self.host.emit, f"ignored a malformed agent message ({msg})")
                case Join():
                    self._on_join(msg)
                case Exited() if (msg.worker in self.workers.by_id
                                  and msg.attempt == self.host.attempt.restarts):
                    self._on_remote_exit(msg)
                case Spawned():
                    self._on_spawned(msg)
                case Left() if msg.node in self.nodes and self.nodes[msg.node].alive:
                    why = f"its agent left ({msg.reason})"
                    if running:
                        self._lost_nodes.append((msg.node, why, 0.0))
                    else:
                        self._node_lost(self.nodes[msg.node], why, time.time())
                case Draining() if msg.node in self.nodes and self.nodes[msg.node].alive:
                    self.drained.asked(msg)
                case Pong():
                    self.watch.answer(msg.node, msg.seq)
                case Bye() if msg.node in self.nodes:
                    self.nodes[msg.node].gone()  # it has ended for good

    def _on_spawned(self, msg: Spawned) -> None:
        started = msg.started()
        if isinstance(started, str):
            notice(self.host.emit, f"ignored a malformed agent message ({started})")
            return
        for wid, local_rank, pid in started:
            if wid in self.workers.by_id:
                self.workers.by_id[wid].spawned(pid, local_rank)
        rec = self.host.recovery
        if msg.node in self.nodes and self.nodes[msg.node].relays_at(msg.relay) and \
                rec is not None:
            rec.gens.inboxes_changed()  # the forwarders are told their groups ahead

    def _on_join(self, msg: Join) -> None:
        node = Node(msg.node, msg.host, msg.pid, msg.nproc, net_drill=msg.net_drill,
                    relay_inbox=msg.relay)  # a takeover: the relay its workers watch on
        taken = node.index in self.nodes and self.nodes[node.index].alive
        refused = why_refused(rdzv_id=self.spec.rdzv_id, flags=shared_flags(self.spec),
                              joining_rdzv_id=msg.rdzv_id, joining_flags=msg.flags,
                              index=node.index, index_taken=taken)
        if refused is not None:
            self.table.send(node, End(code=1, reason=refused, lost=False, refused=True))
            self._last_refusal = f"{node.label} was refused: {refused}"
            notice(self.host.emit, f"{node.label} refused: {refused}")
            return
        self.nodes[node.index] = node
        self.watch.watch(node.index)  # a node waiting to be used can die too
        if msg.running:
            self._adopt_node(node, msg.running)
            return
        notice(self.host.emit, f"{node.label} joined with {node.nproc} workers")
        # while an attempt runs, the main loop's next pass admits it (`_admit_waiting`)

    # ----------------------------------------------------------------- a takeover (etcd)
    def decided(self, decision: Decision | None) -> None:
        """What adopting the running attempt decided (a node lost): the first tick returns
        the first one (the next generation covers every loss found by then)."""
        self._pending = self._pending or decision

    def _adopt_node(self, node: Node, running: str) -> None:
        """A node of the attempt that runs, whose coordinator is gone: its workers go on,
        its agent now follows this one's stores."""
        ids = self.workers.adopt(node.index, running)
        node.entered_attempt()
        self.table.start(node, -1, node.index, 0, spare=False, adopt=True)
        notice(self.host.emit, f"{node.label} came over with {len(ids)} live workers")

    def _admit_waiting(self) -> None:
        """Nodes that joined the running job enter in join order while it has room: at
        once, or when a node is lost; the first that must wait holds the rest back."""
        rec = self.host.recovery
        for node in sorted((n for n in self.table.alive() if not n.in_attempt),
                           key=lambda n: n.index):
            why = why_wait(1 + sum(n.in_attempt for n in self.table.alive()), self.spec.nnodes_max,
                           rec is not None, rec is not None and rec.uses_api) or (
                rec.groups.node_waits(len(self.others.members)) if rec is not None else None)
            if why is not None:
                if self._waiting.news(node.index, why):
                    notice(self.host.emit, f"{node.label} waits: {why}")
                return
            self._waiting.forget(node.index)
            self._admit(node)

    def _admit(self, node: Node) -> None:
        """A node entering a running job: its workers enter at a step boundary and heal, or,
        when the members and the joiners on their way already hold the first world size,
        they wait as spares."""
        rec, host = self.host.recovery, self.host
        assert rec is not None
        group_rank = host.attempt.group_world_size  # never reused within an attempt
        host.update_attempt(group_world_size=group_rank + 1)
        entering = len(rec.membership.members) + len(
            rec.membership.with_role(WorkerRole.JOINING, WorkerRole.READY))
        if entering >= len(self.others.members):
            notice(self.host.emit, f"{node.label} enters the running job as spares: its "
                   f"world size ({len(self.others.members)}) is whole" + (
                       "" if rec.membership.generation else  # late for the start: say why
                       f"; it came after --nnodes MIN and the last call (--rdzv-conf "
                       f"last_call_timeout={self.spec.timings.last_call_timeout:g})"))
            rec.add_spares(self._start_node(node, -1, group_rank, spare=True))
            return
        notice(self.host.emit, f"{node.label} enters the running job")
        host.update_attempt(world_size=entering + node.nproc)
        rec.add_joiners(self._start_node(node, -1, group_rank))

    def _on_remote_exit(self, msg: Exited) -> None:
        w = self.workers.by_id[msg.worker]
        logs = self.host.runtime.services.logs
        self.workers.exited(msg, logs.keep_error(  # its own is on its node
            self.host.attempt.restarts, f"node{w.node}.w{w.worker_id}", msg.error))

    # ----------------------------------------------------------------- supervision hooks
    def remote_exits(self) -> list[RemoteWorker]:
        self.drain_inbox(running=True)
        return self.workers.hand_over()

    def idle_wait(self, local: float | None) -> float | None:
        return self.beat_s

    def on_local_exit(self, w: Worker) -> None:
        pass

    def tick(self, periodic: bool = True) -> Decision | None:
        """`periodic` False: exits decided, published first; heartbeats read next pass."""
        if (why := self.plane.deposed()) is not None:  # another agent may lead by now
            raise deposed(self.plane, f"the coordinator stopped deciding: {why}")  # once
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return pending
        self.table.publish_status()
        self.table.send_net_drills()
        verdict = self.watch.check(self.rdzv.store, lambda: [
            n.index for n in self.table.alive()]) if periodic else Verdict([], None)
        if periodic and self.host.recovery is not None:
            self.host.recovery.gens.warm_relays(time.monotonic())
        self.table.ping(verdict.ping)
        if (stepping_down := self.drained.tick()) is not None:
            return stepping_down  # this node drained (etcd): the job goes on without it
        lost, self._lost_nodes = self._lost_nodes + verdict.lost, []
        now = time.time()
        first = {i: (why, s) for i, why, s in reversed(lost)}  # a node lost twice: once
        gone = [(self.nodes[i], why, now - s) for i, (why, s) in first.items()
                if self.nodes[i].alive]
        for node, _, _ in gone:  # all at once: the decision sees how many nodes are left
            node.gone()
        decision = self._nodes_lost(gone) if gone else None
        if decision is None:  # after the shrink: room for a waiting node grows the job back
            self._admit_waiting()
        return decision

    def suspect(self) -> None:
        """A worker saw a peer's connection break: ping every node of the attempt (a live
        agent answers in ms) and check the heartbeats on a short fuse."""
        self.table.ping(self.watch.suspect([n.index for n in self.table.alive() if n.in_attempt]))

    def _node_lost(self, node: Node, why: str, last_seen: float) -> Decision | None:
        """`last_seen`: wall clock of its last sign of life, the fault's best estimate."""
        return self._nodes_lost([(node, why, last_seen)])

    def _nodes_lost(self, lost: list[tuple[Node, str, float]]) -> Decision | None:
        """Nodes lost in one pass (each marked dead already: the decision sees how many are
        left), told and forgotten one by one, decided together (one O(members) decision,
        not one per node: `agent.node_losses`)."""
        losses, workers = [], []
        for node, why, last_seen in lost:
            node.gone()
            self.watch.forget(node.index)
            self._waiting.forget(node.index)
            notice(self.host.emit, f"{node.label} is lost: {why}")
            self.table.send(node, End(code=1, reason=f"the coordinator dropped this node "
                                      f"({why})", lost=True, refused=False))
            its = self.workers.lost(node.index)
            workers += its
            losses.append(NodeLoss(node.index, node.label, tuple(its), last_seen))
        rec = self.host.recovery
        if rec is not None and rec.uses_api:
            alive = len(self.table.alive())
            left = 1 + alive  # a waiting node keeps the job above --nnodes MIN
            return rec.on_nodes_lost(losses, left, alive - len(self.others.other_nodes()))
        self.workers.also_exited(workers)  # torchrun: a failed member restarts or ends the job
        return None

    # ----------------------------------------------------------------- the job
    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        return self.table.net_down(node, duration)

    def uses_api(self, local: bool) -> bool:
        return local

    def fence_generation(self, gen: Generation) -> None:
        self.plane.record(gen)

    def decorate_status(self, status: Status) -> Status:
        return dataclasses.replace(self.table.decorate_status(status),
                                   control_plane=self.plane.describe())

    def stop_workers(self, sig: int, grace: float, stop_local: StopLocal) -> int | None:
        return self.ending.stop_workers(sig, grace, stop_local)
