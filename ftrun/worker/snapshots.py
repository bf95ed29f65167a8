"""The worker's side of snapshots: taking one at a step boundary, resuming from the newest.

Owns: `Snapshots`, which the worker API calls at every step boundary (one replica per node
copies the registered state, its random streams and its committed step into the agent's
shared-memory slot when one is due: the only synchronous part of a snapshot) and once when a
worker starts with no live replica to heal from (load the newest complete snapshot: the
node's shared-memory slots first, then the disk, skipping, with one line each, any that is
partial or corrupt).
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported when it runs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ftrun.adapters import snapshot_io
from ftrun.core import timeouts
from ftrun.core.spec import WorkerEnv
from ftrun.protocol.rendezvous import Generation, Resumed
from ftrun.protocol.snapshots import (
    SLOTS,
    disk_snapshots,
    is_due,
    read_manifest,
    read_slot_record,
    slot_paths,
    slot_to_fill,
    snapshots_this_node,
    verify,
)

STEP = "ftrun.step"  # the committed step, beside the registered objects in a snapshot


class Snapshots:
    def __init__(self, wenv: WorkerEnv) -> None:
        self.shm_dir = wenv.snapshot_shm
        self.every = wenv.snapshot_every
        self.interval_s = wenv.snapshot_interval
        self.resume_dir = wenv.resume_dir
        self.resuming = wenv.resume  # started with no live replica: load the newest first
        self.worker_id = wenv.worker_id
        self._last_step = 0
        self._last_at = time.time()
        self.skipped = 0  # due, but the agent was still reading the slot to fill
        self._slots: dict[int, snapshot_io.Slot] = {}  # kept mapped from one snapshot to the next
        self._reserving: threading.Thread | None = None  # maps and writes every slot's pages

    @property
    def taking(self) -> bool:
        return bool(self.shm_dir) and (self.every > 0 or self.interval_s > 0)

    def at_boundary(self, gen: Generation, committed: int, objects: Mapping[str, Any],
                    final: bool) -> None:
        """A step boundary after a commit: take a snapshot of `objects` (what the script
        registered, and the random streams) if one is due on this replica. The `final` one
        (every step committed) is always taken, waiting for the slot if the agent reads it."""
        now = time.time()
        due = final and committed > self._last_step or is_due(
            self.every, self.interval_s, committed, self._last_step, self._last_at, now)
        if not snapshots_this_node(gen.members, self.worker_id):
            return
        reserving = self._reserving or self._reserve(objects)
        if not due:
            return
        self._last_step, self._last_at = committed, now
        # long done, but for a snapshot due at once; one still reserving is skipped: it holds
        # the slots' locks through this process's own descriptors, which exclude nothing here
        reserving.join(timeouts.SNAPSHOT_FLUSH_S if final else timeouts.SNAPSHOT_RESERVE_S)
        if reserving.is_alive():
            self.skipped += 1
            return
        index = slot_to_fill(self.shm_dir)
        slot, record = self._slots[index], slot_paths(self.shm_dir, index)[1]
        if not slot.lock(timeouts.SNAPSHOT_FLUSH_S if final else 0.0):
            self.skipped += 1  # the agent is still writing that one to disk
            return
        try:
            if os.path.exists(record):
                os.unlink(record)  # the slot is not complete from here until it is published
            started = time.perf_counter()  # blocking: state_dict() and the copy
            state = {name: obj.state_dict() for name, obj in objects.items()}
            rec = slot.write({**state, STEP: committed}, committed, self.worker_id, gen.number)
            blocking = round((time.perf_counter() - started) * 1000, 2)
            tmp = f"{record}.tmp"
            with open(tmp, "w") as f:
                f.write(replace(rec, blocking_ms=blocking).to_json())
            os.rename(tmp, record)
        finally:
            slot.unlock()

    def _reserve(self, objects: Mapping[str, Any]) -> threading.Thread:
        """The first boundary of the replica that snapshots: open every slot, then size them
        for this state and write their pages in a thread of their own, so that the first
        copies into them are as quick as the later ones (each was ~5x slower)."""
        self._slots = {i: snapshot_io.Slot(slot_paths(self.shm_dir, i)[0]) for i in range(SLOTS)}
        size = snapshot_io.reserved_size({n: o.state_dict() for n, o in objects.items()})
        slots = [(slot, slot_paths(self.shm_dir, i)[1]) for i, slot in self._slots.items()]

        def reserve_all() -> None:
            for slot, record in slots:
                slot.reserve(size, record)

        self._reserving = threading.Thread(target=reserve_all, daemon=True,
                                           name="ftrun-snapshot-reserve")
        self._reserving.start()
        return self._reserving

    def resume(self, objects: Mapping[str, Any]) -> Resumed | None:
        """Load the newest complete snapshot into `objects`; what to tell the agent, or None
        when there is none."""
        self.resuming = False
        started = time.time()
        for where, taken_at, read in self._candidates():
            try:
                state = read()
                missing = sorted(set(objects) - set(state))
                if missing:
                    raise Broken(f"it holds no state for {', '.join(missing)}")
                for name, obj in objects.items():
                    obj.load_state_dict(state[name])
                now = time.time()
                return Resumed(self.worker_id, int(state[STEP]), where, taken_at, now,
                               round((now - started) * 1000, 1))
            except Broken as exc:
                _say(f"skipping snapshot {where}: {exc}")
            except Exception as exc:  # a snapshot that cannot be loaded is skipped, said once
                _say(f"skipping snapshot {where}: {type(exc).__name__}: {exc}"[:300])
        return None

    def _candidates(self) -> list[tuple[str, float, Callable[[], Mapping[str, Any]]]]:
        found = []
        if self.shm_dir:
            for slot in range(SLOTS):
                rec = read_slot_record(self.shm_dir, slot)
                if rec is not None:
                    path = slot_paths(self.shm_dir, slot)[0]
                    found.append((rec.step, 1, f"shared memory slot {slot} (step {rec.step})",
                                  rec.taken_at, _reader(path, rec)))
        if self.resume_dir:
            single = read_manifest(self.resume_dir) is not None
            for step, path in ([(-1, self.resume_dir)] if single
                               else disk_snapshots(self.resume_dir)):
                doc = read_manifest(path) or {}
                step = int(str(doc.get("step", step)))
                found.append((step, 0, path, float(str(doc.get("taken_at", 0.0))),
                              _disk_reader(path)))
        found.sort(key=lambda c: (c[0], c[1]), reverse=True)  # newest; memory before disk
        return [(where, at, read) for _, _, where, at, read in found]


def _reader(path: str, rec: Any) -> Callable[[], Mapping[str, Any]]:
    return lambda: snapshot_io.read_slot(path, rec, owned=True)


class Broken(Exception):
    """A disk snapshot that is partial or corrupt: its checksums say so before it is read."""


def _disk_reader(path: str) -> Callable[[], Mapping[str, Any]]:
    def read() -> Mapping[str, Any]:
        why = verify(path)
        if why is not None:
            raise Broken(why)
        return snapshot_io.load_disk(path)
    return read


def _say(text: str) -> None:
    print(f"ftrun: {text}", file=sys.stderr, flush=True)
