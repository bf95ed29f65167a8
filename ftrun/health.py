"""The agent's watch over silent faults: frozen workers, stragglers and GPU health.

Owns: the GPU monitor of the run (backend chosen by --gpu-backend), the map from local ranks
to GPU UUIDs and the set of excluded GPUs, and `tick()`, run from the agent's main loop, which
turns GPU verdicts, hangs and stragglers into actions through the pure functions of policy.py.
Must not import: torch, typer, rich, the CLI.
"""

from __future__ import annotations

import os
import queue
import time
from typing import TYPE_CHECKING

from ftrun import timeouts
from ftrun.errors import FtrunError
from ftrun.gpu import GpuMonitor, SimBackend, open_backend, uuids_by_local_rank
from ftrun.gpuhealth import Health, Verdict
from ftrun.policy import Liveness, find_hang, find_straggler, hang_timeout
from ftrun.progress import Progress

if TYPE_CHECKING:
    from ftrun.agent import Agent

CHECK_EVERY_S = 0.25
STRAGGLER_CHECKS = 8  # consecutive checks (2 s) before a rank is called a straggler


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
        self._cpu: dict[int, tuple[int, float]] = {}  # pid -> (utime+stime ticks, seen at)
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
        if now < self._next or self.agent.ft is None or not self.agent.ft.hello:
            return
        self._next = now + CHECK_EVERY_S
        number = self.agent.ft.number
        members = [m for m in self.local_liveness(now) + self.agent.remote_liveness()
                   if m.generation == number]  # not started, or still recovering into it
        if len(members) < 2:
            return
        spec = self.agent.spec
        hang = find_hang(members, hang_timeout(members, timeouts.HANG_FLOOR_S, spec.hang_timeout))
        if hang is not None:
            self._on_hang(hang.worker, hang.reason)
            return
        self._check_straggler(members)

    def local_liveness(self, now: float) -> list[Liveness]:
        """This node's members that reported progress (a follower sends these to the
        coordinator in its heartbeat, so hangs are judged over the whole job)."""
        out = []
        for w in self.agent.live_members():
            p: Progress = self.agent.observer.progress(w.worker_id)
            if p.generation < 0:
                continue
            out.append(Liveness(
                worker=w.worker_id, rank=p.rank, step=p.step,
                idle_s=now - max(p.last_commit, p.step_started),
                in_commit_s=now - p.commit_started if p.commit_started else None,
                stopped=_stopped(w.spawned.pid), compute_s=p.compute_time, step_s=p.step_time,
                cpu_idle_s=self._cpu_idle(w.spawned.pid, now), generation=p.generation))
        return out

    def _cpu_idle(self, pid: int, now: float) -> float:
        """Seconds since the process last used CPU (as far as these checks can tell)."""
        ticks = _cpu_ticks(pid)
        last = self._cpu.get(pid)
        if last is None or last[0] != ticks:
            self._cpu[pid] = (ticks, now)
            return 0.0
        return now - last[1]

    def _on_hang(self, worker: int | None, reason: str) -> None:
        ft = self.agent.ft
        assert ft is not None
        if worker is None:
            ft.rebuild(reason)
            return
        if self._kill(worker, "hang"):
            self.agent.emit("notice", {"text": f"hang: {reason}; killing worker {worker}"})

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
