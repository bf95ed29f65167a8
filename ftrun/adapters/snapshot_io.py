"""A snapshot's bytes: copied into a shared-memory slot, read back from it, written to disk in
torch's Distributed Checkpoint format and read back from there.

Owns: the slot layout (the pickled skeleton, then one flat part per dtype, 64-byte aligned;
every tensor is copied once, straight into the mapped slot: the only work the training thread
does), the state tree rebuilt over a slot or a disk snapshot (views, no copy), and the disk
write (`torch.distributed.checkpoint.save` of the nested state, so DCP's own tools load it,
plus ftrun's skeleton that restores what DCP's flattening loses: integer keys, tuples, the
non-tensor values' types).
Must not import: typer, rich, NVML, the agent, the worker library. Torch is imported lazily.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import pickle
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ftrun.adapters.room import claim
from ftrun.core import timeouts
from ftrun.core.errors import first_line
from ftrun.protocol.snapshots import SKELETON, SlotRecord, not_mine, try_lock, unsafe

_ALIGN = 64
# "WID:STEP[:PAUSE_S]": the first attempt's worker WID dies halfway through copying the
# snapshot of STEP, PAUSE_S seconds (0 by default) after it got there: the other ranks copy
# theirs meanwhile, so that only its part is missing (a test's drill)
DRILL_KILL_MID_SNAPSHOT = "FTRUN_DRILL_KILL_MID_SNAPSHOT"


class Unreadable(Exception):
    """A snapshot that must not be read: another user's, or writable by others (one line)."""


class WriteFailed(Exception):
    """A disk write that failed (DCP's own `CheckpointException` is a BaseException, which an
    `except Exception` would let kill the writer thread): the first cause, in one line."""


class _Slice:
    """A tensor's place in a slot: (part, element offset, shape); for a DTensor's local shard,
    also where it sits in the global tensor (`dist`: global shape, offset, placements)."""

    dist: tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]] | None = None

    def __init__(self, part: int, offset: int, shape: tuple[int, ...]) -> None:
        self.part, self.offset, self.shape = part, offset, shape


class LocalShard:
    """A DTensor's local shard read back from a slot: the shard, the global tensor's shape,
    where the shard starts in it, and the placements it had (no mesh: a mesh is a live
    process group's, rebuilt by whoever loads it)."""

    def __init__(self, tensor: Any, global_shape: tuple[int, ...], offset: tuple[int, ...],
                 placements: tuple[Any, ...]) -> None:
        self.tensor, self.global_shape = tensor, global_shape
        self.offset, self.placements = offset, placements


class _Path:
    """A tensor's place in a disk snapshot: its path in the state tree (DCP's key); for a
    sharded snapshot's DTensor, the placements it was saved with."""

    placements: tuple[Any, ...] | None = None

    def __init__(self, path: tuple[str, ...]) -> None:
        self.path = path


Leaf = Callable[[Any, tuple[str, ...]], Any]


def map_leaves(value: Any, is_leaf: Callable[[Any], bool], fn: Leaf,
               path: tuple[str, ...] = ()) -> Any:
    """Rebuild a state tree (dicts, lists, tuples, namedtuples) with `fn(leaf, path)` at its
    leaves."""
    if is_leaf(value):
        return fn(value, path)
    if isinstance(value, dict):
        return type(value)((k, map_leaves(v, is_leaf, fn, (*path, str(k))))
                           for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(map_leaves(v, is_leaf, fn, (*path, str(i)))
                             for i, v in enumerate(value)))
    if isinstance(value, (list, tuple)):
        return type(value)(map_leaves(v, is_leaf, fn, (*path, str(i)))
                           for i, v in enumerate(value))
    return value


