"""The fan-out tree of a large job's generations (protocol.fanout): the plan is pure, the
forwarding runs through real relays and real c10d stores: a forwarder pushes the record to its
group's inboxes, one it cannot reach is pushed to on the coordinator's store, and a group
whose forwarder died reads what it missed from the coordinator's store."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from conftest import wait_for

from ftrun.adapters.relay_inbox import frame
from ftrun.adapters.store import LOOPBACK, HostedStore, client
from ftrun.cluster.relay import GenerationRelay, inbox_link, open_relay
from ftrun.protocol.fanout import (
    RelayHop,
    RelayMessage,
    parse_relay_message,
    relay_message,
    relay_plan,
    relay_queue,
    warm_message,
)
from ftrun.protocol.rendezvous import Generation, gen_key, publish


def _gen(number: int) -> Generation:
    return Generation(number, tuple(range(10_000, 10_008)), reason=f"g{number}")


# ------------------------------------------------------------------ the plan (pure)
def test_a_small_job_is_pushed_to_node_by_node() -> None:
    nodes = [(n, f"10.0.0.{n}:7000") for n in range(1, 64)]
    assert relay_plan(nodes) == [RelayHop(n) for n in range(1, 64)]


def _reached(plan: list[RelayHop]) -> list[int]:
    return sorted([hop.node for hop in plan] + [int(c.split("@")[0]) for hop in plan
                                                for c in hop.children])


def test_a_large_job_is_pushed_to_one_node_a_group_of_about_its_square_root() -> None:
    nodes = [(n, f"h{n}:7") for n in range(1, 1025)]
    plan = relay_plan(nodes)
    assert len(plan) == 32 and all(len(hop.children) == 31 for hop in plan)
    assert _reached(plan) == list(range(1, 1025))  # every node once
    assert plan[0] == RelayHop(1, tuple(f"{n}@h{n}:7" for n in range(2, 33)))  # indices 1-32
    assert plan[1] == RelayHop(33, tuple(f"{n}@h{n}:7" for n in range(34, 65)))


def test_a_node_lost_changes_only_its_own_group() -> None:
    nodes = [(n, f"h{n}:7") for n in range(1, 1025)]
    before = relay_plan(nodes)
    for lost in (40, 33):  # one forwarded to, then its group's forwarder
        after = relay_plan([(n, a) for n, a in nodes if n != lost])
        assert _reached(after) == [n for n in range(1, 1025) if n != lost]
        assert [hop for hop in after if hop not in before] == [
            hop for hop in after if hop.node in (33, 34)]  # group 33-64 alone


def test_a_node_without_an_inbox_is_pushed_to_directly() -> None:
    nodes = [(n, "" if n % 10 == 0 else f"h{n}:7") for n in range(1, 101)]
    plan = relay_plan(nodes, tree_from=64)
    direct = [hop.node for hop in plan if not hop.children]
    assert set(range(10, 101, 10)) <= set(direct)
    assert all(not c.startswith(f"{n}@") for hop in plan for c in hop.children
               for n in range(10, 101, 10))
    few = [(n, "" if n > 5 else f"h{n}:7") for n in range(1, 101)]  # 5 with an inbox
    assert relay_plan(few, tree_from=64) == [RelayHop(n) for n in range(1, 101)]


def test_a_relay_message_carries_the_children_and_drops_a_malformed_one() -> None:
    raw = relay_message(7, b'{"x": 1}', ("3@10.0.0.3:5000", "4@h:6000"))
    assert parse_relay_message(raw) == RelayMessage(7, b'{"x": 1}',
                                                    ((3, "10.0.0.3:5000"), (4, "h:6000")))
    assert parse_relay_message(b"7 x@h:1,5@nocolon,6@h:2\nrec") == RelayMessage(
        7, b"rec", ((6, "h:2"),))
    assert parse_relay_message(b"7\nrec") == RelayMessage(7, b"rec")
    assert parse_relay_message(b"7") == RelayMessage(7, None)
    assert parse_relay_message(b"x 1@h:1\nrec") is None
    assert parse_relay_message(warm_message(("3@h:5", "4@h:6"))) == RelayMessage(
        -1, None, ((3, "h:5"), (4, "h:6")), warm=True)  # a group told ahead: no record


# ------------------------------------------------------------------ real relays
class _Pops:
    """A relay's connection to the coordinator's store that records what it popped."""

    def __init__(self, inner: object, popped: list[bytes]) -> None:
        self._inner, self._popped = inner, popped

    def queue_pop(self, key: str, block: bool) -> bytes:
        raw = self._inner.queue_pop(key, block)  # type: ignore[attr-defined]
        self._popped.append(bytes(raw))
        return raw  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@contextmanager
def _job(nodes: int) -> Iterator[tuple[object, dict[int, GenerationRelay], dict[int, list[bytes]]]]:
    """The coordinator's store with generation 0, and a relay for each node 1..`nodes` with
    an inbox on loopback; each relay's pops from the coordinator's store are recorded."""
    upstream = HostedStore(0, LOOPBACK)
    store = upstream.serve()
    publish(store, _gen(0))
    popped: dict[int, list[bytes]] = {n: [] for n in range(1, nodes + 1)}
    with ExitStack() as stack:
        relays = {}
        for n in popped:
            relays[n] = GenerationRelay(
                lambda n=n: _Pops(client(LOOPBACK, upstream.port, 10.0), popped[n]),  # type: ignore[misc]
                n, lambda why: None, reachable_as=LOOPBACK)
            stack.callback(relays[n].close, True)
        yield store, relays, popped
    time.sleep(0.05)
    upstream.close()


def _holds(relay: GenerationRelay, number: int) -> bool:
    held = relay.latest()
    return held is not None and held.number >= number


def test_a_forwarder_pushes_the_record_to_its_group_not_the_coordinators_store() -> None:
    """The first record reaches the group on the coordinator's store while the forwarder
    connects to their inboxes (off its forwarding path); the next ones go to the inboxes."""
    with _job(3) as (store, relays, popped):
        children = tuple(f"{n}@{relays[n].inbox_addr}" for n in (2, 3))
        publish(store, _gen(1), relays=[RelayHop(1, children)])  # type: ignore[arg-type]
        for n in (1, 2, 3):
            wait_for(lambda n=n: _holds(relays[n], 1), 10, f"node {n} holding generation 1")
        assert len(popped[2]) == len(popped[3]) == 1  # not connected yet: upstream
        wait_for(lambda: all(relays[1].forwards_to(relays[n].inbox_addr) for n in (2, 3)), 10,
                 "the forwarder connected to both inboxes")
        for number in (2, 3):
            publish(store, _gen(number), relays=[RelayHop(1, children)])  # type: ignore[arg-type]
        for n in (1, 2, 3):
            wait_for(lambda n=n: _holds(relays[n], 3), 10, f"node {n} holding generation 3")
        assert relays[3].latest() == _gen(3)
        assert len(popped[1]) == 3 and len(popped[2]) == len(popped[3]) == 1  # none upstream


def test_a_forwarder_told_its_group_ahead_sends_the_first_record_through_the_inboxes() -> None:
    """The coordinator tells each forwarder its group once the inboxes are known
    (`Generations.warm_relays`): the forwarder connects then, so the first fault's record
    already goes to the inboxes, not to the group on the coordinator's store."""
    with _job(3) as (store, relays, popped):
        children = tuple(f"{n}@{relays[n].inbox_addr}" for n in (2, 3))
        store.queue_push(relay_queue(1), warm_message(children))  # type: ignore[attr-defined]
        wait_for(lambda: all(relays[1].forwards_to(relays[n].inbox_addr) for n in (2, 3)), 10,
                 "the forwarder connected to both inboxes, told ahead")
        assert _holds(relays[1], 0) and not _holds(relays[1], 1)  # no record came with it
        publish(store, _gen(1), relays=[RelayHop(1, children)])  # type: ignore[arg-type]
        for n in (1, 2, 3):
            wait_for(lambda n=n: _holds(relays[n], 1), 10, f"node {n} holding generation 1")
        assert popped[2] == popped[3] == []  # through the inboxes, the first one too


