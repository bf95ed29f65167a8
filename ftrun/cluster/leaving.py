"""A follower's ways out of the job: a notice (a planned leave), a signal, the coordinator's end.

Owns: `Leaving`. A notice (SIGTERM or --drain-signal, the first one, to an agent whose workers
use the ftrun API) is told to the coordinator (`Draining`) and this node's workers run on
while the coordinator hands their ranks over to other nodes: they leave at a step boundary
and exit 0; the coordinator's `End` (code 0) then stops what is left (its spares) and the
agent exits 0, its node drained. A second signal, any other one, or the window's end
(`Notices.expired`) stops the workers at once and says `Left`: the coordinator counts the node
lost (a fault), as without a notice. Also how the coordinator's `End` reads on this node: 0
done (or drained), 75 requeue (not a failure), anything else a failure.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from ftrun.agent.notices import Notices
from ftrun.agent.outcomes import stopped_by
from ftrun.agent.roster import RunResult
from ftrun.cluster.host import NodeHost
from ftrun.cluster.messages import Draining, End, Left, Report
from ftrun.core.events import FailureFields, emit_as, notice
from ftrun.core.exits import EXIT_REQUEUE, signal_name


class Leaving:
    def __init__(self, host: NodeHost, report: Callable[[Report], None]) -> None:
        """`report`: to the coordinator (nothing goes once the store is lost)."""
        self.host = host
        self.report = report
        self.notices = Notices(host.runtime.spec)

    @property
    def draining(self) -> bool:
        return self.notices.received is not None

    def signalled(self, sig: int, index: int, uses_api: bool) -> RunResult | None:
        """None: `sig` is a notice, told to the coordinator (the workers run on); else the
        node stopped on it."""
        if not uses_api or not self.notices.is_notice(sig):
            return self.leave(sig, index)
        self.notices.take(sig, index, ())
        window = self.host.runtime.spec.drain_window
        self.report(Draining(node=index, reason=f"{signal_name(sig)}: a notice",
                             window_s=window))
        notice(self.host.emit, f"received {signal_name(sig)}: a notice; the "
                               "coordinator hands this node's ranks over to other "
                               f"nodes within {window:g} s (--drain-window; a second "
                               "signal stops at once)")
        return None

    def expired(self, index: int) -> RunResult | None:
        """The notice's window is over: the node stops, whatever its drain reached."""
        sig = self.notices.expired(time.time())
        if sig is None:
            return None
        window = self.host.runtime.spec.drain_window
        return self.leave(sig, index, f"its drain window ({window:g} s, --drain-window) ran out")

    def leave(self, sig: int, index: int, why: str = "") -> RunResult:
        """Stop this node's workers on `sig` and say so: the coordinator counts it lost."""
        self.report(Left(node=index, reason=why or f"received {signal.Signals(sig).name}"))
        workers = self.host.runtime.workers
        workers.stop(sig, self.host.runtime.spec.shutdown_timeout)
        workers.close_streams()
        return stopped_by(sig, self.host.attempt.restarts, workers.exits(),
                          self.host.runtime.services.logs.run_dir)

    def ended(self, cmd: End) -> RunResult:
        """The coordinator ended this node (not `lost`): what is left stops, the code is its."""
        workers = self.host.runtime.workers
        if workers.alive():  # a drained node's spares, or the job's end
            workers.stop(signal.SIGTERM, self.host.runtime.spec.shutdown_timeout)
        workers.close_streams()
        if cmd.refused:
            reason = f"the coordinator refused this node: {cmd.reason}"
        elif cmd.code == 0 and self.draining:
            reason = f"this node drained: {cmd.reason}"
        else:
            reason = f"the coordinator ended the job: {cmd.reason}"
        if cmd.code not in (0, EXIT_REQUEUE):  # a requeue is the scheduler's, not a failure
            emit_as(self.host.emit, FailureFields(reason))
        elif cmd.code == 0 and self.draining:
            notice(self.host.emit, reason)
        return RunResult(cmd.code, reason, exits=workers.exits(),
                         restarts_used=self.host.attempt.restarts,
                         log_dir=self.host.runtime.services.logs.run_dir)
