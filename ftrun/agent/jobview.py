"""The whole job as `ftrun status` shows it on a multi-node run.

Owns: the coordinator's `Node` record, a worker's role name, and merging the coordinator's
own status with the other nodes' heartbeat payloads (their workers as their agents last saw
them) into one document.
Must not import: torch, typer, rich, the agents.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftrun.core.membership import Membership


@dataclass
class Node:
    index: int
    host: str
    pid: int
    nproc: int
    alive: bool = True
    in_attempt: bool = False  # its workers belong to the current attempt
    net_drill: str = ""  # why a net-down drill cannot run there ("": it can)

    @property
    def label(self) -> str:
        return f"node {self.index} ({self.host})"


def role_of(membership: Membership | None, worker_id: int) -> str:
    """Without in-process recovery every worker is a member; with it, its role's name."""
    if membership is None:
        return "member"
    role = membership.role(worker_id)
    return role.shown if role is not None else "gone"


def merge_job_status(doc: dict[str, Any], nodes: Sequence[Node],
                     payloads: Mapping[int, Mapping[str, Any]], membership: Membership | None,
                     world_size: int, endpoint: str) -> dict[str, Any]:
    """The coordinator's status (node 0) plus every live node's workers from its payload."""
    host = socket.gethostname()
    workers = [{"node": 0, "host": host, **w} for w in doc["workers"]]
    by_index = {n.index: n for n in nodes}
    for index, payload in sorted(payloads.items()):
        for w in payload.get("workers", []):
            role = (role_of(membership, int(w["worker_id"])) if membership is not None
                    else w.get("role"))
            workers.append({**w, "role": role, "node": index, "host": by_index[index].host})
    listing = [{"node": 0, "host": host, "pid": os.getpid(), "alive": True,
                "role": "coordinator (serves the store)", "snapshot": doc.get("snapshot")}]
    listing += [{"node": n.index, "host": n.host, "pid": n.pid, "alive": n.alive,
                 "role": "worker node", "snapshot": payloads.get(n.index, {}).get("snapshot")}
                for n in nodes]
    view = membership.view if membership is not None else None  # one read: a consistent pair
    return {**doc, "workers": workers, "nodes": listing, "endpoint": endpoint,
            "generation": view.generation if view is not None else doc["generation"],
            "world_size": len(view.members) if view is not None else world_size}