def test_a_forwarder_closes_its_links_to_nodes_that_left_its_group() -> None:
    """A new group (told ahead, or with a record) keeps only its own links: one to a node
    that left held a reader thread there until the forwarder's relay closed."""
    with _job(3) as (store, relays, popped):
        two, three = (f"{n}@{relays[n].inbox_addr}" for n in (2, 3))
        store.queue_push(relay_queue(1), warm_message((two, three)))  # type: ignore[attr-defined]
        wait_for(lambda: all(relays[1].forwards_to(relays[n].inbox_addr) for n in (2, 3)), 10,
                 "the forwarder connected to both inboxes")
        publish(store, _gen(1), relays=[RelayHop(1, (two,)), RelayHop(3)])  # type: ignore[arg-type]
        for n in (1, 2, 3):
            wait_for(lambda n=n: _holds(relays[n], 1), 10, f"node {n} holding generation 1")
        assert relays[1].forwards_to(relays[2].inbox_addr)
        assert not relays[1].forwards_to(relays[3].inbox_addr)  # closed, and not asked again
        store.queue_push(relay_queue(1), warm_message((three,)))  # type: ignore[attr-defined]
        wait_for(lambda: relays[1].forwards_to(relays[3].inbox_addr), 10, "the new group's link")
        assert not relays[1].forwards_to(relays[2].inbox_addr)


