"""A generation record written compactly: its members as runs of consecutive worker ids, and
the record compressed in the store once it is large.

A node's workers have consecutive ids (node k: k*10000 + 0..n-1) and sit in consecutive ranks,
so a job's members are a few runs per node: at 4,096 nodes of 8 the record drops from 319 KB
of JSON (and 41 ms to encode, 8 ms to decode) to ~37 KB, and ~1 KB compressed. Every node's
relay reads it once per generation from the coordinator's store, so that store serves ~4 MB
per fault at that size, not 1.3 GB.

Owns: `encode` (ids -> a flat list [gap, count, gap, count, ...]: each run's first id as its
distance from the end of the run before it, then its length), `decode` (strict: ints, every
count at least 1, every id not negative, at most MAX_MEMBERS ids: anything may be written to
the store or to etcd), and `pack`/`unpack`: the record's bytes in a store, zlib-compressed
above PACK_FROM bytes (JSON text never starts with zlib's first byte).
Must not import: anything outside the standard library and `ftrun.core`.
"""

from __future__ import annotations

import itertools
import operator
import zlib
from collections.abc import Sequence

from ftrun.core.errors import FtrunError

RUNS_FROM = 64  # members: a smaller record keeps its plain list (readable in a store dump)
PACK_FROM = 4096  # bytes of JSON: a larger record is compressed in the store
MAX_MEMBERS = 10_000_000  # a record claiming more is refused, not expanded
MAX_RECORD_BYTES = 256 << 20  # a compressed record expanding past this is refused
_ZLIB = b"x"  # zlib's first byte at every level


def encode(ids: Sequence[int]) -> list[int]:
    """The runs of `ids`, as the flat list above (C-level loops: 32,768 ids in ~1 ms)."""
    ids = tuple(ids)
    if not ids:
        return []
    steps = map(operator.sub, ids[1:], ids)  # 1 inside a run
    firsts = [0, *itertools.compress(range(1, len(ids)), map(operator.ne, steps,
                                                             itertools.repeat(1)))]
    lengths = list(map(operator.sub, [*firsts[1:], len(ids)], firsts))
    heads = list(map(ids.__getitem__, firsts))
    gaps = map(operator.sub, heads, [0, *map(operator.add, heads[:-1], lengths[:-1])])
    return list(itertools.chain.from_iterable(zip(gaps, lengths, strict=True)))


def decode(flat: object, what: str) -> tuple[int, ...]:
    """The ids `flat` holds (as `encode` writes them), or a one-line FtrunError."""
    if not isinstance(flat, list) or len(flat) % 2:
        raise FtrunError(f"{what}: member_runs is not a list of (gap, count) pairs")
    if not set(map(type, flat)) <= {int}:  # no bool, no float, no string
        raise FtrunError(f"{what}: member_runs holds something other than integers")
    counts = flat[1::2]
    if counts and (min(counts) < 1 or sum(counts) > MAX_MEMBERS):
        raise FtrunError(f"{what}: member_runs has a count below 1 or over {MAX_MEMBERS} ids")
    ends = list(itertools.accumulate(map(operator.add, flat[::2], counts)))
    starts = list(map(operator.sub, ends, counts))
    if starts and min(starts) < 0:
        raise FtrunError(f"{what}: member_runs names a negative worker id")
    return tuple(itertools.chain.from_iterable(map(range, starts, ends)))


def pack(text: str) -> bytes:
    raw = text.encode()
    return zlib.compress(raw, 1) if len(raw) > PACK_FROM else raw


def unpack(raw: str | bytes, what: str) -> str | bytes:
    """The JSON text of a record as a store holds it (compressed or not)."""
    if isinstance(raw, bytes) and raw[:1] == _ZLIB:
        inflate = zlib.decompressobj()
        try:
            text = inflate.decompress(raw, MAX_RECORD_BYTES)
        except zlib.error:
            raise FtrunError(f"{what} is neither JSON nor compressed JSON") from None
        if inflate.unconsumed_tail:
            raise FtrunError(f"{what} expands past {MAX_RECORD_BYTES >> 20} MB")
        return text
    return raw
