"""The helpers one run of an agent opens and closes: logs, journal, snapshot keeper, progress
slots, health watch, control plane, metrics endpoint, and the run's place in the history.

Owns: `RunServices`, an object the agent builds first (the metrics port first of all, so a port
in use is said before any worker starts; nothing here starts a thread until `serve`), finishing
a run (its report files kept when its temporary logs go) and closing them in reverse.
Must not import: torch, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace

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
from ftrun.core.events import EventSink, notice
from ftrun.core.spec import RunSpec


class RunServices:
    def __init__(self, spec: RunSpec, run_id: str, sink: EventSink, port: AgentPort,
                 guardian: Guardian) -> None:
        """`port`: the agent, as its helpers reach it (they only keep it until `serve`)."""
        self.spec = spec
        self.run_id = run_id
        self.metrics: MetricsServer | None = None
        if spec.metrics_port is not None:  # bound before any worker starts
            self.metrics = MetricsServer(spec.metrics_addr, spec.metrics_port, os.environ)
        try:
            self.logs = RunLogs(spec, run_id)
            run_dir = self.logs.run_dir
            self.journal = Journal(sink, os.path.join(run_dir, LOG_FILE) if run_dir else None)
            self.snapshots = SnapshotKeeper(spec, run_id, 0, self.journal.emit)
            for slots in self.snapshots.private_dirs:  # gone with the agent, even SIGKILLed
                guardian.remove_on_death(slots)
            self.progress_dir = (os.path.join(run_dir, "progress") if run_dir
                                 else tempfile.mkdtemp(prefix="ftrun_progress_"))
            os.makedirs(self.progress_dir, exist_ok=True)
            self.slots = ProgressSlots(self.progress_dir)
            self.health = HealthWatch(port, self.slots)
            self.control_plane = ControlPlane(port, self.slots, self.journal, self.health,
                                              run_dir)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise

    def serve(self, remembered: bool) -> None:
        """`remembered`: `ftrun report --last` shows this run (a follower's: no, the
        coordinator's run is the job's)."""
        if remembered:
            history.remember(self.run_id, self.logs.run_dir)
        if self.metrics is not None:
            self.control_plane.scraped_at(self.metrics.url)
            self.metrics.serve(self.control_plane.status)
            notice(self.journal.emit, self.metrics.notice)
        self.control_plane.serve()  # last: a request may come at once, from another thread

    def finish(self, result: RunResult) -> RunResult:
        result = replace(result, faults=tuple(r.fault() for r in self.journal.faults))
        succeeded = result.exit_code == 0
        if self.logs.run_dir and self.logs.removable(succeeded):
            # for `ftrun report --last`
            history.keep(self.run_id, self.logs.run_dir, (LOG_FILE, TIMELINE_FILE))
        removed = self.logs.cleanup(succeeded)
        return result if not removed else replace(result, log_dir=None)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        for part in (self.control_plane, self.slots, self.health, self.snapshots,
                     self.journal):
            part.close()
