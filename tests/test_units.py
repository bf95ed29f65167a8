"""Pure pieces: state edges, decisions, healing plans, the env contract, generation records."""
import itertools

import pytest

from ftrun.core.policy import (
    Action,
    Decision,
    FaultAction,
    Snapshot,
    decide_fault,
    decide_group,
)
from ftrun.core.spec import WorkerEnv
from ftrun.core.states import TransitionError, WorkerState, allowed, check_transition
from ftrun.protocol.rendezvous import Generation, Suspect, parse_request

EDGES = {
    (WorkerState.RUNNING, WorkerState.STOPPING), (WorkerState.RUNNING, WorkerState.SUCCEEDED),
    (WorkerState.RUNNING, WorkerState.FAILED), (WorkerState.STOPPING, WorkerState.TERMINATED),
    (WorkerState.STOPPING, WorkerState.SUCCEEDED), (WorkerState.STOPPING, WorkerState.FAILED),
}


@pytest.mark.parametrize("src, dst", list(itertools.product(WorkerState, WorkerState)))
def test_every_worker_state_edge(src, dst) -> None:
    assert allowed(src, dst) == ((src, dst) in EDGES)
    if (src, dst) not in EDGES:
        with pytest.raises(TransitionError):
            check_transition(src, dst)


@pytest.mark.parametrize("exits, first, used, max_r, action, culprit, reason", [
    ({0: None, 1: None}, None, 0, 0, Action.WAIT, None, "workers running"),
    ({0: 0, 1: None}, None, 0, 0, Action.WAIT, None, "workers running"),
    ({0: 0, 1: 0}, None, 0, 0, Action.SUCCEED, None, "all 2 workers exited 0"),
    ({0: None, 1: 3}, 1, 0, 0, Action.FAIL, 1,
     "rank 1 exited with 3; no restarts allowed (--max-restarts 0)"),
    ({0: None, 1: 3}, 1, 0, 2, Action.RESTART_GROUP, 1,
     "rank 1 exited with 3; restarting all workers (1/2)"),
    ({0: None, 1: 3}, 1, 1, 2, Action.RESTART_GROUP, 1,
     "rank 1 exited with 3; restarting all workers (2/2)"),
    ({0: None, 1: -9}, 1, 2, 2, Action.FAIL, 1,
     "rank 1 exited with -9 (SIGKILL); all 2 restarts used"),
    ({}, None, 0, 0, Action.WAIT, None, "workers running"),  # none started yet: not a success
])
def test_decide_group(exits, first, used, max_r, action, culprit, reason) -> None:
    assert decide_group(exits, first, used, max_r) == Decision(action, reason, culprit)


def fault(lost=1, crash_loop=0, **kw):
    snap = dict(members=(0, 1, 2), on_fault="replace", faults=1, max_faults=10)
    snap.update(kw)
    return decide_fault(Snapshot(**snap), lost, "exited with -9 (SIGKILL)", 3, crash_loop)


def test_replace_keeps_the_rank_with_a_new_worker_or_a_spare() -> None:
    d = fault()
    assert (d.action, d.members, d.joiners, d.spare_used) == (FaultAction.REPLACE, (0, 3, 2),
                                                              (3,), None)
    d = fault(spares=(7,))
    assert (d.members, d.spare_used) == ((0, 7, 2), 7) and "spare worker 7 takes rank 1" in d.reason


def test_shrink_and_its_bounds() -> None:
    d = fault(on_fault="shrink")
    assert (d.action, d.members) == (FaultAction.SHRINK, (0, 2))
    assert fault(on_fault="shrink", spares=(7,)).action is FaultAction.REPLACE
    assert fault(on_fault="shrink", min_nproc=3).action is FaultAction.FAIL
    assert fault(on_fault="shrink", min_nproc=3, restarts_left=1).action is \
        FaultAction.RESTART_GROUP


