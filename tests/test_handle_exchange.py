"""A group's bootstrap exchange in O(N) store requests (`ftrun.worker.exchange`, issue #52).

Store level, on a real TCPStore with one connection per simulated member: the exchange costs
2 calls a member and one more in all, whatever N (the old key-by-key reads cost 1 + 2N a
member); gloo's own access pattern through a `GatheringStore` costs the same; a BUSY member
is seen by every member. Real processes: 4 workers build a fresh gloo group and reconfigure
the default group twice through it, and every all-reduce sums right; then one leaves, and
the other three, whose reconfigure for a generation with it still waits for its handle,
reconfigure for the next generation at once (the superseded one never re-forms the group).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ftrun.adapters.store import CountingStore, Tally, client
from ftrun.worker.exchange import all_gather, gathered, tidy
from ftrun.worker.joining import BUSY

FIXTURE = Path(__file__).parent / "fixtures" / "exchange_group.py"
JOIN_S = 60.0


POOL = 24  # connections, one per simulated member (made once: each costs a name lookup)


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30),
                          wait_for_workers=False)
    yield store


@pytest.fixture(scope="module")
def pool(server: Any) -> list[Any]:
    return [client("127.0.0.1", server.port, 30.0) for _ in range(POOL)]


def run_members(size: int, body: Callable[[int], Any]) -> list[Any]:
    """`body(rank)` on one thread per member; every result (or the exception raised)."""
    results: list[Any] = [None] * size

    def one(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except Exception as exc:  # checked by the caller
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a member never returned"
    return results


def connections(pool: list[Any], size: int, tally: Tally) -> list[Any]:
    """`size` members' connections, their requests counted into `tally`."""
    return [CountingStore(conn, tally) for conn in pool[:size]]


@pytest.mark.parametrize("size", [4, 24])
def test_the_exchange_costs_two_calls_a_member(pool: list[Any], size: int) -> None:
    tally = Tally()
    stores = connections(pool, size, tally)
    values = run_members(size, lambda r: all_gather(
        stores[r], f"g{size}/", r, size, b"handle-%d" % r))
    assert all(v == [b"handle-%d" % r for r in range(size)] for v in values)
    assert tally.total == 2 * size + 1  # set, get (which waits); rank 0: set, multi_get, set


@pytest.mark.parametrize("size", [4, 24])
def test_gloo_reads_through_a_gathering_store_cost_two_calls_a_member(
        pool: list[Any], size: int) -> None:
    def gloo_like(rank: int, store: Any, prefix: str) -> list[bytes]:
        """What gloo's full mesh does with its store: its own key, then every rank's."""
        store.set(f"{prefix}0/{rank}", b"addr-%d" % rank)
        got = []
        for i in range(size):
            store.wait([f"{prefix}0/{i}"], timedelta(seconds=JOIN_S))
            got.append(bytes(store.get(f"{prefix}0/{i}")))
        return got

    plain, joined = Tally(), Tally()
    direct = connections(pool, size, plain)
    run_members(size, lambda r: gloo_like(r, direct[r], f"p{size}/"))
    kept = [gathered(s, r, size) for r, s in enumerate(connections(pool, size, joined))]
    got = run_members(size, lambda r: gloo_like(r, kept[r], f"q{size}/"))
    assert all(g == [b"addr-%d" % i for i in range(size)] for g in got)
    assert plain.total == size * (1 + 2 * size)  # key by key: quadratic
    assert joined.total == 2 * size + 1


def test_one_busy_member_is_seen_by_every_member(pool: list[Any]) -> None:
    stores = connections(pool, 4, Tally())
    handles = run_members(4, lambda r: all_gather(
        stores[r], "busy/", r, 4, (BUSY if r == 2 else f"h{r}").encode()))
    assert all(BUSY.encode() in h for h in handles)  # so every member builds a fresh group


def test_tidy_zeroes_only_the_unused_bytes_of_an_ipv4_address() -> None:
    host = b"vm"
    storage = (2).to_bytes(2, "little") + b"\x99\xf7\x7f\x00\x00\x01" + bytes(8) + b"\xab" * 112
    record = (len(host).to_bytes(8, "little") + host + (136).to_bytes(8, "little") + storage
              + b"\xff" * 8)
    tidied = tidy(record)
    assert len(tidied) == len(record)
    assert tidied[:18 + 16] == record[:18 + 16] and tidied[-8:] == record[-8:]
    assert tidied[18 + 16:18 + 128] == bytes(112)
    assert tidy(b"not an address") == b"not an address"


@pytest.mark.timeout(180)
def test_four_processes_build_real_gloo_groups_through_the_exchange(server: Any) -> None:
    procs = [subprocess.Popen([sys.executable, str(FIXTURE), str(server.port), str(r), "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(4)]
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in outs]
    rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    for r, row in enumerate(rows):
        assert row["fresh"] == 10.0 and row["fresh_again"] == 4.0
        assert row["native4"] == [True, 10.0, r, 4] and row["native5"] == [True, 10.0, r, 4]
        if r < 3:
            assert row["native7"] == [True, 6.0, r, 3]
            # 7 did not wait for 6, which ended without re-forming the group
            assert row["seven_done"] < row["six_ended"] and row["native6"] != "re-formed"
    # every exchange went through one joined record: no member's address under gloo's own key
    keys = [k for k in server.list_keys() if k.startswith("ftrun/") and not k.endswith("claimed")]
    assert keys and all("/gather/" in k for k in keys), keys
