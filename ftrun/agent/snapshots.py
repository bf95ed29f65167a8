"""The agent's side of snapshots: the shared-memory slots it owns and their copies on disk.

Owns: `SnapshotKeeper`: the node's shared-memory directory (made when the run starts, removed
when the agent ends: it outlives every worker, not the agent), what each worker is told
(where the slots are, how often to fill one, whether it starts with no live replica and must
resume), a writer thread that copies each newly published slot to `--snapshot-dir` in torch's
Distributed Checkpoint format (atomically: a temporary directory, a manifest of checksums
last, then a rename; the newest `--snapshot-keep` kept), what it reports (an event per
snapshot written, a notice for one that could not be, the status line), and the newest step a
total loss can resume from.
Must not import: the worker library, typer, rich, the CLI. Torch only inside the writer thread
(through `adapters.snapshot_io`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Any

from ftrun.adapters import snapshot_io
from ftrun.core import timeouts
from ftrun.core.events import Event, EventSink
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE
from ftrun.protocol.snapshots import (
    SlotRecord,
    disk_snapshots,
    newest_slot,
    node_dir,
    prune,
    read_manifest,
    read_slot_record,
    root_of,
    slot_paths,
    step_dir,
    temp_dir,
    try_lock,
    write_manifest,
)

SHM_ROOT = "/dev/shm"
WRITER_NICENESS = 10


def default_dir(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), "ftrun-snapshots", run_id)


class SnapshotKeeper:
    def __init__(self, spec: RunSpec, run_id: str, node: int, emit: EventSink) -> None:
        self.spec = spec
        self.node = node
        self._emit = emit
        self.on = spec.snapshots
        self.base = spec.snapshot_dir or (root_of(spec.resume) if spec.resume
                                          else default_dir(run_id))
        self.disk = node_dir(self.base, node)
        self._resumed_from: list[int] = []  # snapshot steps whole-group restarts resumed from
        self.shm = ""
        self.last: dict[str, Any] | None = None  # the newest snapshot written to disk
        self._written_step = -1
        self._results: queue.SimpleQueue[tuple[Event, dict[str, Any]]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.on:
            root = SHM_ROOT if os.path.isdir(SHM_ROOT) else None
            self.shm = tempfile.mkdtemp(prefix=f"ftrun-snap-{run_id[:16]}-", dir=root)
            self._thread = threading.Thread(target=self._write_loop, name="ftrun-snapshots",
                                            daemon=True)
            self._thread.start()

    def bind_node(self, node: int) -> None:
        """A follower learns its node index once it joined: its disk snapshots go there."""
        self.node, self.disk = node, node_dir(self.base, node)

    def worker_fields(self, worker_id: int, attempt: int) -> dict[str, Any]:
        """What a worker is told. The first workers of an attempt after a restart (or of a
        `--resume` run) have no live replica to heal from: they resume from a snapshot."""
        first = worker_id % WORKER_ID_STRIDE < self.spec.nproc
        resume = first and (attempt > 0 and self.on or attempt == 0 and bool(self.spec.resume))
        return {"snapshot_shm": self.shm, "snapshot_every": self.spec.snapshot_every,
                "snapshot_interval": self.spec.snapshot_interval, "resume": resume,
                "resume_dir": (self.spec.resume if attempt == 0 and self.spec.resume
                               else self.base) if resume else ""}

    def newest_step(self) -> int:
        """The newest step a total loss could resume from on this node (-1: none)."""
        if not self.on:
            return -1
        slot = newest_slot(self.shm)
        return max(slot[1].step if slot else -1, self._written_step)

    def resumable(self) -> tuple[int, int]:
        """(the newest step a total loss resumes from or -1, restarts already resumed from
        it): a snapshot that every resume dies after is not resumed from forever."""
        step = self.newest_step()
        return step, self._resumed_from.count(step)

    def restarting(self) -> None:
        """A whole-group restart begins: it resumes from the newest snapshot."""
        if self.on:
            self._resumed_from.append(self.newest_step())

    def drain(self) -> None:
        """The main loop reports what the writer thread did (the journal is not thread-safe)."""
        while True:
            try:
                kind, fields = self._results.get_nowait()
            except queue.Empty:
                return
            self._emit(kind, fields)

    def describe(self, now: float) -> dict[str, Any] | None:
        if not self.on:
            return None
        doc: dict[str, Any] = {"dir": self.disk, "every": self.spec.snapshot_every,
                               "interval_s": self.spec.snapshot_interval}
        slot = newest_slot(self.shm)
        if slot is not None:
            doc["shm_step"] = slot[1].step
        if self.last is not None:
            doc.update(self.last, age_s=round(now - float(self.last["taken_at"]), 1))
        return doc

    def close(self) -> None:
        """The run is over: the newest slot goes to disk first (bounded), then the slots go."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeouts.SNAPSHOT_FLUSH_S)
            self.drain()
        if self.shm:
            shutil.rmtree(self.shm, ignore_errors=True)
            self.shm = ""

    # ---------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        # below the workers: on a busy node a disk write must not slow the training steps
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        snapshot_io.prepare()  # DCP's first use costs ~1 s: not at the first snapshot
        while True:
            stopping = self._stop.wait(timeouts.SNAPSHOT_POLL_S)
            self._write_newest()
            if stopping:
                return

    def _write_newest(self) -> None:
        found = newest_slot(self.shm)
        if found is None or found[1].step <= self._written_step:
            return
        slot, _ = found
        data = slot_paths(self.shm, slot)[0]
        try:
            fd = os.open(data, os.O_RDONLY)
        except OSError:
            return
        try:
            if not try_lock(fd, shared=True):
                return  # a worker is filling it: the next poll sees the result
            rec = read_slot_record(self.shm, slot)  # under the lock: what the slot holds now
            if rec is None or rec.step <= self._written_step:
                return
            self._write(data, rec)
        finally:
            os.close(fd)

    def _write(self, data: str, rec: SlotRecord) -> None:
        started = time.time()
        final, tmp = step_dir(self.disk, rec.step), temp_dir(self.disk, rec.step)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)  # and the node's directory, the first time
            snapshot_io.save_disk(snapshot_io.read_slot(data, rec), tmp)
            write_manifest(tmp, rec.step, rec.taken_at, {"worker": rec.worker,
                                                         "generation": rec.generation})
            if os.path.exists(final):
                shutil.rmtree(final)  # an older run's step of the same number
            os.rename(tmp, final)
        except Exception as exc:  # reported, never fatal: training goes on
            shutil.rmtree(tmp, ignore_errors=True)
            self._written_step = rec.step  # not retried: the next snapshot comes soon
            self._results.put((Event.NOTICE, {"text": f"snapshot of step {rec.step} could not "
                                                      f"be written to {self.disk}: "
                                                      f"{type(exc).__name__}: {exc}"[:300]}))
            return
        self._written_step = rec.step
        prune(self.disk, self.spec.snapshot_keep)
        self.last = {"step": rec.step, "taken_at": rec.taken_at, "bytes": rec.total_bytes,
                     "blocking_ms": rec.blocking_ms,
                     "write_ms": round((time.time() - started) * 1000, 1), "path": final}
        self._results.put((Event.SNAPSHOT, dict(self.last)))


def newest_on_disk(base: str) -> tuple[int, str] | None:
    """The newest finished snapshot under `base` (a --resume argument), unverified."""
    for step, path in disk_snapshots(base):
        if read_manifest(path) is not None:
            return step, path
    return None
