"""The agent's window to the outside: `ftrun status` answers, `ftrun inject-fault` drills and
`ftrun drain` requests (checked here, started by the recovery from the main loop).

Owns: the run's control server (serving from `serve()`, once the agent is whole), building the
status document as `protocol.status` records (from the port, the progress slots, the journal,
the health watch and the attempt's membership), checking every request where it enters with
`protocol.control_ops.check_request` (one-line errors; nothing malformed reaches the main loop),
refusing a drill this job cannot take, and applying drills from the agent's main loop: signals
the agent sends itself, or drill slots a worker acts on at a step.
Must not import: torch, typer, rich, the CLI, the agent (it reaches the node through
`ports.ControlPort`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ftrun.adapters.control import RunInfo, run_dir
from ftrun.adapters.control_server import ControlServer
from ftrun.adapters.slots import ProgressSlots
from ftrun.agent.jobview import role_of
from ftrun.agent.journal import Journal, summarize
from ftrun.agent.ports import ControlPort
from ftrun.agent.roster import Worker
from ftrun.agent.timeline import Timeline, sample_every_s
from ftrun.agent.watch import HealthWatch
from ftrun.core.drains import DrainRequest
from ftrun.core.errors import FtrunError
from ftrun.core.events import DrillFields, emit_as, notice
from ftrun.core.faultkinds import AGENT_SIGNALS, GPU_KINDS, NOTICE_KINDS, WORKER_ONLY, FaultKind
from ftrun.core.membership import Membership
from ftrun.core.options import RdzvBackend
from ftrun.core.policy import phase_text
from ftrun.core.replica_groups import group_rows
from ftrun.core.spec import RunSpec
from ftrun.protocol.control import (
    DrainQueued,
    GpuInjected,
    Injected,
    NetDowned,
    Preempted,
    read_reply,
    reply,
)
from ftrun.protocol.control_ops import DrainOp, InjectOp, StatusOp, check_request
from ftrun.protocol.rendezvous import node_of
from ftrun.protocol.status import Gpu, ReplicaGroup, Status, Summary, WorkerRow


def job_of(spec: RunSpec) -> str | None:
    """What every agent of a multi-node job shares, whatever its run id: its rendezvous.
    `ftrun status` shows agents of one job on one host as one job."""
    if spec.nnodes_max <= 1:
        return None
    where = (f"{spec.master_addr}:{spec.master_port}" if spec.rdzv_backend is RdzvBackend.STATIC
             else spec.rdzv_endpoint)
    return f"{spec.rdzv_backend}://{where}/{spec.rdzv_id}"


@dataclass(frozen=True)
class Drill:
    """A checked drill on its way from the server thread to the main loop."""

    worker: int
    kind: FaultKind
    at_step: int
    arg: float
    chaos: int | None = None  # --chaos: the fault's number in its chaos run


class ControlPlane:
    def __init__(self, port: ControlPort, slots: ProgressSlots, journal: Journal,
                 health: HealthWatch, log_dir: str | None) -> None:
        self.port = port
        self.slots = slots
        self.journal = journal
        self.health = health
        self.membership: Membership | None = None  # the attempt's, while it runs in-process
        self._drill_seq = 0
        self.drills: queue.SimpleQueue[Drill] = queue.SimpleQueue()
        self.drain_requests: queue.SimpleQueue[DrainRequest] = queue.SimpleQueue()
        self._latest: tuple[float, Status | None] = (0.0, None)  # the last whole-job status
        sock = os.path.join(run_dir(), f"{port.control_name()}.sock")
        self.info = RunInfo(port.run_id, os.getpid(), port.spec.script, time.time(), sock,
                            log_dir, job_of(port.spec))
        self.timeline = Timeline(log_dir, sample_every_s(port.spec.nnodes_max))
        self.metrics_url: str | None = None  # where Prometheus scrapes this agent, if it does
        self.server = ControlServer(self.info, self.handle)  # serves from serve() on

    def scraped_at(self, url: str) -> None:
        """Where Prometheus scrapes this agent: `ftrun status` names it."""
        self.metrics_url = url

    def follow(self, membership: Membership | None) -> None:
        """The attempt's membership while it runs in-process (None: the attempt is over)."""
        self.membership = membership

    def serve(self) -> None:
        """Answer `ftrun status` and `ftrun inject-fault` from now on: called once this object
        and the agent it reads are whole (a request is answered from another thread)."""
        self.server.start()

    def close(self) -> None:
        self.server.close()
        self.timeline.close()

    def sample(self, now: float, ended: Sequence[object] = (), whole_job: bool = True) -> None:
        """The main loop's pass: a timeline line for `ftrun report`, twice a second, and one
        whenever workers of this node ended (their last steps, read before their progress
        slots are retired: a run's last commits come just before its workers exit).
        `whole_job`: the job's status (a coordinator's: every node); a follower samples its
        own node, without asking the coordinator's store twice a second."""
        gone = [w for w in ended if isinstance(w, Worker)]
        if not gone and not self.timeline.due(now):
            return
        try:
            built_at, latest = self._latest  # a whole-job status the status thread built
            if latest is not None and whole_job and not gone and \
                    time.monotonic() - built_at <= self.timeline.every_s:
                doc = latest  # since the last sample was due: not built again on this loop
            else:
                doc = self.status() if whole_job else self.local_status()
            if gone:
                doc = dataclasses.replace(doc, workers=(*doc.workers, *self.rows(now, gone)))
            self.timeline.sample(doc, now)
        except Exception as exc:  # the history must never stop the job: said once, skipped
            if self.timeline.failed(now):
                notice(self.port.emit, f"could not sample the timeline: {exc}")

    # ------------------------------------------------------------ requests (server thread)
    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = check_request(req)
        if isinstance(op, StatusOp):
            return reply(self.status())
        if isinstance(op, DrainOp):
            drain = self._drain_request(op)
            self.drain_requests.put(drain)
            self.port.wake()
            return reply(DrainQueued(drain.token, drain.what, drain.leavers))
        if op.kind in NOTICE_KINDS:  # as a scheduler sends it: SIGTERM to this agent
            if not self.port.uses_api():
                raise FtrunError("--kind preempt needs a script that uses the ftrun worker API "
                                 "(without it a notice stops the job, as torchrun's would)",
                                 hint="use --kind kill to drill a plain script")
            os.kill(os.getpid(), signal.SIGTERM)
            return reply(Preempted(os.getpid(), self.port.spec.drain_window))
        if op.gpu is not None:
            return reply(GpuInjected(op.gpu, self.health.inject(op.gpu, op.kind, op.xid)))
        if op.node is not None:  # the node's hook answers a JSON object: checked here
            return reply(read_reply(NetDowned, self.port.net_down(op.node, op.duration)))
        target = self._validate(op)
        self.drills.put(Drill(target.worker_id, op.kind, op.at_step, op.slot_arg, op.chaos))
        self.port.wake()
        return reply(Injected(target.worker_id, target.spawned.pid, target.rank))

    def _validate(self, op: InjectOp) -> Worker:
        """What a checked request asks of this job: a worker-API drill of a plain script, or a
        rank this node does not run, is refused here."""
        kind, at_step, rank = op.kind, op.at_step, op.rank
        if kind in GPU_KINDS:
            raise FtrunError(f"--kind {kind} breaks a GPU", hint="use --gpu N instead of --rank")
        if (kind in WORKER_ONLY or at_step >= 0) and not self.port.uses_api():
            raise FtrunError(f"--kind {kind} {'--at-step ' if kind not in WORKER_ONLY else ''}"
                             "needs a script that uses the ftrun worker API",
                             hint="use --kind kill, segv or hang without --at-step")
        by_rank = {self._rank_of(w): w for w in self.port.live_members()}
        if not by_rank:
            raise FtrunError("no worker of this job is running yet (it is starting or "
                             "restarting its workers)", hint="try again in a moment")
        if rank not in by_rank:
            here = sorted(by_rank)
            multi = self.port.spec.nnodes_max > 1
            where = "on this node" if multi else "in this job"
            raise FtrunError(f"no rank {rank} {where} (ranks here: "
                             f"{', '.join(map(str, here)) or 'none'})",
                             hint="run inject-fault on the node that runs that rank" if multi
                             else f"use --rank 0..{len(here) - 1}")
        return by_rank[rank]

    def _drain_request(self, op: DrainOp) -> DrainRequest:
        """The leavers a checked `ftrun drain` names, or a one-line FtrunError."""
        ms = self.membership
        if ms is None or not self.port.uses_api():
            raise FtrunError("a drain needs a script that uses the ftrun worker API, run by "
                             "the agent that decides for the job",
                             hint="several nodes: run ftrun drain on the coordinator's host, "
                                  "or send the node its notice (SIGTERM to its ftrun)")
        members = ms.members
        leavers: tuple[int, ...]
        if op.rank is not None:
            if op.rank >= len(members):
                raise FtrunError(f"no rank {op.rank} in this job (ranks 0..{len(members) - 1})",
                                 hint=f"use --rank 0..{len(members) - 1}")
            what, leavers = f"rank {op.rank}", (members[op.rank],)
        elif op.node is not None:
            what, leavers = f"node {op.node}", tuple(m for m in members
                                                      if node_of(m) == op.node)
        else:
            what = f"gpu {op.gpu}"
            leavers = tuple(w.worker_id for w in self.port.live_members()
                            if w.local_rank == op.gpu)
        if not leavers:
            raise FtrunError(f"{what} runs no member of this job", hint="ftrun status lists "
                             "the members, their nodes and their devices")
        return DrainRequest(what, leavers, time.time() + self.port.spec.drain_window,
                            node_leaves=op.node is not None, node=op.node,
                            token=uuid.uuid4().hex[:12])

    def _rank_of(self, w: Worker) -> int:
        """Its rank now: from its progress slot once it reported one (ranks move with the
        generations), else the rank it was started with."""
        p = self.slots.progress(w.worker_id)
        return p.rank if p.generation >= 0 and p.rank >= 0 else w.rank

    # ------------------------------------------------------------ drills (main loop)
    def apply_drills(self) -> None:
        """The main loop's pass over the slots: close exited workers', apply queued drills."""
        members = self.membership.members if self.membership is not None else ()
        self.slots.retire({w.worker_id for w in self.port.workers_snapshot()}, members)
        while not self.drain_requests.empty():
            self.port.start_drain(self.drain_requests.get_nowait())
        while True:
            try:
                drill = self.drills.get_nowait()
            except queue.Empty:
                return
            worker = self.port.worker_by_id(drill.worker)
            if worker is None or not worker.alive:
                continue
            kind, at_step = drill.kind, drill.at_step  # checked by check_request
            if kind != FaultKind.SLOW:  # a slower rank is no fault: nothing to name
                self.journal.drill_injected(worker.worker_id, kind, time.time())
            if kind in AGENT_SIGNALS and at_step < 0:
                with contextlib.suppress(ProcessLookupError):  # it may have just exited
                    os.kill(worker.spawned.pid, AGENT_SIGNALS[kind])
            else:
                self._drill_seq += 1
                self.slots.write_drill(worker.worker_id, self._drill_seq, kind, at_step,
                                       drill.arg)
            emit_as(self.port.emit, DrillFields(worker.worker_id, worker.rank, kind, at_step,
                                                drill.chaos))

    # ------------------------------------------------------------ status
    def status(self) -> Status:
        """The job as `ftrun status` shows it (its node adds the zygote and snapshots, a
        coordinator the other nodes)."""
        doc = self.port.decorate_status(self.local_status())
        self._latest = (time.monotonic(), doc)  # the timeline takes it (8,192 rows: ~0.3 s)
        return doc

    def local_status(self) -> Status:
        port, now, ms = self.port, time.time(), self.membership
        view = ms.view if ms is not None else None  # one read: generation and members agree
        faults, spec = self.journal.faults, port.spec
        groups = group_rows(ms, spec.shard_size) if ms is not None and spec.shard_size > 1 \
            else None
        return Status(
            run_id=port.run_id, script=spec.script, pid=os.getpid(),
            started_at=self.info.started_at, uptime_s=round(now - self.info.started_at, 1),
            generation=view.generation if view else 0,
            world_size=len(view.members) if view else spec.nproc,
            policy=spec.on_fault, spares=spec.spares, shard_size=spec.shard_size,
            attempt=port.restarts, log_dir=self.info.log_dir, ft_api=bool(ms and ms.uses_api),
            workers=self.rows(now), hang_timeout_s=round(self.health.timeout_s, 2) or None,
            faults=tuple(r.fault() for r in faults),
            summary=Summary.from_json(summarize(faults, now - self.info.started_at)),
            heal=self.journal.heals.describe(), steps_per_s=self.timeline.steps_per_s(),
            gpus=tuple(Gpu.from_json(g) for g in self.health.gpu_table()),
            metrics=self.metrics_url,
            replica_groups=None if groups is None else tuple(
                ReplicaGroup.from_json(g) for g in groups),
            drains=tuple(self.journal.drains.values()) or None, verify_every=spec.verify_every)

    def rows(self, now: float, workers: Sequence[Worker] | None = None) -> tuple[WorkerRow, ...]:
        """One row per live worker of this node (or per one of `workers`), from its progress
        slot."""
        rows = []
        for w in self.port.workers_snapshot() if workers is None else workers:
            p = self.slots.progress(w.worker_id)
            has = p.generation >= 0
            gpu, health = self.health.gpu_of(w.local_rank)
            rows.append(WorkerRow(
                worker_id=w.worker_id, rank=p.rank if has else w.rank,
                local_rank=w.local_rank, pid=w.spawned.pid, state=w.state.value,
                role=role_of(self.membership, w.worker_id),
                step=p.step if has else None,
                committed_step=p.step - 1 if has else None,
                step_time_ms=round(p.step_time * 1000, 1) if has else None,
                since_progress_s=round(now - p.phase_started, 2)
                if has and p.phase_started else None,
                phase=phase_text(p.phase, p.step, p.collective, p.label) if has else None,
                cpu=self.health.cpu_state(w.spawned.pid, now),
                gpu=gpu, health=health, straggler=self.health.stragglers.get(w.worker_id)))
        return tuple(rows)
