"""The worker's side of snapshots: taking one at a step boundary, resuming from the newest.

Owns: `Snapshots`, which the worker API calls at every step boundary (one replica per node
copies the registered state, its random streams and its committed step into the agent's
shared-memory slot when one is due: the only synchronous part of a snapshot) and once when a
worker starts with no live replica to heal from (load the newest complete snapshot: the
node's shared-memory slots first, then the disk, skipping, with one line each, any that is
partial or corrupt). With --shard-size every rank of the node's first replica group fills
its own shard's slots, and a rank resumes from a complete set of shards (its own, from shared
memory) or from disk through DCP, resharded to its shape (worker/sharded_snapshot.py); a
group that spans nodes fills each node's part, and its ranks agree over their shard group on
a step every one of them holds before any loads (a node holds only its own shards). Where the
slots go, with their room reserved, is worker/snapshot_slots.py's.
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

from ftrun.adapters import room, sharded_io, snapshot_io
from ftrun.core import timeouts
from ftrun.core.errors import first_line
from ftrun.core.spec import WorkerEnv
from ftrun.protocol.rendezvous import Generation, Resumed
from ftrun.protocol.shard_sets import (
    ShardSet,
    complete_sets,
    shard_dir,
    snapshot_shard,
)
from ftrun.protocol.snapshots import (
    EXIT_CANNOT_RESUME,
    SLOTS,
    Manifest,
    disk_snapshots,
    is_due,
    manifest_of,
    read_manifest,
    read_slot_record,
    slot_paths,
    slot_to_fill,
    snapshots_this_node,
    verify,
)
from ftrun.worker import sharded_snapshot
from ftrun.worker.aligning import STREAMS
from ftrun.worker.snapshot_slots import Placement

NO_CAP = 1 << 62  # any step: the first round of a spanning group's agreement
STEP = "ftrun.step"  # the committed step, beside the registered objects in a snapshot
# (step, where, taken at, read): a snapshot a worker may resume from
Candidate = tuple[int, str, float, Callable[[], dict[str, Any]]]


class Snapshots:
    def __init__(self, wenv: WorkerEnv) -> None:
        self.shm_dir = wenv.snapshot_shm
        self.spill_dir = wenv.snapshot_spill  # slots on disk, when /dev/shm has no room
        self.resume_run, self.resume_step = wenv.resume_run, wenv.resume_step
        self.every = wenv.snapshot_every
        self.interval_s = wenv.snapshot_interval
        self.resume_dir = wenv.resume_dir
        self.resuming = wenv.resume  # started with no live replica: load the newest first
        self.worker_id = wenv.worker_id
        self.shard_size = wenv.shard_size
        self.nproc = wenv.local_world_size
        # groups that span nodes
        self.spans = wenv.shard_size > max(1, wenv.local_world_size)
        self._last_step = 0
        self._last_at = time.time()
        self.skipped = 0  # due, but the agent was still reading the slot to fill
        # by time, sharded: the boundary shard 0's clock names, and the one its group heard
        # at a step's start (api.py carries both in the group's generation check)
        self.proposed = self.agreed_due = -1
        self._place = Placement(self.shm_dir, self.spill_dir, self.worker_id)
        self._no_room_said = False

    @property
    def off(self) -> str:
        """Why snapshots are off on this worker (no room for its slots anywhere), or ""."""
        thread = self._place.thread
        return self._place.off if thread is not None and not thread.is_alive() else ""

    @property
    def taking(self) -> bool:
        return bool(self.shm_dir) and (self.every > 0 or self.interval_s > 0) and not self.off

    def at_boundary(self, gen: Generation, committed: int, objects: Mapping[str, Any],
                    final: bool) -> None:
        """A step boundary after a commit: take a snapshot of `objects` (what the script
        registered, and the random streams) if one is due on this replica. The `final` one
        (every step committed) is always taken, waiting for the slot if the agent reads it.
        With --shard-size, every rank of the node's first replica group copies its own
        shards into its shard's slots."""
        now = time.time()
        sub = self._where(gen)
        if sub is None:
            return
        due = final and committed > self._last_step or self._due(committed, now, sub)
        reserving = self._place.thread or self._reserve(objects, sub)
        if not due:
            return
        self._last_step, self._last_at = committed, now
        # long done, but for a snapshot due at once; one still reserving is skipped: it holds
        # the slots' locks through this process's own descriptors, which exclude nothing here
        reserving.join(timeouts.SNAPSHOT_FLUSH_S if final else timeouts.SNAPSHOT_RESERVE_S)
        if reserving.is_alive() or self.off:
            self.skipped += 1
            return
        where = self._place.dir
        index = slot_to_fill(where)
        slot, record = self._place.slots[index], slot_paths(where, index)[1]
        if not slot.lock(timeouts.SNAPSHOT_FLUSH_S if final else 0.0):
            self.skipped += 1  # the agent is still writing that one to disk
            return
        try:
            if os.path.exists(record):
                os.unlink(record)  # the slot is not complete from here until it is published
            self._fill(slot, record, objects, committed, gen.number)
        except room.NoRoom as exc:  # a state grown past its reserved room: this one skipped
            self.skipped += 1
            if not self._no_room_said:
                self._no_room_said = True
                _say(f"snapshot of step {committed} skipped: {exc}")
        finally:
            slot.unlock()

    def _fill(self, slot: snapshot_io.Slot, record: str, objects: Mapping[str, Any],
              committed: int, generation: int) -> None:
        """Copy the state into the locked `slot`, then publish its `record`."""
        started = time.perf_counter()  # blocking: state_dict() and the copy
        state = {name: obj.state_dict() for name, obj in objects.items()}
        rec = slot.write({**state, STEP: committed}, committed, self.worker_id, generation)
        blocking = round((time.perf_counter() - started) * 1000, 2)
        tmp = f"{record}.tmp"
        with open(tmp, "w") as f:
            f.write(replace(rec, blocking_ms=blocking).to_json())
        os.rename(tmp, record)

    def _where(self, gen: Generation) -> str | None:
        """The slot directory (below the slots' root) this worker fills, or None when
        another replica of its node takes the snapshots."""
        if self.shard_size <= 1:
            return "" if snapshots_this_node(gen.members, self.worker_id) else None
        shard = snapshot_shard(gen.members, self.worker_id, self.shard_size, self.spans)
        return None if shard is None else os.path.basename(shard_dir("", shard))

    def _due(self, committed: int, now: float, sub: str) -> bool:
        """By steps: the same boundary on every rank. By time, sharded: shard 0's clock
        names the next boundary, which its group hears at that step's start (the group's
        generation check carries it); the other shards follow it, never their own clocks
        (a set split between two steps is never complete), wherever their nodes are."""
        if self.shard_size <= 1 or self.every > 0 or self.interval_s <= 0:
            return is_due(self.every, self.interval_s, committed, self._last_step,
                          self._last_at, now)
        due = committed > self._last_step and self.agreed_due == committed
        if not due and sub == "shard0" and is_due(0, self.interval_s, committed,
                                                  self._last_step, self._last_at, now):
            self.proposed = committed + 1
        return due

    def _reserve(self, objects: Mapping[str, Any], sub: str) -> threading.Thread:
        """The first boundary of the replica that snapshots: size the slots for this state,
        place them where there is room for every one and reserve it (snapshot_slots.py)."""
        size = snapshot_io.reserved_size({n: o.state_dict() for n, o in objects.items()})
        return self._place.start(size, sub)

    def resume(self, objects: Mapping[str, Any]) -> Resumed | None:
        """Load the newest snapshot this worker may use into `objects`; what to tell the
        agent. None loaded ends the worker with EXIT_CANNOT_RESUME after one line (the agent
        chose a snapshot, or --resume named one): training from step 0 instead would be
        silent, and would overwrite what it was given. A group that spans nodes none of
        whose ranks holds a snapshot after a restart (a loss before the first) starts from
        step 0 (None), as a node without a snapshot does."""
        self.resuming = False
        started = time.time()
        skipped: list[str] = []
        found = self._candidates(objects)
        none_held = False
        if self.spans:
            resumed, none_held = self._agreed(found, objects, skipped, started)
            if none_held and self.resume_run:
                return None
        else:
            resumed = self._load_first(found, objects, skipped, started)
        if resumed is not None:
            for line in skipped:  # worth saying only now: an older one served instead
                _say(f"skipping snapshot {line}")
            return resumed
        what = f"--resume {self.resume_dir}" if not self.resume_run else \
            f"the snapshot of step {self.resume_step}" if self.resume_step >= 0 else \
            "a snapshot"
        why = f"no snapshot fits (the newest, {skipped[0]})" if skipped else "none is left"
        if self.spans and not skipped and not none_held:
            why = ("no step that every rank of its replica group holds and could load (a "
                   "node of the group without its part: new since, or its snapshots gone)")
        _say(f"error: cannot resume from {what}: {why}")
        sys.exit(EXIT_CANNOT_RESUME)  # the agent ends the job: no replacement would fit

    def _load_first(self, found: list[Candidate], objects: Mapping[str, Any],
                    skipped: list[str], started: float) -> Resumed | None:
        """Load the first of `found` that fits into `objects`; why each before it did not."""
        for _, where, taken_at, read in found:
            try:
                state = read()
                sharded_snapshot.own_streams(state, objects, STREAMS)
                why = first_mismatch(state, objects)  # before any object is loaded: all or none
                if why is not None:
                    raise Broken(why)
                for name, obj in objects.items():
                    obj.load_state_dict(state[name])
                now = time.time()
                return Resumed(self.worker_id, int(state[STEP]), where, taken_at, now,
                               round((now - started) * 1000, 1))
            except (Broken, snapshot_io.Unreadable) as exc:
                skipped.append(f"{where}: {exc}")
            except Exception as exc:  # a snapshot that cannot be loaded is skipped, said once
                skipped.append(first_line(f"{where}: {type(exc).__name__}: {exc}", 300))
        return None

    def _agreed(self, found: list[Candidate], objects: Mapping[str, Any],
                skipped: list[str], started: float) -> tuple[Resumed | None, bool]:
        """A group that spans nodes: each node holds its own shards only, so the group's
        ranks agree on the newest step every one of them holds (and then loaded: one that
        failed makes them all try the next older), over the shard group. Every rank of the
        group enters, one whose node holds nothing included (the agent tells each to after a
        restart): (what was loaded, whether no rank held any snapshot at all)."""
        cap = NO_CAP
        while True:
            mine = [c for c in found if c[0] <= cap]
            step = sharded_snapshot.agree_min(objects, max((c[0] for c in mine), default=-1))
            if step < 0:
                return None, cap == NO_CAP and sharded_snapshot.agree_min(
                    objects, 0 if found else 1) == 1
            resumed = self._load_first([c for c in mine if c[0] == step], objects, skipped,
                                       started)
            if sharded_snapshot.agree_min(objects, 0 if resumed else -1) == 0:
                return resumed, False
            cap = step - 1

    def _candidates(self, objects: Mapping[str, Any]) -> list[Candidate]:
        """Newest first, shared memory before disk: this agent's slots (complete sets of
        shards, sharded), and the disk snapshots of `resume_dir` (only this run's after a
        restart, none newer than the agent chose)."""
        found: list[tuple[int, int, str, float, Callable[[], dict[str, Any]]]] = []
        newest = self.resume_step if self.resume_step >= 0 else None
        mesh = sharded_snapshot.mesh_of(objects) if self.spans else None
        own = mesh.get_local_rank() if mesh is not None else 0
        for held in complete_sets((self.shm_dir, self.spill_dir), self.shard_size,
                                  self.nproc) if self.shard_size > 1 else ():
            if (newest is None or held.step <= newest) and held.holds(own):
                label = "shared memory" if held.parts[0][0].startswith(self.shm_dir) else "disk"
                found.append((held.step, 1, f"{label} slots of {self.shard_size} shards "
                              f"(step {held.step})", max(r.taken_at for _, _, r in held.parts),
                              _set_reader(held, objects)))
        for slots in (self.shm_dir, self.spill_dir) if self.shard_size <= 1 else ():
            for slot in range(SLOTS) if slots else ():
                rec = read_slot_record(slots, slot)
                if rec is not None and (newest is None or rec.step <= newest):
                    path = slot_paths(slots, slot)[0]
                    label = "shared memory" if slots == self.shm_dir else "disk"
                    found.append((rec.step, 1, f"{label} slot {slot} (step {rec.step})",
                                  rec.taken_at, _reader(path, rec)))
        if self.resume_dir:
            single = read_manifest(self.resume_dir) is not None
            for step, path in ([(-1, self.resume_dir)] if single
                               else disk_snapshots(self.resume_dir)):
                man = manifest_of(path)
                if isinstance(man, Manifest):
                    if self.resume_run and man.run != self.resume_run:
                        continue  # another run's: used only when --resume names it
                    step = man.step
                if newest is None or step <= newest:
                    found.append((step, 0, path, man.taken_at if isinstance(man, Manifest)
                                  else 0.0, _disk_reader(path, objects)))
        found.sort(key=lambda c: (c[0], c[1]), reverse=True)  # newest; memory before disk
        return [(step, where, at, read) for step, _, where, at, read in found]


