"""Snapshots: where they live and how a complete one is told from a partial or corrupt one.
Shared by the agent (which owns the shared-memory slots and writes the disk copies) and the
worker (which fills a slot and resumes from the newest complete snapshot).

Owns: the shared-memory slot files (`slot<k>.bin`, published by `slot<k>.json`, a
`SlotRecord` written after the data: a slot without its record is never read), the choice of
the slot to fill and of the replica that fills it, when a snapshot is due, a worker's word
to the agent that it found room for its slots nowhere (`off-<worker>`), the disk layout
(`<dir>/node<k>/step-<n>/`: torch Distributed Checkpoint files, ftrun's skeleton, and the
manifest `ftrun.json` with every file's size and CRC-32, written last, then the directory is
renamed into place), listing, verifying and pruning disk snapshots, and the safety rules:
whose a snapshot is (the manifest names the run that wrote it: a run prunes and overwrites
only its own), and whether it may be read at all (its directory and files belong to this
user and no one else can write them: a pickle is code).
Must not import: torch, typer, rich, the agent or the worker library.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from ftrun.protocol.rendezvous import node_of

SLOTS = 2  # the newest complete slot is never overwritten: the next one goes to the other
MANIFEST = "ftrun.json"
SKELETON = "ftrun-skeleton.pkl"
FORMAT = 1
EXIT_CANNOT_RESUME = 66  # sysexits' EX_NOINPUT: a worker told to resume found no snapshot that fits
_OFF = "off-"  # a worker's marker: no room for its slots anywhere
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
    if not shm_dir:
        return None
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


def tell_off(dirs: tuple[str, ...], worker: int, text: str) -> bool:
    """A worker with room for its slots nowhere tells the agent why (a marker beside them, made
    one line and an event by the agent); False when no directory takes it."""
    for d in dirs:
        with contextlib.suppress(OSError):
            fd = os.open(os.path.join(d, f"{_OFF}{worker}"),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with open(fd, "w") as f:
                f.write(text)
            return True
    return False


def told_off(dirs: tuple[str, ...]) -> str | None:
    """Why a worker of this node turned snapshots off (the first marker's text), or None."""
    for d in dirs:
        for name in (n for n in _listdir(d) if n.startswith(_OFF)):
            with contextlib.suppress(OSError), open(os.path.join(d, name)) as f:
                if text := f.read(1000).strip():
                    return text
    return None


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
    """Last file of a snapshot: sizes and checksums of every other file in it (each made
    private to this user on the way: DCP writes them with the umask's modes)."""
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name != MANIFEST and os.path.isfile(full):
            os.chmod(full, 0o600)
            files[name] = {"bytes": os.path.getsize(full), "crc32": crc32_of(full)}
    doc = {"format": FORMAT, "step": step, "taken_at": taken_at, "files": files, **extra}
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
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


@dataclass(frozen=True)
class Manifest:
    """A snapshot's manifest, its fields checked."""

    step: int
    taken_at: float
    run: str  # the run that wrote it ("": a snapshot of an ftrun that did not say)
    files: tuple[tuple[str, int, int], ...]  # (name, bytes, crc32)


def decode_manifest(doc: object) -> Manifest | str:
    """A manifest, or why it is not one (one line): a wrong-typed field is a reason, never a
    crash (`"step": "sixty"` must not stop a resume that an older snapshot can serve)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return "an unknown manifest format"
    step, taken_at, run, files = (doc.get(k) for k in ("step", "taken_at", "run", "files"))
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"its manifest's step is {step!r}, not a step number"
    if not isinstance(taken_at, (int, float)) or isinstance(taken_at, bool):
        return f"its manifest's taken_at is {taken_at!r}, not a time"
    if not isinstance(run, (str, type(None))):
        return f"its manifest's run is {run!r}, not a run's name"
    if not isinstance(files, dict) or SKELETON not in files:
        return "an unknown manifest format"
    listed = []
    for name, want in sorted(files.items()):
        size, crc = (want.get("bytes"), want.get("crc32")) if isinstance(want, dict) else (0, 0)
        if not isinstance(size, int) or not isinstance(crc, int) or os.sep in name:
            return f"its manifest's entry for {name!r} is malformed"
        listed.append((name, size, crc))
    return Manifest(step, float(taken_at), run or "", tuple(listed))


def manifest_of(path: str) -> Manifest | str:
    """The manifest of the snapshot at `path`, or why there is none (one line)."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return "no manifest (a partial write)"
    except OSError as exc:
        return f"its manifest cannot be read ({exc.strerror})"
    try:
        return decode_manifest(json.loads(raw))
    except (ValueError, RecursionError):
        return f"its manifest is truncated or corrupt ({len(raw)} bytes, not JSON)"


def verify(path: str) -> str | None:
    """None when the snapshot at `path` is complete and intact, else why not (one line)."""
    man = manifest_of(path)
    if isinstance(man, str):
        return man
    for name, size, crc in man.files:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) != size:
            return f"{name} has {os.path.getsize(full)} bytes, not {size}"
        if crc32_of(full) != crc:
            return f"{name} fails its checksum"
    return None


