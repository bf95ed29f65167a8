"""The agent's side of snapshots: the shared-memory slots it owns and their copies on disk.

Owns: `SnapshotKeeper`: the node's shared-memory directory (made when the run starts, removed
when the agent ends: it outlives every worker, not the agent), what each worker is told
(where the slots are, how often to fill one, whether it starts with no live replica and must
resume), a writer thread that copies each newly published slot to `--snapshot-dir` in torch's
Distributed Checkpoint format (with --shard-size, the newest complete set of shards as one
checkpoint, adapters/sharded_io.py; groups that span nodes: this node's part of one;
atomically: a temporary directory, a manifest of checksums last, then a rename; the newest
`--snapshot-keep` kept), what it reports (an event per
snapshot written, a `snapshot_failed` event for one that could not be, the status line), the
newest step a total loss can resume from, and the safety rules on its side: the default
directory is this user's alone, the snapshot directory is checked writable at launch, a
run prunes and overwrites only the snapshots it wrote (its name is in each manifest), the
shared memory a killed agent left is removed (by any run), and a state that /dev/shm has no
room for goes to slots on disk instead, or with room nowhere, snapshots are off (the worker's
choice: only it knows the state's size; the agent says it in one line and an event).
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
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ftrun.adapters import room, sharded_io, snapshot_io
from ftrun.adapters.leftovers import remove_dead_slots, shm_prefix, shm_root, spill_prefix
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError, first_line
from ftrun.core.events import (
    EventSink,
    Fields,
    NoticeFields,
    SnapshotFailedFields,
    SnapshotFields,
    emit_as,
    notice,
)
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE
from ftrun.protocol.shard_sets import complete_sets
from ftrun.protocol.snapshots import (
    SlotRecord,
    disk_snapshots,
    newest_slot,
    node_dir,
    owner_of,
    private_dir,
    prune,
    read_manifest,
    read_slot_record,
    root_of,
    slot_paths,
    step_dir,
    temp_dir,
    told_off,
    try_lock,
    writable,
    write_manifest,
)
from ftrun.protocol.status import Snapshot

STREAMS = "ftrun.random_streams"  # the worker's name for its random streams (aligning.STREAMS)
WRITER_NICENESS = 10


def default_root() -> str:
    """Every default snapshot directory of this user lives here: this user's alone (0700),
    so no other user's file can ever pass for one of their snapshots."""
    return os.path.join(tempfile.gettempdir(), f"ftrun-snapshots-{os.getuid()}")


def default_dir(run_id: str) -> str:
    return os.path.join(default_root(), run_id)


