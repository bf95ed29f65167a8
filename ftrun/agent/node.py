"""The per-node agent: start the workers, watch them, decide, act, report.

Owns: one run from start to end: the guardian, signal handling, the store per attempt,
spawning workers with their environment, an event loop that sees a worker's exit the moment
it happens (pidfd), torchrun's whole-group restart, graceful then forced shutdown.
Must not import: typer, rich, the CLI or the worker library. Torch only through `store`.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace

from ftrun.adapters.procs import Guardian, signal_group
from ftrun.adapters.report import WorkerExit
from ftrun.adapters.store import LOOPBACK, HostedStore, QueueReader, advertised_addr, client
from ftrun.adapters.wakeup import Wakeup
from ftrun.adapters.workerspec import spawn_error, worker_argv, worker_env
from ftrun.agent.nodehooks import NodeHooks
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import Outcome, RemoteWorker, RunResult, Worker
from ftrun.agent.services import RunServices
from ftrun.agent.starter import WorkerStarter
from ftrun.agent.timeline import EVERY_S as TIMELINE_EVERY_S
from ftrun.agent.watch import CHECK_EVERY_S
from ftrun.core import timeouts
from ftrun.core.events import Event, EventSink
from ftrun.core.exits import signal_name
from ftrun.core.policy import Action, Decision, decide_group
from ftrun.core.spec import RunSpec
from ftrun.core.states import WorkerState
from ftrun.protocol.rendezvous import REQUEST_QUEUE


def _ignore(kind: str, fields: Mapping[str, object]) -> None:
    pass


class Agent(NodeHooks, RunServices):
    def __init__(self, spec: RunSpec, env: Mapping[str, str] | None = None,
                 emit: EventSink = _ignore) -> None:
        self.spec = spec
        self.base_env = dict(os.environ if env is None else env)
        self._sink = emit
        self.emit: EventSink = emit  # replaced by the journal's once the run has a log dir
        self.run_id = spec.rdzv_id if spec.rdzv_id != "none" or self._static_port() else ""
        self.run_id = self.run_id or str(uuid.uuid4())
        self._wakeup = Wakeup()
        self._workers: list[Worker] = []
        self.restarts = 0
        self.recovery: Recovery | None = None  # this attempt's, when recovery is in-process
        self._sel: selectors.BaseSelector | None = None
        self.worker_port = 0  # where workers reach this attempt's store
        self._next_id = spec.nproc
        self._killed: set[tuple[int, int]] = set()
        self.group_rank, self.group_world_size, self.world_size = 0, 1, spec.nproc
        self.relay_addr = ""  # a follower's generation relay, which its workers watch

    # ----------------------------------------------------------------- top level
    def run(self) -> RunResult:
        guardian = Guardian()  # before any thread or socket exists
        self._guardian = guardian
        self._wakeup.install(self.spec.signals_to_handle)
        self.starter = WorkerStarter(self.spec, lambda kind, fields: self.emit(kind, fields),
                                     self._wakeup, guardian.watch)
        try:
            self._open_metrics()
            self._prepare_env()
            self.starter.open(self.base_env)  # the zygote imports torch meanwhile
            self._open_services(guardian, self)
            return self._finish(self._run_attempts())
        finally:
            self._kill_all(signal.SIGKILL)
            self._close_services()
            self.starter.close()
            guardian.close()
            self._wakeup.close()

    def _run_attempts(self) -> RunResult:
        restarts = 0
        while True:
            hosted = HostedStore.for_workers(self.spec, self._static_port() or 0,
                                             self.master_addr)
            self.restarts = restarts
            try:
                self.worker_port = hosted.port
                if self.starter.zygote is not None:
                    hosted.serve()  # imports torch while the zygote imports its own
                self._start_group(restarts, hosted)
                hosted.serve()  # (new processes:) imports torch while the workers import theirs
                if self.spec.on_fault != "restart":
                    self._start_recovery(hosted)
                outcome = self._supervise()
                if outcome.signum is not None:
                    return self._shutdown_on_signal(outcome, restarts)
                assert outcome.decision is not None
                decision = outcome.decision
                if decision.action is Action.SUCCEED:
                    self._stop_workers(signal.SIGKILL, 0.0)  # idle spares hold no state
                    self._close_streams()
                    return RunResult(0, decision.reason, exits=tuple(outcome.exits),
                                     restarts_used=restarts, log_dir=self.logs.run_dir)
                if not self.uses_api():  # in-process faults were announced already
                    self.emit(Event.FAILURE, {"reason": decision.reason, "rank": decision.culprit})
                stop_sig = self._stop_workers(signal.SIGTERM, self.spec.shutdown_timeout)
                self._close_streams()
                if stop_sig is not None:
                    return self._signal_result(stop_sig, restarts)
                if decision.action is Action.RESTART_GROUP:
                    self.snapshots.restarting()
                    restarts += 1
                    self.emit(Event.RESTART, {"reason": decision.reason, "attempt": restarts})
                    continue
                exits = tuple(w.exit for w in self._workers if w.exit is not None)
                return RunResult(1, decision.reason, cause=outcome.cause, exits=exits,
                                 restarts_used=restarts, log_dir=self.logs.run_dir)
            finally:
                self._end_recovery(hosted)
                hosted.close()

    def _start_recovery(self, hosted: HostedStore) -> None:
        self.recovery = Recovery(self, hosted.store)
        self.control_plane.membership = self.recovery.membership
        port = hosted.port
        self._requests = QueueReader(
            lambda: client(LOOPBACK, port, timeouts.WATCH_POLL_S), REQUEST_QUEUE,
            self.recovery.deliver, lambda why: None, "ftrun-requests")

    def _end_recovery(self, hosted: HostedStore) -> None:
        """The attempt is over: its request reader is woken and joined before the store
        goes (a thread left inside a C++ call aborts the interpreter's exit)."""
        if self.recovery is None:
            return
        self._requests.close(hosted.store)
        self.recovery.detach()
        self.recovery = None
        self.control_plane.membership = None

    # ----------------------------------------------------------------- environment
    def _static_port(self) -> int | None:
        """torchrun's static store port; multi-node worker stores take a free port (the
        endpoint's port serves the agents' rendezvous store)."""
        s = self.spec
        if s.standalone or s.rdzv_backend != "static" or s.nnodes_max > 1:
            return None
        return s.master_port

    def _prepare_env(self) -> None:
        env = self.base_env
        if "OMP_NUM_THREADS" not in env and self.spec.nproc > 1:
            env["OMP_NUM_THREADS"] = "1"
            self.emit(Event.NOTICE, {"text": "setting OMP_NUM_THREADS=1 for each worker (it was "
                                         "unset); export it yourself to tune"})
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(self.spec.signals_to_handle)
        static = self._static_port() is not None
        local = advertised_addr(self.spec.local_addr)
        self.master_addr = self.spec.master_addr if static else local

    # ----------------------------------------------------------------- workers
    def _start_group(self, restarts: int, hosted: HostedStore) -> None:
        self._workers, self._next_id = [], self.spec.nproc  # ids restart with every attempt
        self.starter.wait_for_zygote()  # its imports; a signal meanwhile ends the wait
        if self._wakeup.signals:  # stopped before the workers started: start none, then stop
            return
        for local_rank in range(self.spec.nproc):
            self.spawn_worker(local_rank, rank=local_rank, local_rank=local_rank)
        self.emit(Event.STARTED, {"attempt": restarts, "world_size": self.world_size,
                              "pids": [w.spawned.pid for w in self._workers],
                              "master": f"{self.master_addr}:{hosted.port}"})

    def spawn_worker(self, worker_id: int, rank: int, local_rank: int,
                     spare: bool = False) -> Worker:
        """Start one worker of the current attempt (a first member, a replacement, a spare)."""
        streams = self.logs.streams_for(self.restarts, local_rank, rank=rank,
                                        worker_id=worker_id if worker_id >= self.spec.nproc
                                        else None)
        wenv = worker_env(self.spec, self.base_env, rank=rank, local_rank=local_rank,
                          worker_id=worker_id, restarts=self.restarts, run_id=self.run_id,
                          master_addr=self.master_addr, port=self.worker_port,
                          error_file=streams.error_file, spare=spare,
                          progress_dir=self.progress_dir, world_size=self.world_size,
                          group_rank=self.group_rank, group_world_size=self.group_world_size,
                          relay=self.relay_addr)
        wenv = replace(wenv, **self.snapshots.worker_fields(worker_id, self.restarts))
        env = {**self.base_env, **wenv.to_env()}
        self.slots.reset(worker_id)  # no progress of an earlier attempt's worker
        try:
            spawned = self.starter.start(worker_argv(self.spec, self.base_env, local_rank), env,
                                         streams.stdout, streams.stderr)
        except OSError as exc:
            streams.close()
            raise spawn_error(self.spec, exc) from exc
        streams.after_spawn()
        self._guardian.watch(spawned.pid)
        worker = Worker(rank, local_rank, worker_id, spawned, streams)
        self._workers.append(worker)
        if self._sel is not None and spawned.pidfd is not None:
            self._sel.register(spawned.pidfd, selectors.EVENT_READ, worker)
        self.emit(Event.SPAWNED, {"worker": worker_id, "rank": rank, "local_rank": local_rank,
                                  "pid": spawned.pid, "via": spawned.via, "spare": spare,
                                  "zygote": self.starter.zygote_pid(spawned)})
        return worker

    def live_members(self) -> list[Worker]:
        """Workers of the current generation in rank order (all live workers without FT)."""
        if self.recovery is None or not self.recovery.uses_api:
            return sorted((w for w in self._workers if w.alive), key=lambda w: w.rank)
        by_id = {w.worker_id: w for w in self._workers}
        members = self.recovery.membership.members
        return [by_id[m] for m in members if m in by_id and by_id[m].alive]

    def workers_snapshot(self) -> list[Worker]:
        return [w for w in list(self._workers) if w.alive]

    def wake(self) -> None:
        """Interrupt the event loop from another thread (the request reader)."""
        self._wakeup.wake()

    def _supervise(self) -> Outcome:
        outcome = Outcome()
        with self._selector() as sel:
            self._sel = sel
            try:
                while outcome.decision is None:
                    outcome.signum = self._wakeup.pop_signal()
                    if outcome.signum is not None:
                        return outcome
                    ended: list[Worker | RemoteWorker] = [
                        *self._reap_ready(sel, self._idle_wait()), *self._remote_exits()]
                    outcome.decision = self._tick()
                    if self.recovery is not None:
                        outcome.decision = outcome.decision or self.recovery.handle_requests()
                    self.control_plane.sample(time.time(), ended)  # before slots retire
                    self.control_plane.apply_drills()
                    for worker in ended:
                        self._on_exit(worker, outcome)
                    if outcome.decision is None:
                        outcome.decision = self._group_decision(outcome)
            finally:
                self._sel = None
        return outcome

    def _idle_wait(self) -> float | None:
        return CHECK_EVERY_S if self.recovery else TIMELINE_EVERY_S

    def _on_exit(self, worker: Worker | RemoteWorker, outcome: Outcome) -> None:
        assert worker.exit is not None
        outcome.exits.append(worker.exit)
        rec = self.recovery
        if rec is not None and not rec.owns(worker):
            rec.catch_up()  # its hello may still be queued
            decision = rec.handle_requests()
            if decision is not None and outcome.decision is None:
                outcome.decision = decision
        if rec is not None and rec.owns(worker):
            decision = rec.on_exit(worker)
            if decision is not None and outcome.decision is None:
                outcome.decision, outcome.cause = decision, worker.exit
            return
        if worker.exit.failed and outcome.first_failure is None:
            outcome.first_failure = worker.rank
            outcome.cause = worker.exit

    def _group_decision(self, outcome: Outcome) -> Decision | None:
        rec = self.recovery
        if rec is not None and outcome.first_failure is None:
            if rec.done():
                verdict = rec.end_decision()  # FAIL names a rank lost after its last step
                outcome.cause = next((e for e in reversed(outcome.exits)
                                      if e.rank == verdict.culprit and e.failed), None)
                return verdict
            if rec.uses_api:
                return None
        members = self.all_workers() if rec is None else [
            w for w in self.all_workers() if w.worker_id in rec.membership.members]
        codes = {w.rank: (w.exit.returncode if w.exit else None) for w in members}
        decision = decide_group(codes, outcome.first_failure, self.restarts,
                                self.spec.max_restarts)
        return None if decision.action is Action.WAIT else decision

    def _selector(self) -> selectors.DefaultSelector:
        sel = selectors.DefaultSelector()
        sel.register(self._wakeup.reader, selectors.EVENT_READ, None)
        for w in self._workers:
            if w.alive and w.spawned.pidfd is not None:
                sel.register(w.spawned.pidfd, selectors.EVENT_READ, w)
        return sel

    def _reap_ready(self, sel: selectors.BaseSelector, timeout: float | None) -> list[Worker]:
        """Block until a worker exits, a signal arrives, or `timeout`; return the exited."""
        polling = any(w.alive and w.spawned.pidfd is None for w in self._workers)
        wait = 0.05 if polling and (timeout is None or timeout > 0.05) else timeout
        ready: list[Worker] = []  # pidfds in the order the kernel saw the exits
        for key, _ in sel.select(wait):
            if key.data is None:
                self._wakeup.drain()
            else:
                ready.append(key.data)
        ended = []
        for w in [*ready, *(w for w in self._workers if w not in ready)]:
            if w.alive and w.spawned.process.poll() is not None:
                if w.spawned.pidfd is not None:
                    sel.unregister(w.spawned.pidfd)  # before close(): the fd number is reused
                self._record_exit(w)
                ended.append(w)
        self.starter.reap_strays([w.spawned.pid for w in self._workers if w.alive],
                                 self._guardian.pid)
        return ended

    def _record_exit(self, w: Worker) -> None:
        code = w.spawned.process.returncode
        assert code is not None  # poll() saw the exit
        by_launcher = w.state is WorkerState.STOPPING
        drill = self.journal.pending_drill(w.worker_id)
        w.exit = WorkerExit(rank=w.rank, local_rank=w.local_rank, pid=w.spawned.pid,
                            returncode=code, detected_at=time.monotonic(), wall_time=time.time(),
                            error_file=w.streams.error_file, killed_by_launcher=by_launcher,
                            sent_by_ftrun=drill or "")
        if by_launcher:
            w.move(WorkerState.TERMINATED)
        else:
            w.move(WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED)
        w.spawned.close()
        signal_group(w.spawned.pid, signal.SIGKILL)  # what it left in its group goes too
        self._guardian.forget(w.spawned.pid)
        self.emit(Event.EXIT, {"rank": w.rank, "pid": w.spawned.pid, "returncode": code,
                           "by_launcher": by_launcher})

    def _stop_workers(self, sig: int, grace: float) -> int | None:
        """Signal every live worker group, wait `grace`, then SIGKILL. Returns a signal the
        agent received meanwhile (a second Ctrl-C skips the grace), or None."""
        received: int | None = None
        for w in self._workers:
            if w.alive:
                w.move(WorkerState.STOPPING)
                signal_group(w.spawned.pid, sig)
        deadline = time.monotonic() + grace
        with self._selector() as sel:
            while any(w.alive for w in self._workers):
                left = deadline - time.monotonic()
                received = self._wakeup.pop_signal()
                if left <= 0 or received is not None:
                    break
                self._reap_ready(sel, timeout=left)
            if any(w.alive for w in self._workers):
                self._kill_all(signal.SIGKILL)
                kill_deadline = time.monotonic() + timeouts.KILL_REAP_S
                while any(w.alive for w in self._workers) and time.monotonic() < kill_deadline:
                    self._reap_ready(sel, timeout=kill_deadline - time.monotonic())
        return received

    def _kill_all(self, sig: int) -> None:
        for w in self._workers:
            if w.alive:
                if w.state is not WorkerState.STOPPING:
                    w.move(WorkerState.STOPPING)
                signal_group(w.spawned.pid, sig)

    def _close_streams(self) -> None:
        for w in self._workers:
            w.streams.close()

    def _shutdown_on_signal(self, outcome: Outcome, restarts: int) -> RunResult:
        assert outcome.signum is not None
        sig = outcome.signum
        alive = sum(w.alive for w in self._workers)
        self.emit(Event.SIGNAL, {"signal": signal_name(sig), "workers": alive,
                             "grace_s": self.spec.shutdown_timeout})
        again = self._stop_workers(sig, self.spec.shutdown_timeout)
        if again is not None:
            self.emit(Event.SIGNAL, {"signal": signal_name(again), "workers": 0, "grace_s": 0})
        self._close_streams()
        return self._signal_result(sig, restarts)

    def _signal_result(self, sig: int, restarts: int) -> RunResult:
        exits = tuple(w.exit for w in self._workers if w.exit is not None)
        return RunResult(1, f"received {signal_name(sig)}; workers stopped", exits=exits,
                         restarts_used=restarts, log_dir=self.logs.run_dir,
                         signal_received=signal_name(sig))