# ---------------------------------------------------------------- whose, and who may read it
def not_mine(st: os.stat_result, what: str) -> str | None:
    """Why a file or directory must not be read as a snapshot (its pickles would run as this
    user's code): another user owns it, or others may write it. None: it is safe."""
    if st.st_uid != os.getuid():
        return f"{what} belongs to uid {st.st_uid}, not to you: never read"
    if st.st_mode & 0o022:
        return f"{what} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): " \
               "never read"
    return None


def unsafe(path: str) -> str | None:
    """A disk snapshot may be read only if its directory and every file in it are this
    user's and no one else's to write; why not, else None. Checked before anything in it is
    unpickled (DCP's metadata is a pickle, and so is ftrun's skeleton)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory"
        why = not_mine(st, path)
        for name in [] if why else os.listdir(path):
            full = os.path.join(path, name)
            entry = os.lstat(full)
            if not stat.S_ISREG(entry.st_mode):
                return f"{full} is not a plain file: never read"
            why = why or not_mine(entry, full)
        return why
    except OSError as exc:
        return f"cannot inspect {path} ({exc.strerror})"


def private_dir(path: str) -> str | None:
    """Create `path` (with its parents) for this user alone, or check that an existing one is
    this user's (made 0700 if it was wider); why it cannot be used, else None."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"cannot use {path} ({exc.strerror})"
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            return f"{path} belongs to uid {st.st_uid}, not to you"
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
        return None
    finally:
        os.close(fd)


def writable(path: str) -> str | None:
    """Whether snapshots can be written under the directory `path` (created if missing): a
    probe file written and removed. Why not (one line), else None."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        probe = os.path.join(path, f".ftrun-probe-{os.getpid()}")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        os.unlink(probe)
        return None
    except OSError as exc:
        return f"cannot write to {path} ({exc.strerror})"


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


def prune(node_base: str, keep: int, run: str) -> list[str]:
    """Keep the newest `keep` complete snapshots that the run `run` wrote in a node's
    directory; drop its older ones, and this user's temporary directories of writers that
    are gone (a killed agent's). Another run's snapshots are never touched. Returns what was
    removed."""
    removed = []
    own = [p for _, p in disk_snapshots(node_base)
           if isinstance(man := manifest_of(p), Manifest) and man.run == run]
    for path in own[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for name in _listdir(node_base):
        m = re.fullmatch(r"\.step-\d{9}\.tmp-(\d+)", name)
        full = os.path.join(node_base, name)
        if m and not _alive(int(m.group(1))) and _owned(full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed


def owner_of(path: str) -> str | None:
    """The run that wrote the snapshot at `path` ("" unnamed), or None when there is none."""
    man = manifest_of(path)
    return man.run if isinstance(man, Manifest) else None


def _owned(path: str) -> bool:
    with contextlib.suppress(OSError):
        return os.lstat(path).st_uid == os.getuid()
    return False


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
