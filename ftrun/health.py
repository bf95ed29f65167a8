"""The agent's watch over silent faults: hung workers, stragglers and GPU health.

Owns: the GPU monitor of the run (backend chosen by --gpu-backend), the map from local ranks
to GPU UUIDs and the set of excluded GPUs, and `tick()`, run from the agent's main loop, which
turns GPU verdicts, hangs and stragglers into actions through the pure functions of policy.py.
Hangs are judged by progress (the workers' slots), never by CPU use: a rank spinning in a busy
loop is as hung as a stopped one. A rebuild of a stuck communicator is followed up: if no step
is committed within another timeout, the ranks are replaced.
Must not import: torch, typer, rich, the CLI.
"""

from __future__ import annotations

import os
import queue
import time
from typing import TYPE_CHECKING

from ftrun.errors import FtrunError
from ftrun.gpu import GpuMonitor, SimBackend, open_backend, uuids_by_local_rank
from ftrun.gpuhealth import Health, Verdict
from ftrun.policy import (
    Liveness,
    find_hang,
    find_straggler,
    hang_timeout,
    replace_after_rebuild,
)
from ftrun.progress import Progress

if TYPE_CHECKING:
    from ftrun.agent import Agent

CHECK_EVERY_S = 0.25
STRAGGLER_CHECKS = 8  # consecutive checks (2 s) before a rank is called a straggler
CPU_IDLE_S = 1.0  # `ftrun status` calls a worker idle after this long without CPU time


