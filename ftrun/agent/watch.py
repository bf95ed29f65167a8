"""The agent's watch over silent faults: hung workers, stragglers and GPU health.

Owns: the GPU monitor of the run (backend chosen by --gpu-backend), the map from local ranks
to GPU UUIDs and the set of excluded GPUs, and `tick()`, run from the agent's main loop, which
turns GPU verdicts, hangs and stragglers into findings (`Kill`, `Rebuild`) through the pure
functions of core.policy; the agent acts on them.
Hangs are judged by progress (the workers' slots), never by CPU use: a rank spinning in a busy
loop is as hung as a stopped one. A rebuild of a stuck communicator is followed up: if no step
is committed within another timeout, the ranks are replaced.
Must not import: torch, typer, rich, the CLI, the agent (it reaches the node through
`ports.WatchPort`).
"""

from __future__ import annotations

import os
import queue
from dataclasses import dataclass

import psutil

from ftrun.adapters.slots import ProgressSlots
from ftrun.agent.ports import WatchPort
from ftrun.core import timeouts
from ftrun.core.drains import DrainRequest
from ftrun.core.errors import FtrunError
from ftrun.core.events import GpuFields, StragglerFields, emit_as, notice
from ftrun.core.membership import Membership
from ftrun.core.options import DrainOn
from ftrun.core.policy import (
    Liveness,
    find_hang,
    find_straggler,
    hang_timeout,
    replace_after_rebuild,
)
from ftrun.core.states import Phase
from ftrun.gpu.monitor import GpuMonitor, SimBackend, open_backend, uuids_by_local_rank
from ftrun.gpu.verdicts import Health, Verdict, predicts_failure


@dataclass(frozen=True)
class Kill:
    """Kill this member (once per attempt); `why` names the fault in its record, `notice` is
    said once it is done."""

    worker: int
    why: str
    notice: str = ""


@dataclass(frozen=True)
class Rebuild:
    """No member is to blame: rebuild the communicator with the same members."""

    reason: str
    stuck_at: int  # the highest step a member works on: a commit past it means it helped


@dataclass(frozen=True)
class Drain:
    """Hand this member's rank over (--drain-on degraded: its GPU predicts a failure)."""

    request: DrainRequest


Finding = Kill | Rebuild | Drain
CHECK_EVERY_S = 0.25
HANG_CHECK_MARGIN_S = 0.01  # a check due when a wait crosses the timeout comes this much later
STRAGGLER_CHECKS = 8  # consecutive checks (2 s) before a rank is called a straggler
CPU_IDLE_S = 1.0  # `ftrun status` calls a worker idle after this long without CPU time
KILL_EXIT_WAIT_S = 10.0  # a member the watch killed, still listed after this: judged again
ROWS_PER_CHECK = 2048  # members judged every CHECK_EVERY_S at most: a larger job is judged
# less often (8,192 members: every second; one judgement ~50 ms, which a fault waits behind)


SUSPECT = "suspect"  # a GPU's health after silent corruption on it: excluded, not failed


