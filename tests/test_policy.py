"""Every recovery decision of policy.py from a Snapshot: the exact action, the next members,
the joiners, the spare used, whether to grow back, and the reason `ftrun status` shows."""
from dataclasses import FrozenInstanceError, replace

import pytest

from ftrun.core.policy import (
    FaultAction,
    FaultDecision,
    Respawn,
    Snapshot,
    decide_comm_failure,
    decide_fault,
    decide_node_loss,
    decide_rebuild,
    decide_respawn,
)

A = FaultAction
NEW = 5  # the id a new worker would get
BASE = Snapshot(members=(0, 1, 2), faults=1, max_faults=10)
KILLED = "worker 1 (rank 1) exited with -9 (SIGKILL)"
LOOPED = ("worker 3 (rank 1) exited with -9 (SIGKILL): the 3rd replacement in a row for rank 1 "
          "to fail before its first commit (a crash loop)")


def outcome(d: FaultDecision) -> tuple:
    return d.action, d.members, d.joiners, d.spare_used, d.regrow, d.reason


def gave_up(action: FaultAction, reason: str) -> tuple:
    return action, (), (), None, True, reason


FAULTS = [  # id, snapshot changes, lost, crash_loop, expected outcome
    ("new-worker", {}, 1, 0,
     (A.REPLACE, (0, 5, 2), (5,), None, True, f"{KILLED}; new worker 5 takes rank 1")),
    ("spare", dict(spares=(7, 8)), 1, 0,
     (A.REPLACE, (0, 7, 2), (7,), 7, True, f"{KILLED}; spare worker 7 takes rank 1")),
    ("spare-under-shrink", dict(spares=(7,), on_fault="shrink"), 1, 0,
     (A.REPLACE, (0, 7, 2), (7,), 7, True, f"{KILLED}; spare worker 7 takes rank 1")),
    ("ready-spare-before-starting", dict(spares=(7,), starting_spares=(8,)), 1, 0,
     (A.REPLACE, (0, 7, 2), (7,), 7, True, f"{KILLED}; spare worker 7 takes rank 1")),
    ("starting-spare", dict(starting_spares=(8, 9)), 1, 0,  # the agent orders: same node first
     (A.REPLACE, (0, 8, 2), (8,), 8, True, f"{KILLED}; starting spare worker 8 takes rank 1")),
    ("starting-spare-under-shrink", dict(starting_spares=(8,), on_fault="shrink"), 1, 0,
     (A.REPLACE, (0, 8, 2), (8,), 8, True, f"{KILLED}; starting spare worker 8 takes rank 1")),
    ("starting-spare-budget", dict(faults=11, starting_spares=(8,)), 1, 0,
     gave_up(A.FAIL, f"{KILLED}; fault budget exhausted (10, --max-faults)")),
    ("starting-spare-crash-loop", dict(members=(0, 3, 2), starting_spares=(8,)), 3, 3,
     (A.SHRINK, (0, 2), (), None, False,
      f"{LOOPED}; continuing with 2, no more replacements for it")),
    ("shrink", dict(on_fault="shrink"), 1, 0,
     (A.SHRINK, (0, 2), (), None, True, f"{KILLED}; continuing with 2, replacement to follow")),
    ("shrink-to-min", dict(on_fault="shrink", min_nproc=2), 1, 0,
     (A.SHRINK, (0, 2), (), None, True, f"{KILLED}; continuing with 2, replacement to follow")),
    ("below-min", dict(on_fault="shrink", min_nproc=3), 1, 0,
     gave_up(A.FAIL, f"{KILLED}; 2 left is below --min-nproc 3")),
    ("below-min-restarts", dict(on_fault="shrink", min_nproc=3, restarts_left=1), 1, 0,
     gave_up(A.RESTART_GROUP,
             f"{KILLED}; 2 left is below --min-nproc 3; restarting all workers")),
    ("alone", dict(members=(1,)), 1, 0,
     gave_up(A.FAIL, "worker 1 (rank 0) exited with -9 (SIGKILL); no replica left to heal from")),
    ("all-unhealed", dict(members=(3, 1, 4), unhealed=frozenset({3, 4})), 1, 0,
     gave_up(A.FAIL, "worker 1 (rank 1) exited with -9 (SIGKILL); no replica left to heal from")),
    ("all-unhealed-restarts", dict(members=(3, 1), unhealed=frozenset({3}), restarts_left=2),
     1, 0, gave_up(A.RESTART_GROUP, "worker 1 (rank 1) exited with -9 (SIGKILL); no replica "
                                    "left to heal from; restarting all workers")),
    ("budget", dict(faults=11, spares=(7,)), 1, 0,
     gave_up(A.FAIL, f"{KILLED}; fault budget exhausted (10, --max-faults)")),
    ("budget-restarts", dict(faults=11, restarts_left=1), 1, 0,
     gave_up(A.RESTART_GROUP,
             f"{KILLED}; fault budget exhausted (10, --max-faults); restarting all workers")),
    ("budget-before-replica", dict(members=(1,), faults=11), 1, 0,
     gave_up(A.FAIL, "worker 1 (rank 0) exited with -9 (SIGKILL); fault budget exhausted "
                     "(10, --max-faults)")),
    ("early-failure-replaced", dict(members=(0, 3, 2)), 3, 2,
     (A.REPLACE, (0, 5, 2), (5,), None, True,
      "worker 3 (rank 1) exited with -9 (SIGKILL); new worker 5 takes rank 1")),
    ("crash-loop", dict(members=(0, 3, 2), spares=(7,)), 3, 3,
     (A.SHRINK, (0, 2), (), None, False,
      f"{LOOPED}; continuing with 2, no more replacements for it")),
    ("crash-loop-4th", dict(members=(0, 3, 2)), 3, 4,
     (A.SHRINK, (0, 2), (), None, False,
      f"{LOOPED.replace('3rd', '4th')}; continuing with 2, no more replacements for it")),
    ("crash-loop-below-min", dict(members=(0, 3, 2), min_nproc=3, restarts_left=2), 3, 3,
     gave_up(A.FAIL, f"{LOOPED}; 2 left is below --min-nproc 3: stopping")),
]


