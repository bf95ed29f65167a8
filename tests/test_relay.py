"""A follower's generation relay against real c10d stores: what the coordinator publishes
reaches the relay's own store, in order, with the same keys, and a worker's watcher there
sees it."""

from __future__ import annotations

import threading
import time

from conftest import wait_for

from ftrun.adapters.store import LOOPBACK, HostedStore, client
from ftrun.cluster.relay import GenerationRelay
from ftrun.protocol.fanout import parse_relay_message, relay_message, relay_queue
from ftrun.protocol.rendezvous import LATEST_KEY, Generation, gen_key, publish
from ftrun.worker.comm import Interrupt
from ftrun.worker.genwatch import GenerationWatcher


def _gen(number: int) -> Generation:
    return Generation(number, tuple(range(10_000, 10_000 + 8 * (number + 1))),
                      reason=f"g{number}")


def test_a_relay_copies_every_generation_named_on_its_queue() -> None:
    upstream = HostedStore(0, LOOPBACK)
    store = upstream.serve()

    def connect() -> object:
        return client(LOOPBACK, upstream.port, 10.0)

    publish(store, _gen(0), relays=[1])
    relay = GenerationRelay(connect, 1, lambda why: None)
    try:
        host, _, port = relay.addr.rpartition(":")
        local = client(host, int(port), 10.0)
        seen: list[int] = []
        arrived = threading.Event()

        def saw(gen: Generation) -> None:
            seen.append(gen.number)
            if gen.number == 3:
                arrived.set()

        watcher = GenerationWatcher(lambda: client(host, int(port), 10.0), 0, Interrupt(), saw)
        for n in (1, 2, 3):
            publish(store, _gen(n), relays=[1, 2])  # node 2 has no relay: nobody reads it
        assert arrived.wait(10.0)
        watcher.stop()
        assert seen == [1, 2, 3]
        assert Generation.from_json(local.get(gen_key(2))) == _gen(2)
        # the watcher saw record 3; the relay sets the latest number just after it
        wait_for(lambda: int(local.get(LATEST_KEY)) == 3, 10, "the latest number, 3")
        late = GenerationRelay(connect, 3, lambda why: None)  # a node admitted now
        try:
            h, _, p = late.addr.rpartition(":")
            late_store = client(h, int(p), 10.0)
            assert int(late_store.get(LATEST_KEY)) == 3  # starts at the newest, no older
            assert not late_store.check([gen_key(2)])
        finally:
            late.close(link_works=True)
    finally:
        relay.close(link_works=True)
        time.sleep(0.05)
        upstream.close()


class _Reads:
    """A source connection that counts its record reads."""

    def __init__(self, inner: object, counts: list[str]) -> None:
        self._inner, self._counts = inner, counts

    def get(self, key: str) -> bytes:
        self._counts.append(key)
        return self._inner.get(key)  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_a_pushed_record_is_kept_without_a_read_and_a_gap_is_read_from_the_source() -> None:
    """The coordinator pushes each record whole (`relay_message`): the next one is kept as
    it came, with no read of the coordinator's store (a round trip a node for every
    generation, before); after a missed one, the gap is read from the source;
    a number alone (an older coordinator's push) is read as before."""
    upstream = HostedStore(0, LOOPBACK)
    store = upstream.serve()
    reads: list[str] = []
    publish(store, _gen(0), relays=[1])
    relay = GenerationRelay(lambda: _Reads(client(LOOPBACK, upstream.port, 10.0), reads), 1,
                            lambda why: None)
    try:
        host, _, port = relay.addr.rpartition(":")
        local = client(host, int(port), 10.0)
        reads.clear()  # the catch-up read generation 0
        publish(store, _gen(1), relays=[1])
        local.wait([gen_key(1)])
        assert reads == [] and Generation.from_json(local.get(gen_key(1))) == _gen(1)
        store.set(gen_key(2), _gen(2).encode())  # published, its push lost
        store.queue_push(relay_queue(1), relay_message(3, _gen(3).encode()))
        local.wait([gen_key(3)])  # the relay sets the record, then the latest number
        wait_for(lambda: int(local.get(LATEST_KEY)) == 3, 10, "the latest number, 3")
        assert reads == [gen_key(2)]  # only the gap read
        assert Generation.from_json(local.get(gen_key(2))) == _gen(2)
        store.set(gen_key(4), _gen(4).encode())
        store.queue_push(relay_queue(1), "4")
        local.wait([gen_key(4)])
        assert reads[-1] == gen_key(4) and parse_relay_message(b"x\n") is None
    finally:
        relay.close(link_works=True)
        time.sleep(0.05)
        upstream.close()
