"""A follower's relay of the job's generations to its own workers: fan-out through node agents.

Owns: a store of this node's own, on loopback, holding a copy of every generation record of
the attempt under the same keys; the thread that copies each new record from the
coordinator's worker store when the coordinator names it on this node's relay queue; and
the address this node's workers watch (`FTRUN_RELAY`). A new generation thus wakes one
reader per node on the coordinator's store, not one per worker, and the record crosses the
network once per node.
Must not import: typer, rich, the CLI, the agent or the worker library. Torch lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftrun.adapters.store import LOOPBACK, HostedStore, QueueReader
from ftrun.core import timeouts
from ftrun.core.errors import first_line
from ftrun.protocol.rendezvous import LATEST_KEY, gen_key, relay_queue


class GenerationRelay:
    """Started before this node's workers of an attempt, closed after they stopped."""

    def __init__(self, connect: Callable[[], Any], node: int,
                 on_lost: Callable[[str], None]) -> None:
        self._hosted = HostedStore(0, LOOPBACK)
        self._local = self._hosted.serve()
        self.addr = f"{LOOPBACK}:{self._hosted.port}"
        self._upstream = connect()  # the copier's own reads (the reader thread's only)
        self._upstream.set_timeout(timedelta(seconds=timeouts.STORE_LOST_S))
        self._on_lost = on_lost
        self._copied = -1
        if self._upstream.check([LATEST_KEY]):  # a running job: from its newest generation
            self._copy_up_to(int(self._upstream.get(LATEST_KEY)), first=True)
        self._reader = QueueReader(connect, relay_queue(node), self._deliver, on_lost,
                                   "ftrun-relay")

    def _deliver(self, raw: str | bytes) -> None:  # the reader thread
        try:
            number = int(raw)
        except ValueError:
            return  # not ours to act on: only the coordinator pushes here
        try:
            self._copy_up_to(number)
        except Exception as exc:  # the coordinator's store is gone: the heartbeat says so
            self._on_lost(first_line(exc))

    def _copy_up_to(self, number: int, first: bool = False) -> None:
        """Copy every record after the last copied up to `number` (a node admitted late
        starts at the newest: its workers are in no older one). Called before the reader
        thread starts, then on it only."""
        start = number if first else self._copied + 1
        for n in range(start, number + 1):
            record = self._upstream.get(gen_key(n))
            self._local.set(gen_key(n), record)  # the record first, as `publish` does
            self._local.set(LATEST_KEY, str(n))
            self._copied = n

    def close(self, link_works: bool) -> None:
        """`link_works` False: the coordinator's store is out of reach; the reader is left
        to end with the connection (a daemon)."""
        self._reader.close(self._upstream if link_works else None)
        self._local = None
        self._hosted.close()  # the server stops with its last reference


def open_relay(addr: str, port: int, node: int) -> tuple[GenerationRelay | None, str]:
    """This attempt's relay of the coordinator's store at `addr:port`, or None with why it
    could not start (the workers then watch the coordinator's store, as they can)."""
    from ftrun.adapters.store import client

    try:
        return GenerationRelay(
            lambda: client(addr, port, timeouts.STORE_CLIENT_CONNECT_S),
            node, lambda why: None), ""  # a lost store is the heartbeat's to notice
    except Exception as exc:
        return None, first_line(exc)