def test_a_node_the_forwarder_cannot_reach_is_pushed_to_on_the_coordinators_store() -> None:
    with _job(2) as (store, relays, popped):
        dead = HostedStore(0, LOOPBACK)  # a port that nobody serves
        dead_at = f"{LOOPBACK}:{dead.port}"
        dead.close()
        for number in (1, 2):
            publish(store, _gen(number),
                    relays=[RelayHop(1, (f"2@{dead_at}",))])  # type: ignore[arg-type]
            wait_for(lambda n=number: _holds(relays[2], n), 10, f"node 2 holding {number}")
        assert [parse_relay_message(raw) for raw in popped[2]] == [
            RelayMessage(n, _gen(n).encode()) for n in (1, 2)]  # the forwarder pushed upstream
        assert not relays[1].forwards_to(dead_at)


def test_a_node_whose_inbox_closed_gets_that_same_record_on_the_coordinators_store() -> None:
    """A frame into an inbox that closed its end would be lost (only the next write fails):
    the forwarder looks first, and pushes that node's record upstream, not the next one."""
    with _job(3) as (store, relays, popped):
        children = tuple(f"{n}@{relays[n].inbox_addr}" for n in (2, 3))
        store.queue_push(relay_queue(1), warm_message(children))  # type: ignore[attr-defined]
        wait_for(lambda: all(relays[1].forwards_to(relays[n].inbox_addr) for n in (2, 3)), 10,
                 "the forwarder connected to both inboxes")
        relays[3]._inbox.close()  # type: ignore[union-attr]  # its inbox alone ends
        time.sleep(0.2)  # its end's close reached the forwarder's link
        publish(store, _gen(1), relays=[RelayHop(1, children)])  # type: ignore[arg-type]
        for n in (1, 2, 3):
            wait_for(lambda n=n: _holds(relays[n], 1), 10, f"node {n} holding generation 1")
        assert popped[2] == [] and [parse_relay_message(raw) for raw in popped[3]] == [
            RelayMessage(1, _gen(1).encode())]
        assert not relays[1].forwards_to(relays[3].inbox_addr)  # dropped: asked again


def test_a_group_whose_forwarder_died_reads_what_it_missed_from_the_coordinators_store(
        ) -> None:
    with _job(3) as (store, relays, popped):
        group = tuple(f"{n}@{relays[n].inbox_addr}" for n in (2, 3))
        relays[1].close(link_works=True)  # its node lost: the push below reaches no one
        publish(store, _gen(1), relays=[RelayHop(1, group)])  # type: ignore[arg-type]
        publish(store, _gen(2), relays=[RelayHop(2, group[1:])])  # the next plan, without it
        for n in (2, 3):
            wait_for(lambda n=n: _holds(relays[n], 2), 10, f"node {n} holding generation 2")
            host, _, port = relays[n].addr.rpartition(":")
            local = client(host, int(port), 10.0)
            assert Generation.from_json(local.get(gen_key(1))) == _gen(1)  # the gap, read
        pushed = [parse_relay_message(raw) for raw in popped[2] + popped[3]]
        assert 1 not in [m.number for m in pushed if m is not None]  # never pushed to them


def test_a_followers_relay_takes_records_on_its_inbox_at_its_address_towards_the_coordinator(
        ) -> None:
    upstream = HostedStore(0, LOOPBACK)
    store = upstream.serve()
    publish(store, _gen(0))
    relay, why = open_relay(LOOPBACK, upstream.port, 1)  # as a follower opens it, no --local-addr
    assert relay is not None and why == ""
    try:
        host, _, port = relay.inbox_addr.rpartition(":")
        assert host == LOOPBACK and int(port) != int(relay.addr.rpartition(":")[2])
        link = inbox_link(relay.inbox_addr, 10.0)
        link.send(frame(relay_message(1, _gen(1).encode())))
        wait_for(lambda: _holds(relay, 1), 10, "generation 1, taken on the inbox")
        link.close()
    finally:
        relay.close(link_works=True)
        time.sleep(0.05)
        upstream.close()
