"""Healing: streaming a live replica's state into the members that are behind.

Owns: describing the registered objects' state (model, optimizer, anything with state_dict())
as a small pickled skeleton (keys, shapes, dtypes, the non-tensor values) plus the tensors'
bytes, cut into chunks (`chunk_layout`); moving the chunks point-to-point over the
generation's group, abandonably, each source sending a disjoint share (striped) of what the
receiver asked for; and writing them into the receiver's own tensors. Extra memory is a few
chunks on either side: a chunk that is one piece of one tensor travels straight from the
source's tensor into the receiver's, the others through one staging buffer per peer. No
tensor is pickled: bitwise exact. A heal cut off by a fault leaves a `HealProgress` that the
next generation's heal resumes (only the missing chunks travel, from the sources left).
Must not import: typer, rich, NVML, the agent. Torch is imported lazily.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftrun.core import timeouts
from ftrun.core.errors import first_line
from ftrun.worker.comm import Abandoned, CommError, Group, Interrupt

DRILL_KILL_MID_TRANSFER = "FTRUN_DRILL_KILL_MID_TRANSFER"  # a worker id
_TAG_HEADER, _TAG_META, _TAG_REQUEST, _TAG_CHUNK = 1, 2, 3, 16

Segment = tuple[int, int, int]  # (leaf index, first byte, end byte)
Chunk = tuple[Segment, ...]


@dataclass(frozen=True)
class _Ref:
    """A tensor's place in the skeleton: its leaf index, dtype, local shape, where it lived
    ('cpu' or 'cuda'), and for a DTensor's local shard what it is rebuilt from (`sharded`:
    its placements, global shape and stride, and its mesh's shape)."""

    index: int
    dtype: str
    shape: tuple[int, ...]
    device_type: str
    sharded: tuple[Any, ...] | None = None


@dataclass
class HealStats:
    """One heal, as either side saw it."""

    bytes: int = 0
    seconds: float = 0.0
    sources: tuple[int, ...] = ()
    chunks: int = 0
    staged_bytes: int = 0  # the largest staging buffer held at once (0: none needed)


@dataclass
class HealProgress:
    """What a receiver got of a heal that a fault cut off. Its own tensors then hold a mix of
    states: it reports no committed step (never a source) until a heal completes."""

    step: int = -1  # the step being healed to
    signature: tuple[Any, ...] = ()  # the layout's leaves: a resume needs the same ones
    received: set[int] = field(default_factory=set)
    targets: list[Any] = field(default_factory=list)  # where each leaf's bytes go
    finals: list[Any] = field(default_factory=list)  # what each leaf becomes in the state

    @property
    def dirty(self) -> bool:
        return self.step >= 0


def chunk_layout(nbytes: Sequence[int], chunk_bytes: int) -> list[Chunk]:
    """Pure and deterministic: every source and the receiver cut the same chunks. A tensor of
    a chunk or more is cut into chunks of its own (each travels without a copy), in order;
    the smaller ones follow, packed together up to the chunk size wherever they stand (an
    optimizer's small `step` tensors between its moments make no chunks of a few bytes)."""
    chunks: list[Chunk] = []
    packed: list[Segment] = []
    used = 0
    for index, size in enumerate(nbytes):
        if size >= chunk_bytes:
            chunks += [((index, start, min(size, start + chunk_bytes)),)
                       for start in range(0, size, chunk_bytes)]
    for index, size in enumerate(nbytes):
        if 0 < size < chunk_bytes:
            if used + size > chunk_bytes:
                chunks.append(tuple(packed))
                packed, used = [], 0
            packed.append((index, 0, size))
            used += size
    if packed:
        chunks.append(tuple(packed))
    return chunks


def stripe(needed: Sequence[int], sources: Sequence[int], sizes: Sequence[int]
           ) -> dict[int, list[int]]:
    """Each source's disjoint share of the `needed` chunks (`sizes`: every chunk's bytes),
    balanced by bytes: each chunk to the source with the fewest so far, the first on a tie.
    Pure; each share in increasing order, as the sources send them."""
    shares: dict[int, list[int]] = {src: [] for src in sources}
    load = dict.fromkeys(sources, 0)
    for chunk_id in needed:
        src = min(sources, key=lambda s: load[s])  # min keeps the first of equals
        shares[src].append(chunk_id)
        load[src] += sizes[chunk_id]
    return shares


