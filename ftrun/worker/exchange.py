"""A group's bootstrap exchange in O(N) store requests: every member's value gathered once and
published as one record.

A group of N members must learn every member's address (gloo's full mesh) or handle (a native
reconfigure). Done key by key, each member reads N keys: N² requests on the job's store, one
server thread, per rebuild (~17 M gets at 4,096 ranks, plus a wait before each). Here each
member sets its value; one member (rank 0) reads all N in one `multi_get`, which waits until
the last is set, and publishes them joined and compressed under one key; every other member
reads that key once, with a `get` that waits for it. Two calls a member (c10d sends a get as
a wait and a get: three requests on the wire), and no poll: a wait expiring every few ms is,
at thousands of members, a storm of requests on one server thread.

Owns: `all_gather` (`publish`, then `joined`) and `GatheringStore`, the c10d Store handed to
gloo for a fresh group or a native reconfigure: the key each member sets under a prefix is
its address, gathered as above, and the N keys gloo then reads under that prefix are served
from the joined record. It also turns on gloo's rank-as-sequence-number (`linear_gloo`):
without it each member's address carries one sequence number per peer (8 bytes × N), and
the joined record would be O(N²) bytes.
Must not import: typer, rich, NVML, psutil, the agent, the rest of the worker library (comm and
joining import this). Torch at module level: imported only where a group is built.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

JOINED = "gather/all"  # under a prefix: every value, joined by the gatherer
RANK_AS_SEQ_ENV = "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"  # gloo: a pair is named by its rank
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"  # gloo connects each pair at its first use: not gathered
_LEN = struct.Struct("<I")
_SIZE = struct.Struct("<Q")  # gloo's size_t fields
_SOCKADDR_STORAGE = 128
_FAMILY_USES = {2: 16, 10: 28}  # AF_INET, AF_INET6: the bytes of a sockaddr_storage they use



def value_key(prefix: str, rank: int) -> str:
    return f"{prefix}gather/{rank}"


def pack(values: Sequence[bytes]) -> bytes:
    """The joined record: the count and every value's length, then the values as columns
    (byte i of every value, then byte i+1, ..., each value padded to the longest), the whole
    compressed. Columns put like with like (one host's addresses differ in a port, handles
    in a few digits): ~9 bytes a member for gloo's addresses, against ~15 value by value."""
    lengths = list(map(len, values))
    width = max(lengths, default=0)
    rows = b"".join(v.ljust(width, b"\0") for v in values)
    head = struct.pack(f"<I{len(values)}I", len(values), *lengths)
    return zlib.compress(head + b"".join(rows[i::width] for i in range(width)), 1)


def unpack(record: bytes) -> list[bytes]:
    body = zlib.decompress(record)
    (count,) = _LEN.unpack_from(body)
    lengths = struct.unpack_from(f"<{count}I", body, _LEN.size)
    width = max(lengths, default=0)
    columns = memoryview(body)[_LEN.size * (count + 1):]
    rows = bytearray(count * width)
    for i in range(width):
        rows[i::width] = columns[i * count:(i + 1) * count]
    return [bytes(rows[r * width:r * width + n]) for r, n in enumerate(lengths)]


def tidy(address: bytes) -> bytes:
    """gloo's address record (its tcp `Rank`: the host name, the device's sockaddr_storage
    and sequence number, then any pair ids) with the sockaddr's unused bytes zeroed: gloo
    copies the whole 128-byte storage, uninitialised stack included, which compresses badly
    (the kernel reads only the family's own bytes). Any other shape is returned unchanged."""
    if len(address) < 2 * _SIZE.size:
        return address
    (host_len,) = _SIZE.unpack_from(address, 0)
    at = _SIZE.size + host_len
    if host_len > 255 or len(address) < at + _SIZE.size:
        return address
    (addr_len,) = _SIZE.unpack_from(address, at)
    start = at + _SIZE.size
    if addr_len < _SOCKADDR_STORAGE or len(address) < start + addr_len:
        return address
    used = _FAMILY_USES.get(int.from_bytes(address[start:start + 2], "little"))
    if used is None:
        return address
    return (address[:start + used] + bytes(_SOCKADDR_STORAGE - used)
            + address[start + _SOCKADDR_STORAGE:])


def multi_get(store: Any, keys: list[str]) -> list[bytes]:
    """One request where the store has `multi_get` (a TCPStore, a PrefixStore over one); a
    Python store without it reads key by key (still one member's N reads, not N²)."""
    try:
        return [bytes(v) for v in store.multi_get(keys)]
    except (RuntimeError, AttributeError):
        return [bytes(store.get(k)) for k in keys]


class ExchangeTimeout(Exception):
    """Not every member of an exchange set its value in time (one died, or never came)."""


GATHERER = 0  # the rank that gathers: its one read waits for every value


