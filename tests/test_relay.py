"""A follower's generation relay against real c10d stores: what the coordinator publishes
reaches the relay's own store, in order, with the same keys, and a worker's watcher there
sees it."""

from __future__ import annotations

import threading
import time

from ftrun.adapters.store import LOOPBACK, HostedStore, client
from ftrun.cluster.relay import GenerationRelay
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
        assert int(local.get(LATEST_KEY)) == 3
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
