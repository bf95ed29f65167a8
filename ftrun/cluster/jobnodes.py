"""The coordinator's table of the other nodes and what it shows of them.

Owns: the node table's reads (live nodes, their heartbeat payloads, read at most once per
beat), the whole job's status (`ftrun status` on any node: published in the store every
second), a remote worker's last committed step and liveness for the health watch, and the
net-down drill: node 0's acted out here, another node's checked against what it said when
it joined, then sent to it.
Must not import: typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

import json
import queue
import time
from typing import Any

from ftrun.adapters.store import HostedStore
from ftrun.agent.jobview import Node, merge_job_status
from ftrun.agent.node import Agent
from ftrun.cluster.link import STATUS_KEY, Endpoint, command_queue, read_payloads
from ftrun.cluster.messages import Command, NetDown, send
from ftrun.cluster.netdrill import NetDrills, check_duration, refuse
from ftrun.cluster.nodewatch import NodeWatch
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError
from ftrun.core.events import Event
from ftrun.core.policy import Liveness
from ftrun.protocol.rendezvous import node_of


class NodeTable(Agent):
    rdzv: HostedStore
    ep: Endpoint
    nodes: dict[int, Node]
    beat_s: float
    watch: NodeWatch
    _payloads: dict[int, tuple[float, dict[str, Any]]]
    _next_status: float
    _net: NetDrills | None
    _net_drills: queue.SimpleQueue[tuple[int, float]]

    def _send(self, node: Node, cmd: Command) -> None:
        send(self.rdzv.store, command_queue(node.index), cmd)  # our own store

    def _alive(self) -> list[Node]:
        return [n for n in list(self.nodes.values()) if n.alive]  # the control thread too

    def committed_step(self, worker_id: int) -> int:
        node = node_of(worker_id)
        if node == 0:
            return super().committed_step(worker_id)
        doc = self._payload(node)
        step = next((w.get("step") for w in doc.get("workers", [])
                     if w.get("worker_id") == worker_id), None)
        return -1 if step is None else int(step)

    def remote_liveness(self) -> list[Liveness]:
        nodes = [n for n in self._alive() if n.in_attempt]
        return [Liveness(**d) for n in nodes for d in self._payload(n.index).get("liveness", [])]

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        """Control thread: node 0's drill here; another node's is checked, then sent to it
        from the main loop (which owns the store connection)."""
        check_duration(duration)
        if node == 0:
            if self._net is None:
                self._net = NetDrills(self.ep.host, self.emit)
            return self._net.start(0, duration)
        target = self.nodes.get(node)
        if target is None or not target.alive:
            live = ", ".join(str(n.index) for n in self._alive())
            raise FtrunError(f"no live node {node} in this job (nodes: 0{', ' if live else ''}"
                             f"{live})", hint="see the nodes with `ftrun status`")
        if target.net_drill:
            raise refuse(node, target.net_drill)
        self._net_drills.put((node, duration))
        self.wake()
        return {"node": node, "host": target.host, "duration": duration}

    def _send_net_drills(self) -> None:
        while True:
            try:
                node, duration = self._net_drills.get_nowait()
            except queue.Empty:
                break
            if self.nodes[node].alive:
                self._send(self.nodes[node], NetDown(duration=duration))
        if self._net is not None:
            self._net.check()

    # ----------------------------------------------------------------- status
    def decorate_status(self, doc: dict[str, Any]) -> dict[str, Any]:
        nodes = list(self.nodes.values())  # the control thread reads while the loop adds
        payloads = {n.index: self._payload(n.index) for n in nodes if n.alive}
        membership = self.recovery.membership if self.recovery is not None else None
        doc = super().decorate_status(doc)  # this node's zygote and snapshots
        doc = merge_job_status(doc, nodes, payloads, membership, self.world_size, str(self.ep))
        return {**doc, "rdzv_store_ops": getattr(self.rdzv.store, "calls", None)}

    def _payload(self, node: int) -> dict[str, Any]:
        """Every node's payload is read at once, at most once per heartbeat period: a fault,
        the health watch or a status asks for every member's."""
        now = time.monotonic()
        seen_at, doc = self._payloads.get(node, (-1.0, {}))
        if now - seen_at >= self.beat_s:
            self._read_payloads(now)
            doc = self._payloads.get(node, (now, {}))[1]
        return doc

    def _read_payloads(self, now: float) -> None:
        """One request for every live node that has beaten (a payload is set before the
        first beat); one that has not shows nothing yet."""
        live = {n.index for n in self._alive()}
        nodes = [n for n in self.watch.beats.beaten() if n in live]
        self._payloads = {n: (now, {}) for n in live}
        for node, doc in zip(nodes, read_payloads(self.rdzv.store, nodes), strict=True):
            self._payloads[node] = (now, doc)

    def _publish_status(self) -> None:
        now = time.monotonic()
        if now < self._next_status:
            return
        self._next_status = now + timeouts.STATUS_EVERY_S
        try:
            self.rdzv.store.set(STATUS_KEY, json.dumps(self.control_plane.status()))
        except Exception as exc:  # a status snapshot must never stop the job
            self.emit(Event.NOTICE, {"text": f"could not publish the job status: {exc}"})
