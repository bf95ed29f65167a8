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
from ftrun.worker.makeup import Plan, Redo, plan_for

LOOP = str(FIXTURES / "redo_loop.py")
OLD = Generation(0, (10, 11, 12, 13))


# ------------------------------------------------------------------ the plan (pure)
def parts(plan_of: Any, n: int) -> list[tuple[list[int], float]]:
    got = [plan_of(i).part(n) for i in range(plan_of(0).survivors)]
    assert all(not isinstance(p, str) for p in got), got
    return got


def test_the_lost_share_is_split_among_the_survivors_in_their_new_order() -> None:
    new = Generation(1, (13, 10, 12))  # rank 1 (worker 11) lost; the survivors' new order
    plans = {w: plan_for(3, OLD, new, w) for w in new.members}
    assert all(isinstance(p, Plan) and p.lost_ranks == (1,) and p.lost_workers == (11,)
               and p.world_size == 4 and p.survivors == 3 for p in plans.values())
    by_index = {p.index: p for p in plans.values() if isinstance(p, Plan)}
    got = parts(by_index.__getitem__, 14)  # shares 4,4,3,3: rank 1 held positions 4..7
    assert [g[0] for g in got] == [[4, 5], [6], [7]]
    assert [g[1] for g in got] == [0.5, 0.25, 0.25]  # each part over one lost share


def test_a_second_fault_recomputes_the_shares_from_what_is_left() -> None:
    newer = Generation(2, (10, 13))  # 11 lost first, then 12 during the make-up
    plans = [plan_for(3, OLD, newer, w) for w in newer.members]
    assert all(isinstance(p, Plan) and p.lost_ranks == (1, 2) for p in plans)
    got = parts(lambda i: plans[i], 16)  # shares of 4: positions 4..11 pooled
    assert sorted(i for g in got for i in g[0]) == list(range(4, 12))
    assert [g[1] for g in got] == [1.0, 1.0]  # 4 of a lost share of 4 each


def test_cases_the_make_up_cannot_do_exactly_say_why() -> None:
    assert plan_for(3, OLD, Generation(1, (10, 12, 13, 14)), 10) == \
        "worker 14 joined in generation 1"
    assert plan_for(3, OLD, OLD, 10) == "no member was lost"
    plan = plan_for(3, OLD, Generation(1, (10, 13)), 10)
    assert isinstance(plan, Plan)
    assert plan.part(14) == "the lost ranks' shares of 14 differ in size"  # 4 and 3
    assert plan.part(4) == ([1], 1.0) or plan.part(4) == ([2], 1.0)  # 1 of each lost rank
    lone = plan_for(3, OLD, Generation(1, (10, 11, 12)), 10)
    assert isinstance(lone, Plan) and lone.part(4) == \
        "the lost share of 4 is smaller than the 3 survivors"


def test_a_repeated_step_reports_its_whole_batch_and_shard_groups_say_they_repeat(
        capsys: pytest.CaptureFixture[str]) -> None:
    step_mode = Redo(False, 10)
    step_mode.start_pass(3)
    step_mode.broke(3, OLD, None)
    step_mode.start_pass(3)  # the repeat: a full pass, its batch cut through ft
    assert step_mode.cut(24, 3) is None and step_mode.cut(24, 3) is None
    assert step_mode.committed() == (48, 1.0)
    assert step_mode.committed() == (0, 0.0)  # the next step broke nothing
    sharded = Redo(True, 10, "--shard-size groups")
    assert not sharded.lost
    sharded.broke(3, OLD, None)
    assert "--redo lost: step 3 is repeated in full (--shard-size groups are not supported" \
        in capsys.readouterr().err


# ------------------------------------------------------------------ the agent (fakes)
def test_a_spare_enters_after_the_survivors_commit_the_make_up() -> None:
    rec, port, store = make(spares=1, redo="lost", nproc=3)
    hello(rec, 0)
    hello(rec, 3, spare=True)
    assert rec.on_exit(exit_(port, 1, -9)) is None
    gen = store.generation()
    assert gen.members == (0, 2) and gen.urgent and gen.joiners == ()
    assert "2 redo its share of the step, spare worker 3 enters after them" in gen.reason
    assert rec.membership.role(3) is WorkerRole.SPARE  # not called in during the make-up
    recovered(rec, 0)
    grown = store.generation()
    assert grown.members == (0, 2, 3) and grown.joiners == (3,) and not grown.urgent
    assert port.placed[-1][2]  # and the pool is refilled


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
RUNS = {  # name: (script flags, the worker killed and its step)
    # uneven shares (14 a micro-batch over 4: 4,4,3,3) and accumulation; the last step
    # breaks, so no step runs at 3 (its uneven shares would weigh samples otherwise)
    "uneven": ("--batch", "28", "--accum", "2", "--steps", "6", "--die", "1:5"),
    # even shares: a step in the middle breaks, the replacement enters later
    "even": ("--batch", "24", "--accum", "2", "--steps", "8", "--die", "1:3",
             "--step-time", "0.3"),
    # and a second fault during the make-up: the two survivors redo both lost shares
    "twice": ("--batch", "24", "--accum", "2", "--steps", "6", "--die", "1:3",
              "--die-makeup", "2"),
}
SURVIVORS = {"uneven": [0, 2, 3], "even": [0, 2, 3], "twice": [0, 3]}


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
                              *flags[:6]], capture_output=True, text=True, timeout=120)
        assert ref.returncode == 0, ref.stderr
        r = run_ftrun("--nproc", "4", "--redo", "lost", "--log-dir", str(out / "logs"),
                      LOOP, "--out", str(out), *flags, timeout=240)
        return out, r

    with ThreadPoolExecutor(len(RUNS)) as pool:
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
            assert sorted(p["wid"] for p in done) == survivors
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
