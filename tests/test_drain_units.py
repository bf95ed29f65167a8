"""Planned leaves without processes: the pure plan of a drain, every edge of its states, and
`Recovery` carrying drains out through a fake port and an in-memory store (#48)."""
from __future__ import annotations

import itertools
import time

import pytest
from test_recovery_core import exit_, hello, make, recovered

from ftrun.core.drains import (
    DRAIN_EDGES,
    DrainRequest,
    DrainState,
    Handover,
    check_drain_move,
    new_members,
    plan_drain,
)
from ftrun.core.membership import WorkerRole
from ftrun.core.policy import Action, Snapshot

R = WorkerRole


# ------------------------------------------------------------------ the plan (pure)
def snap(**over: object) -> Snapshot:
    return Snapshot(**{"members": (0, 1, 2, 3), **over})  # type: ignore[arg-type]


def test_a_ready_spare_takes_the_rank_before_a_starting_one() -> None:
    plan = plan_drain(snap(spares=(5,), starting_spares=(4,)), (1,), "rank 1",
                      node_leaves=False)
    assert plan.state is DrainState.WAITING and plan.handovers == (Handover(1, 5),)
    assert plan.reason == "rank 1: worker 1 (rank 1) hands over to spare worker 5"
    starting = plan_drain(snap(starting_spares=(4,)), (1,), "rank 1", node_leaves=False)
    assert starting.handovers == (Handover(1, 4),)
    assert "starting spare worker 4" in starting.reason


def test_without_a_spare_replace_starts_a_new_worker_and_shrink_shrinks() -> None:
    new = plan_drain(snap(), (2,), "rank 2", node_leaves=False)
    assert new.handovers == (Handover(2, None, new=True),) and new.state is DrainState.WAITING
    shrink = plan_drain(snap(on_fault="shrink"), (2,), "rank 2", node_leaves=False)
    assert shrink.handovers == (Handover(2, None),) and shrink.state is DrainState.WAITING
    assert shrink.reason.endswith("worker 2 (rank 2) leaves; the job shrinks to 3")


def test_a_drain_that_cannot_be_served_is_refused_and_says_why() -> None:
    low = plan_drain(snap(on_fault="shrink", min_nproc=4), (2,), "rank 2", node_leaves=False)
    assert low.state is DrainState.REFUSED
    assert "3 left would be below --min-nproc 4" in low.reason
    stranger = plan_drain(snap(), (9,), "rank 9", node_leaves=False)
    assert stranger.state is DrainState.REFUSED and "not a member" in stranger.reason


def test_a_leaving_node_shrinks_like_a_lost_one_and_never_uses_its_own_spares() -> None:
    plan = plan_drain(snap(spares=(10_004,)), (2, 3),
                      "node 1", node_leaves=True, leaving_spares=frozenset({10_004}))
    assert plan.shrinks == 2 and plan.state is DrainState.WAITING  # 2 left, min 1
    everyone = plan_drain(snap(spares=(4,)), (0, 1, 2, 3), "node 0", node_leaves=True,
                          leaving_spares=frozenset({4}))
    assert everyone.state is DrainState.REQUEUE and "nowhere to go" in everyone.reason
    reserved = plan_drain(snap(spares=(4, 5)), (1,), "rank 1", node_leaves=False,
                          reserved=frozenset({4}))
    assert reserved.handovers == (Handover(1, 5),)  # another drain counts on 4


def test_the_swap_keeps_ranks_and_drops_leavers_without_a_taker() -> None:
    assert new_members((0, 1, 2, 3), {1: 5}) == (0, 5, 2, 3)
    assert new_members((0, 1, 2, 3), {1: 5, 3: None}) == (0, 5, 2)


EDGES = list(itertools.product(DrainState, DrainState))


@pytest.mark.parametrize(("now", "to"), EDGES, ids=lambda s: s.value)
def test_every_drain_move_is_allowed_or_refused_by_the_table(now: DrainState,
                                                             to: DrainState) -> None:
    if to in DRAIN_EDGES[now]:
        check_drain_move(now, to)
    else:
        with pytest.raises(AssertionError):
            check_drain_move(now, to)


# ------------------------------------------------------------------ the agent (fakes)
def request(*leavers: int, what: str = "rank 1", node: int | None = None,
            window: float = 30.0) -> DrainRequest:
    return DrainRequest(what, leavers, time.time() + window, node_leaves=node is not None,
                        node=node)


def states(port: object) -> list[str]:
    return [f["state"] for k, f in port.events if k == "drain"]  # type: ignore[attr-defined]


