"""One node's runtime: the parts every role of the node runs on.

Owns: `NodeRuntime`, the parts the agent builds once, before any role exists, and hands to
each role the node plays (alone, coordinating, following): the run's spec, the wake-up, the
worker starter, this node's workers, the run's services, the port the helpers reach the
agent through, and the loop's precedence over the status builders. A role composes them and
calls their methods; it never replaces one (the record is frozen), so a role handed over to
the next finds the same parts.
Must not import: the agent's node, the cluster, typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftrun.adapters.wakeup import Wakeup
from ftrun.agent.ports import AgentPort
from ftrun.agent.precedence import LoopPrecedence
from ftrun.agent.services import RunServices
from ftrun.agent.starter import WorkerStarter
from ftrun.agent.workers import NodeWorkers
from ftrun.core.spec import RunSpec


@dataclass(frozen=True)
class NodeRuntime:
    """What one node runs on, whatever role it plays."""

    spec: RunSpec
    wakeup: Wakeup  # signals and cross-thread wake-ups of the agent's loop
    starter: WorkerStarter  # the zygote, or new processes
    workers: NodeWorkers  # this node's processes: spawn, reap, stop
    services: RunServices  # metrics, logs, journal, snapshots, health, control plane
    port: AgentPort  # what every helper is handed (routing to this node's or the others')
    precedence: LoopPrecedence = field(default_factory=LoopPrecedence)  # the loop deciding
    # a fault goes before the threads that build the job's status
