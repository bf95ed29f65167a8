"""The wire of the agents' unit tests without processes: an in-memory store with TCPStore's
semantics (keys, counters, queues that block until an item or the client's timeout), the
coordinator's store served from it, a follower's outbox onto it, and the helpers that read
back what travelled on it as the receiving side parses it.
"""

from __future__ import annotations

import dataclasses
import threading
import typing
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from ftrun.adapters.store import HostedStore
from ftrun.cluster.link import AGENT_QUEUE, Outbox, command_queue
from ftrun.cluster.messages import Command, Report, parse_command, parse_report
from ftrun.protocol.rendezvous import LATEST_KEY, Generation, encode, gen_key

M = TypeVar("M")
_ZERO: dict[object, object] = {str: "", int: 0, float: 0.0, bool: False}


def message(cls: type[M], **given: Any) -> M:
    """A message (or any flat record) with the `given` fields and every other one at its
    type's zero value ("", 0, False): a field added for another feature leaves what a test
    says, and what it expects to read, as they were."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    assert set(given) <= set(names), set(given) - set(names)
    return cls(**{n: given[n] if n in given else _ZERO[hints[n]] for n in names})


# ------------------------------------------------------------------ the store
class StoreTimeout(RuntimeError):
    """What c10d raises when a blocking call expires (its text is how callers tell)."""


class _Data:
    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}
        self.cond = threading.Condition()


def _raw(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class MemoryStore:
    """One client connection to an in-memory TCPStore: keys hold their last value, `add`
    counts, a queue pops in push order; `get`, `multi_get` and a blocking `queue_pop` wait
    for their key or item until this client's timeout, then raise as c10d does. `client()`
    is another connection to the same store, with a timeout of its own."""

    def __init__(self, data: _Data | None = None, timeout_s: float = 5.0) -> None:
        self._data = data or _Data()
        self._timeout_s = timeout_s

    def client(self) -> MemoryStore:
        return MemoryStore(self._data, self._timeout_s)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def _wait(self, ready: Callable[[], bool], what: str) -> None:  # under the lock
        if not self._data.cond.wait_for(ready, self._timeout_s):
            raise StoreTimeout(f"wait timeout after {self._timeout_s * 1000:.0f}ms, {what}")

    def set(self, key: str, value: str | bytes) -> None:
        with self._data.cond:
            self._data.keys[key] = _raw(value)
            self._data.cond.notify_all()

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        with self._data.cond:
            self._wait(lambda: all(k in self._data.keys for k in keys), f"keys={list(keys)}")
            return [self._data.keys[k] for k in keys]

    def add(self, key: str, amount: int) -> int:
        with self._data.cond:
            value = int(self._data.keys.get(key, b"0")) + amount
            self._data.keys[key] = str(value).encode()
            self._data.cond.notify_all()
            return value

    def check(self, keys: Sequence[str]) -> bool:
        with self._data.cond:
            return all(k in self._data.keys for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._data.cond:
            found = self._data.keys.pop(key, None) is not None
            return self._data.queues.pop(key, None) is not None or found

    def queue_push(self, key: str, value: str | bytes) -> None:
        with self._data.cond:
            self._data.queues.setdefault(key, deque()).append(_raw(value))
            self._data.cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        with self._data.cond:
            if block:
                self._wait(lambda: bool(self._data.queues.get(key)), f"queue={key}")
            elif not self._data.queues.get(key):
                raise StoreTimeout(f"queue {key} is empty")  # not a timeout in c10d either
            return self._data.queues[key].popleft()

    def queue_len(self, key: str) -> int:
        with self._data.cond:
            return len(self._data.queues.get(key, ()))

    def drain(self, key: str) -> list[bytes]:
        """Everything queued under `key`, taken (what its reader would pop next)."""
        with self._data.cond:
            items = list(self._data.queues.get(key, ()))
            self._data.queues.pop(key, None)
            return items


def generation(store: MemoryStore) -> Generation:
    """The newest generation published to `store`."""
    return Generation.from_json(store.get(gen_key(int(store.get(LATEST_KEY)))))


def commands(store: MemoryStore, node: int) -> list[Command]:
    """The commands sent to `node` since the last look, as that node would parse them."""
    out = [parse_command(raw) for raw in store.drain(command_queue(node))]
    assert not [c for c in out if isinstance(c, str)], out
    return [c for c in out if not isinstance(c, str)]


def reports(store: MemoryStore) -> list[Report]:
    """The reports the followers sent since the last look, as the coordinator parses them."""
    out = [parse_report(raw) for raw in store.drain(AGENT_QUEUE)]
    assert not [r for r in out if isinstance(r, str)], out
    return [r for r in out if not isinstance(r, str)]


class MemoryHosted(HostedStore):
    """The coordinator's rendezvous store, served in memory: no socket, no torch."""

    def __init__(self, store: MemoryStore) -> None:  # no bind: nothing listens
        self._sock = None
        self.host, self.port = "127.0.0.1", 29400
        self.store = None
        self._memory = store

    def serve(self, timeout_s: float = 0.0) -> Any:
        if self.store is None:
            self.store = self._memory.client()
        return self.store

    def client(self, timeout_s: float) -> MemoryStore:
        return self._memory.client()

    def close(self) -> None:
        self.store = None


class StoreOutbox(Outbox):
    """A follower's outbox without its thread: each report is pushed at once, in order, onto
    the coordinator's queue, as the outbox's thread pushes it."""

    def __init__(self, store: MemoryStore) -> None:  # no thread, no connection
        self._store = store

    def put(self, msg: Command | Report) -> None:
        self._store.queue_push(AGENT_QUEUE, encode(msg))

    def close(self, flush_s: float) -> None:
        pass