def describe(objects: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """(skeleton with _Ref leaves, the leaves' local tensors in order): the state as it is,
    no copy (a non-contiguous tensor, rare in a state dict, is made contiguous)."""
    import torch

    leaves: list[Any] = []

    def strip(t: Any) -> _Ref:
        sharded = None
        if hasattr(t, "to_local"):  # a DTensor: its shard only, never gathered
            sharded = (tuple(t.placements), tuple(t.shape), tuple(t.stride()),
                       tuple(t.device_mesh.shape))
            t = t.to_local()
        leaves.append(t.detach().contiguous())
        return _Ref(len(leaves) - 1, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                    t.device.type, sharded)

    state = {k: o.state_dict() for k, o in objects.items()}
    return map_leaves(state, lambda v: isinstance(v, torch.Tensor), strip), leaves


def send_heal(group: Group, dst: int, sources: Sequence[int], objects: Mapping[str, Any],
              interrupt: Interrupt, device: Any, chunk_bytes: int) -> HealStats:
    """This member's share of `dst`'s heal: the skeleton if it is the first source, then the
    chunks `dst` asks of it."""
    import torch

    started = time.monotonic()
    skeleton, leaves = describe(objects)
    views = [_bytes(t) for t in leaves]
    sizes = [v.numel() for v in views]
    layout = chunk_layout(sizes, chunk_bytes)
    if group.rank == sources[0]:
        meta = pickle.dumps({"skeleton": skeleton, "chunk_bytes": chunk_bytes, "sizes": sizes})
        header = torch.tensor([len(meta), len(layout)], dtype=torch.int64)
        _run(group, "send", header.to(device), dst, _TAG_HEADER, interrupt)
        _run(group, "send", torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device),
             dst, _TAG_META, interrupt)
    request = torch.zeros(len(layout) + 1, dtype=torch.int64, device=device)
    _run(group, "recv", request, dst, _TAG_REQUEST, interrupt)
    wanted = [int(i) for i in request.cpu().tolist()[1:1 + int(request[0])]]
    drill = os.environ.get(DRILL_KILL_MID_TRANSFER) == os.environ.get("FTRUN_WORKER_ID", "-")
    stats = HealStats(sources=tuple(sources))
    staging: Any = None
    for chunk_id in wanted:
        chunk = layout[chunk_id]
        direct = _direct(chunk, views, device)
        if direct is None:
            staging = staging if staging is not None else _staging(chunk_bytes, device)
            stats.staged_bytes = chunk_bytes
            direct = _gather(chunk, views, staging)
        _run(group, "send", direct, dst, _TAG_CHUNK + chunk_id, interrupt)
        if drill:  # a fault drill: a source dies mid-heal, its first chunk sent (so the
            os.kill(os.getpid(), signal.SIGKILL)  # heal that resumes has something kept)
        stats.bytes += direct.numel()
        stats.chunks += 1
    stats.seconds = time.monotonic() - started
    return stats


