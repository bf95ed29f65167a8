"""The agent as a multi-node cluster sees it.

Owns: `NodeHost`, the members of `agent.node.Agent` that the coordinating and following
clusters use: the node's runtime they compose (`NodeRuntime`: spec, wake-up, starter, this
node's workers, services, the helpers' port), the attempt's facts they read and replace
(`Attempt`: addresses, world size; no cluster assigns an agent's attribute), the attempt's
recovery, and the few actions they ask for. A cluster is built with the agent it belongs to
and typed against this, so its decisions can be tested with a fake.
Must not import: the agent's node, typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import Attempt
from ftrun.agent.runtime import NodeRuntime
from ftrun.agent.watch import Finding
from ftrun.core.events import Event


class NodeHost(Protocol):
    """The agent: the runtime every role composes, the attempt's facts and recovery (a new
    coordinator builds a recovery on the runtime's port), and what it is asked to do."""

    recovery: Recovery | None

    @property
    def runtime(self) -> NodeRuntime: ...
    @property
    def attempt(self) -> Attempt:
        """What this node's workers are told of the attempt (`update_attempt` changes it)."""
    def update_attempt(self, **changes: Any) -> None:
        """Replace `Attempt` fields: a start order's facts, a node entering, the relay."""
    def emit(self, kind: Event, fields: Mapping[str, object]) -> None: ...
    def act(self, findings: list[Finding]) -> None:
        """Do what the health watch found (kills, rebuilds)."""
