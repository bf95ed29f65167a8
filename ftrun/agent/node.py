"""The per-node agent: start the workers, watch them, decide, act, report.

Owns: one run from start to end: the guardian, signal handling, the store per attempt, the
workers' environment, an event loop that sees a worker's exit the moment it happens,
torchrun's whole-group restart, graceful then forced shutdown, and the answers the agent's
helpers get through their ports (`ports`), this node's from its `NodeWorkers` and the other
nodes' from its `Cluster`. What differs between one node, the coordinator of several and a
follower is the `Cluster` object it is given (`agent.cluster.Local`, `cluster.coordinating`,
`cluster.following`); nothing subclasses the agent.
Must not import: typer, rich, the CLI or the worker library. Torch only through `store`.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

from ftrun.adapters.procs import Guardian
from ftrun.adapters.store import LOOPBACK, HostedStore, QueueReader, advertised_addr, client
from ftrun.adapters.wakeup import Wakeup
from ftrun.adapters.workerspec import shared_env, static_port, worker_env
from ftrun.agent.cluster import Adopt, Cluster, Handover, Local
from ftrun.agent.nodeport import NodePort
from ftrun.agent.notices import Notices
from ftrun.agent.outcomes import Outcome, group_decision, on_exit, stopped_by
from ftrun.agent.pacing import Pacing
from ftrun.agent.precedence import freeze_heap
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import Attempt, RemoteWorker, RunResult, Worker
from ftrun.agent.runtime import NodeRuntime
from ftrun.agent.services import RunServices
from ftrun.agent.starter import WorkerStarter
from ftrun.agent.timeline import EVERY_S as TIMELINE_EVERY_S
from ftrun.agent.watch import Drain, Finding, Kill, Rebuild
from ftrun.agent.workers import NodeWorkers
from ftrun.core import timeouts
from ftrun.core.errors import Deposed, SteppingDown
from ftrun.core.events import (
    EventSink,
    FailureFields,
    RestartFields,
    SignalFields,
    StartedFields,
    emit_as,
    notice,
)
from ftrun.core.exits import EXIT_REQUEUE, signal_name
from ftrun.core.options import OnFault, RdzvBackend
from ftrun.core.policy import Action, Decision
from ftrun.core.spec import RunSpec
from ftrun.core.states import TransitionError, role_change_refused
from ftrun.protocol.rendezvous import REQUEST_QUEUE


def _ignore(kind: str, fields: Mapping[str, object]) -> None:
    pass


def _alone(agent: Agent) -> Cluster:
    return Local()


class Agent:
    def __init__(self, spec: RunSpec, cluster: Callable[[Agent], Cluster] = _alone,
                 env: Mapping[str, str] | None = None, emit: EventSink = _ignore) -> None:
        """`cluster`: makes the rest of the job as this agent sees it, given the agent."""
        self.spec = spec
        self.base_env = dict(os.environ if env is None else env)
        self.emit: EventSink = emit  # the journal's once the services exist
        run_id = spec.rdzv_id if spec.rdzv_id != "none" or self._static_port() else ""
        self.attempt = Attempt(run_id=run_id or str(uuid.uuid4()), world_size=spec.nproc)
        self.recovery: Recovery | None = None  # this attempt's, when recovery is in-process
        self._requests: QueueReader | None = None  # the recovery's request reader
        self._killed: set[tuple[int, int]] = set()  # (attempt, worker) the watch had killed
        self.notices = Notices(spec)  # a preemption notice: this node's ranks hand over
        self.pacing = Pacing()  # a burst's exits in one pass; a fault's pass publishes first
        self.guardian = Guardian()  # before any thread or socket of the run exists
        try:
            self.runtime = self._build_runtime(spec)
            self.emit = self.runtime.services.journal.emit
            self.cluster = cluster(self)
        except BaseException:
            self.guardian.close()
            raise
        self.runtime.workers.report_exits_to(self.cluster.on_local_exit)

    def _build_runtime(self, spec: RunSpec) -> NodeRuntime:
        """The parts every role runs on (`NodeRuntime`), each handed only what it uses."""
        wakeup = Wakeup()
        starter = WorkerStarter(spec, lambda kind, fields: self.emit(kind, fields), wakeup,
                                self.guardian.watch)
        port = NodePort(spec, wakeup.wake, self.emit, lambda: self.cluster,
                        lambda: self.recovery, lambda: self.attempt)
        services = RunServices(spec, self.attempt.run_id, self.emit, port, self.guardian)
        workers = NodeWorkers(spec, self.base_env, starter, self.guardian, wakeup, services,
                              self._env_for, services.journal.emit)
        port.attach(workers, services, starter)
        return NodeRuntime(spec, wakeup, starter, workers, services, port)

    # ----------------------------------------------------------------- top level
    def run(self) -> RunResult:
        self.runtime.wakeup.install(self.spec.signals_to_handle)
        result: RunResult | None = None
        try:
            self._prepare_env()
            self.cluster.prepare()
            self.runtime.starter.open(self.base_env)  # the zygote imports torch meanwhile
            self.runtime.services.serve(self.cluster.remembered)
            ran = self.cluster.drive(self._run_attempts)
            while isinstance(ran, Handover):  # this node plays another part from now on
                ran = self._play(ran)
            result = self.runtime.services.finish(ran)
            return result
        finally:
            try:
                self.cluster.close(result)
            finally:
                self.runtime.workers.kill_all(signal.SIGKILL)
                self.runtime.services.close()
                self.runtime.starter.close()
                self.guardian.close()
                self.runtime.wakeup.close()

    def _run_attempts(self, adopt: Adopt | None = None) -> RunResult:
        """Attempt after attempt (torchrun's whole-group restarts); `adopt`: the first one is
        an attempt already running, whose recovery this agent takes over."""
        restarts = self.attempt.restarts
        while True:
            hosted = HostedStore.for_workers(self.spec, self._static_port() or 0,
                                             self.attempt.master_addr)
            freeze_heap()  # torch is in by now: a full collection's bulk
            self.update_attempt(restarts=restarts)
            try:
                self.update_attempt(worker_port=hosted.port)
                if adopt is not None:
                    hosted.serve()
                    self._start_recovery(hosted, adopt(hosted))
                    adopt = None
                else:
                    self._start_attempt(restarts, hosted)
                result = self._attempt(restarts)
                if result is not None:
                    return result
                restarts += 1
            finally:
                self._end_recovery(hosted)
                hosted.close()

    def _play(self, handover: Handover) -> RunResult | Handover:
        """The next role's run (`Handover`): the last one's has returned (its frames are
        gone) and handed over what goes on (its workers, its relay); it is closed already
        or, when it took over, shares its control plane with the new one."""
        refused = role_change_refused(self.cluster.role, handover.to.role)
        if refused is not None:
            raise TransitionError(refused)  # a defect: the CLI asks for a report
        self.cluster = handover.to
        self.runtime.workers.report_exits_to(handover.to.on_local_exit)
        handover.to.prepare()
        return handover.to.drive(lambda: self._run_attempts(handover.adopt))

    def _start_attempt(self, restarts: int, hosted: HostedStore) -> None:
        if self.runtime.starter.zygote is not None:
            hosted.serve()  # imports torch while the zygote imports its own
        self._start_group(restarts, hosted)
        hosted.serve()  # (new processes:) imports torch while the workers import theirs
        if self.spec.on_fault is not OnFault.RESTART:
            self._start_recovery(hosted, Recovery(self.runtime.port, hosted.store))

    def _attempt(self, restarts: int) -> RunResult | None:
        """Supervise the attempt to its end: the run's result, or None to restart it."""
        outcome = self._supervise()
        if outcome.signum is not None:
            return self._shutdown_on_signal(outcome, restarts)
        assert outcome.decision is not None
        decision, log_dir = outcome.decision, self.runtime.services.logs.run_dir
        if decision.action in (Action.SUCCEED, Action.REQUEUE):
            self._stop_workers(signal.SIGKILL, 0.0)  # idle spares hold no state
            self.runtime.workers.close_streams()
            code = EXIT_REQUEUE if decision.action is Action.REQUEUE else 0
            return RunResult(code, decision.reason, exits=tuple(outcome.exits),
                             restarts_used=restarts, log_dir=log_dir)
        if not self.runtime.port.uses_api():  # in-process faults were announced already
            emit_as(self.emit, FailureFields(decision.reason, decision.culprit))
        stop_sig = self._stop_workers(signal.SIGTERM, self.spec.shutdown_timeout)
        self.runtime.workers.close_streams()
        if stop_sig is not None:
            return self._stopped_by(stop_sig, restarts)
        if decision.action is Action.RESTART_GROUP:
            self.runtime.services.snapshots.restarting()
            emit_as(self.emit, RestartFields(decision.reason, restarts + 1))
            return None
        return RunResult(1, decision.reason, cause=outcome.cause,
                         exits=self.runtime.workers.exits(), restarts_used=restarts,
                         log_dir=log_dir)

    def _start_recovery(self, hosted: HostedStore, recovery: Recovery) -> None:
        self.recovery = recovery
        self.runtime.services.control_plane.follow(recovery.membership)
        port = hosted.port
        self._requests = QueueReader(
            lambda: client(LOOPBACK, port, timeouts.WATCH_POLL_S), REQUEST_QUEUE,
            recovery.deliver, lambda why: None, "ftrun-requests")

    def _end_recovery(self, hosted: HostedStore) -> None:
        """The attempt is over: its request reader is woken and joined before the store
        goes (a thread left inside a C++ call aborts the interpreter's exit)."""
        if self.recovery is None:
            return
        if self._requests is not None:
            self._requests.close(hosted.store)
            self._requests = None
        self.recovery.detach()
        self.recovery = None
        self.runtime.services.control_plane.follow(None)

    # ----------------------------------------------------------------- environment
    def _static_port(self) -> int | None:
        return static_port(self.spec)

    def _prepare_env(self) -> None:
        said = shared_env(self.spec, self.base_env)
        if said:
            notice(self.emit, said)
        self.update_attempt(master_addr=self.spec.master_addr if self._static_port() is not None
                            else advertised_addr(self.spec.local_addr))

    def _env_for(self, worker_id: int, rank: int, local_rank: int, spare: bool,
                 error_file: str) -> dict[str, str]:
        svc, a = self.runtime.services, self.attempt
        wenv = worker_env(self.spec, self.base_env, rank=rank, local_rank=local_rank,
                          worker_id=worker_id, restarts=a.restarts, run_id=a.run_id,
                          master_addr=a.master_addr, port=a.worker_port,
                          error_file=error_file, spare=spare, progress_dir=svc.progress_dir,
                          world_size=a.world_size, group_rank=a.group_rank,
                          group_world_size=a.group_world_size, relay=a.relay_addr)
        wenv = replace(wenv, **svc.snapshots.worker_fields(worker_id, a.restarts))
        return {**self.base_env, **wenv.to_env()}

    # ----------------------------------------------------------------- workers
    def _start_group(self, restarts: int, hosted: HostedStore) -> None:
        self.runtime.workers.new_attempt(restarts, self.spec.nproc)
        self.cluster.start_group(restarts, hosted, lambda: self._start_local(restarts, hosted))

    def _start_local(self, restarts: int, hosted: HostedStore) -> None:
        self.runtime.starter.wait_for_zygote()  # its imports; a signal meanwhile ends the wait
        if self.runtime.wakeup.signals:  # stopped before the workers started: start none, then stop
            return
        for local_rank in range(self.spec.nproc):
            self.runtime.workers.spawn(local_rank, rank=local_rank, local_rank=local_rank)
        emit_as(self.emit, StartedFields(restarts, self.attempt.world_size,
                                         tuple(w.spawned.pid for w in self.runtime.workers.all),
                                         f"{self.attempt.master_addr}:{hosted.port}"))

    def _supervise(self) -> Outcome:
        outcome = Outcome()
        try:
            return self._watch(outcome)
        except Deposed as exc:  # its leadership ended (etcd refused a generation, or lapsed)
            if isinstance(exc, SteppingDown):  # another agent leads: this one will follow it
                notice(self.emit, exc.one_line())
            elif self.runtime.port.uses_api():  # else _attempt tells it
                emit_as(self.emit, FailureFields(exc.one_line()))
            outcome.overruled(Decision(Action.FAIL, exc.one_line()))
            return outcome

    def _watch(self, outcome: Outcome) -> Outcome:
        with self.runtime.workers.watching() as sel:
            while outcome.decision is None:
                outcome.stop(self._signal(time.time()))
                if outcome.signum is not None:
                    return outcome
                ended: list[Worker | RemoteWorker] = [
                    *self.runtime.workers.reap_ready(sel, self._idle_wait()),
                    *self.cluster.remote_exits()]
                with self.runtime.precedence.deciding(self._generation):  # builders wait
                    self._pass(sel, ended, outcome)
        return outcome

    def _pass(self, sel: selectors.BaseSelector, ended: list[Worker | RemoteWorker],
              outcome: Outcome) -> None:
        """One pass of the loop: what it found (`ended`: exits, maybe none) and what its tick
        finds (nodes lost, requests, findings), decided and published as one generation.
        A pass with exits leaves the periodic checks to the next (`Pacing`)."""
        control = self.runtime.services.control_plane
        if ended and self.recovery is not None:
            ended += self.pacing.rest_of_burst(lambda timeout_s: [
                *self.runtime.workers.reap_ready(sel, timeout_s), *self.cluster.remote_exits()])
        checks = self.pacing.runs_checks(bool(ended))
        try:
            with self._one_generation():  # what this pass finds: one generation
                outcome.decide(self._tick(checks))
                if self.recovery is not None and outcome.decision is None:
                    outcome.decide(self.recovery.handle_requests())
                control.sample(time.time(), ended)  # before slots retire
                control.apply_drills()
                for worker in ended:
                    on_exit(self.recovery, worker, outcome)
            if outcome.decision is None:
                outcome.decide(group_decision(
                    self.recovery, outcome, self.runtime.port.all_workers,
                    self.attempt.restarts, self.spec.max_restarts))
        finally:  # a pass that raised (deposed) still settles what the next one owes
            self.pacing.passed(bool(ended), checks)

    def _generation(self) -> int:
        """The membership's number (-1 without in-process recovery): a pass that moved it
        published, and the status builders settle after it (precedence.py)."""
        return self.recovery.membership.generation if self.recovery is not None else -1

    def _one_generation(self) -> AbstractContextManager[None]:
        """The changes decided in one pass of the loop (faults found together: several
        exits, nodes lost at once) are published as one generation (`Generations.batch`)."""
        return self.recovery.gens.batch() if self.recovery is not None else nullcontext()

    def _signal(self, now: float) -> int | None:
        """A signal that stops the workers, or None. A notice (notices.py) to a job that
        uses the API starts a drain of this node instead; its window's end stops them."""
        sig = self.runtime.wakeup.pop_signal()
        rec = self.recovery
        if sig is None or rec is None or not rec.uses_api or not self.notices.is_notice(sig):
            return sig if sig is not None else self.notices.expired(now)
        whole = self.spec.nnodes_max > 1 and self.spec.rdzv_backend is not RdzvBackend.ETCD and \
            self.cluster.index == 0  # the c10d store goes with this node
        req = self.notices.take(sig, self.cluster.index, rec.membership.members, whole)
        notice(self.emit, f"received {signal_name(sig)}: a notice; handing "
                          f"this node's ranks over within {self.spec.drain_window:g} s "
                          "(--drain-window; a second signal stops at once)")
        rec.drains.start(req)
        return None

    def _idle_wait(self) -> float | None:
        return self.cluster.idle_wait(self.runtime.services.health.wait_s(time.time())
                                      if self.recovery else TIMELINE_EVERY_S)

    def _tick(self, checks: bool = True) -> Decision | None:
        """`checks` False: the periodic ones (hangs judged, heartbeats read) wait."""
        membership = self.recovery.membership if self.recovery is not None else None
        self.act(self.runtime.services.health.tick(membership, time.time(), judge=checks))
        self.runtime.services.snapshots.drain()
        return self.cluster.tick(periodic=checks)

    def act(self, findings: list[Finding]) -> None:
        """Do what the health watch found: kill a member once per attempt (on whichever node
        it runs), rebuild a stuck communicator and have the watch follow it up."""
        for f in findings:
            if isinstance(f, Kill):
                key = (self.attempt.restarts, f.worker)
                if key in self._killed or not self.runtime.port.kill_worker(f.worker):
                    continue
                self._killed.add(key)
                self.runtime.services.journal.drill_injected(f.worker, f.why, time.time())
                if f.notice:
                    notice(self.emit, f.notice)
            elif isinstance(f, Drain):
                self.runtime.port.start_drain(f.request)
            elif (isinstance(f, Rebuild) and self.recovery is not None
                  and self.recovery.rebuild(f.reason)):
                self.runtime.services.health.rebuilt(self.recovery.membership.generation,
                                                     f.stuck_at, time.time())

    def _stop_workers(self, sig: int, grace: float) -> int | None:
        return self.cluster.stop_workers(sig, grace, self.runtime.workers.stop)

    def _shutdown_on_signal(self, outcome: Outcome, restarts: int) -> RunResult:
        assert outcome.signum is not None
        sig = outcome.signum
        alive = len(self.runtime.workers.alive())
        emit_as(self.emit, SignalFields(signal_name(sig), alive, self.spec.shutdown_timeout))
        again = self._stop_workers(sig, self.spec.shutdown_timeout)
        if again is not None:
            emit_as(self.emit, SignalFields(signal_name(again), 0, 0.0))
        self.runtime.workers.close_streams()
        return self._stopped_by(sig, restarts)

    def _stopped_by(self, sig: int, restarts: int) -> RunResult:
        return stopped_by(sig, restarts, self.runtime.workers.exits(),
                          self.runtime.services.logs.run_dir)

    # ----------------------------------------------------------------- for the cluster
    def update_attempt(self, **changes: Any) -> None:
        """What the cluster learnt of the attempt (a start order, a node entering): the
        facts the next workers get are replaced whole, in one place."""
        self.attempt = replace(self.attempt, **changes)
