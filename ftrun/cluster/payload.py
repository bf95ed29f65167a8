"""What a follower's heartbeat carries: its node's workers, their liveness, its snapshots.

Owns: `NodePayload`, called on the heartbeat's thread: the typed `Payload` of this node, for
`ftrun status` and so that the coordinator judges hangs and stragglers over the whole job,
rebuilt as often as the coordinator's health check reads it, not at every beat.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import time
from typing import Any

from ftrun.agent.services import RunServices
from ftrun.agent.watch import CHECK_EVERY_S
from ftrun.cluster.messages import Payload


class NodePayload:
    def __init__(self, services: RunServices) -> None:
        self.services = services
        self._at, self._last = 0.0, dict[str, Any]()

    def __call__(self) -> dict[str, Any]:
        now, svc = time.time(), self.services
        if now - self._at >= CHECK_EVERY_S:
            self._last = Payload(workers=svc.control_plane.rows(now),
                                 liveness=tuple(svc.health.local_liveness(now)),
                                 snapshot=svc.snapshots.describe(now)).to_json()
            self._at = now
        return self._last