def _is_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Slot:
    """One shared-memory slot file, kept open and mapped by the worker that fills it: mapping
    it afresh for each snapshot would fault every page in again (half the copy's time)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._mm: mmap.mmap | None = None
        self._bytes: Any = None  # one uint8 tensor over the whole mapping

    def lock(self, wait_s: float) -> bool:
        """The agent's writer reads a slot under a shared lock: wait for it at most `wait_s`."""
        deadline = time.monotonic() + wait_s
        while not try_lock(self.fd, shared=False):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)

    def reserve(self, size: int, record: str) -> None:
        """Map at least `size` bytes and write every page once, off the training thread, so
        that no snapshot's copy faults a tmpfs page in (allocating and zeroing it took as long
        as the copy). A slot whose `record` says it holds a published snapshot keeps its
        bytes: its pages are in memory already, and mapping them is all that is left to do."""
        if not self.lock(timeouts.SNAPSHOT_RESERVE_S):
            return  # the agent is writing it to disk: the first copy into it faults instead
        try:
            held = os.fstat(self.fd).st_size
            if os.path.exists(record) and held:
                self._mapping(held)
            else:
                self._mapping(size).zero_()
        finally:
            self.unlock()

    def write(self, state: Mapping[str, Any], step: int, worker: int,
              generation: int) -> SlotRecord:
        """Copy `state` (a tree of state dicts) into the slot (locked by the caller). The
        record is what the caller publishes once this returns."""
        started = time.perf_counter()
        plan = Plan(state)
        flat = self._mapping(plan.total_bytes)
        flat[:len(plan.meta)].copy_(_frombytes(plan.meta))
        flats = [flat[o:o + n * _size_of(d)].view(d)
                 for d, n, o in zip(plan.dtypes, plan.counts, plan.offsets, strict=True)]
        for i, (part, offset, t) in enumerate(plan.tensors):
            flats[part][offset:offset + t.numel()].copy_(t.detach().reshape(-1))
            if i == len(plan.tensors) // 2 and (pause := _drill_kill(worker, step)) is not None:
                time.sleep(pause)
                os.kill(os.getpid(), 9)  # a fault drill: the snapshot's writer dies mid-copy
        parts = tuple((str(d).removeprefix("torch."), o, n)
                      for d, o, n in zip(plan.dtypes, plan.offsets, plan.counts, strict=True))
        return SlotRecord(step=step, taken_at=time.time(), worker=worker,
                          generation=generation, meta_bytes=len(plan.meta), parts=parts,
                          total_bytes=plan.total_bytes,
                          blocking_ms=round((time.perf_counter() - started) * 1000, 2))

    def _mapping(self, size: int) -> Any:
        """The slot mapped at `size` bytes or more (a state that grows a little, a longer
        skeleton, reuses the mapping), pages populated up front."""
        import torch

        if self._mm is not None and len(self._mm) >= size:
            return self._bytes
        self._unmap()
        size = max(size, os.fstat(self.fd).st_size)
        claim(self.fd, size, os.path.dirname(self.path))
        self._mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        with warnings.catch_warnings():  # a writable mmap is what we want here
            warnings.simplefilter("ignore", UserWarning)
            self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._bytes

    def _unmap(self) -> None:
        self._bytes = None  # the tensor's buffer export first, or the mapping cannot close
        if self._mm is not None:
            self._mm.close()
            self._mm = None


class Plan:
    """Where each tensor of a state tree goes in a slot: the pickled skeleton first, then one
    flat part per dtype. Computing it costs no copy."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.tensors: list[tuple[int, int, Any]] = []  # (part, element offset, tensor)
        self.dtypes: list[Any] = []
        self.counts: list[int] = []
        self.meta = pickle.dumps(map_leaves(dict(state), _is_tensor, self._strip))
        self.offsets, self.total_bytes = _layout(len(self.meta), self.dtypes, self.counts)

    def _strip(self, t: Any, _path: tuple[str, ...]) -> _Slice:
        dist = None
        if hasattr(t, "to_local"):  # a DTensor: its local shard only, never gathered
            dist = dtensor_place(t)
            t = t.to_local()
        dtypes, counts = self.dtypes, self.counts
        part = dtypes.index(t.dtype) if t.dtype in dtypes else len(dtypes)
        if part == len(dtypes):
            dtypes.append(t.dtype)
            counts.append(0)
        self.tensors.append((part, counts[part], t))
        counts[part] += t.numel()
        ref = _Slice(part, counts[part] - t.numel(), tuple(t.shape))
        ref.dist = dist
        return ref


def dtensor_place(t: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
    """A DTensor's (global shape, this rank's offset in it, placements): local arithmetic on
    the mesh's coordinate, no collective."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(t.shape), tuple(int(o) for o in offset), tuple(t.placements)


def reserved_size(state: Mapping[str, Any]) -> int:
    """What to reserve for snapshots of `state`: its size now, with room for a skeleton that
    pickles a little longer later (step counters), rounded up to whole MiB."""
    need = Plan(state).total_bytes + (64 << 10)
    return (need + (1 << 20) - 1) >> 20 << 20


def _layout(meta_bytes: int, dtypes: list[Any], counts: list[int]) -> tuple[list[int], int]:
    offsets, end = [], _round_up(meta_bytes)
    for dtype, n in zip(dtypes, counts, strict=True):
        offsets.append(end)
        end = _round_up(end + n * _size_of(dtype))
    return offsets, end


