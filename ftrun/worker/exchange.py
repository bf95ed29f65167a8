"""A group's bootstrap exchange in O(N) store requests: every member's value gathered once and
published as one record.

A group of N members must learn every member's address (gloo's full mesh) or handle (a native
reconfigure). Done key by key, each member reads N keys: N² requests on the job's store, one
server thread, per rebuild (~17 M at 4,096 ranks). Here each member sets its value and adds
one to a counter; the member whose add reaches N (the last to arrive: it waits for no one)
reads the N values in one `multi_get` and publishes them joined, compressed, under one key;
every other member waits on that key and reads it once. Four requests a member, whoever
arrives last; the wait is one blocked request, never a poll (at thousands of members a wait
expiring every few ms is a storm of requests on one server thread).

Owns: `all_gather` (the exchange, with the caller's wait: `blocking_wait`) and
`GatheringStore`, the c10d Store handed to gloo for a fresh group or a native reconfigure:
the key each member sets under a prefix is its address, gathered as above, and the N keys
gloo then reads under that prefix are served from the joined record. It also turns
on gloo's rank-as-sequence-number (`linear_gloo`): without it each member's address carries
one sequence number per peer (8 bytes × N), and the joined record would be O(N²) bytes.
Must not import: typer, rich, NVML, psutil, the agent, the rest of the worker library (comm and
joining import this). Torch at module level: imported only where a group is built.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

COUNT = "gather/n"  # under a prefix: how many members have set their value
JOINED = "gather/all"  # under a prefix: every value, joined by the member that counted last
RANK_AS_SEQ_ENV = "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"  # gloo: a pair is named by its rank
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"  # gloo connects each pair at its first use: not gathered
_LEN = struct.Struct("<I")
_SIZE = struct.Struct("<Q")  # gloo's size_t fields
_SOCKADDR_STORAGE = 128
_FAMILY_USES = {2: 16, 10: 28}  # AF_INET, AF_INET6: the bytes of a sockaddr_storage they use

Waiter = Callable[[list[str]], None]  # blocks until every key exists (or raises)


def value_key(prefix: str, rank: int) -> str:
    return f"{prefix}gather/{rank}"


def pack(values: Sequence[bytes]) -> bytes:
    """The joined record: each value length-prefixed, the whole compressed (the addresses of
    one host differ in a port, the handles in a number: they compress several-fold)."""
    body = b"".join(_LEN.pack(len(v)) + v for v in values)
    return zlib.compress(_LEN.pack(len(values)) + body, 1)


def unpack(record: bytes) -> list[bytes]:
    body = zlib.decompress(record)
    (count,), at, out = _LEN.unpack_from(body), _LEN.size, []
    for _ in range(count):
        (n,) = _LEN.unpack_from(body, at)
        at += _LEN.size
        out.append(body[at:at + n])
        at += n
    return out


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


def blocking_wait(store: Any, timeout_s: float, what: str) -> Waiter:
    """One wait on `store` for the joined record, up to `timeout_s`: no request while it
    waits (a wait expiring every few ms, at thousands of members, is a storm of them)."""
    def wait(keys: list[str]) -> None:
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
        except Exception as exc:
            text = str(exc).lower()
            if "timeout" not in text and "timed out" not in text:
                raise
            raise ExchangeTimeout(f"{what}: not every member came within {timeout_s:g} s"
                                  ) from None
    return wait


def all_gather(store: Any, prefix: str, rank: int, size: int, value: bytes,
               wait: Waiter) -> list[bytes]:
    """Every member's `value`, in rank order, once all `size` members have called this with
    the same `prefix` (never used before: a generation's own). `wait` blocks until its keys
    exist; it decides how long, and whether a newer generation cancels (it raises)."""
    store.set(value_key(prefix, rank), value)
    if int(store.add(prefix + COUNT, 1)) == size:  # the last to arrive gathers
        values = multi_get(store, [value_key(prefix, r) for r in range(size)])
        store.set(prefix + JOINED, pack(values))
        return values
    wait([prefix + JOINED])
    values = unpack(bytes(store.get(prefix + JOINED)))
    if len(values) != size:
        raise ValueError(f"{prefix}: {len(values)} values gathered for {size} members")
    return values


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

    def _joined(self, prefix: str, timeout: timedelta | None) -> list[bytes]:
        values = self._values.get(prefix)
        if values is None:
            keys = [prefix + JOINED]
            self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)
            values = unpack(bytes(self._inner.get(prefix + JOINED)))
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
        self._inner.set(value_key(prefix, rank), data)
        if int(self._inner.add(prefix + COUNT, 1)) == size:
            values = multi_get(self._inner, [value_key(prefix, r) for r in range(size)])
            self._inner.set(prefix + JOINED, pack(values))
            self._values = {prefix: values}

    def get(self, key: str) -> bytes:
        found = self._exchange_of(key)
        if found is None:
            return bytes(self._inner.get(key))
        return self._joined(found[0], None)[found[1]]

    def _split(self, keys: list[str]) -> tuple[list[str], list[str]]:
        """(the keys that are `inner`'s, the exchanges the others belong to)."""
        found = [(k, self._exchange_of(k)) for k in keys]
        exchanges = dict.fromkeys(f[0] for _, f in found if f is not None)
        return [k for k, f in found if f is None], list(exchanges)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        rest, exchanges = self._split(keys)
        for prefix in exchanges:
            self._joined(prefix, timeout)
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