def recv_heal(group: Group, sources: Sequence[int], objects: Mapping[str, Any], step: int,
              progress: HealProgress, interrupt: Interrupt, device: Any,
              mesh: Any = None) -> HealStats:
    """Receive a heal into the registered objects' own tensors, from `sources` (the first
    sends the skeleton), resuming `progress` when it was cut off at the same step."""
    import torch

    started = time.monotonic()
    header = torch.zeros(2, dtype=torch.int64, device=device)
    _run(group, "recv", header, sources[0], _TAG_HEADER, interrupt)
    meta_len, n_chunks = (int(x) for x in header.cpu().tolist())
    raw = torch.empty(meta_len, dtype=torch.uint8, device=device)
    _run(group, "recv", raw, sources[0], _TAG_META, interrupt)
    meta = pickle.loads(_as_bytes(raw.cpu()))
    skeleton, chunk_bytes = meta["skeleton"], meta["chunk_bytes"]
    layout = chunk_layout(meta["sizes"], chunk_bytes)
    if len(layout) != n_chunks:
        raise CommError(f"the heal's layout differs: {len(layout)} chunks, source {n_chunks}")
    signature = (tuple(meta["sizes"]), chunk_bytes)
    if progress.step != step or progress.signature != signature:
        progress.step, progress.signature, progress.received = step, signature, set()
        progress.targets, progress.finals = _targets(skeleton, objects, device, mesh)
    needed = [i for i in range(len(layout)) if i not in progress.received]
    shares = stripe(needed, sources, [_chunk_size(c) for c in layout])
    for src in sources:
        request = torch.zeros(len(layout) + 1, dtype=torch.int64)
        request[0] = len(shares[src])
        request[1:1 + len(shares[src])] = torch.tensor(shares[src], dtype=torch.int64)
        _run(group, "send", request.to(device), src, _TAG_REQUEST, interrupt)
    views = [_bytes(t) for t in progress.targets]
    stats = HealStats(sources=tuple(sources))
    _Receiver(group, shares, layout, views, progress, device, chunk_bytes, stats).run(interrupt)
    state = map_leaves(skeleton, lambda v: isinstance(v, _Ref),
                       lambda ref: progress.finals[ref.index])
    missing = set(objects) - set(state)
    if missing:
        raise RuntimeError(f"the healing source registered no state for {sorted(missing)}")
    for name, obj in objects.items():
        obj.load_state_dict(state[name])  # its own tensors, filled in place: no copy to make
    progress.step, progress.received = -1, set()
    progress.targets, progress.finals = [], []
    stats.seconds = time.monotonic() - started
    return stats


class _Receiver:
    """Every source's next chunk is posted at once (the sources send in parallel); each is
    written into place as it completes, then that source's next one is posted. When a source
    fails (or a new generation cuts the heal off), what the others had already sent is kept
    in the progress before the error goes on: the next heal asks only for the rest."""

    def __init__(self, group: Group, shares: dict[int, list[int]], layout: list[Chunk],
                 views: list[Any], progress: HealProgress, device: Any, chunk_bytes: int,
                 stats: HealStats) -> None:
        self.group, self.layout, self.views, self.progress = group, layout, views, progress
        self.device, self.chunk_bytes, self.stats = device, chunk_bytes, stats
        self.queues = {src: list(ids) for src, ids in shares.items() if ids}
        self.staging: dict[int, Any] = {}
        # source -> (work, chunk id, buffer, whether the buffer is staging to scatter from)
        self.posted: dict[int, tuple[Any, int, Any, bool]] = {}

    def run(self, interrupt: Interrupt) -> None:
        for src in self.queues:
            self._post(src)
        failed = -1
        try:
            while self.posted:
                for src in list(self.posted):
                    failed = src
                    self.group.wait(self.posted[src][0], interrupt, timeouts.STATE_TRANSFER_S)
                    self._done(src, then_next=True)
        except (CommError, Abandoned):
            self._salvage(skip=failed)
            raise

    def _post(self, src: int) -> None:
        chunk_id = self.queues[src].pop(0)
        buffer = _direct(self.layout[chunk_id], self.views, self.device)
        staged = buffer is None
        if staged:
            self.staging.setdefault(src, _staging(self.chunk_bytes, self.device))
            self.stats.staged_bytes = self.chunk_bytes * len(self.staging)
            buffer = self.staging[src][:_chunk_size(self.layout[chunk_id])]
        self.posted[src] = (_start(self.group, "recv", buffer, src, _TAG_CHUNK + chunk_id),
                            chunk_id, buffer, staged)

    def _done(self, src: int, then_next: bool) -> None:
        _work, chunk_id, buffer, staged = self.posted.pop(src)
        if staged:  # a direct chunk landed in place already
            _scatter(self.layout[chunk_id], self.views, buffer)
        self.progress.received.add(chunk_id)
        self.stats.bytes += buffer.numel()
        self.stats.chunks += 1
        if then_next and self.queues[src]:
            self._post(src)

    def _salvage(self, skip: int) -> None:
        """The chunks the live sources had sent when the heal broke (the failed op of `skip`
        belongs to the reaper now: a gloo op is waited on once)."""
        for src in [s for s in self.posted if s != skip]:
            try:
                self.group.wait(self.posted[src][0], Interrupt(), timeouts.HEAL_SALVAGE_S)
            except CommError:
                continue
            self._done(src, then_next=False)