def _size_of(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _frombytes(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _drill_kill(worker: int, step: int) -> float | None:
    """The pause before the drill's death of `worker` copying `step`, or None: no drill."""
    wid, _, rest = os.environ.get(DRILL_KILL_MID_SNAPSHOT, "").partition(":")
    at, _, pause = rest.partition(":")
    if (wid, at) != (str(worker), str(step)) or os.environ.get("FTRUN_ATTEMPT") != "0":
        return None
    return float(pause or 0)


def read_slot(path: str, rec: SlotRecord, owned: bool = False,
              shards: bool = False) -> dict[str, Any]:
    """The state tree a slot holds, as views of the mapped slot (kept alive by them), or
    with `owned`, of one private copy per part: a state that is loaded must own its tensors
    (an optimizer keeps what it is given, and the slot is overwritten by the next snapshot).
    With `shards`, a DTensor's local shard comes back as a `LocalShard` (where it sits in
    the global tensor), else as the bare local tensor."""
    import torch

    with open(path, "rb") as f:
        why = not_mine(os.fstat(f.fileno()), path)  # the very file mapped, before unpickling
        if why is not None:
            raise Unreadable(why)
        mm = mmap.mmap(f.fileno(), rec.total_bytes, prot=mmap.PROT_READ)
    skeleton = pickle.loads(mm[:rec.meta_bytes])  # noqa: S301 - this user's own, checked
    with warnings.catch_warnings():  # read-only buffer: the views are never written
        warnings.simplefilter("ignore", UserWarning)
        flats = [torch.frombuffer(mm, dtype=getattr(torch, d), count=n, offset=o)
                 for d, o, n in rec.parts]
    if owned:
        flats = [f.clone() for f in flats]

    def fill(ref: _Slice, _path: tuple[str, ...]) -> Any:
        n = 1
        for d in ref.shape:
            n *= d
        t = flats[ref.part][ref.offset:ref.offset + n].view(ref.shape)
        dist = getattr(ref, "dist", None)
        return LocalShard(t, *dist) if shards and dist is not None else t

    state: dict[str, Any] = map_leaves(skeleton, lambda v: isinstance(v, _Slice), fill)
    return state


def prepare() -> None:
    """Import what a disk write needs, ahead of the first one."""
    import torch.distributed.checkpoint  # noqa: F401


def save_disk(state: Mapping[str, Any], path: str) -> None:
    """`state` as a DCP checkpoint in the (new, empty) directory `path`, plus the skeleton."""
    write_checkpoint(path, dict(state), map_leaves(dict(state), _is_tensor,
                                                    lambda _t, p: _Path(p)))


def write_checkpoint(path: str, tree: dict[str, Any], skeleton: Any, planner: Any = None
                     ) -> None:
    """The skeleton (where each tensor sits in the tree) and `tree` as a DCP checkpoint, by
    this one process, in the new, empty directory `path`; a failed write is WriteFailed with
    its first cause (a full disk, say)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    fd = os.open(os.path.join(path, SKELETON), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(fd, "wb") as f:
        pickle.dump(skeleton, f)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tree, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                     planner=planner, no_dist=True)
    except CheckpointException as exc:
        raise WriteFailed(_first_cause(exc)) from None


def _first_cause(exc: Any) -> str:
    """`[Errno 28] No space left on device` out of DCP's per-rank failure table."""
    for failure in getattr(exc, "failures", {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, BaseException):
            return f"{type(cause).__name__}: {cause}"
    return first_line(exc, 1000)


def load_disk(path: str) -> dict[str, Any]:
    """The state tree of a disk snapshot (its checksums verified by the caller). Nothing in
    it is unpickled unless it is this user's own, and no one else's to write."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader, meta, skeleton = open_checkpoint(path)
    flat = {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for fqn, md in meta.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}
    read_checkpoint(reader, flat)
    fqn = fqn_of(meta)
    state: dict[str, Any] = map_leaves(skeleton, is_ref, lambda ref, _p: flat[fqn(ref.path)])
    return state


def open_checkpoint(path: str) -> tuple[Any, Any, Any]:
    """(reader, metadata, skeleton) of a disk snapshot, refused before anything in it is
    unpickled unless it is this user's own and no one else's to write."""
    why = unsafe(path)
    if why is not None:
        raise Unreadable(why)
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata()
    with open(os.path.join(path, SKELETON), "rb") as f:
        skeleton = pickle.load(f)  # noqa: S301 - this user's own (checked above), checksummed
    return reader, meta, skeleton


def read_checkpoint(reader: Any, flat: dict[str, Any]) -> None:
    """Read the tensors named in `flat` (by DCP's fully qualified name) into them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:  # a BaseException: the caller's `except` would miss it
        raise OSError(_first_cause(exc)) from None


def fqn_of(meta: Any) -> Callable[[tuple[str, ...]], str]:
    """A skeleton path's name in the checkpoint's metadata."""
    by_path = {tuple(str(k) for k in p): fqn for fqn, p in (meta.planner_data or {}).items()}
    return lambda path: by_path.get(path, ".".join(path))


def is_ref(v: Any) -> bool:
    """A skeleton's leaf: where a tensor of the checkpoint goes."""
    return isinstance(v, _Path)
