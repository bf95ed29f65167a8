"""--redo lost: the survivors keep their gradients of the broken step and redo only the lost
rank's share of it; the committed step equals the fault-free one within float tolerance.
Pure plans first, then the agent's side through fakes, then real runs (4 gloo workers, a
SIGKILL in the middle of a backward)."""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, run_ftrun
from test_recovery_core import exit_, hello, make, recovered

from ftrun.core.membership import WorkerRole
from ftrun.protocol.rendezvous import Generation
from ftrun.worker.loader import Loader
from ftrun.worker.makeup import Blend, Part, Plan, Redo, plan_for

LOOP = str(FIXTURES / "redo_loop.py")
OLD = Generation(0, (10, 11, 12, 13))


# ------------------------------------------------------------------ the plan (pure)
def parts(plan_of: Any, n: int) -> list[Part]:
    got = [plan_of(i).part(n) for i in range(plan_of(0).survivors)]
    assert all(isinstance(p, Part) for p in got), got
    return got


def test_the_lost_share_is_split_among_the_survivors_in_their_new_order() -> None:
    new = Generation(1, (13, 10, 12))  # rank 1 (worker 11) lost; the survivors' new order
    plans = {w: plan_for(3, OLD, new, w) for w in new.members}
    assert all(isinstance(p, Plan) and p.lost_ranks == (1,) and p.lost_workers == (11,)
               and p.world_size == 4 and p.survivors == 3 for p in plans.values())
    by_index = {p.index: p for p in plans.values() if isinstance(p, Plan)}
    got = parts(by_index.__getitem__, 14)  # shares 4,4,3,3: rank 1 held positions 4..7
    assert [g.positions for g in got] == [[4, 5], [6], [7]]
    # every sample weighs 1/14 of the sum divided by 4: a part of k samples weighs 4k/14,
    # and a survivor's kept pass its old share's size (13: 3, 10: 4, 12: 3) times 4/14
    assert [g.weight for g in got] == [8 / 14, 4 / 14, 4 / 14]
    assert [g.kept_weight for g in got] == [12 / 14, 16 / 14, 12 / 14]


def test_even_shares_keep_the_weights_of_an_average() -> None:
    plan = plan_for(3, OLD, Generation(1, (10, 12, 13)), 12)
    assert isinstance(plan, Plan)
    part = plan.part(32)  # shares of 8; rank 1's 8 cut 3, 3, 2: worker 12 is index 1
    assert isinstance(part, Part) and part.positions == [11, 12, 13]
    assert (part.weight, part.kept_weight) == (3 / 8, 1.0)  # bitwise what averaging gives


def test_a_second_fault_recomputes_the_shares_from_what_is_left() -> None:
    newer = Generation(2, (10, 13))  # 11 lost first, then 12 during the make-up
    plans = [plan_for(3, OLD, newer, w) for w in newer.members]
    assert all(isinstance(p, Plan) and p.lost_ranks == (1, 2) for p in plans)
    got = parts(lambda i: plans[i], 16)  # shares of 4: positions 4..11 pooled
    assert sorted(i for g in got for i in g.positions) == list(range(4, 12))
    assert [g.weight for g in got] == [1.0, 1.0]  # 4 of a lost share of 4 each


def test_a_spare_entering_with_the_make_up_takes_a_part_and_kept_nothing() -> None:
    new = Generation(1, (10, 14, 12, 13), joiners=(14,))  # spare 14 takes lost rank 1
    plans = [plan_for(3, OLD, new, w) for w in new.members]
    assert all(isinstance(p, Plan) and p.survivors == 4 for p in plans)
    got = parts(lambda i: plans[i], 28)  # shares of 7: rank 1's 7..13 cut 2, 2, 2, 1
    assert [g.positions for g in got] == [[7, 8], [9, 10], [11, 12], [13]]
    assert [g.kept_weight for g in got] == [1.0, 0.0, 1.0, 1.0]  # 14 ran no full pass
    spare = plans[1]
    assert isinstance(spare, Plan) and spare.old_rank == -1


def test_uneven_lost_shares_are_pooled_not_refused() -> None:
    plan = plan_for(3, OLD, Generation(1, (10, 13)), 10)  # ranks 1 and 2 of 4,4,3,3 lost
    assert isinstance(plan, Plan)
    part = plan.part(14)
    assert isinstance(part, Part) and part.positions == [4, 5, 6, 7]  # half of 4..10
    assert (part.weight, part.kept_weight) == (16 / 14, 16 / 14)


