"""The helpers one run of an agent opens and closes: logs, journal, snapshot keeper, progress
slots, health watch, control plane, metrics endpoint, and the run's place in the history.

Owns: `RunServices`, the agent's mixin that opens them in order (the metrics port first, so a
port in use is said before any worker starts), finishes a run (its report files kept when its
temporary logs go) and closes them in reverse, whatever was opened.
Must not import: torch, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from typing import Any

from ftrun.adapters import history
from ftrun.adapters.logs import RunLogs
from ftrun.adapters.metrics import MetricsServer
from ftrun.adapters.procs import Guardian
from ftrun.adapters.slots import ProgressSlots
from ftrun.agent.control_plane import ControlPlane
from ftrun.agent.journal import LOG_FILE, Journal
from ftrun.agent.ports import AgentPort
from ftrun.agent.roster import RunResult
from ftrun.agent.snapshots import SnapshotKeeper
from ftrun.agent.timeline import FILE as TIMELINE_FILE
from ftrun.agent.watch import HealthWatch
from ftrun.core.events import Event, EventSink
from ftrun.core.spec import RunSpec


class RunServices:
    REMEMBERED = True  # `ftrun report --last` shows this agent's run (a follower's: no)
    spec: RunSpec
    run_id: str
    emit: EventSink
    _sink: EventSink
    metrics: MetricsServer | None
    logs: RunLogs
    journal: Journal
    snapshots: SnapshotKeeper
    progress_dir: str
    slots: ProgressSlots
    health: HealthWatch
    control_plane: ControlPlane

    def _open_metrics(self) -> None:
        self.metrics = None
        if self.spec.metrics_port is not None:  # bound before any worker starts
            self.metrics = MetricsServer(self.spec.metrics_addr, self.spec.metrics_port,
                                         os.environ)

    def _open_services(self, guardian: Guardian, port: AgentPort) -> None:
        """`port`: the agent itself, as its helpers reach it."""
        self.logs = RunLogs(self.spec, self.run_id)
        run_dir = self.logs.run_dir
        self.journal = Journal(self._sink, os.path.join(run_dir, LOG_FILE) if run_dir else None)
        if self.REMEMBERED:
            history.remember(self.run_id, run_dir)
        self.emit = self.journal.emit
        self.snapshots = SnapshotKeeper(self.spec, self.run_id, 0, self.emit)
        for slots in self.snapshots.private_dirs:  # gone with the agent, even a SIGKILLed one
            guardian.remove_on_death(slots)
        self.progress_dir = (os.path.join(run_dir, "progress") if run_dir
                             else tempfile.mkdtemp(prefix="ftrun_progress_"))
        os.makedirs(self.progress_dir, exist_ok=True)
        self.slots = ProgressSlots(self.progress_dir)
        self.health = HealthWatch(port, self.slots)
        self.control_plane = ControlPlane(port, self.slots, self.journal, self.health, run_dir)
        if self.metrics is not None:
            self.control_plane.metrics_url = self.metrics.url
            self.metrics.serve(self.control_plane.status)
            self.emit(Event.NOTICE, {"text": self.metrics.notice})
        self.control_plane.serve()  # last: a request may come at once, from another thread

    def _finish(self, result: RunResult) -> RunResult:
        result = replace(result, faults=tuple(self.journal.faults))
        succeeded = result.exit_code == 0
        if self.logs.run_dir and self.logs.removable(succeeded):
            # for `ftrun report --last`
            history.keep(self.run_id, self.logs.run_dir, (LOG_FILE, TIMELINE_FILE))
        removed = self.logs.cleanup(succeeded)
        return result if not removed else replace(result, log_dir=None)

    def _close_services(self) -> None:
        opened: dict[str, Any] = vars(self)
        if opened.get("metrics") is not None:
            self.metrics.close()  # type: ignore[union-attr]
        for name in ("control_plane", "slots", "health", "snapshots", "journal"):
            if name in opened:
                opened[name].close()