def first_mismatch(saved: Mapping[str, Any], objects: Mapping[str, Any]) -> str | None:
    """The first place where a snapshot's state does not fit the registered objects (a
    tensor of another shape, a module's key it lacks), named as `model.0.weight`; None when
    it fits as far as shapes tell."""
    for name, obj in objects.items():
        if name not in saved:
            return f"it holds no state for {name}"
        why = _tree_mismatch(saved[name], obj.state_dict(), name)
        if why is not None:
            return why
    return None


def _tree_mismatch(saved: Any, current: Any, path: str) -> str | None:
    import torch

    if isinstance(current, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            return f"{path} is not a tensor in the snapshot"
        if tuple(saved.shape) != tuple(current.shape):
            return (f"{path} has shape {tuple(saved.shape)} in the snapshot, "
                    f"{tuple(current.shape)} here")
        return None
    if isinstance(current, Mapping) and isinstance(saved, Mapping):
        module_like = bool(current) and all(isinstance(v, torch.Tensor)
                                            for v in current.values())
        for key, value in current.items():
            if key not in saved:
                if module_like:  # a module's state dict: every key is needed
                    return f"{path}.{key} is not in the snapshot"
                continue  # an optimizer's state fills in as it steps
            why = _tree_mismatch(saved[key], value, f"{path}.{key}")
            if why is not None:
                return why
        return None
    if isinstance(current, (list, tuple)) and isinstance(saved, (list, tuple)):
        if len(current) != len(saved):
            return f"{path} has {len(saved)} entries in the snapshot, {len(current)} here"
        for i, (a, b) in enumerate(zip(saved, current, strict=True)):
            why = _tree_mismatch(a, b, f"{path}.{i}")
            if why is not None:
                return why
    return None


def _reader(path: str, rec: Any) -> Callable[[], dict[str, Any]]:
    return lambda: snapshot_io.read_slot(path, rec, owned=True)


def _set_reader(held: ShardSet, objects: Mapping[str, Any]) -> Callable[[], dict[str, Any]]:
    return lambda: sharded_snapshot.read_set(held, objects)


class Broken(Exception):
    """A snapshot that is partial, corrupt or does not fit: said in one line, then skipped."""


def _disk_reader(path: str, objects: Mapping[str, Any]) -> Callable[[], dict[str, Any]]:
    """Checksums first; then a rank with sharded state reads, through DCP, the part of each
    tensor it holds now (any shape that wrote it), its shapes checked before any is read;
    one without reads every tensor whole (a sharded snapshot's chunks put together)."""
    def read() -> dict[str, Any]:
        paths = sharded_snapshot.disk_parts(path, objects)  # a node's part: with the others?
        if isinstance(paths, str):
            raise Broken(paths)
        for part in paths:
            why = verify(part)
            if why is not None:
                raise Broken(why)
        if sharded_snapshot.mesh_of(objects) is None and paths == [path]:
            return snapshot_io.load_disk(path)  # refuses another user's before unpickling
        why = first_mismatch(sharded_io.saved_shapes(path), objects)
        if why is not None:
            raise Broken(why)
        state = sharded_io.load_parts(paths, sharded_snapshot.targets(objects))
        if (own := sharded_snapshot.part_of(path)) is not None and len(paths) == 1:
            state[sharded_snapshot.SHARDS_OF] = own[2]  # its own shard's part, same shape
        return state
    return read


def _say(text: str) -> None:
    print(f"ftrun: {text}", file=sys.stderr, flush=True)