@pytest.mark.parametrize("changes, lost, loop, expected",
                         [pytest.param(*row[1:], id=row[0]) for row in FAULTS])
def test_decide_fault(changes: dict, lost: int, loop: int, expected: tuple) -> None:
    d = decide_fault(replace(BASE, **changes), lost, "exited with -9 (SIGKILL)", NEW, loop)
    assert outcome(d) == expected


NODES = Snapshot(members=(0, 1, 10_000, 10_001, 20_000, 20_001), faults=1, max_faults=10,
                 nodes_left=2, min_nodes=2)
TWO = (10_000, 10_001)
LOST = "node 1 lost with 2 members"

NODE_LOSSES = [  # id, snapshot changes, lost members, expected outcome
    ("spares-take-all", dict(spares=(2, 20_002, 3)), TWO,
     (A.REPLACE, (0, 1, 2, 20_002, 20_000, 20_001), (2, 20_002), None, True,
      f"{LOST}; spare workers 2, 20002 take their ranks on 2 nodes")),
    ("ready-then-starting", dict(spares=(2,), starting_spares=(20_002, 3)), TWO,
     (A.REPLACE, (0, 1, 2, 20_002, 20_000, 20_001), (2, 20_002), None, True,
      f"{LOST}; spare workers 2, 20002 (starting) take their ranks on 2 nodes")),
    ("starting-take-some", dict(starting_spares=(20_002,)), TWO,
     (A.SHRINK, (0, 1, 20_002, 20_000, 20_001), (20_002,), None, True,
      f"{LOST}; continuing with 5 workers on 2 nodes (1 spare used)")),
    ("spares-take-some", dict(spares=(2,)), TWO,
     (A.SHRINK, (0, 1, 2, 20_000, 20_001), (2,), None, True,
      f"{LOST}; continuing with 5 workers on 2 nodes (1 spare used)")),
    ("no-spares", {}, TWO,
     (A.SHRINK, (0, 1, 20_000, 20_001), (), None, True,
      f"{LOST}; continuing with 4 workers on 2 nodes")),
    ("one-member-one-node-left", dict(nodes_left=1, min_nodes=1), (10_000,),
     (A.SHRINK, (0, 1, 10_001, 20_000, 20_001), (), None, True,
      "node 1 lost with 1 member; continuing with 5 workers on 1 node")),
    ("below-min-nodes", dict(nodes_left=1, spares=(2, 3)), TWO,
     gave_up(A.FAIL, f"{LOST}; 1 node left is below --nnodes minimum 2")),
    ("below-min-nodes-restarts", dict(nodes_left=0, restarts_left=1), TWO,
     gave_up(A.RESTART_GROUP,
             f"{LOST}; 0 nodes left is below --nnodes minimum 2; restarting all workers")),
    ("budget", dict(faults=11, nodes_left=1), TWO,
     gave_up(A.FAIL, f"{LOST}; fault budget exhausted (10, --max-faults)")),
    ("no-replica", dict(unhealed=frozenset({0, 1, 20_000, 20_001})), TWO,
     gave_up(A.FAIL, f"{LOST}; no replica left to heal from")),
]


