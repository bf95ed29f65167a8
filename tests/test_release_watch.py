"""A finished script's wait for release follows its job's store when the store moves (etcd:
a new coordinator serves another), and ends at once, as before, when it cannot move.
Real TCPStores on loopback; the worker's store address is what `where` reads."""
from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any

from ftrun.adapters.store import client
from ftrun.protocol.rendezvous import RELEASE_KEY
from ftrun.worker.comm import Interrupt
from ftrun.worker.script_end import ReleaseWatch


def server() -> tuple[Any, int]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                          wait_for_workers=False)
    return store, store.port


def test_the_wait_moves_with_the_store_and_is_released_there() -> None:
    old, old_port = server()
    new, new_port = server()
    at = {"port": old_port}
    interrupt = Interrupt()
    watch = ReleaseWatch(lambda: client("127.0.0.1", at["port"], 5.0), interrupt,
                         lambda: f"127.0.0.1:{at['port']}", move_s=30.0)
    assert not watch.released.wait(0.3)
    del old  # the coordinator's store is gone
    gc.collect()
    assert not watch.released.wait(0.5)  # waiting for a generation naming another store
    at["port"] = new_port  # ...which names the new coordinator's
    new.set(RELEASE_KEY, "1")
    assert watch.released.wait(20)
    assert interrupt.store_lost is None and interrupt.wake.is_set()


def test_a_store_that_cannot_move_is_gone_at_once() -> None:
    old, port = server()
    interrupt = Interrupt()
    watch = ReleaseWatch(lambda: client("127.0.0.1", port, 5.0), interrupt)
    assert not watch.released.wait(0.3)
    del old
    gc.collect()
    assert watch.released.wait(20)
    assert interrupt.store_lost
