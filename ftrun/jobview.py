"""The whole job as `ftrun status` shows it on a multi-node run.

Owns: a worker's role name, and merging the coordinator's own status with the other nodes'
heartbeat payloads (their workers as their agents last saw them) into one document.
Must not import: torch, typer, rich, the agents.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class _Membership(Protocol):
    spares: list[int]
    starting_spares: set[int]
    unhealed: set[int]
    members: tuple[int, ...]


class _NodeView(Protocol):
    index: int
    host: str
    pid: int
    alive: bool


def role_of(ft: _Membership | None, worker_id: int) -> str:
    if ft is None:
        return "member"
    if worker_id in ft.spares:
        return "spare"
    if worker_id in ft.starting_spares:
        return "spare (starting)"
    if worker_id in ft.unhealed:
        return "joining"
    return "member" if worker_id in ft.members else "gone"


def merge_job_status(doc: dict[str, Any], nodes: Sequence[_NodeView],
                     payloads: Mapping[int, Mapping[str, Any]], ft: _Membership | None,
                     world_size: int, endpoint: str) -> dict[str, Any]:
    """The coordinator's status (node 0) plus every live node's workers from its payload."""
    host = socket.gethostname()
    workers = [{"node": 0, "host": host, **w} for w in doc["workers"]]
    by_index = {n.index: n for n in nodes}
    for index, payload in sorted(payloads.items()):
        for w in payload.get("workers", []):
            role = role_of(ft, int(w["worker_id"])) if ft is not None else w.get("role")
            workers.append({**w, "role": role, "node": index, "host": by_index[index].host})
    listing = [{"node": 0, "host": host, "pid": os.getpid(), "alive": True,
                "role": "coordinator (serves the store)"}]
    listing += [{"node": n.index, "host": n.host, "pid": n.pid, "alive": n.alive,
                 "role": "worker node"} for n in nodes]
    return {**doc, "workers": workers, "nodes": listing, "endpoint": endpoint,
            "world_size": len(ft.members) if ft is not None else world_size}