def publish(store: Any, prefix: str, rank: int, size: int, value: bytes) -> list[bytes] | None:
    """Set this member's `value`; the gatherer then reads all `size` values (one request that
    waits until the last is set: the store's timeout) and publishes them joined, and has
    them (None for every other member: `joined` reads them)."""
    store.set(value_key(prefix, rank), value)
    if rank != GATHERER:
        return None
    values = multi_get(store, [value_key(prefix, r) for r in range(size)])
    store.set(prefix + JOINED, pack(values))
    return values


def joined(store: Any, prefix: str, size: int) -> list[bytes]:
    """The joined record, once the gatherer has published it: one `get`, which waits for it
    (the store's timeout: no request while it waits)."""
    values = unpack(bytes(store.get(prefix + JOINED)))
    if len(values) != size:
        raise ValueError(f"{prefix}: {len(values)} values gathered for {size} members")
    return values


def all_gather(store: Any, prefix: str, rank: int, size: int, value: bytes) -> list[bytes]:
    """Every member's `value`, in rank order, once all `size` members have called this with
    the same `prefix` (never used before: a generation's own), within `store`'s timeout."""
    try:
        got = publish(store, prefix, rank, size, value)
        return got if got is not None else joined(store, prefix, size)
    except Exception as exc:
        text = str(exc).lower()
        if "timeout" not in text and "timed out" not in text:
            raise
        raise ExchangeTimeout(f"{prefix}: not every member of {size} came in time") from None


def linear_gloo() -> None:
    """Every member of an ftrun job names its pairs by rank (the same in each: every member
    builds its groups through this module); a value the user set is kept."""
    os.environ.setdefault(RANK_AS_SEQ_ENV, "1")


def gathered(inner: Any, rank: int | None = None, size: int | None = None) -> Any:
    """The store to hand gloo: `inner` with each full-mesh exchange gathered (a fresh group:
    its `rank` and `size`; a reconfigurable group: `expect` before each reconfigure). Where
    gloo connects lazily (TORCH_GLOO_LAZY_INIT), `inner` itself: it reads a peer's key only
    when it first talks to it."""
    if os.environ.get(LAZY_ENV, "0") not in ("", "0"):
        return inner
    linear_gloo()
    store = GatheringStore(inner)
    if rank is not None and size is not None:
        store.expect(rank, size)
    return store


class GatheringStore(dist.Store):
    """A c10d Store over `inner` (torch calls it from C++: it must outlive every call, so
    whoever hands it to torch keeps it). The first key set whose last part is this member's
    rank starts an exchange under that key's prefix; the keys gloo reads under the prefix
    come from the joined record. Every other call goes to `inner` unchanged."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner
        self._lock = threading.Lock()
        self._rank: int | None = None
        self._size = 0
        self._values: dict[str, list[bytes]] = {}  # prefix -> gathered values
        self._mine: dict[str, int] = {}  # prefix -> this member's rank in that exchange

    def expect(self, rank: int, size: int) -> None:
        """The next exchange: this member's rank, and how many take part."""
        with self._lock:
            self._rank, self._size = rank, size

    def _exchange_of(self, key: str) -> tuple[str, int] | None:
        prefix, _, last = key.rpartition("/")
        prefix += "/"
        if prefix in self._mine and last.isdigit():
            return prefix, int(last)
        return None

    def _joined(self, prefix: str) -> list[bytes]:
        values = self._values.get(prefix)
        if values is None:
            values = joined(self._inner, prefix, self._mine[prefix])
            self._values = {prefix: values}  # only the newest exchange is kept
        return values

    def set(self, key: str, value: Any) -> None:
        prefix, _, last = key.rpartition("/")
        prefix += "/"
        with self._lock:
            rank, size = self._rank, self._size
            starts = rank is not None and last == str(rank) and prefix not in self._mine
            if starts:
                self._mine = {prefix: size}
                self._rank = None  # one exchange per expect()
        if not starts:
            self._inner.set(key, value)
            return
        assert rank is not None
        data = tidy(value.encode() if isinstance(value, str) else bytes(value))
        values = publish(self._inner, prefix, rank, size, data)
        if values is not None:
            self._values = {prefix: values}

    def get(self, key: str) -> bytes:
        found = self._exchange_of(key)
        if found is None:
            return bytes(self._inner.get(key))
        return self._joined(found[0])[found[1]]

    def _split(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """(the keys that are `inner`'s, the exchanges the others belong to)."""
        found = [(k, self._exchange_of(k)) for k in keys]
        exchanges = dict.fromkeys(f[0] for _, f in found if f is not None)
        return [k for k, f in found if f is None], list(exchanges)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        rest, exchanges = self._split(keys)
        for prefix in exchanges:  # the store's own timeout (torch sets it for a reconfigure)
            self._joined(prefix)
        if rest:
            self._inner.wait(rest) if timeout is None else self._inner.wait(rest, timeout)

    def check(self, keys: list[str]) -> bool:
        rest, exchanges = self._split(keys)
        rest += [p + JOINED for p in exchanges if p not in self._values]
        return bool(self._inner.check(rest)) if rest else True

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)
