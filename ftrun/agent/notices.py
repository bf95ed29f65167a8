"""A preemption notice to one agent: SIGTERM (or --drain-signal) means "this node will be taken".

Owns: `Notices`: whether a signal is a notice (a job that uses the ftrun API, --drain-window
above 0, the first one: a second notice, or any other signal, stops the workers at once as
before), the drain request for this node's members with the window's deadline, and the hard
end of the window (the node is taken then, whatever the drain reached).
Must not import: typer, rich, the CLI, the worker library, the agent's node.
"""

from __future__ import annotations

import signal
import time

from ftrun.core.drains import DrainRequest
from ftrun.core.exits import signal_name
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import node_of

WINDOW_GRACE_S = 2.0  # past the window, the workers are stopped as on any signal


class Notices:
    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.received: int | None = None  # the notice's signal, once one came
        self.deadline = 0.0  # wall clock: the window's end

    def is_notice(self, sig: int) -> bool:
        names = {"SIGTERM", self.spec.drain_signal} - {""}
        return (self.received is None and self.spec.drain_window > 0
                and signal_name(sig) in names)

    def take(self, sig: int, node: int, members: tuple[int, ...],
             whole_job: bool = False) -> DrainRequest:
        """This node's members leave within the window (a drain of the node); `whole_job`:
        the job cannot go on without this node (it serves the c10d store), every member
        leaves."""
        self.received = sig
        self.deadline = time.time() + self.spec.drain_window
        here = members if whole_job else tuple(m for m in members if node_of(m) == node)
        why = f"{signal_name(sig)}: a notice{'; the store goes with it' if whole_job else ''}"
        return DrainRequest(f"node {node} ({why})", here, self.deadline, node_leaves=True,
                            node=node)

    def expired(self, now: float) -> int | None:
        """The window is over: the signal to stop the workers with, as without a notice."""
        if self.received is None or now < self.deadline + WINDOW_GRACE_S:
            return None
        return signal.SIGTERM