def test_give_up_when_no_state_is_left_or_the_budget_is_spent() -> None:
    d = fault(members=(1,))
    assert d.action is FaultAction.FAIL and "no replica left" in d.reason
    assert fault(members=(1, 3), unhealed=frozenset({3})).action is FaultAction.FAIL
    assert fault(faults=11).action is FaultAction.FAIL


def test_a_crash_loop_stops_replacing_the_rank() -> None:
    for loop in (1, 2):  # a replacement that failed before its first commit: replaced again
        assert fault(lost=3, members=(0, 3, 2), crash_loop=loop).action is FaultAction.REPLACE
    d = fault(lost=3, members=(0, 3, 2), crash_loop=3, spares=(7,))
    assert (d.action, d.members, d.regrow) == (FaultAction.SHRINK, (0, 2), False)
    assert "3rd replacement in a row for rank 1" in d.reason and "crash loop" in d.reason
    d = fault(lost=3, members=(0, 3, 2), crash_loop=3, min_nproc=3, restarts_left=2)
    assert d.action is FaultAction.FAIL and "below --min-nproc 3: stopping" in d.reason


@pytest.mark.parametrize("raw, why", [
    ("{", "not JSON"),
    ("[" * 60_000 + "]" * 60_000, "not JSON"),
    ("[1]", "a JSON list, not an object"),
    ('{"kind": "hello", "worker": "abc", "pid": 1, "spare": false}', "'worker' is 'abc'"),
    ('{"kind": "hello", "worker": true, "pid": 1, "spare": false}', "not int"),
    ('{"kind": "hello", "worker": -4, "pid": 1, "spare": false}', "negative"),
    ('{"kind": "comm_failed", "worker": 1, "generation": 2}', "no 'error'"),
    ('{"kind": "bogus", "worker": 1}', "unknown kind 'bogus'"),
    ('{"kind": "suspect", "worker": 1, "generation": 1.5}', "not int"),
])
def test_malformed_worker_requests_are_refused_with_a_reason(raw, why) -> None:
    reason = parse_request(raw)
    assert isinstance(reason, str) and why in reason


def test_a_well_formed_request_passes() -> None:
    raw = '{"kind": "suspect", "worker": 1, "generation": 4}'
    assert parse_request(raw) == Suspect(worker=1, generation=4)


def test_generation_round_trip() -> None:
    g = Generation(3, (0, 4, 2), "r", True, 1.5, 1.0, (4,))
    assert Generation.from_json(g.to_json()) == g
    assert (g.rank_of(4), g.rank_of(9), g.world_size, g.pg_prefix) == (1, None, 3, "ftrun/pg/3/")


def test_worker_env_round_trip() -> None:
    w = WorkerEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, group_rank=0,
                  group_world_size=1, role_rank=1, role_name="default", role_world_size=2,
                  master_addr="h", master_port=5, restart_count=0, max_restarts=0, run_id="x",
                  use_agent_store=True, nccl_async_error_handling="1", error_file="", worker_id=4,
                  spare=True)
    env = w.to_env()
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["FTRUN_SPARE"] == "True"
    assert WorkerEnv.from_env(env) == w


def test_an_error_is_cut_to_its_first_line_even_without_a_message() -> None:
    from ftrun.core.errors import first_line

    assert first_line(RuntimeError("")) == "RuntimeError"  # IndexError before
    assert first_line(RuntimeError("\n\n  peer gone\nTraceback ...")) == "peer gone"
    assert first_line(ValueError("x" * 300), 120) == "x" * 120
    assert first_line("") == "" and first_line("one\ntwo") == "one"


def test_a_collective_that_fails_without_a_message_is_a_comm_error() -> None:
    from ftrun.protocol.rendezvous import Generation
    from ftrun.worker.comm import CommError, Group, Interrupt

    def fails() -> None:
        raise RuntimeError("")

    with pytest.raises(CommError, match="^RuntimeError$"):
        Group(Generation(1, (0, 1)), 0, object()).run(fails, Interrupt())
