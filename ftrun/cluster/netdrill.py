"""A node agent's side of `ftrun inject-fault --node K --kind net-down --duration S`.

Owns: whether this node may take its link down (found once, when it joins: the answer
travels in its Join report so that the coordinator can refuse a drill for it in one line),
acting the drill out, and saying so when the link could not be restored.
Must not import: torch, typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

from typing import Any

from ftrun.adapters.netlink import NAMESPACE_HINT, LinkDrill, drill_target
from ftrun.core.errors import FtrunError
from ftrun.core.events import EventSink, notice

MAX_NET_DOWN_S = 3600.0


def check_duration(duration: float) -> float:
    if not 0 < duration <= MAX_NET_DOWN_S:
        raise FtrunError(f"--duration must be 0..{MAX_NET_DOWN_S:g} seconds, not {duration:g}",
                         hint="e.g. --duration 5")
    return duration


def refuse(node: int, why: str) -> FtrunError:
    return FtrunError(f"node {node} cannot take its link down: {why}", hint=NAMESPACE_HINT)


class NetDrills:
    """This node's link drills. `peer`: the host whose route names the link (the endpoint)."""

    def __init__(self, peer: str, emit: EventSink) -> None:
        self.device, self.refusal = drill_target(peer)
        self._emit = emit
        self._drill = LinkDrill()

    def start(self, node: int, duration: float) -> dict[str, Any]:
        if self.refusal:
            raise refuse(node, self.refusal)
        self._drill.start(self.device, check_duration(duration))
        notice(self._emit, f"net-down drill: {self.device} down for "
                           f"{duration:g} s")
        return {"node": node, "device": self.device, "duration": duration}

    def start_commanded(self, node: int, duration: float) -> None:
        """A drill the coordinator sent: refused, it is said here (nobody waits for it)."""
        try:
            self.start(node, duration)
        except FtrunError as exc:
            notice(self._emit, f"net-down drill refused: {exc.message}")

    def check(self) -> None:
        """The main loop's pass: a link that did not come back up is said once."""
        failed = self._drill.take_failure()
        if failed:
            notice(self._emit, failed)

    def close(self) -> None:
        failed = self._drill.restore()
        if failed:
            notice(self._emit, failed)
