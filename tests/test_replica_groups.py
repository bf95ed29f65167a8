"""Replica groups (--shard-size), without processes: the option's checks, the pure decision on
a lost member, the status rows, and where a rank sits."""
import pytest
from statusdocs import status

from ftrun.cli.launch_args import parse_run_args
from ftrun.core.errors import UsageError
from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.policy import FaultAction, Snapshot
from ftrun.core.replica_groups import decide_group_fault, group_rows, replica_groups
from ftrun.core.spec import WorkerEnv
from ftrun.protocol.rendezvous import Generation
from ftrun.worker.sharded import Placement, group_members, replicate_members


def test_shard_size_reaches_the_spec_and_only_the_sharded_workers_environment() -> None:
    assert parse_run_args(["--nproc", "4", "--shard-size", "2", "t.py"]).shard_size == 2
    assert parse_run_args(["--nproc", "4", "t.py"]).shard_size == 1
    base = dict(rank=0, local_rank=0, world_size=4, local_world_size=4, group_rank=0,
                group_world_size=1, role_rank=0, role_name="default", role_world_size=4,
                master_addr="h", master_port=1, restart_count=0, max_restarts=0, run_id="r",
                use_agent_store=True, nccl_async_error_handling="1", error_file="e",
                worker_id=0)
    assert "FTRUN_SHARD_SIZE" not in WorkerEnv(**base).to_env()  # a plain job: as before
    env = WorkerEnv(**base, shard_size=2).to_env()
    assert env["FTRUN_SHARD_SIZE"] == "2" and WorkerEnv.from_env(env).shard_size == 2


@pytest.mark.parametrize(("argv", "says"), [
    (["--nproc", "4", "--shard-size", "3"], "does not divide"),
    (["--nproc", "4", "--shard-size", "0"], ">= 1"),
    (["--nproc", "4", "--shard-size", "x"], "not an integer"),
    (["--nproc", "4", "--shard-size", "2", "--on-fault", "restart"], "in-process"),
])
def test_shard_size_refuses_what_it_cannot_run_in_one_line(argv: list[str], says: str) -> None:
    with pytest.raises(UsageError, match=says) as err:
        parse_run_args([*argv, "t.py"])
    assert "\n" not in str(err.value) and err.value.hint


def test_a_lost_member_takes_its_whole_group_out_and_the_others_go_on() -> None:
    s = Snapshot(members=(0, 1, 2, 3, 4, 5), max_faults=10, restarts_left=0)
    d = decide_group_fault(s, 3, "exited with 1", 2)
    assert d.action is FaultAction.SHRINK and d.regrow
    assert d.members == (0, 1, 4, 5) and d.evicted == (2,)
    assert "replica group 1 out" in d.reason and "2 groups of 2" in d.reason


def test_no_complete_healed_group_left_is_a_total_loss() -> None:
    # group 0 holds no committed state yet (healing): losing group 1 leaves no source
    s = Snapshot(members=(0, 1, 2, 3), unhealed=frozenset({0, 1}), max_faults=10)
    d = decide_group_fault(s, 2, "exited with 1", 2)
    assert d.action is FaultAction.FAIL and "no other replica group" in d.reason
    alone = Snapshot(members=(0, 1), max_faults=10, restarts_left=1)
    assert decide_group_fault(alone, 1, "hung", 2).action is FaultAction.RESTART_GROUP


def test_budgets_and_crash_loops_bound_the_fresh_groups() -> None:
    s = Snapshot(members=(0, 1, 2, 3), faults=3, max_faults=2)
    assert decide_group_fault(s, 0, "x", 2).action is FaultAction.FAIL
    loop = decide_group_fault(Snapshot(members=(0, 1, 2, 3), max_faults=9), 3, "x", 2, 3)
    assert loop.action is FaultAction.SHRINK and not loop.regrow and "crash loop" in loop.reason
    low = Snapshot(members=(0, 1, 2, 3), max_faults=9, min_nproc=3)
    assert decide_group_fault(low, 0, "x", 2).action is FaultAction.FAIL