class HealthWatch:
    def __init__(self, port: WatchPort, slots: ProgressSlots) -> None:
        self.port = port
        self.slots = slots
        spec = port.spec
        # simulated GPUs: one per worker and spare, one free for a replacement, or
        # FTRUN_SIM_GPUS (drills that exclude several GPUs need more)
        count = int(os.environ.get("FTRUN_SIM_GPUS", 0)) or (
            spec.nproc + spec.spares + (1 if spec.spares == 0 else 0))
        backend, message = open_backend(spec.gpu_backend, count)
        if message:
            notice(port.emit, message)
        self.backend = backend
        self.uuids = (uuids_by_local_rank(backend, os.environ.get("CUDA_VISIBLE_DEVICES"))
                      if backend else [])
        self.excluded: set[str] = set()
        self.suspects: dict[str, str] = {}  # uuid -> why (silent corruption on it)
        self.changes: queue.SimpleQueue[tuple[str, Verdict]] = queue.SimpleQueue()
        self.monitor = GpuMonitor(backend, self._on_change) if backend else None
        self.stragglers: dict[int, str] = {}
        self._hits: dict[int, int] = {}
        self._cpu: dict[int, tuple[float, float]] = {}  # pid -> (CPU seconds, changed at)
        self.timeout_s = 0.0  # the hang timeout in force (shown by `ftrun status`)
        self._rebuilt: tuple[int, int, float] | None = None  # (generation, step stuck at, when)
        self._kept: set[int] = set()  # replicas kept through failed rebuilds at _kept_step
        self._kept_step = -1
        self._killing: dict[int, float] = {}  # members the watch killed -> when
        self._degraded: dict[str, tuple[float, Verdict]] = {}  # uuid -> since, its verdict
        self._drained: set[str] = set()  # GPUs whose rank was handed over
        self._next = 0.0

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    # ------------------------------------------------------------ GPUs
    def _on_change(self, uuid: str, verdict: Verdict) -> None:  # monitor threads
        self.changes.put((uuid, verdict))
        self.port.wake()

    def gpu_of(self, local_rank: int) -> tuple[str | None, str | None]:
        if local_rank >= len(self.uuids):
            return None, None
        uuid = self.uuids[local_rank]
        verdict = self.monitor.verdicts.get(uuid) if self.monitor else None
        if uuid in self.suspects and (verdict is None or verdict.health is not Health.FAILED):
            return uuid, SUSPECT
        return uuid, verdict.health.value if verdict else "healthy"

    def suspect(self, local_rank: int, why: str) -> None:
        """A worker on this device held corrupt state (silent corruption, #53): its GPU is
        suspect, and no replacement starts on it again."""
        if local_rank >= len(self.uuids):
            return  # no GPU known: a CPU run, or one without NVML
        uuid = self.uuids[local_rank]
        self.suspects[uuid] = why
        self.excluded.add(uuid)
        emit_as(self.port.emit, GpuFields(uuid, SUSPECT, why, (local_rank,)))

    def gpu_table(self) -> list[dict[str, object]]:
        """Every GPU of this node in local-rank order, excluded ones included."""
        return [{"index": i, "gpu": uuid, "health": self.gpu_of(i)[1],
                 "excluded": uuid in self.excluded} for i, uuid in enumerate(self.uuids)]

    def pick_local_rank(self, preferred: int) -> int:
        """The lost worker's device, unless its GPU is excluded: then a free healthy one."""
        if not self.uuids or self.uuids[preferred % len(self.uuids)] not in self.excluded:
            return preferred
        busy = {w.local_rank for w in self.port.workers_snapshot()}
        for local_rank, uuid in enumerate(self.uuids):
            if uuid not in self.excluded and local_rank not in busy:
                return local_rank
        notice(self.port.emit, "no healthy GPU is free: the replacement starts "
                               "without one of its own")
        return len(self.uuids) + preferred

    def inject(self, index: int, kind: str, xid: int | None) -> str:
        if not isinstance(self.backend, SimBackend):
            raise FtrunError("GPU faults can only be injected into simulated GPUs",
                             hint="start the job with --gpu-backend sim")
        return self.backend.inject(index, kind, xid)

    def _gpu_findings(self, now: float) -> list[Finding]:
        found: list[Finding] = []
        while True:
            try:
                uuid, verdict = self.changes.get_nowait()
            except queue.Empty:
                return found
            local = [i for i, u in enumerate(self.uuids) if u == uuid]
            emit_as(self.port.emit, GpuFields(uuid, verdict.health.value, verdict.reason,
                                              tuple(local)))
            if verdict.health is Health.FAILED:
                self.excluded.add(uuid)
                found += [Kill(w.worker_id, f"gpu: {verdict.reason}")
                          for w in self.port.workers_snapshot() if w.local_rank in local]
            if verdict.health is Health.DEGRADED:
                self._degraded.setdefault(uuid, (now, verdict))
            else:
                self._degraded.pop(uuid, None)

    def _degraded_drains(self, now: float) -> list[Finding]:
        """--drain-on degraded: a GPU whose readings predict a failure (worn memory at once,
        throttling once sustained) hands its member's rank over, once; it is not used again."""
        if self.port.spec.drain_on is not DrainOn.DEGRADED:
            return []
        found: list[Finding] = []
        members = {w.local_rank: w for w in self.port.live_members()}
        for uuid, (since, verdict) in list(self._degraded.items()):
            due = predicts_failure(verdict) or now - since >= timeouts.GPU_THROTTLE_SUSTAINED_S
            index = self.uuids.index(uuid) if uuid in self.uuids else -1
            if not due or uuid in self._drained or index not in members:
                continue
            self._drained.add(uuid)
            self.excluded.add(uuid)
            found.append(Drain(DrainRequest(
                f"gpu {index} (degraded: {verdict.reason})", (members[index].worker_id,),
                now + self.port.spec.drain_window)))
        return found

    # ------------------------------------------------------------ hangs and stragglers
    def tick(self, membership: Membership | None, now: float, judge: bool = True
             ) -> list[Finding]:
        """What the agent should do about GPUs, hangs and stragglers; it acts, this watches.
        `judge` False: hangs and stragglers wait for the next tick (a fault's pass)."""
        found = self._noted(self._gpu_findings(now), now)  # before judging: a GPU kill counts
        found += self._degraded_drains(now)
        return found + (self._noted(self._judge(membership, now), now) if judge else [])

    def _noted(self, found: list[Finding], now: float) -> list[Finding]:
        self._killing.update((f.worker, now) for f in found if isinstance(f, Kill))
        return found

    def _judge(self, membership: Membership | None, now: float) -> list[Finding]:
        if now < self._next or membership is None or not membership.uses_api:
            return []
        self._next = now + CHECK_EVERY_S
        if self._awaiting_kill(membership, now):
            return []
        ids = set(membership.members)  # a set: thousands of rows, each looked up
        rows = [m for m in self.local_liveness(now) + self.port.remote_liveness()
                if m.worker in ids]
        self._next = max(self._next, now + CHECK_EVERY_S * len(rows) / ROWS_PER_CHECK)
        members = [m for m in rows if m.generation == membership.generation]  # the others:
        if not rows:  # not started, or still recovering into it
            return []
        self.timeout_s = hang_timeout(members or rows, self.port.spec.hang_timeout)
        failed = self._rebuild_failed(rows, membership.generation, now)
        if failed is not None or not members:
            return failed or []
        crossing = next_hang_check_s(members, self.timeout_s)  # sooner than the pace, if due
        if crossing is not None:
            self._next = min(self._next, now + crossing)
        hang = find_hang(members, self.timeout_s, len(membership.members))
        if hang is not None and hang.worker is None:
            return [Rebuild(hang.reason, max(m.step for m in members))]
        if hang is not None and hang.worker is not None:
            return [Kill(hang.worker, "hang", f"hang: {hang.reason}; killing worker "
                                              f"{hang.worker}")]
        return self._check_straggler(members) if len(members) > 1 else []

    def _awaiting_kill(self, membership: Membership, now: float) -> bool:
        """A member the watch killed (a hang, a failed GPU, an evicted straggler) is still
        listed, its exit not yet seen: that exit brings the recovery; meanwhile its peers'
        waits would read as a second fault, a stuck communicator rebuilt for nothing."""
        self._killing = {w: at for w, at in self._killing.items()
                         if w in membership.members and now - at < KILL_EXIT_WAIT_S}
        return bool(self._killing)

    def wait_s(self, now: float) -> float:
        """How long the agent may wait before the next check is due."""
        return min(CHECK_EVERY_S, max(0.0, self._next - now))

    def rebuilt(self, generation: int, stuck_at: int, now: float) -> None:
        """The agent rebuilt the communicator for a `Rebuild`: watch that it helps."""
        self._rebuilt = (generation, stuck_at, now)

    def local_liveness(self, now: float) -> list[Liveness]:
        """This node's members that reported progress (a follower sends these to the
        coordinator in its heartbeat, so hangs are judged over the whole job)."""
        out = []
        live = self.port.live_members()
        for w in live:
            p = self.slots.progress(w.worker_id)
            if p.generation < 0:
                continue
            in_collective = p.phase == Phase.COLLECTIVE and p.collective_started > 0
            out.append(Liveness(
                worker=w.worker_id, rank=p.rank, step=p.step,
                idle_s=now - (p.phase_started or max(p.last_commit, p.step_started)),
                waiting_s=now - p.collective_started if in_collective else None,
                stopped=_stopped(w.spawned.pid), compute_s=p.compute_time, step_s=p.step_time,
                generation=p.generation, phase=p.phase or Phase.STEP,
                collective=p.collective,
                label=p.label, step_p95_s=p.step_p95))
        pids = {w.spawned.pid for w in live}
        self._cpu = {pid: seen for pid, seen in self._cpu.items() if pid in pids}
        return out

    def cpu_state(self, pid: int, now: float) -> str:
        """"busy" or "idle" (no CPU time for a second): shown, never used to decide."""
        used = _cpu_seconds(pid)
        last = self._cpu.get(pid)
        if last is None or last[0] != used:
            self._cpu[pid] = (used, now)
            return "busy"
        return "idle" if now - last[1] > CPU_IDLE_S else "busy"

    def _rebuild_failed(self, rows: list[Liveness], current: int, now: float
                        ) -> list[Finding] | None:
        """After a rebuild, no member committed a step for another timeout: the rebuilt
        communicator is stuck too (or members never reached it). Replace the ranks. None:
        no rebuild has failed (judge hangs as usual)."""
        stuck_at = max(m.step for m in rows)
        if self._kept and stuck_at > self._kept_step:
            self._kept = set()  # the job moved on: a later incident starts afresh
        if self._rebuilt is None:
            return None
        generation, step, at = self._rebuilt
        if current != generation or stuck_at > step:
            self._rebuilt = None  # it helped, or another fault took over
            return None
        if now - at <= self.timeout_s:
            return None
        self._rebuilt = None
        out, why = replace_after_rebuild(rows, generation, frozenset(self._kept))
        if all(m.generation >= generation for m in rows):  # one replica kept: not again
            self._kept.update(m.worker for m in rows if m.worker not in out)
            self._kept_step = step
        notice(self.port.emit, f"hang: {why}")
        return [Kill(worker, "hang") for worker in out]

    def _check_straggler(self, members: list[Liveness]) -> list[Finding]:
        found = find_straggler(members, self.port.spec.straggler_factor)
        worker = found[0] if found else None
        self._hits = {worker: self._hits.get(worker, 0) + 1} if worker is not None else {}
        if found is None or self._hits[found[0]] != STRAGGLER_CHECKS:
            return []
        self.stragglers[found[0]] = found[1]
        evict = self.port.spec.evict_stragglers
        emit_as(self.port.emit, StragglerFields(found[0], found[1], evict))
        return [Kill(found[0], "straggler")] if evict else []


def _cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time; -1 once it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return -1.0
    return float(times.user + times.system)


def _stopped(pid: int) -> bool:
    """SIGSTOPped or stopped by a tracer (a frozen peer raises nothing on its peers)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED,
                                                psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def next_hang_check_s(members: list[Liveness], timeout_s: float) -> float | None:
    """How soon a hang could be decided: when the next wait in a collective crosses the
    timeout (the evidence `find_hang` needs); None if no wait is under way to cross it (the
    next check comes at the usual pace). Without it a hang would be found up to a whole check
    interval after the timeout. Waits past it already were judged: a peer in a long phase may
    keep them there, not a reason to check sooner. Not capped at CHECK_EVERY_S: that undid
    a large job's slower pace (ROWS_PER_CHECK), and at 32,768 members a judgement (~25 ms of
    the coordinator's loop) came every 0.25 s, in every fault's fan-out."""
    before = [timeout_s - m.waiting_s for m in members
              if m.waiting_s is not None and m.waiting_s < timeout_s]
    return min(before) + HANG_CHECK_MARGIN_S if before else None