def test_cases_the_make_up_cannot_do_exactly_say_why() -> None:
    assert plan_for(3, OLD, OLD, 10) == "no member was lost"
    lone = plan_for(3, OLD, Generation(1, (10, 11, 12)), 10)
    assert isinstance(lone, Plan) and lone.part(4) == \
        "the lost share of 4 is smaller than the 3 members"


def test_an_uneven_full_pass_is_weighed_by_its_share() -> None:
    """--redo lost: every sample weighs 1/n, whatever the live membership; an even share
    keeps DDP's average (no blend at all), and --redo step is DDP's."""
    place = {"rank": 0, "world": 3}
    redo = Redo(True, 10, lambda: (place["rank"], place["world"]))
    redo.start_pass(5)
    assert redo.cut(32, 5) is None and redo.cut(32, 5) is None  # shares 11, 11, 10
    assert redo.blend() == Blend(11 * 3 / 32, None, 3, makeup=False)
    place["rank"] = 2
    redo.start_pass(6)
    assert redo.cut(32) is None and redo.blend() == Blend(10 * 3 / 32, None, 3, makeup=False)
    redo.start_pass(7)
    assert redo.cut(30) is None and redo.blend() is None  # 10 each: the average as it is
    redo.start_pass(8)
    assert redo.cut(32) is None and redo.cut(30) is None
    assert redo.blend() is None  # batches cut unlike each other: averaged per rank
    step_mode = Redo(False, 10, lambda: (0, 3))
    step_mode.start_pass(5)
    assert step_mode.cut(32) is None and step_mode.blend() is None


def test_a_repeated_step_reports_its_whole_batch_and_shard_groups_say_they_repeat(
        capsys: pytest.CaptureFixture[str]) -> None:
    step_mode = Redo(False, 10, lambda: (0, 4))
    step_mode.start_pass(3)
    step_mode.broke(3, OLD, None)
    step_mode.start_pass(3)  # the repeat: a full pass, its batch cut through ft
    assert step_mode.cut(24, 3) is None and step_mode.cut(24, 3) is None
    assert step_mode.committed()[:2] == (48, 1.0)
    assert step_mode.committed() == (0, 0.0, 0.0)  # the next step broke nothing
    sharded = Redo(True, 10, lambda: (0, 4), "--shard-size groups")
    assert not sharded.lost
    sharded.broke(3, OLD, None)
    assert "--redo lost: step 3 is repeated in full (--shard-size groups are not supported" \
        in capsys.readouterr().err


# ------------------------------------------------------------------ the agent (fakes)
def test_a_ready_spare_enters_with_the_make_up() -> None:
    rec, port, store = make(spares=1, redo="lost", nproc=3)
    hello(rec, 0)
    hello(rec, 3, spare=True)
    assert rec.on_exit(exit_(port, 1, -9)) is None
    gen = store.generation()
    assert gen.members == (0, 3, 2) and gen.urgent and gen.joiners == (3,)
    assert "2 redo its share of the step with spare worker 3, which enters now" in gen.reason
    assert rec.membership.role(3) is WorkerRole.HEALING
    recovered(rec, 0)
    assert store.generation().number == gen.number  # nothing enters after it
    assert port.placed[-1][2]  # and the pool is refilled


def test_a_starting_spare_enters_after_the_survivors_commit_the_make_up() -> None:
    rec, port, store = make(spares=1, redo="lost", nproc=3)
    hello(rec, 0)  # spare 3 is still starting
    assert rec.on_exit(exit_(port, 1, -9)) is None
    gen = store.generation()
    assert gen.members == (0, 2) and gen.urgent and gen.joiners == ()
    assert "2 redo its share of the step, spare worker 3 enters after them" in gen.reason
    recovered(rec, 0)
    hello(rec, 3, spare=True)  # ready once the make-up is over: it enters now
    grown = store.generation()
    assert grown.members == (0, 2, 3) and grown.joiners == (3,) and not grown.urgent


def test_a_chosen_spare_that_dies_before_entering_is_followed_by_the_next() -> None:
    """#51: the spare chosen to enter after the make-up died first; the job stayed a rank
    short for good with two ready spares idle."""
    rec, port, store = make(spares=2, redo="lost", nproc=3)
    hello(rec, 0)
    hello(rec, 4, spare=True)  # spare 3 still starting, spare 4 ready
    assert rec.on_exit(exit_(port, 1, -9)) is None  # the ready one enters at once
    assert store.generation().members == (0, 4, 2)
    assert rec.on_exit(exit_(port, 3, -9)) is None  # the starting spare dies: a refill
    rec2, port2, store2 = make(spares=2, redo="lost", nproc=3)
    hello(rec2, 0)  # both spares still starting: the first is chosen to enter later
    assert rec2.on_exit(exit_(port2, 1, -9)) is None
    assert "spare worker 3 enters after them" in store2.generation().reason
    assert rec2.on_exit(exit_(port2, 3, -9)) is None  # it dies before its hello
    recovered(rec2, 0)
    hello(rec2, 4, spare=True)  # the next spare takes the entry
    assert store2.generation().members == (0, 2, 4)


