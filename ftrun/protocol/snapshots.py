"""Snapshots: where they live and how a complete one is told from a partial or corrupt one.
Shared by the agent (which owns the shared-memory slots and writes the disk copies) and the
worker (which fills a slot and resumes from the newest complete snapshot).

Owns: the shared-memory slot files (`slot<k>.bin`, published by `slot<k>.json`, a
`SlotRecord` written after the data: a slot without its record is never read), the choice of
the slot to fill and of the replica that fills it, when a snapshot is due, the disk layout
(`<dir>/node<k>/step-<n>/`: torch Distributed Checkpoint files, ftrun's skeleton, and the
manifest `ftrun.json` with every file's size and CRC-32, written last, then the directory is
renamed into place), listing, verifying and pruning disk snapshots.
Must not import: torch, typer, rich, the agent or the worker library.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from ftrun.protocol.rendezvous import node_of

SLOTS = 2  # the newest complete slot is never overwritten: the next one goes to the other
MANIFEST = "ftrun.json"
SKELETON = "ftrun-skeleton.pkl"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class SlotRecord:
    """One complete snapshot in a shared-memory slot."""

    step: int  # committed steps it holds (training resumes at this step)
    taken_at: float  # wall clock
    worker: int
    generation: int
    meta_bytes: int  # the pickled skeleton at the start of the slot
    parts: tuple[tuple[str, int, int], ...]  # (dtype, byte offset, elements) per flat part
    total_bytes: int
    blocking_ms: float  # what the training thread spent copying it

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> SlotRecord:
        doc = json.loads(raw)
        doc["parts"] = tuple(tuple(p) for p in doc["parts"])
        return cls(**doc)


def slot_paths(shm_dir: str, slot: int) -> tuple[str, str]:
    return os.path.join(shm_dir, f"slot{slot}.bin"), os.path.join(shm_dir, f"slot{slot}.json")


def read_slot_record(shm_dir: str, slot: int) -> SlotRecord | None:
    try:
        with open(slot_paths(shm_dir, slot)[1]) as f:
            return SlotRecord.from_json(f.read())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def newest_slot(shm_dir: str) -> tuple[int, SlotRecord] | None:
    found = [(r.step, s, r) for s in range(SLOTS) if (r := read_slot_record(shm_dir, s))]
    if not found:
        return None
    _, slot, rec = max(found)
    return slot, rec


def slot_to_fill(shm_dir: str) -> int:
    """Any slot but the one holding the newest complete snapshot."""
    newest = newest_slot(shm_dir)
    return 0 if newest is None else (newest[0] + 1) % SLOTS


def try_lock(fd: int, shared: bool) -> bool:
    """A slot's lock: the worker fills it under an exclusive lock, the agent's writer reads it
    under a shared one. Never blocks: a busy slot is skipped, not waited for."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def snapshots_this_node(members: tuple[int, ...], worker_id: int) -> bool:
    """One replica per node takes the snapshots: its member of lowest rank."""
    node = node_of(worker_id)
    return next((m for m in members if node_of(m) == node), None) == worker_id


def is_due(every: int, interval_s: float, committed: int, last_step: int, last_at: float,
           now: float) -> bool:
    """At a step boundary after a commit: every `every` committed steps, or once `interval_s`
    seconds have passed since the last snapshot (the first one after the first interval)."""
    if committed <= last_step or committed == 0:
        return False
    if every > 0:
        return committed % every == 0
    return interval_s > 0 and now - last_at >= interval_s


# ---------------------------------------------------------------- disk
def node_dir(base: str, node: int) -> str:
    return os.path.join(base, f"node{node}")


def step_dir(node_base: str, step: int) -> str:
    return os.path.join(node_base, f"step-{step:09d}")


def temp_dir(node_base: str, step: int) -> str:
    return os.path.join(node_base, f".step-{step:09d}.tmp-{os.getpid()}")


def crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(path: str, step: int, taken_at: float, extra: dict[str, object]) -> None:
    """Last file of a snapshot: sizes and checksums of every other file in it."""
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name != MANIFEST and os.path.isfile(full):
            files[name] = {"bytes": os.path.getsize(full), "crc32": crc32_of(full)}
    doc = {"format": FORMAT, "step": step, "taken_at": taken_at, "files": files, **extra}
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(path, MANIFEST))


def read_manifest(path: str) -> dict[str, object] | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def verify(path: str) -> str | None:
    """None when the snapshot at `path` is complete and intact, else why not (one line)."""
    doc = read_manifest(path)
    if doc is None:
        return "no manifest (a partial write)"
    files = doc.get("files")
    if doc.get("format") != FORMAT or not isinstance(files, dict) or SKELETON not in files:
        return "an unknown manifest format"
    for name, want in sorted(files.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) != want.get("bytes"):
            return f"{name} has {os.path.getsize(full)} bytes, not {want.get('bytes')}"
        if crc32_of(full) != want.get("crc32"):
            return f"{name} fails its checksum"
    return None


def disk_snapshots(base: str) -> list[tuple[int, str]]:
    """Every finished (renamed into place) snapshot under `base`, any node's, newest first.
    `base` is a --snapshot-dir (with node<k>/ below it) or one node's directory."""
    found = []
    for node_base in [base, *_node_dirs(base)]:
        for name in _listdir(node_base):
            m = _STEP_DIR.match(name)
            if m:
                found.append((int(m.group(1)), os.path.join(node_base, name)))
    return sorted(found, reverse=True)


def _node_dirs(base: str) -> Iterator[str]:
    for name in _listdir(base):
        if re.fullmatch(r"node\d+", name) and os.path.isdir(os.path.join(base, name)):
            yield os.path.join(base, name)


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def root_of(path: str) -> str:
    """The --snapshot-dir a path names: itself, or for one snapshot (`.../node<k>/step-<n>`
    or a bare `step-<n>`), the directory above its node's."""
    if read_manifest(path) is None:
        return path
    parent = os.path.dirname(os.path.abspath(path))
    return os.path.dirname(parent) if re.fullmatch(r"node\d+", os.path.basename(parent)) \
        else parent


def prune(node_base: str, keep: int) -> list[str]:
    """Keep the newest `keep` complete snapshots of a node; drop older ones and the temporary
    directories of writers that are gone (a killed agent's). Returns what was removed."""
    removed = []
    complete = [p for _, p in disk_snapshots(node_base) if read_manifest(p) is not None]
    for path in complete[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for name in _listdir(node_base):
        m = re.fullmatch(r"\.step-\d{9}\.tmp-(\d+)", name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(node_base, name), ignore_errors=True)
            removed.append(os.path.join(node_base, name))
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this writer's own leftover: it is not writing it now
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
