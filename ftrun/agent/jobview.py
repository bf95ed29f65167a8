"""The whole job as `ftrun status` shows it on a multi-node run.

Owns: the coordinator's `Node` record, a worker's role name, and merging the coordinator's
own status with the other nodes' heartbeat payloads (their workers as their agents last saw
them) into one document.
Must not import: torch, typer, rich, the agents.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ftrun.core.membership import Membership
from ftrun.core.records import replaced
from ftrun.protocol.status import NodeRow, Snapshot, Status, WorkerRow


@dataclass
class Node:
    index: int
    host: str
    pid: int
    nproc: int
    alive: bool = True
    in_attempt: bool = False  # its workers belong to the current attempt
    net_drill: str = ""  # why a net-down drill cannot run there ("": it can)
    relay_inbox: str = ""  # where its relay takes forwarded records (protocol.fanout)

    @property
    def label(self) -> str:
        return f"node {self.index} ({self.host})"

    # The coordinator's node table changes a record only through these: the record is the
    # agent's (it shows in `ftrun status`), the cluster says what happened to the node.
    def gone(self) -> None:
        """Lost, drained or ended for good: never alive again under this index."""
        self.alive = False

    def entered_attempt(self) -> None:
        """Its workers were started into (or adopted by) the current attempt."""
        self.in_attempt = True

    def left_attempt(self) -> None:
        """Its workers were told to stop: they belong to no attempt now."""
        self.in_attempt = False

    def relays_at(self, inbox: str) -> bool:
        """Its agent said where its relay of this attempt takes forwarded records: whether
        that is news."""
        changed, self.relay_inbox = inbox != self.relay_inbox, inbox
        return changed


class NodeReport(Protocol):
    """What a node last said of itself (its heartbeat payload, `cluster.messages.Payload`)."""

    @property
    def workers(self) -> tuple[WorkerRow, ...]: ...
    @property
    def snapshot(self) -> Snapshot | None: ...


def role_of(membership: Membership | None, worker_id: int) -> str:
    """Without in-process recovery every worker is a member; with it, its role's name."""
    if membership is None:
        return "member"
    role = membership.role(worker_id)
    return role.shown if role is not None else "gone"


def merge_job_status(doc: Status, nodes: Sequence[Node], payloads: Mapping[int, NodeReport],
                     membership: Membership | None, world_size: int, endpoint: str,
                     store_ops: int | None, pace: Callable[[], None] = lambda: None
                     ) -> Status:
    """The coordinator's status (node 0) plus every live node's workers from its payload.
    `pace` is called between two nodes (the builder's pause while the agent's loop decides)."""
    host = socket.gethostname()
    workers = [replaced(w, node=0, host=host) for w in doc.workers]
    by_index = {n.index: n for n in nodes}
    for index, payload in sorted(payloads.items()):
        pace()
        for w in payload.workers:
            role = role_of(membership, w.worker_id) if membership is not None else w.role
            workers.append(replaced(w, role=role, node=index, host=by_index[index].host))
    listing = [NodeRow(node=0, host=host, pid=os.getpid(), alive=True,
                       role="coordinator (serves the store)", snapshot=doc.snapshot)]
    listing += [NodeRow(node=n.index, host=n.host, pid=n.pid, alive=n.alive, role="worker node",
                        snapshot=p.snapshot if (p := payloads.get(n.index)) else None)
                for n in nodes]
    view = membership.view if membership is not None else None  # one read: a consistent pair
    return dataclasses.replace(
        doc, workers=tuple(workers), nodes=tuple(listing), endpoint=endpoint,
        generation=view.generation if view is not None else doc.generation,
        world_size=len(view.members) if view is not None else world_size,
        rdzv_store_ops=store_ops)
