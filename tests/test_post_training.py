"""A rank lost after its last step, in its post-training code (issue 35, item 2).

The replacement heals to the final state, ft.steps() yields nothing for it, and it runs the
rest of the script; without a replacement the job fails and names the rank. The end-to-end
runs use tests/fixtures/post_train.py: every rank writes post_<rank>.json (a checksum of its
model and momentum) once its training is over."""
import json
import re
from pathlib import Path

import pytest
from conftest import FIXTURES, run_ftrun

from ftrun.agent.script_ends import ScriptEnds
from ftrun.core.policy import Action, FaultAction, Snapshot, decide_late_fault
from ftrun.protocol.rendezvous import RELEASE_KEY, Stage

SCRIPT = str(FIXTURES / "post_train.py")
STEPS = 6


def outputs(out: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("post_*.json")}


# ------------------------------------------------------------------ the pure parts
def test_late_fault_is_replaced_where_the_policy_replaces() -> None:
    snap = Snapshot(members=(0, 1), faults=1, max_faults=5)
    d = decide_late_fault(snap, 1, "exited with -9 (SIGKILL)", 2)
    assert d.action is FaultAction.REPLACE and d.members == (0, 2) and d.joiners == (2,)
    assert d.reason == ("worker 1 (rank 1) exited with -9 (SIGKILL) after its last step; new "
                        "worker 2 takes rank 1")
    spare = decide_late_fault(Snapshot(members=(0, 1), spares=(5,), on_fault="shrink",
                                       faults=1, max_faults=5), 1, "exited with 3", 2)
    assert spare.action is FaultAction.REPLACE and spare.joiners == (5,)


def test_late_fault_without_a_replacement_fails_at_the_end() -> None:
    snap = Snapshot(members=(0, 1, 2), on_fault="shrink", faults=1, max_faults=5)
    d = decide_late_fault(snap, 1, "exited with -9 (SIGKILL)", 3)
    assert d.action is FaultAction.FAIL_AT_END and d.members == (0, 2) and not d.joiners
    assert "rank 1" in d.reason and "post-training work is lost" in d.reason
    loop = decide_late_fault(Snapshot(members=(0, 1), faults=3, max_faults=5), 1, "exited "
                             "with 1", 4, crash_loop=3)
    assert loop.action is FaultAction.FAIL_AT_END and "crash loop" in loop.reason
    spent = decide_late_fault(Snapshot(members=(0, 1), faults=2, max_faults=1), 1, "x", 2)
    assert spent.action is FaultAction.FAIL and "after its last step" in spent.reason


