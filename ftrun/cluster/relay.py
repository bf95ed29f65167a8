"""A follower's relay of the job's generations to its own workers: fan-out through node agents.

Owns: a store of this node's own, on loopback, holding a copy of every generation record of
the attempt under the same keys; the thread that copies each new record from the job's worker
store when the coordinator names it on this node's relay queue; moving that copying to another
source store when the leadership (and the store with it) moves (`follow`), without a gap the
workers could wait in; and the address this node's workers watch (`FTRUN_RELAY`). A new
generation thus wakes one reader per node on the coordinator's store, not one per worker, and
the record crosses the network once per node. In a large job (`protocol.fanout.relay_plan`)
the coordinator pushes to one node of each group, which forwards the record to the others'
inboxes (`adapters.relay_inbox`: a plain listener of each relay's, read beside its queue on
the coordinator's store). The store the workers watch listens on loopback only.
Must not import: typer, rich, the CLI, the agent or the worker library. Torch lazily.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftrun.adapters.relay_inbox import InboxLink, InboxListener, closed, frame
from ftrun.adapters.store import ALL_INTERFACES, LOOPBACK, HostedStore, QueueReader
from ftrun.cluster.forward_links import ForwardLinks
from ftrun.core import timeouts
from ftrun.core.errors import first_line
from ftrun.protocol.fanout import RelayMessage, parse_relay_message, relay_message, relay_queue
from ftrun.protocol.rendezvous import LATEST_KEY, Generation, gen_key, store_endpoint


class _Source:
    """One store the relay copies from: its connection (the copier's reads only) and the
    reader of this node's relay queue on it."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self.connect = connect
        self.upstream = connect()
        self.upstream.set_timeout(timedelta(seconds=timeouts.STORE_LOST_S))
        self.reader: QueueReader | None = None


class GenerationRelay:
    """Started before this node's workers of an attempt, closed after they stopped."""

    def __init__(self, connect: Callable[[], Any], node: int,
                 on_lost: Callable[[str], None], local: Any = None,
                 reachable_as: str = "") -> None:
        """`local`: where the records are copied (a simulated node's own store, which its
        workers do not watch); by default a store of this node's own, served here on
        loopback, at `addr`. `reachable_as`: this node's address for the other nodes: it
        then has an inbox, listening on every interface (on loopback only if that is the
        address), at `inbox_addr`."""
        self._hosted: HostedStore | None = None
        if local is None:
            self._hosted = HostedStore(0, LOOPBACK)
            local = self._hosted.serve()
        self._local: Any = local
        self.addr = "" if self._hosted is None else f"{LOOPBACK}:{self._hosted.port}"
        self._node = node
        self._on_lost = on_lost
        self._lock = threading.Lock()  # the copied records: a reader's thread, or follow()
        self._copied = -1
        self._links = ForwardLinks(inbox_link)
        self._inbox: InboxListener | None = None
        self.inbox_addr = ""  # where a forwarder sends to this node ("": no inbox)
        try:
            if reachable_as:  # a message that fails (none is sent before the address is
                # named) is dropped, as one that does not parse
                self._inbox = InboxListener(
                    LOOPBACK if reachable_as == LOOPBACK else ALL_INTERFACES,
                    lambda raw: self._on_message(self._source, raw))
                self.inbox_addr = f"{reachable_as}:{self._inbox.port}"
            source = _Source(connect)
            self._source = source
            self._catch_up(source)
            source.reader = self._reader_of(source)
        except BaseException:
            if self._inbox is not None:
                self._inbox.close()
            if self._hosted is not None:
                self._hosted.close()
            raise

    def follow(self, connect: Callable[[], Any]) -> None:
        """Copy from the store `connect` reaches from now on (the new leader's): first every
        record after the last copied up to its newest, then each one named on its relay
        queue. The old source's reader is dropped without a call to the old store (it may be
        dead or cut off: its thread ends with its connection); anything it still delivers is
        ignored. Raises if the new store cannot be reached (the old source stays)."""
        source = _Source(connect)
        with self._lock:
            old, self._source = self._source, source
        try:
            self._catch_up(source)
        except Exception:
            with self._lock:
                self._source = old
            raise
        source.reader = self._reader_of(source)
        if old.reader is not None:
            old.reader.close(None)

    def _reader_of(self, source: _Source) -> QueueReader:
        return QueueReader(source.connect, relay_queue(self._node),
                           lambda raw: self._on_message(source, raw),
                           lambda why: self._lost(source, why), "ftrun-relay")

    def _lost(self, source: _Source, why: str) -> None:
        if source is self._source:  # a source followed away from is expected to die
            self._on_lost(why)

    def _on_message(self, source: _Source, raw: str | bytes) -> None:
        """A reader's thread: a record pushed by the coordinator, or (the inbox) forwarded.
        Kept here first, then forwarded to this node's group, if it names one."""
        message = parse_relay_message(raw)
        if message is None:
            return  # not ours to act on
        if message.warm:  # the group this node forwards to from now on: connect ahead
            self._links.keep_only({addr for _, addr in message.children})
            for _, addr in message.children:
                self._links.ask(addr)
            return
        number, record = message.number, message.record
        if record is None or not self._keep(source, number, record):
            try:  # a gap (or only the number came): read from the source
                self._copy_up_to(source, number, record)
            except Exception as exc:  # the store is gone: the heartbeat (or election) says so
                self._lost(source, first_line(exc))
        if message.children:
            self._forward(source, message)

    def _forward(self, source: _Source, message: RelayMessage) -> None:
        """Send the record to each node of this node's group, on its inbox; one not connected
        yet (`ForwardLinks`), whose inbox closed its end, or that takes nothing at once is
        pushed to on the source instead, as the coordinator would have. A host gone silent
        loses what is sent to it until its link is cut (`INBOX_UNACKED_S`): its node is
        lost to the job by then, and a relay reads any gap from the source."""
        payload = (relay_message(message.number, message.record) if message.record is not None
                   else str(message.number).encode())
        try:
            framed: bytes | None = frame(payload)
        except ValueError:
            framed = None  # too long for a frame: the whole group on the source
        group = {addr for _, addr in message.children}
        self._links.keep_only(group)
        links = {addr: self._links.get(addr) for addr in group} if framed is not None else {}
        gone = closed([link for link in links.values() if link is not None])
        for node, addr in message.children:
            link = links.get(addr)
            if link in gone:
                self._links.drop(addr)
            elif link is not None and framed is not None:
                try:
                    link.send(framed)
                    continue
                except Exception:
                    self._links.drop(addr)
            with contextlib.suppress(Exception):  # the source gone too: its loss says so
                source.upstream.queue_push(relay_queue(node), payload)

    def _keep(self, source: _Source, number: int, record: bytes) -> bool:
        """Keep `record` if it is the next one this node's workers wait for (or the first):
        False if records were missed before it (they are read from the source)."""
        with self._lock:
            if source is not self._source or self._local is None:
                return True  # followed away meanwhile, or closed: nothing to keep
            if self._copied >= 0 and number != self._copied + 1:
                return number <= self._copied  # an old one: kept already
            self._store(number, record)
            return True

    def _store(self, number: int, record: bytes) -> None:
        """Under the lock: the record first, then the pointer, as `publish` does."""
        self._local.set(gen_key(number), record)
        self._local.set(LATEST_KEY, str(number))
        self._copied = number

    def _catch_up(self, source: _Source) -> None:
        """Copy up to the newest record `source` holds (none: wait for its queue)."""
        if source.upstream.check([LATEST_KEY]):
            self._copy_up_to(source, int(source.upstream.get(LATEST_KEY)))

    def _copy_up_to(self, source: _Source, number: int, record: bytes | None = None) -> None:
        """Copy every record after the last copied up to `number` (a node admitted late
        starts at the newest: its workers are in no older one). A record the source does not
        hold (a new leader's store starts at the newest generation it knows) is filled with
        the next one it holds: a watcher waiting for the missing number reads a newer record
        and goes on from there (`GenerationWatcher`), so no worker waits in a gap. `record`:
        `number`'s, if it came with the push (not read again). The reads run outside the
        lock: a dead source blocks only its own reader."""
        start = number if self._copied < 0 else self._copied + 1
        got: list[tuple[int, bytes]] = []
        for n in range(number, start - 1, -1):  # newest first: a missing one takes the next
            key = gen_key(n)
            if n == number and record is not None:
                got.append((n, record))
            elif n == number or source.upstream.check([key]):
                got.append((n, source.upstream.get(key)))
            else:
                got.append((n, got[-1][1]))
        with self._lock:
            if source is not self._source or self._local is None:
                return  # followed away meanwhile, or closed
            for n, record in reversed(got):
                if n > self._copied:
                    self._store(n, record)

    def forwards_to(self, inbox: str) -> bool:
        """Whether a record for the node at `inbox` goes there from here (connected), not
        on the source."""
        return self._links.connected(inbox)

    def latest(self) -> Generation | None:
        """The newest generation copied here (what this node's workers hold), or None."""
        with self._lock:
            local = self._local
            if local is None or self._copied < 0:
                return None
            return Generation.from_json(local.get(gen_key(self._copied)))

    def close(self, link_works: bool) -> None:
        """`link_works` False: the source store is out of reach; the reader is left to end
        with the connection (a daemon)."""
        source = self._source
        if source.reader is not None:
            source.reader.close(source.upstream if link_works else None)
        if self._inbox is not None:
            self._inbox.close()
        self._links.close()
        with self._lock:
            self._local = None
        if self._hosted is not None:
            self._hosted.close()  # the server stops with its last reference


def inbox_link(addr: str, timeout_s: float) -> InboxLink:
    """A forwarder's connection to the inbox at `addr` ("host:port", a node's `inbox_addr`)."""
    host, port = store_endpoint(addr)
    return InboxLink(host, port, timeout_s)


def connector(addr: str, timeout_s: float = timeouts.STORE_CLIENT_CONNECT_S
              ) -> Callable[[], Any]:
    """What `follow` takes for the store at `addr` ("host:port", a generation's `store`)."""
    from ftrun.adapters.store import client

    host, port = store_endpoint(addr)
    return lambda: client(host, port, timeout_s)


def open_relay(addr: str, port: int, node: int, local_addr: str | None = None
               ) -> tuple[GenerationRelay | None, str]:
    """This attempt's relay of the coordinator's store at `addr:port`, or None and the line
    saying it could not start (the workers then watch the coordinator's store, as they can).
    Its inbox is reached at `local_addr` (--local-addr), else at this host's address on the
    route to the coordinator."""
    from ftrun.adapters.store import client

    try:
        return GenerationRelay(
            lambda: client(addr, port, timeouts.STORE_CLIENT_CONNECT_S),
            node, lambda why: None,  # a lost store is the heartbeat's to notice
            reachable_as=local_addr or route_addr(addr, port)), ""
    except Exception as exc:
        return None, (f"no generation relay on this node ({first_line(exc)}); its workers "
                      "watch the coordinator's store")


def route_addr(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent), "" if none: a relay
    then has no inbox, and the coordinator pushes to it directly."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except (OSError, UnicodeError):
        return ""