@pytest.mark.parametrize("changes, lost, expected",
                         [pytest.param(*row[1:], id=row[0]) for row in NODE_LOSSES])
def test_decide_node_loss(changes: dict, lost: tuple, expected: tuple) -> None:
    assert outcome(decide_node_loss(replace(NODES, **changes), "node 1", lost)) == expected


COMM = "worker 1 reported a communicator failure: gloo: Connection closed by peer"
STUCK = "every rank has waited 12.0s in collective 2 of step 7: rebuilding the communicator"


@pytest.mark.parametrize("changes, expected", [
    pytest.param({}, (A.REBUILD, (0, 1, 2), (), None, True, COMM), id="rebuild"),
    pytest.param(dict(faults=10), (A.REBUILD, (0, 1, 2), (), None, True, COMM), id="last-fault"),
    pytest.param(dict(faults=11, restarts_left=3),  # FAIL, restarts left or not
                 gave_up(A.FAIL, f"{COMM}; fault budget exhausted (10, --max-faults)"),
                 id="over-budget"),
])
def test_decide_comm_failure(changes: dict, expected: tuple) -> None:
    d = decide_comm_failure(replace(BASE, **changes), 1, "gloo: Connection closed by peer")
    assert outcome(d) == expected


@pytest.mark.parametrize("changes, expected", [
    pytest.param({}, (A.REBUILD, (0, 1, 2), (), None, True, STUCK), id="rebuild"),
    pytest.param(dict(faults=11, restarts_left=1),
                 gave_up(A.NONE, f"{STUCK}; fault budget exhausted (10): not rebuilding"),
                 id="refused"),
])
def test_decide_rebuild(changes: dict, expected: tuple) -> None:
    assert outcome(decide_rebuild(replace(BASE, **changes), STUCK)) == expected


DIED = "spare worker 10002 exited with 1"


@pytest.mark.parametrize("faults, in_a_row, alive, expected", [
    pytest.param(1, 1, True, Respawn(True, f"{DIED}; starting another"), id="allowed"),
    pytest.param(10, 2, True, Respawn(True, f"{DIED}; starting another"), id="last-fault"),
    pytest.param(11, 1, True, Respawn(False, f"{DIED}; not starting another"), id="budget"),
    pytest.param(1, 1, False, Respawn(False, f"{DIED}; not starting another"), id="node-gone"),
    pytest.param(11, 3, True, Respawn(False, f"{DIED}; not starting another"),
                 id="budget-before-loop"),
    pytest.param(1, 3, True, Respawn(False, f"{DIED}: 3 spares in a row on node 1 failed before "
                                            f"their first commit (a crash loop); not starting "
                                            f"more"), id="crash-loop"),
])
def test_decide_respawn(faults: int, in_a_row: int, alive: bool, expected: Respawn) -> None:
    snap = replace(BASE, faults=faults)
    assert decide_respawn(snap, DIED, "spares", 1, in_a_row, alive) == expected


def test_a_snapshot_cannot_change_under_a_decision() -> None:
    with pytest.raises(FrozenInstanceError):
        BASE.faults = 2  # type: ignore[misc]


def test_a_node_waiting_to_join_is_not_counted_among_the_running_ones() -> None:
    """#51 (low): `continuing with 2 workers on 3 nodes` counted a node still waiting to be
    admitted; it keeps the job above --nnodes MIN, but runs nothing yet."""
    s = Snapshot(members=(0, 1, 10_000, 10_001, 20_000, 20_001), nodes_left=3,
                 nodes_waiting=1, min_nodes=2)
    d = decide_node_loss(s, "node 2 (h2)", (20_000, 20_001))
    assert d.action is FaultAction.SHRINK
    assert d.reason.endswith("continuing with 4 workers on 2 nodes (1 more waiting to join)")
