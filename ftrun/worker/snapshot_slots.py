"""Where a worker's snapshot slots go, with their room reserved before anything is copied in.

Owns: `Placement`: choosing the slots' directory (shared memory when it holds every slot, else
the disk under --snapshot-dir, else nowhere: snapshots are off for this worker), opening the
slots and reserving their room (posix_fallocate, adapters/room.py) and writing every page
once, in a thread of its own; and telling the agent when there is room nowhere (a marker
beside the slots, which the agent turns into one line and an event; the worker says the line
itself only when no marker can be written). A slot mapped without its room kills the process
that touches a page the filesystem cannot supply (SIGBUS), and every replacement the same way.
Must not import: typer, rich, NVML, the agent, worker.api. Torch only through the slots.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

from ftrun.adapters import room, snapshot_io
from ftrun.protocol.snapshots import SLOTS, slot_paths, tell_off


class Placement:
    def __init__(self, shm_dir: str, spill_dir: str, worker_id: int) -> None:
        self.shm_dir, self.spill_dir, self.worker_id = shm_dir, spill_dir, worker_id
        self.dir = shm_dir  # where this worker's slots are, once placed
        self.slots: dict[int, snapshot_io.Slot] = {}  # kept mapped from one snapshot to the next
        self.off = ""  # why there is room for the slots nowhere: snapshots are off
        self.thread: threading.Thread | None = None

    def start(self, size: int, sub: str) -> threading.Thread:
        """Place and reserve every slot of `size` bytes (in the subdirectory `sub` of the
        slots' root, "" for none) in a thread: the first copies into them are then as quick
        as the later ones (each was ~5x slower), and the training thread waits for none of
        it. Read `dir`, `slots` and `off` only once the thread has ended."""
        self.thread = threading.Thread(target=self._place, args=(size, sub), daemon=True,
                                       name="ftrun-snapshot-reserve")
        self.thread.start()
        return self.thread

    def _place(self, size: int, sub: str) -> None:
        shm_free = _free(self.shm_dir, sub)
        places = [self.shm_dir] if shm_free >= SLOTS * size else []
        places += [self.spill_dir] if self.spill_dir else []
        for root in places:
            where = os.path.join(root, sub) if sub else root
            try:
                self.slots = _reserved(where, size)
            except (room.NoRoom, OSError):
                continue
            self.dir = where
            if root != self.shm_dir:
                free = _free(self.shm_dir, sub)
                _say(f"/dev/shm has {free >> 20} MiB free, snapshots need {SLOTS} x "
                     f"{size >> 20} MiB: snapshotting to disk only ({self.spill_dir})")
            return
        self.off = self._no_room(size, sub)
        if not tell_off((self.shm_dir, self.spill_dir), self.worker_id, self.off):
            _say(self.off)

    def _no_room(self, size: int, sub: str) -> str:
        where = [f"/dev/shm ({_free(self.shm_dir, sub) >> 20} MiB free)"]
        if self.spill_dir:
            where.append(f"--snapshot-dir {os.path.dirname(self.spill_dir)} "
                         f"({_free(self.spill_dir, '') >> 20} MiB free)")
        return (f"snapshots are off: {SLOTS} slots of {room.mib(size)} MiB fit neither in "
                f"{' nor in '.join(where)}; training goes on without them (a larger /dev/shm "
                "or room under --snapshot-dir brings them back)")


def _reserved(where: str, size: int) -> dict[int, snapshot_io.Slot]:
    """Every slot in `where`, its room reserved and its pages written; NoRoom (or another
    OSError) with the slots this made removed again."""
    os.makedirs(where, mode=0o700, exist_ok=True)
    slots: dict[int, snapshot_io.Slot] = {}
    try:
        for i in range(SLOTS):
            slots[i] = snapshot_io.Slot(slot_paths(where, i)[0])
            slots[i].reserve(size, slot_paths(where, i)[1])
    except BaseException:
        for i, slot in slots.items():
            slot.close()
            data, record = slot_paths(where, i)
            if not os.path.exists(record):  # a published snapshot's slot stays as it was
                with contextlib.suppress(OSError):
                    os.unlink(data)
        raise
    return slots


def _free(root: str, sub: str) -> int:
    """What a filesystem has free for the slots: its free room, plus what the slots already
    there hold (they are reused)."""
    held = 0
    for i in range(SLOTS):
        with contextlib.suppress(OSError):
            held += os.path.getsize(slot_paths(os.path.join(root, sub), i)[0])
    try:
        return room.free(root) + held
    except OSError:
        return 0  # no shared memory to speak of: the disk, if there is a place on it


def _say(text: str) -> None:
    print(f"ftrun: {text}", file=sys.stderr, flush=True)