def _targets(skeleton: Any, objects: Mapping[str, Any], device: Any, mesh: Any
             ) -> tuple[list[Any], list[Any]]:
    """Per leaf: the tensor its bytes are written into (the receiver's own when it has one
    of that dtype and shape, else one allocated here, once) and what the state gets."""
    import torch

    own = dict(paths({k: o.state_dict() for k, o in objects.items()}))
    # paths() visits the leaves in describe()'s order: the refs come in index order
    refs = [(path, ref) for path, ref in paths(skeleton) if isinstance(ref, _Ref)]
    targets: list[Any] = []
    finals: list[Any] = []
    for path, ref in refs:
        mine: Any = own.get(path)
        local = mine.to_local() if hasattr(mine, "to_local") else mine
        if (isinstance(local, torch.Tensor) and str(local.dtype).removeprefix("torch.")
                == ref.dtype and tuple(local.shape) == ref.shape and local.is_contiguous()):
            targets.append(local.detach())
            finals.append(mine)
            continue
        on = device if ref.device_type != "cpu" else torch.device("cpu")
        fresh = torch.empty(ref.shape, dtype=getattr(torch, ref.dtype), device=on)
        targets.append(fresh)
        finals.append(fresh if ref.sharded is None else _rebuild(fresh, ref.sharded, mesh))
    return targets, finals


def _direct(chunk: Chunk, views: list[Any], device: Any) -> Any:
    """The chunk's bytes as one tensor on the group's device without a copy, or None."""
    if len(chunk) != 1:
        return None
    index, start, end = chunk[0]
    view = views[index][start:end]
    return view if view.device == device else None


def _gather(chunk: Chunk, views: list[Any], staging: Any) -> Any:
    offset = 0
    for index, start, end in chunk:
        staging[offset:offset + end - start].copy_(views[index][start:end])
        offset += end - start
    return staging[:offset]


def _scatter(chunk: Chunk, views: list[Any], buffer: Any) -> None:
    offset = 0
    for index, start, end in chunk:
        views[index][start:end].copy_(buffer[offset:offset + end - start])
        offset += end - start


def _chunk_size(chunk: Chunk) -> int:
    return sum(end - start for _i, start, end in chunk)


def _staging(chunk_bytes: int, device: Any) -> Any:
    """One chunk's buffer on the group's device, reused for every chunk of the heal."""
    import torch

    return torch.empty(chunk_bytes, dtype=torch.uint8, device=device)


def _bytes(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


def _rebuild(local: Any, sharded: tuple[Any, ...], mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor

    placements, shape, stride, mesh_shape = sharded
    if mesh is None or tuple(mesh.shape) != mesh_shape:
        raise RuntimeError(f"the healing source's state is sharded over a mesh of shape "
                           f"{mesh_shape}; this rank's is "
                           f"{None if mesh is None else tuple(mesh.shape)}")
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=stride)


def _as_bytes(t: Any) -> bytes:
    """A CPU uint8 tensor's bytes, without numpy (not a dependency of torch nor of ftrun)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())


def map_leaves(value: Any, is_leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """Rebuild a state-dict tree (dicts, lists, tuples, namedtuples) with `fn` at its leaves."""
    if is_leaf(value):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, map_leaves(v, is_leaf, fn)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(map_leaves(v, is_leaf, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_leaves(v, is_leaf, fn) for v in value)
    return value


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, leaf) of a state-dict tree, in the order map_leaves visits them."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))
    else:
        yield prefix, value


def _start(group: Group, op: str, tensor: Any, peer: int, tag: int) -> Any:
    try:
        return getattr(group.pg, op)([tensor], peer, tag)
    except RuntimeError as exc:
        raise CommError(first_line(exc)) from None


def _run(group: Group, op: str, tensor: Any, peer: int, tag: int, interrupt: Interrupt) -> None:
    group.wait(_start(group, op, tensor, peer, tag), interrupt, timeouts.STATE_TRANSFER_S)