def test_a_ready_spare_is_swapped_in_at_a_planned_boundary_and_the_leaver_goes() -> None:
    rec, port, store = make(spares=1, nproc=3)
    hello(rec, 0)
    hello(rec, 3, spare=True)
    rec.drains.start(request(1))
    gen = store.generation()
    assert gen.members == (0, 3, 2) and gen.joiners == (3,) and not gen.urgent
    assert gen.reason.startswith("planned: rank 1: worker 1 (rank 1) hands over to spare")
    assert rec.membership.role(1) is R.GONE and rec.membership.role(3) is R.HEALING
    assert rec.on_exit(exit_(port, 1, 0)) is None and rec.faults == 0  # the leaver, expected
    recovered(rec, 0)
    assert states(port) == ["waiting", "published", "done"] and rec.faults == 0


def test_a_new_worker_is_made_ready_before_the_swap_and_not_grown_in_otherwise() -> None:
    rec, port, store = make(nproc=3)
    hello(rec, 0)
    rec.drains.start(request(2, what="rank 2"))
    new = port.placed[-1][0]
    assert store.generation().number == 0  # nothing published while it starts
    hello(rec, new)  # READY: the drain publishes its swap, not the usual grow
    gen = store.generation()
    assert gen.members == (0, 1, new) and gen.joiners == (new,) and not gen.urgent


def test_a_taker_that_dies_before_the_swap_is_followed_by_the_next() -> None:
    rec, port, store = make(spares=2, nproc=3)
    hello(rec, 0)  # spares 3 and 4 still starting
    rec.drains.start(request(1))
    assert rec.on_exit(exit_(port, 3, -9)) is None  # the chosen one dies while starting
    hello(rec, 4, spare=True)
    assert store.generation().members == (0, 4, 2)


def test_a_fault_that_takes_the_reserved_spare_makes_the_drain_plan_again() -> None:
    rec, port, store = make(spares=1, nproc=3)
    hello(rec, 0)
    rec.drains.start(request(1))  # spare 3 starting: reserved
    assert rec.on_exit(exit_(port, 2, -9)) is None  # a fault meanwhile takes spare 3
    assert store.generation().members == (0, 1, 3) and store.generation().urgent
    hello(rec, 3, spare=True)  # the drain's taker is a member now: a new worker instead
    new = port.placed[-1][0]
    assert new not in (3,) and not port.placed[-1][2]
    hello(rec, new)
    assert store.generation().members == (0, new, 3)


def test_nowhere_to_go_publishes_a_snapshot_first_end_and_requeues() -> None:
    rec, port, store = make(nproc=2)
    hello(rec, 0)
    rec.drains.start(request(0, 1, what="node 0 (SIGTERM: a notice)", node=0))
    gen = store.generation()
    assert gen.members == () and gen.snapshot_first and not gen.urgent
    assert rec.handle_requests() is None  # the members still take their snapshot
    for wid in (0, 1):
        assert rec.on_exit(exit_(port, wid, 0)) is None
    decision = rec.handle_requests()
    assert decision is not None and decision.action is Action.REQUEUE
    assert "nowhere to go" in decision.reason


def test_a_notice_whose_takers_are_late_shrinks_at_the_window_s_end() -> None:
    rec, port, store = make(nproc=4, spares=1)
    hello(rec, 0)  # spare 4 starting: node 0 "drains" ranks 2 and 3, one taker is late
    rec.drains.start(request(2, 3, what="node 1", node=1, window=-1.0))
    assert rec.handle_requests() is None  # the window is over: the late taker is dropped
    gen = store.generation()
    assert gen.members == (0, 1) and not gen.urgent, gen
    assert "the window ran out: the job shrinks" in gen.reason


def test_ftrun_drain_is_refused_when_its_replacement_is_late() -> None:
    rec, port, store = make(nproc=3, spares=1)
    hello(rec, 0)
    rec.drains.start(request(1, window=-1.0))
    rec.handle_requests()
    assert states(port)[-1] == "refused" and store.generation().number == 0


def test_ftrun_status_shows_a_drain_with_its_deadline_and_a_done_one_with_its_cost() -> None:
    from ftrun.cli.status_view import drain_line
    from ftrun.core.events import DrainFields

    waiting = DrainFields(1, "node 2 (SIGTERM: a notice)", "waiting", "worker 20000 (rank 4) "
                          "hands over to starting spare worker 5", deadline=1030.0)
    assert drain_line(waiting, 1006.2) == (
        "drain #1 node 2 (SIGTERM: a notice): waiting, 24 s left (--drain-window): worker "
        "20000 (rank 4) hands over to starting spare worker 5")
    done = DrainFields(2, "rank 1", "done", "r", stall_ms=18.4,
                       phases_ms={"requested": 0.0, "done": 356.2})
    assert drain_line(done, 0.0) == "drain #2 rank 1: done in 356 ms, the members' " \
                                    "boundary 18 ms: r"