class Released:
    """The store as `release_if_ended` writes it: the keys set, in order."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def set(self, key: str, value: str) -> None:
        self.keys.append(key)


@pytest.mark.parametrize("order", ["rank", "reverse", "interleaved"])
def test_the_end_of_a_large_job_looks_at_each_member_a_bounded_number_of_times(
        order: str) -> None:
    """8,192 members end (each a stage, then its exit) in rank order, in reverse, or odd ranks
    first: the members are released once, after the last one ended, and all the checks
    together look at each member a few times, not once per member that ends (#52: the end of
    a 1,024-node job spent ~13 s of the coordinator's CPU here, found by py-spy)."""
    n = 8192
    members = tuple(range(n))
    ends, store, finished, looked = ScriptEnds(), Released(), set(), [0]

    def is_finished(m: int) -> bool:
        looked[0] += 1
        return m in finished

    ids = {"rank": list(members), "reverse": list(reversed(members)),
           "interleaved": [*members[1::2], *members[0::2]]}[order]
    for k, m in enumerate(ids):
        ends.on_stage(Stage(m, 0, 6, "ended"))
        ends.release_if_ended(store, 0, members, is_finished)
        assert store.keys == ([] if k < n - 1 else [RELEASE_KEY])
    for m in ids:  # their exits after the release: nothing left to check
        finished.add(m)
        ends.release_if_ended(store, 0, members, is_finished)
    assert store.keys == [RELEASE_KEY] and looked[0] <= 4 * n


def test_script_ends_release_and_verdict() -> None:
    ends = ScriptEnds()
    assert not ends.training_over((0, 1))
    ends.on_stage(Stage(0, 0, 6, "trained"))
    assert ends.training_over((0, 1)) and not ends.may_release((0, 1))
    ends.on_stage(Stage(0, 0, 6, "ended"))
    snap = Snapshot(members=(0, 1), faults=1, max_faults=5)
    replaced = decide_late_fault(snap, 1, "exited with -9 (SIGKILL)", 2)
    ends.after_late_fault(1, 1, "exited with -9 (SIGKILL)", replaced)
    assert not ends.may_release((0, 2))  # the replacement's script has not ended
    assert ends.verdict().action is Action.FAIL  # ...so its rank's work is still owed
    ends.on_stage(Stage(2, 1, 6, "ended"))
    assert ends.may_release((0, 2)) and ends.verdict().action is Action.SUCCEED
    ends.released = True
    assert not ends.may_release((0, 2))  # once
    lost = decide_late_fault(Snapshot(members=(0, 2), on_fault="shrink", faults=2,
                                      max_faults=5), 2, "exited with 1", 3)
    ends.after_late_fault(2, 1, "exited with 1", lost)
    verdict = ends.verdict()
    assert verdict.action is Action.FAIL and verdict.culprit == 1
    assert verdict.reason.startswith("rank 1 (worker 2 exited with 1): lost after its last step")
    ends.on_stage(Stage(0, 1, 6, "training"))  # a second training loop
    assert not ends.ended(0)
    assert ends.on_stage(Stage(0, 1, 6, "bogus")) is not None


# ------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_ranks_lost_after_their_last_step_are_replaced_and_finish_the_script(tmp_path) -> None:
    """Worker 1 dies as it leaves ft.steps() (its peers are still in their own post-training
    code), worker 2 a second and a half later (its peers' scripts have ended): the hot spare
    takes one rank, a forked replacement the other (no spare is started past training)."""
    out = tmp_path / "o"
    out.mkdir()
    r = run_ftrun("--nproc", "3", "--spares", "1", SCRIPT, "--out", str(out), "--steps",
                  str(STEPS), "--die-after", "1", "--die-after", "2:1.5", "--linger", "0.5",
                  timeout=150)
    assert r.returncode == 0, r.stderr
    assert "worker 1 (rank 1) exited with -9 (SIGKILL) after its last step; " in r.stderr
    assert "spare worker 3 takes rank 1" in r.stderr
    assert ("worker 2 (rank 2) exited with -9 (SIGKILL) after its last step; new worker 4 "
            "takes rank 2") in r.stderr
    assert "survived 2/2 faults" in r.stderr
    done = outputs(out)
    assert sorted(done) == [0, 1, 2]
    assert [done[r]["worker"] for r in (0, 1, 2)] == [0, 3, 4]
    assert all(o["committed"] == STEPS for o in done.values())
    assert len({(o["checksum"], o["momentum"]) for o in done.values()}) == 1  # the final state


@pytest.mark.slow
def test_a_replica_group_lost_after_its_last_step_is_replaced_at_its_ranks(tmp_path) -> None:
    """--shard-size 2 with FSDP2: worker 1 dies after its last step, its group is out (worker 0
    stopped), a fresh group heals from the live one, takes ranks 0 and 1, and runs the
    post-training code (a full-parameter gather inside the group)."""
    out = tmp_path / "o"
    out.mkdir()
    r = run_ftrun("--nproc", "4", "--shard-size", "2", SCRIPT, "--fsdp", "--out", str(out),
                  "--steps", str(STEPS), "--die-after", "1", "--linger", "0.5", timeout=150)
    assert r.returncode == 0, r.stderr
    assert "worker 1 (rank 1, replica group 0) exited with -9 (SIGKILL) after its last step" \
        in r.stderr
    assert "survived 1/1 faults" in r.stderr
    done = outputs(out)
    assert sorted(done) == [0, 1, 2, 3]
    assert sorted(done[r]["worker"] for r in (0, 1)) == [4, 5]  # the fresh group
    assert all(o["committed"] == STEPS for o in done.values())
    assert len({(o["checksum"], o["momentum"]) for o in done.values()}) == 1


@pytest.mark.slow
def test_a_rank_lost_after_its_last_step_without_a_replacement_fails_the_job(tmp_path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    r = run_ftrun("--nproc", "2", "--on-fault", "shrink", SCRIPT, "--out", str(out),
                  "--steps", str(STEPS), "--die-after", "1", "--linger", "0.5", timeout=150)
    assert r.returncode == 1, r.stderr
    assert ("ftrun: rank 1 (worker 1 exited with -9 (SIGKILL)): lost after its last step and "
            "not replaced, so its post-training work did not run") in r.stderr
    assert re.search(r"(survived 0/1|recovered 0 of 1) faults", r.stderr)  # not recovered
    assert sorted(outputs(out)) == [0]  # the survivor's script ran to its end