def test_a_chosen_spare_that_dies_with_no_spare_left_brings_a_new_worker() -> None:
    rec, port, store = make(spares=1, redo="lost", nproc=3)
    hello(rec, 0)
    assert rec.on_exit(exit_(port, 1, -9)) is None  # spare 3 still starting: enters later
    placed = len(port.placed)
    assert rec.on_exit(exit_(port, 3, -9)) is None
    assert len(port.placed) == placed  # the new worker waits for the make-up's commit
    recovered(rec, 0)
    joiner = port.placed[-1][0]  # the lost rank's device refills the pool; then the joiner
    assert [p[2] for p in port.placed[placed:]] == [True, False]
    hello(rec, joiner)
    assert store.generation().members == (0, 2, joiner)


def test_without_a_spare_the_new_worker_starts_after_the_make_up() -> None:
    rec, port, store = make(redo="lost", nproc=3)
    hello(rec, 0)
    placed = len(port.placed)
    assert rec.on_exit(exit_(port, 1, -9)) is None
    assert store.generation().members == (0, 2) and len(port.placed) == placed
    recovered(rec, 0)
    assert len(port.placed) == placed + 1  # started now, as a shrink's joiner
    joiner = port.placed[-1][0]
    hello(rec, joiner)
    assert store.generation().members == (0, 2, joiner)


# ------------------------------------------------------------------ real runs
Runs = dict[str, tuple[Path, "subprocess.CompletedProcess[str]"]]
RUNS = {  # name: (script flags, the worker killed and its step[, launcher flags])
    # uneven shares (14 a micro-batch over 4: 4,4,3,3) and accumulation; the last step
    # breaks, and its make-up pools shares of 4 (rank 1's) for 3 survivors
    "uneven": ("--batch", "28", "--accum", "2", "--steps", "6", "--die", "1:5"),
    # even shares: a step in the middle breaks, the replacement enters later
    "even": ("--batch", "24", "--accum", "2", "--steps", "8", "--die", "1:3",
             "--step-time", "0.3"),
    # and a second fault during the make-up: the two survivors redo both lost shares
    "twice": ("--batch", "24", "--accum", "2", "--steps", "6", "--die", "1:3",
              "--die-makeup", "2"),
    # #47: a ready spare takes its part of the make-up (rank 1's 7 of each micro-batch cut
    # 2,2,2,1 over four) and no step runs at 3 (28 over 3 would be 10,9,9); Adam's state
    "spare": ("--batch", "56", "--accum", "2", "--steps", "8", "--die", "1:3",
              "--step-time", "0.2", "--opt", "adam"),
    # #47: no spare: the kill in the first micro-batch (inside no_sync), and the steps at 3
    # before the new worker enters cut 32 into 11,11,10, weighed by size
    "shrunk": ("--batch", "64", "--accum", "2", "--steps", "8", "--die", "2:3",
               "--die-micro", "0", "--step-time", "0.3"),
}
LAUNCH = {"spare": ("--spares", "1")}
SURVIVORS = {"uneven": [0, 2, 3], "even": [0, 2, 3], "twice": [0, 3], "spare": [0, 2, 3],
             "shrunk": [0, 1, 3]}
MAKERS = {**SURVIVORS, "spare": [0, 2, 3, 4]}  # who makes up the lost share: spare 4 too


def second_kill_missed(name: str, out: Path) -> None:
    """The `twice` run's second fault is worker 2 killing itself in a make-up pass; in one
    fresh check of two that pass never ran on it (it finished alive), so the scenario this
    case checks did not happen: reported as xfail, not as a pass (closing note, 2026-12-03)."""
    if name == "twice" and (out / "params_2.pt").exists():
        pytest.xfail("the second fault did not fire: worker 2 ran no make-up pass")