class HealthWatch:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        spec = agent.spec
        # simulated GPUs: one per worker and spare, one free for a replacement, or
        # FTRUN_SIM_GPUS (drills that exclude several GPUs need more)
        count = int(os.environ.get("FTRUN_SIM_GPUS", 0)) or (
            spec.nproc + spec.spares + (1 if spec.spares == 0 else 0))
        backend, message = open_backend(spec.gpu_backend, count)
        if message:
            agent.emit("notice", {"text": message})
        self.backend = backend
        self.uuids = (uuids_by_local_rank(backend, os.environ.get("CUDA_VISIBLE_DEVICES"))
                      if backend else [])
        self.excluded: set[str] = set()
        self.changes: queue.SimpleQueue[tuple[str, Verdict]] = queue.SimpleQueue()
        self.monitor = GpuMonitor(backend, self._on_change) if backend else None
        self.stragglers: dict[int, str] = {}
        self._hits: dict[int, int] = {}
        self._cpu: dict[int, tuple[int, float]] = {}  # pid -> (utime+stime ticks, changed at)
        self.timeout_s = 0.0  # the hang timeout in force (shown by `ftrun status`)
        self._rebuilt: tuple[int, int, float] | None = None  # (generation, step stuck at, when)
        self._kept: set[int] = set()  # replicas kept through failed rebuilds at _kept_step
        self._kept_step = -1
        self._killed: set[tuple[int, int]] = set()  # (attempt, worker id) already killed
        self._next = 0.0

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    # ------------------------------------------------------------ GPUs
    def _on_change(self, uuid: str, verdict: Verdict) -> None:  # monitor threads
        self.changes.put((uuid, verdict))
        self.agent.wake()

    def gpu_of(self, local_rank: int) -> tuple[str | None, str | None]:
        if local_rank >= len(self.uuids):
            return None, None
        uuid = self.uuids[local_rank]
        verdict = self.monitor.verdicts.get(uuid) if self.monitor else None
        return uuid, verdict.health.value if verdict else "healthy"

    def pick_local_rank(self, preferred: int) -> int:
        """The lost worker's device, unless its GPU is excluded: then a free healthy one."""
        if not self.uuids or self.uuids[preferred % len(self.uuids)] not in self.excluded:
            return preferred
        busy = {w.local_rank for w in self.agent.workers_snapshot()}
        for local_rank, uuid in enumerate(self.uuids):
            if uuid not in self.excluded and local_rank not in busy:
                return local_rank
        self.agent.emit("notice", {"text": "no healthy GPU is free: the replacement starts "
                                           "without one of its own"})
        return len(self.uuids) + preferred

    def inject(self, index: int, kind: str, xid: int | None) -> str:
        if not isinstance(self.backend, SimBackend):
            raise FtrunError("GPU faults can only be injected into simulated GPUs",
                             hint="start the job with --gpu-backend sim")
        return self.backend.inject(index, kind, xid)

    def _apply_gpu_changes(self) -> None:
        while True:
            try:
                uuid, verdict = self.changes.get_nowait()
            except queue.Empty:
                return
            local = [i for i, u in enumerate(self.uuids) if u == uuid]
            self.agent.emit("gpu", {"uuid": uuid, "health": verdict.health.value,
                                    "reason": verdict.reason, "local_ranks": local})
            if verdict.health is Health.FAILED:
                self.excluded.add(uuid)
                for w in self.agent.workers_snapshot():
                    if w.local_rank in local:
                        self._kill(w.worker_id, f"gpu: {verdict.reason}")

    # ------------------------------------------------------------ hangs and stragglers
    def tick(self) -> None:
        self._apply_gpu_changes()
        now = time.time()
        ft = self.agent.ft
        if now < self._next or ft is None or not ft.hello:
            return
        self._next = now + CHECK_EVERY_S
        rows = [m for m in self.local_liveness(now) + self.agent.remote_liveness()
                if m.worker in ft.members]
        members = [m for m in rows if m.generation == ft.number]  # the others: not started,
        if not rows:  # or still recovering into it
            return
        self.timeout_s = hang_timeout(members or rows, self.agent.spec.hang_timeout)
        if self._rebuild_failed(rows, now) or not members:
            return
        hang = find_hang(members, self.timeout_s, len(ft.members))
        if hang is not None:
            self._on_hang(hang.worker, hang.reason, members, now)
            return
        if len(members) > 1:
            self._check_straggler(members)

    def local_liveness(self, now: float) -> list[Liveness]:
        """This node's members that reported progress (a follower sends these to the
        coordinator in its heartbeat, so hangs are judged over the whole job)."""
        out = []
        live = self.agent.live_members()
        for w in live:
            p: Progress = self.agent.observer.progress(w.worker_id)
            if p.generation < 0:
                continue
            in_collective = p.phase == "collective" and p.collective_started > 0
            out.append(Liveness(
                worker=w.worker_id, rank=p.rank, step=p.step,
                idle_s=now - (p.phase_started or max(p.last_commit, p.step_started)),
                waiting_s=now - p.collective_started if in_collective else None,
                stopped=_stopped(w.spawned.pid), compute_s=p.compute_time, step_s=p.step_time,
                generation=p.generation, phase=p.phase or "step", collective=p.collective,
                label=p.label, step_p95_s=p.step_p95))
        pids = {w.spawned.pid for w in live}
        self._cpu = {pid: seen for pid, seen in self._cpu.items() if pid in pids}
        return out

    def cpu_state(self, pid: int, now: float) -> str:
        """"busy" or "idle" (no CPU time for a second): shown, never used to decide."""
        ticks = _cpu_ticks(pid)
        last = self._cpu.get(pid)
        if last is None or last[0] != ticks:
            self._cpu[pid] = (ticks, now)
            return "busy"
        return "idle" if now - last[1] > CPU_IDLE_S else "busy"

    def _on_hang(self, worker: int | None, reason: str, members: list[Liveness],
                 now: float) -> None:
        ft = self.agent.ft
        assert ft is not None
        if worker is None:
            before = ft.number
            ft.rebuild(reason)
            if ft.number != before:  # not refused (fault budget): watch that it helps
                self._rebuilt = (ft.number, max(m.step for m in members), now)
            return
        if self._kill(worker, "hang"):
            self.agent.emit("notice", {"text": f"hang: {reason}; killing worker {worker}"})

    def _rebuild_failed(self, rows: list[Liveness], now: float) -> bool:
        """After a rebuild, no member committed a step for another timeout: the rebuilt
        communicator is stuck too (or members never reached it). Replace the ranks."""
        ft = self.agent.ft
        assert ft is not None
        stuck_at = max(m.step for m in rows)
        if self._kept and stuck_at > self._kept_step:
            self._kept = set()  # the job moved on: a later incident starts afresh
        if self._rebuilt is None:
            return False
        generation, step, at = self._rebuilt
        if ft.number != generation or stuck_at > step:
            self._rebuilt = None  # it helped, or another fault took over
            return False
        if now - at <= self.timeout_s:
            return False
        self._rebuilt = None
        out, why = replace_after_rebuild(rows, generation, frozenset(self._kept))
        if all(m.generation >= generation for m in rows):  # one replica kept: not again
            self._kept.update(m.worker for m in rows if m.worker not in out)
            self._kept_step = step
        self.agent.emit("notice", {"text": f"hang: {why}"})
        for worker in out:
            self._kill(worker, "hang")
        return True

    def _kill(self, worker: int, why: str) -> bool:
        """SIGKILL a member once (on whichever node it runs); False if it was done already."""
        key = (self.agent.restarts, worker)
        if key in self._killed or not self.agent.kill_worker(worker):
            return False
        self._killed.add(key)
        self.agent.journal.drill_injected(worker, why, time.time())
        return True

    def _check_straggler(self, members: list[Liveness]) -> None:
        found = find_straggler(members, self.agent.spec.straggler_factor)
        worker = found[0] if found else None
        self._hits = {worker: self._hits.get(worker, 0) + 1} if worker is not None else {}
        if found is None or self._hits[found[0]] != STRAGGLER_CHECKS:
            return
        self.stragglers[found[0]] = found[1]
        evict = self.agent.spec.evict_stragglers
        self.agent.emit("straggler", {"worker": found[0], "reason": found[1], "evicted": evict})
        if evict:
            self._kill(found[0], "straggler")


def _cpu_ticks(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return -1


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
