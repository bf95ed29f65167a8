"""The agent's mappings of its workers' progress slots.

Owns: one mapped `Slot` per live (or starting) worker of this node, and the last progress of
exited members as plain values (an exited worker's mapping is closed, so replacements cost
the agent no descriptor each). The main loop, the control server and the heartbeat thread all
read through here, under one lock.
Must not import: torch, typer, rich, the agent or its helpers.
"""

from __future__ import annotations

import threading
from collections.abc import Collection

from ftrun.protocol.progress import Progress, Slot, slot_path


class ProgressSlots:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._slots: dict[int, Slot] = {}
        self._final: dict[int, Progress] = {}  # exited members' last progress
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()

    def reset(self, worker_id: int) -> None:
        """A worker id starts afresh (ids restart with every attempt)."""
        with self._lock:
            self._final.pop(worker_id, None)
            self._slot(worker_id).reset()

    def progress(self, worker_id: int) -> Progress:
        with self._lock:
            final = self._final.get(worker_id)
            return final if final is not None else self._slot(worker_id).read()

    def committed_step(self, worker_id: int) -> int:
        return self.progress(worker_id).step

    def write_drill(self, worker_id: int, seq: int, kind: str, at_step: int,
                    arg: float) -> None:
        with self._lock:
            self._slot(worker_id).write_drill(seq, kind, at_step, arg)

    def retire(self, live: Collection[int], members: Collection[int]) -> None:
        """An exited worker's slot no longer moves: its last progress, as plain values, is all
        the fault accounting still reads (a finished member's committed step, the lost one's
        in its fault record); once it has left the members, not even that."""
        with self._lock:
            for wid in [wid for wid in self._slots if wid not in live]:
                slot = self._slots.pop(wid)
                self._final[wid] = slot.read()
                slot.close()
            self._final = {wid: p for wid, p in self._final.items() if wid in members}

    def _slot(self, worker_id: int) -> Slot:  # under self._lock
        if worker_id not in self._slots:
            self._slots[worker_id] = Slot(slot_path(self.directory, worker_id), create=True)
        return self._slots[worker_id]