def trail(out: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(out.glob("trail_*.jsonl"))
            for line in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Both fault runs side by side, and each one's fault-free reference (one process)."""
    def one(name: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
        out = tmp_path_factory.mktemp(name)
        flags = RUNS[name]
        ref = subprocess.run([sys.executable, LOOP, "--simulate", "4", "--out", str(out),
                              *flags], capture_output=True, text=True, timeout=120)
        assert ref.returncode == 0, ref.stderr
        r = run_ftrun("--nproc", "4", "--redo", "lost", *LAUNCH.get(name, ()), "--log-dir",
                      str(out / "logs"), LOOP, "--out", str(out), *flags, timeout=240)
        return out, r

    with ThreadPoolExecutor(3) as pool:  # 4-5 processes each, on 2 cores
        return dict(zip(RUNS, pool.map(one, RUNS), strict=True))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(RUNS))
def test_the_make_up_commits_the_step_of_the_fault_free_run(runs: Runs, name: str) -> None:
    out, r = runs[name]
    assert r.returncode == 0, r.stderr
    second_kill_missed(name, out)
    assert "3 redo its share of the step" in r.stderr
    ref = torch.load(out / "params_ref.pt")
    finals = {int(p.stem.split("_")[1]): torch.load(p) for p in out.glob("params_[0-9]*.pt")}
    lost = {1, 2} - set(SURVIVORS[name])
    assert set(SURVIVORS[name]) <= set(finals) and not lost & set(finals)
    for params in finals.values():
        for key, value in params.items():
            torch.testing.assert_close(value, ref[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(RUNS))
def test_every_sample_of_every_step_is_used_exactly_once(runs: Runs, name: str) -> None:
    out, r = runs[name]
    assert r.returncode == 0, r.stderr
    second_kill_missed(name, out)
    flags = dict(zip(RUNS[name][::2], RUNS[name][1::2], strict=True))
    survivors = SURVIVORS[name]
    steps, broken = int(flags["--steps"]), int(flags["--die"].split(":")[1])
    loader = Loader(list(range(512)), int(flags["--batch"]), seed=0)
    passes = trail(out)
    for step in range(steps):
        mine = [p for p in passes if p["step"] == step]
        makeups = [p for p in mine if p["makeup"] is not None]
        used = [i for p in mine if p["ok"] for i in p["indices"]]
        if step == broken:  # the survivors' kept pass, then their parts of the lost share
            done = [p for p in makeups if p["ok"]]
            assert sorted(p["wid"] for p in done) == MAKERS[name]
            used += [i for p in mine if not p["ok"] and p["makeup"] is None
                     and p["wid"] in survivors for i in p["indices"]]
        else:
            assert not makeups and all(p["ok"] for p in mine)
        assert sorted(used) == sorted(loader.indices(step)), step
    lost = [w for w in range(4) if w not in survivors]
    lost_share = sum(len(loader.share_of(broken, 0, 2, w, 4)) for w in lost) * 2  # 2 micros
    made_up = [p["makeup"] for p in passes if p["makeup"] and p["ok"]]
    samples = sorted(m["samples"] for m in made_up)
    assert sum(samples) == lost_share and samples[-1] - samples[0] <= 2
    assert all(m["lost_workers"] == lost and m["world_size"] == 4 and m["step"] == broken
               for m in made_up)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_recovery_reports_the_work_it_redid(runs: Runs) -> None:
    out, r = runs["uneven"]
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in
              next((out / "logs").glob("*/events.jsonl")).read_text().splitlines()]
    (first, *_) = [e for e in events if e["event"] == "recovered" and e["generation"] == 1]
    assert first["redone_samples"] == 8  # the lost rank's 4 of each of two micro-batches
    assert first["redone_fraction"] == pytest.approx(8 / 28, abs=1e-4)
    rep = run_ftrun("report", str(out / "logs"), "--json")
    assert rep.returncode == 0, rep.stderr
    (redone,) = [x for x in json.loads(rep.stdout)["redone"] if x["generation"] == 1]
    assert (redone["samples"], redone["step"]) == (8, 5)
    assert redone["seconds"] > 0 and first["redone_s"] == redone["seconds"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_report_counts_the_steps_run_short_handed(runs: Runs) -> None:
    """#47: without a spare, the steps between the make-up and the new worker's entry ran at
    3 of 4; with a ready spare entering with the make-up, none did."""
    counts = {}
    for name in ("shrunk", "spare"):
        out, r = runs[name]
        assert r.returncode == 0, r.stderr
        rep = run_ftrun("report", str(out / "logs"), "--json")
        assert rep.returncode == 0, rep.stderr
        (fault,) = json.loads(rep.stdout)["faults"]
        passes = trail(out)
        short = {p["step"] for p in passes if p["ok"] and p["world"] < 4 and not p["makeup"]}
        counts[name] = (fault["short_steps"], len(short))
        assert fault["redone_s"] > 0
    assert counts["spare"] == (0, 0)
    assert counts["shrunk"][0] == counts["shrunk"][1] > 0, counts
    assert "step" in runs["shrunk"][1].stderr.split("short-handed")[0].rsplit(";", 1)[-1]