def test_status_rows_name_each_group_and_its_state() -> None:
    ms = Membership((0, 1, 2, 3))
    ms.publish((0, 1), ())
    ms.move(4, WorkerRole.JOINING)
    ms.move(5, WorkerRole.JOINING)
    assert group_rows(ms, 2) == [
        {"group": 0, "ranks": [0, 1], "workers": [0, 1], "state": "training"},
        {"group": None, "ranks": [], "workers": [4, 5], "state": "starting"}]
    ms.move(4, WorkerRole.READY)
    ms.move(5, WorkerRole.READY)
    ms.publish((0, 1, 4, 5), (4, 5))
    assert [r["state"] for r in group_rows(ms, 2)] == ["training", "healing"]
    assert replica_groups((0, 1, 4, 5), 2) == [(0, 1), (4, 5)]


def test_a_rank_heals_and_averages_with_the_same_shard_of_the_other_groups() -> None:
    gen = Generation(3, (0, 1, 6, 7, 4, 5))
    assert replicate_members(gen, 1, 2) == (1, 7, 5)
    assert group_members(gen, 7, 2) == (6, 7)
    p = Placement(rank=3, world_size=6, shard_size=2)
    assert (p.replica_rank, p.num_replicas, p.shard_rank) == (1, 3, 1)


def test_status_text_names_the_groups_and_their_policy() -> None:
    from ftrun.cli.status_view import policy_text, replica_groups_text

    assert policy_text(status(shard_size=2, spares=1, policy="replace")) == \
        "a lost group out, then rejoined (groups of 2, spare groups 1)"
    assert policy_text(status(spares=0, policy="shrink")) == "shrink (spares 0)"

    rows = [{"group": 0, "ranks": [0, 1], "workers": [0, 1], "state": "training"},
            {"group": None, "ranks": [], "workers": [4, 5], "state": "starting"}]
    assert replica_groups_text(status(replica_groups=rows).replica_groups or ()) == \
        "0 training (ranks 0-1); starting: workers 4, 5"


def test_the_metrics_count_groups_by_state() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ftrun.adapters import metrics

    doc = status(generation=2, world_size=4, replica_groups=[
        {"group": 0, "ranks": [0, 1], "workers": [0, 1], "state": "training"},
        {"group": 1, "ranks": [2, 3], "workers": [4, 5], "state": "healing"}])
    collector = metrics._Collector(lambda: doc)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    got = {(s.name, tuple(s.labels.items())): s.value for fam in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in fam.samples}
    assert got[("ftrun_replica_groups", (("state", "training"),))] == 1
    assert got[("ftrun_replica_groups", (("state", "healing"),))] == 1
    plain = status(generation=2, world_size=4)  # a data-parallel job has no such family
    collector.status = lambda: plain
    assert "ftrun_replica_groups" not in generate_latest(registry).decode()


def test_a_ready_spare_group_enters_after_the_others_go_on() -> None:
    s = Snapshot(members=(0, 1, 2, 3, 4, 5), max_faults=10)
    d = decide_group_fault(s, 2, "exited with 1", 2, spare_group=(8, 9))
    assert d.action is FaultAction.SHRINK and d.members == (0, 1, 4, 5)
    assert d.spare_used == 8 and not d.regrow and d.evicted == (3,)
    assert "spare group 8, 9 joins at the next step boundary" in d.reason
    # crash-looping replacements are not fed spare groups either
    looped = decide_group_fault(s, 2, "x", 2, crash_loop=3, spare_group=(8, 9))
    assert looped.action is FaultAction.SHRINK and looped.spare_used is None
    assert not looped.regrow


def test_only_errors_that_came_up_through_torch_distributed_wait_for_eviction() -> None:
    import os
    import sys

    from ftrun.worker.sharded import _raised_in_collective

    def traceback_of(code: str, filename: str) -> object:
        try:
            exec(compile(code, filename, "exec"), {})
        except RuntimeError:
            return sys.exc_info()[2]
        raise AssertionError("no error")

    torch_file = os.path.join("site-packages", "torch", "distributed", "tensor", "_ops.py")
    assert _raised_in_collective(traceback_of("raise RuntimeError('reset by peer')",
                                              torch_file))
    assert not _raised_in_collective(traceback_of("raise RuntimeError('a bug')", "train.py"))