class SnapshotKeeper:
    def __init__(self, spec: RunSpec, run_id: str, node: int, emit: EventSink) -> None:
        self.spec = spec
        self.node = node
        self._emit = emit
        self.on = spec.snapshots
        self.base = spec.snapshot_dir or (root_of(spec.resume) if spec.resume
                                          else default_dir(run_id))
        self.disk = node_dir(self.base, node)
        self.run = f"{run_id}/{uuid.uuid4().hex[:12]}"  # in each manifest: whose it is
        self._resumed_from: list[int] = []  # snapshot steps whole-group restarts resumed from
        self._chosen: dict[int, int] = {}  # attempt -> the step its first workers resume from,
        # fixed when the first of them starts (every worker of the attempt before is gone)
        self.shm = self.spill = ""
        self.last: dict[str, Any] | None = None  # the newest snapshot written to disk
        self.failed: list[str] = []  # why each failed write failed
        self._written_step = -1
        self._results: queue.SimpleQueue[Fields] = queue.SimpleQueue()  # events, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.off = ""  # why a worker found no room for its slots anywhere: snapshots are off
        remove_dead_slots()  # any run: what runs SIGKILLed with their guardians left
        if self.on:
            self._check_dir(spec)
            self.shm = tempfile.mkdtemp(prefix=shm_prefix(run_id), dir=shm_root())
            self.spill = tempfile.mkdtemp(prefix=spill_prefix(), dir=self.base)
            self._thread = threading.Thread(target=self._write_loop, name="ftrun-snapshots",
                                            daemon=True)
            self._thread.start()

    def _check_dir(self, spec: RunSpec) -> None:
        """At launch, not at the first snapshot: the directory is usable (the default one
        this user's alone)."""
        flag = "--snapshot-dir" if spec.snapshot_dir else "the default snapshot directory"
        why = None if spec.snapshot_dir or spec.resume else private_dir(default_root())
        why = why or writable(self.base)
        if why is not None:
            raise FtrunError(f"{flag}: {why}", hint="give a --snapshot-dir you can write to")
        others = [(s, owner) for s, p in disk_snapshots(self.base)
                  if (owner := owner_of(p)) is not None]
        if others and not spec.resume:
            notice(self._emit, _others_text(self.base, self.run, *others[0]))

    @property
    def private_dirs(self) -> tuple[str, ...]:
        """What goes with the agent, even a SIGKILLed one: the slots."""
        return tuple(d for d in (self.shm, self.spill) if d)

    def bind_node(self, node: int) -> None:
        """A follower learns its node index once it joined: its disk snapshots go there."""
        self.node, self.disk = node, node_dir(self.base, node)

    def worker_fields(self, worker_id: int, attempt: int) -> dict[str, Any]:
        """What a worker is told. The first workers of an attempt after a restart (or of a
        `--resume` run) have no live replica to heal from: they resume from a snapshot, and
        must (none loaded is an error, not a silent step 0). After a restart that is the
        snapshot the agent chose, this run's own; another run's only when --resume names it."""
        fields: dict[str, Any] = {"snapshot_shm": self.shm, "snapshot_spill": self.spill,
                                  "snapshot_every": self.spec.snapshot_every,
                                  "snapshot_interval": self.spec.snapshot_interval}
        if worker_id % WORKER_ID_STRIDE >= self.spec.nproc:
            return fields  # a replacement or a spare heals from a live replica
        chosen = self._chosen.setdefault(attempt, self.newest_step()) if attempt > 0 else -1
        if chosen >= 0:
            fields.update(resume=True, resume_dir=self.disk, resume_run=self.run,
                          resume_step=chosen)
        elif self.spec.resume:
            fields.update(resume=True, resume_dir=self.spec.resume)
        elif attempt > 0 and self.on and self.spec.groups_span_nodes:  # its group agrees
            # over every node, one holding nothing included
            fields.update(resume=True, resume_dir=self.disk, resume_run=self.run)
        return fields

    def newest_step(self) -> int:
        """The newest step a total loss could resume from on this node (-1: none): with
        --shard-size, a complete set of shards."""
        if not self.on:
            return -1
        return max([*self._slot_steps(), self._written_step])

    def _slot_steps(self) -> list[int]:
        if self.spec.shard_size > 1:
            return [s.step for s in complete_sets(self.private_dirs, self.spec.shard_size,
                                                  self.spec.nproc)[:1]]
        return [s[1].step for d in self.private_dirs if (s := newest_slot(d))]

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
                fields = self._results.get_nowait()
            except queue.Empty:
                return
            emit_as(self._emit, fields)

    def describe(self, now: float) -> Snapshot | None:
        """For `ftrun status` and this node's heartbeat: where, how often, the newest."""
        if not self.on:
            return None
        doc: dict[str, Any] = {"dir": self.disk, "every": self.spec.snapshot_every,
                               "interval_s": self.spec.snapshot_interval}
        slots = self._slot_steps()
        if slots:
            doc["shm_step"] = max(slots)
        if self.last is not None:
            doc.update(self.last, age_s=round(now - float(self.last["taken_at"]), 1))
        if self.failed:
            doc.update(failed=len(self.failed), last_error=self.failed[-1])
        return Snapshot.from_json(doc)

    def close(self) -> None:
        """The run is over: the newest slot goes to disk first (bounded), then the slots go."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeouts.SNAPSHOT_FLUSH_S)
            self.drain()
        if self.failed:  # the end of the run says it, not only the moment it happened
            newest = f"step {self.last['step']}" if self.last else "none"
            notice(self._emit, f"snapshots: {len(self.failed)} could not be "
                               f"written (the last: {self.failed[-1]}); the "
                               f"newest on disk: {newest}")
        for d in self.private_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.shm = self.spill = ""

    # ---------------------------------------------------------------- writer thread
    def _write_loop(self) -> None:
        # below the workers: on a busy node a disk write must not slow the training steps
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        snapshot_io.prepare()  # DCP's first use costs ~1 s: not at the first snapshot
        while True:
            stopping = self._stop.wait(timeouts.SNAPSHOT_POLL_S)
            try:
                self._write_newest()
                self._heard_off()
            except Exception as exc:  # the writer outlives any one snapshot's trouble
                self._results.put(NoticeFields(
                    f"snapshot writer: {type(exc).__name__}: {exc}"[:300]))
            if stopping:
                return

    def _heard_off(self) -> None:
        """A worker found no room for its slots anywhere: one line and an event, once."""
        if not self.off and (why := told_off(self.private_dirs)):
            self.off = why
            self._results.put(NoticeFields(why))

    def _write_newest(self) -> None:
        if self.spec.shard_size > 1:
            self._write_newest_set()
            return
        found = [(s[1].step, d, s[0]) for d in self.private_dirs if (s := newest_slot(d))]
        if not found or max(found)[0] <= self._written_step:
            return
        _, where, slot = max(found)
        data = slot_paths(where, slot)[0]
        try:
            fd = os.open(data, os.O_RDONLY)
        except OSError:
            return
        try:
            if not try_lock(fd, shared=True):
                return  # a worker is filling it: the next poll sees the result
            rec = read_slot_record(where, slot)  # under the lock: what the slot holds now
            if rec is None or rec.step <= self._written_step:
                return
            self._write(lambda tmp: snapshot_io.save_disk(snapshot_io.read_slot(data, rec),
                                                          tmp), rec, {})
        finally:
            os.close(fd)

    def _write_newest_set(self) -> None:
        """The newest complete set of shards, each shard's slot read under its lock: a set
        that a shard began to overwrite meanwhile is left for the next poll."""
        sets = complete_sets(self.private_dirs, self.spec.shard_size, self.spec.nproc)
        if not sets or sets[0].step <= self._written_step:
            return
        newest = sets[0]
        fds: list[int] = []
        try:
            for where, slot, _ in newest.parts:
                fds.append(os.open(slot_paths(where, slot)[0], os.O_RDONLY))
                if not try_lock(fds[-1], shared=True):
                    return  # a shard is filling it: the next poll sees the result
            recs = [read_slot_record(where, slot) for where, slot, _ in newest.parts]
            if any(r is None or r.step != newest.step for r in recs):
                return
            paths = [slot_paths(where, slot)[0] for where, slot, _ in newest.parts]

            def save(tmp: str) -> None:
                shards = [snapshot_io.read_slot(path, rec, shards=True)
                          for path, rec in zip(paths, recs, strict=True) if rec is not None]
                sharded_io.save_shard_set(shards, tmp, STREAMS, newest.first)

            rec = replace(newest.parts[0][2], total_bytes=newest.total_bytes,
                          blocking_ms=newest.blocking_ms)
            part = {"first": newest.first, "of": newest.of} if newest.of else {}
            self._write(save, rec, {"shards": len(newest.parts), **part})
        except OSError:
            return  # a slot that went meanwhile (a stopped group's): the next poll
        finally:
            for fd in fds:
                os.close(fd)

    def _write(self, save: Callable[[str], None], rec: SlotRecord,
               extra: dict[str, Any]) -> None:
        started = time.time()
        final, tmp = step_dir(self.disk, rec.step), temp_dir(self.disk, rec.step)
        try:
            owner = owner_of(final)
            if owner is not None and owner != self.run:
                raise FileExistsError(f"{final} holds another run's snapshot: not overwritten")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(self.disk, mode=0o700, exist_ok=True)
            os.makedirs(tmp, mode=0o700)
            save(tmp)
            write_manifest(tmp, rec.step, rec.taken_at, {"run": self.run, "worker": rec.worker,
                                                         "generation": rec.generation, **extra})
            if os.path.exists(final):
                shutil.rmtree(final)  # this run's own, of the same step (after a restart)
            os.rename(tmp, final)
        except Exception as exc:  # reported, never fatal: training goes on, the next is tried
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk is not kept full by it
            self._written_step = rec.step  # not retried: the next snapshot comes soon
            why = first_line(f"{type(exc).__name__}: {exc}")
            why += _room(self.disk, rec.total_bytes)
            self.failed.append(why)
            self._results.put(SnapshotFailedFields(rec.step, self.disk, why))
            return
        self._written_step = rec.step
        prune(self.disk, self.spec.snapshot_keep, self.run)
        self.last = {"step": rec.step, "taken_at": rec.taken_at, "bytes": rec.total_bytes,
                     "blocking_ms": rec.blocking_ms,
                     "write_ms": round((time.time() - started) * 1000, 1), "path": final}
        self._results.put(SnapshotFields(**self.last))


def _others_text(base: str, run: str, step: int, owner: str) -> str:
    """What a launch says of another run's snapshots in its directory: an earlier run of the
    same job (its --rdzv-id; SIGKILLed, say) is named as such."""
    job = run.split("/")[0]
    whose = (f"an earlier run of this job (--rdzv-id {job})" if owner.split("/")[0] == job
             else "another run")
    return (f"{base} holds snapshots of {whose} (the newest of step {step}): this run starts "
            f"afresh and keeps them, never loading nor overwriting them; `ftrun --resume "
            f"{base} ...` continues that run from them")


def _room(path: str, need: int) -> str:
    """`; 1 MiB free there, 5 MiB needed`: a full disk is a likely cause, and DCP's error (a
    torch.save failing halfway) may not say so."""
    with contextlib.suppress(OSError):
        return (f"; {room.free(path) >> 20} MiB free there, "
                f"{(need + (1 << 20) - 1) >> 20} MiB needed")
    return ""


def newest_on_disk(base: str) -> tuple[int, str] | None:
    """The newest finished snapshot under `base` (a --resume argument), unverified."""
    for step, path in disk_snapshots(base):
        if read_manifest(path) is not None:
            return step, path
    return None
