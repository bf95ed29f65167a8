"""Hangs are judged by progress, not CPU: the pure rule, the progress slot, and real jobs.

Real jobs (marked slow) run tests/fixtures/hang_train.py on 3 gloo workers with
--hang-timeout 2: a rank spinning in `while True: pass`, a SIGSTOPped rank, a rank deadlocked
on a threading.Lock, every rank stuck in one collective (a communicator rebuild), a rank whose
step time varies 5x (no detection) and a long phase longer than the timeout (no detection).
Each ends with the job finishing; in replace mode every replica is bitwise equal to a
fault-free run's."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for
from jobstatus import job_status
from replicas import bitwise_equal, params

from ftrun.agent.journal import Journal
from ftrun.core.policy import (
    HANG_MIN_S,
    HANG_WARMUP_S,
    Liveness,
    find_hang,
    hang_timeout,
    replace_after_rebuild,
)
from ftrun.protocol.progress import FIELDS, NAMES, SIZE, WARMUP_STEPS, Progress, Reporter, Slot, p95


def live(worker: int, **kw: object) -> Liveness:
    base: dict[str, object] = dict(worker=worker, rank=worker, step=10, idle_s=0.1,
                                   waiting_s=None, stopped=False, compute_s=0.1, step_s=0.2,
                                   generation=3, phase="step", collective=0)
    base.update(kw)
    return Liveness(**base)  # type: ignore[arg-type]


def waiting(worker: int, s: float, step: int = 10, n: int = 1) -> Liveness:
    return live(worker, idle_s=s, waiting_s=s, phase="collective", step=step, collective=n)


# ------------------------------------------------------------------ the rule
def test_a_busy_rank_its_peers_wait_for_is_hung_whatever_its_cpu() -> None:
    spinning = [waiting(0, 2.5), live(1, idle_s=2.7), waiting(2, 2.5)]
    h = find_hang(spinning, 2.0)
    assert h is not None and h.worker == 1
    assert "in step 10's own code" in h.reason and "2 of its peers wait for it" in h.reason
    assert "collective 1 of step 10" in h.reason


def test_no_hang_before_the_timeout_on_either_side() -> None:
    assert find_hang([waiting(0, 1.9), live(1, idle_s=5.0)], 2.0) is None  # peers just came
    assert find_hang([waiting(0, 2.5), live(1, idle_s=1.5)], 2.0) is None  # it just moved
    assert find_hang([live(0), live(1), live(2)], 2.0) is None


def test_a_rank_behind_by_a_phase_is_blamed_wherever_it_is() -> None:
    # past step 10's all-reduce, stuck in the optimizer or in user code between steps
    opt = [waiting(0, 3, step=11), live(1, idle_s=3, phase="optimizer", collective=1)]
    assert find_hang(opt, 2.0).worker == 1  # type: ignore[union-attr]
    user = [waiting(0, 3, step=11), live(1, idle_s=3, phase="user", step=11)]
    h = find_hang(user, 2.0)
    assert h is not None and h.worker == 1 and "in user code before step 11" in h.reason


def test_a_rank_waiting_in_the_same_collective_is_never_blamed() -> None:
    two_waiting = [waiting(0, 3), waiting(1, 3), live(2, idle_s=1.0)]
    assert find_hang(two_waiting, 2.0) is None  # rank 2 is on its way


def test_long_phases_and_recovery_pause_the_detector() -> None:
    evaluating = [waiting(0, 60), live(1, idle_s=60, phase="long", label="eval"), waiting(2, 60)]
    assert find_hang(evaluating, 2.0) is None  # and no rebuild: rank 1 is not in the collective
    healing = [waiting(0, 60), live(1, idle_s=60, phase="recovering")]
    assert find_hang(healing, 2.0) is None
    stopped_in_eval = [waiting(0, 9), live(1, idle_s=9, phase="long", stopped=True)]
    assert find_hang(stopped_in_eval, 2.0) is None


def test_a_stopped_rank_is_hung_with_or_without_waiting_peers() -> None:
    h = find_hang([live(0), live(1, idle_s=2.5, stopped=True, phase="collective",
                                  waiting_s=2.5, collective=1)], 2.0)
    assert h is not None and h.worker == 1 and "is stopped" in h.reason


def test_every_rank_in_one_collective_is_a_stuck_communicator() -> None:
    h = find_hang([waiting(i, 2.5) for i in range(3)], 2.0)
    assert h is not None and h.worker is None and "collective 1 of step 10" in h.reason
    assert "rebuilding the communicator" in h.reason
    skipped = [waiting(0, 3), waiting(1, 3, step=11), waiting(2, 3)]
    assert find_hang(skipped, 2.0).worker == 1  # type: ignore[union-attr]


def test_a_lone_rank_is_hung_when_it_makes_no_progress() -> None:
    h = find_hang([live(0, idle_s=2.5)], 2.0)
    assert h is not None and h.worker == 0 and "no peer" in h.reason
    assert find_hang([live(0, idle_s=2.5, phase="long")], 2.0) is None
    # one visible member of a generation of three: the others are on their way, no verdict
    assert find_hang([live(0, idle_s=2.5)], 2.0, world_size=3) is None


def test_a_slow_rank_is_no_hang() -> None:
    # a 5x slower rank keeps its peers waiting five steps' worth, far below ten p95 steps
    rows = [waiting(0, 0.4, step=7), live(1, idle_s=0.5, step_p95_s=0.5), waiting(2, 0.4, step=7)]
    assert find_hang(rows, hang_timeout(rows, None)) is None


def test_hang_timeout_rule() -> None:
    rows = [live(0, step_p95_s=0.15), live(1, step_p95_s=0.6)]
    assert hang_timeout(rows, 2.0) == 2.0 and hang_timeout(rows, 0.5) == 0.5  # exactly
    assert hang_timeout(rows, None) == HANG_MIN_S  # 10 x 0.6 s is below the minimum
    assert hang_timeout([live(0, step_p95_s=3.0)], None) == 30.0
    assert hang_timeout([live(0), live(1)], None) == HANG_WARMUP_S  # nothing measured yet


def test_after_a_failed_rebuild_the_ranks_are_replaced() -> None:
    rows = [live(0, generation=4), live(1, generation=3), live(2, generation=4)]
    out, why = replace_after_rebuild(rows, 4)
    assert out == (1,) and "never reached it: replacing rank 1" in why
    again = [live(i, generation=4) for i in range(3)]
    out, why = replace_after_rebuild(again, 4)
    assert out == (1, 2) and "rank 0 stays as the replica" in why
    out, _ = replace_after_rebuild(again, 4, frozenset({0}))
    assert out == (0, 2)  # kept in an earlier round and still stuck: another one stays
    out, why = replace_after_rebuild([live(0, generation=3), live(1, generation=3)], 4)
    assert out == (0, 1) and "reached by no member" in why


# ------------------------------------------------------------------ the progress slot
def test_layout_is_one_table() -> None:
    assert [f for f in Progress.__dataclass_fields__] == list(NAMES)
    assert SIZE % 8 == 0 and len(FIELDS) == len(NAMES)


def test_reporter_marks_where_the_worker_is(tmp_path: Path) -> None:
    rep = Reporter(str(tmp_path), 7)
    agent = Slot(str(tmp_path / "7"), create=False)
    agent.write_drill(5, "spin", 3, 0.0)
    rep.step_started(3, 1, 2, 100.0)
    p = agent.read()
    assert (p.step, p.rank, p.generation, p.phase, p.phase_started) == (3, 1, 2, "step", 100.0)
    rep.collective_started(100.5)
    p = agent.read()
    assert (p.phase, p.collective, p.collective_started, p.compute_time) == (
        "collective", 1, 100.5, 0.5)
    rep.optimizer(100.7)
    assert agent.read().phase == "optimizer" and agent.read().collective_started == 0.0
    rep.committed(4, 1, 2, 100.8)
    p = agent.read()
    assert (p.step, p.phase, p.last_commit, p.collective) == (4, "user", 100.8, 0)
    rep.long_phase_entered("eval", 101.0)
    rep.long_phase_entered("a nested one, with a name longer than the slot holds", 101.5)
    rep.step_started(4, 1, 2, 102.0)  # inside a long phase: the phase stays long
    p = agent.read()
    assert p.phase == "long" and p.label.startswith("a nested one") and p.phase_started == 101.0
    rep.long_phase_left(103.0)
    assert agent.read().label == "eval"
    rep.long_phase_left(104.0)
    p = agent.read()
    assert (p.phase, p.label, p.phase_started) == ("step", "", 104.0)
    rep.recovering(105.0, 0, 3)  # out of the old collective, switching to generation 3
    p = agent.read()
    assert (p.phase, p.rank, p.generation, p.step) == ("recovering", 0, 3, 4)
    assert rep.due_drill(3) == ("spin", 0.0) and rep.due_drill(3) is None  # drills intact


def test_p95_is_published_after_the_warm_up(tmp_path: Path) -> None:
    rep = Reporter(str(tmp_path), 0)
    t = 0.0
    for step in range(WARMUP_STEPS + 20):
        rep.step_started(step, 0, 0, t)
        t += 30.0 if step == 0 else 0.1  # a first-step compile
        rep.committed(step + 1, 0, 0, t)
        if step + 1 < WARMUP_STEPS:
            assert rep.slot.read().step_p95 == 0.0
    assert rep.slot.read().step_p95 == pytest.approx(0.1)
    assert p95([1.0] * 19 + [50.0]) == 50.0 and p95([1.0] * 21 + [50.0]) == 1.0


def test_status_document_fields_are_json(tmp_path: Path) -> None:
    from dataclasses import asdict

    row = live(0, label="eval", phase="long")
    assert Liveness(**json.loads(json.dumps(asdict(row)))) == row  # the heartbeat payload


# ------------------------------------------------------------------ the journal
def fault(worker: int, decision: str, at: float) -> dict[str, object]:
    return {"worker": worker, "rank": max(worker, 0), "why": "comm" if worker < 0 else "exit",
            "decision": decision, "reason": "r", "detected_at": at}


def test_a_rebuild_takes_the_stall_drills_it_answers() -> None:
    """stall and wedge drills end in a rebuild, which names no worker: it takes them, so the
    worker's next fault is not mislabelled. A drill of another kind stays pending."""
    j = Journal(lambda kind, fields: None)
    j.drill_injected(1, "stall", 100.0)
    j.drill_injected(0, "wedge", 100.5)
    j.drill_injected(2, "hang", 101.0)  # a SIGSTOP: the detector's kill answers it
    j.emit("fault", fault(-1, "rebuild", 103.0))
    j.emit("fault", fault(-1, "rebuild", 110.0))  # no drill left for this one
    j.drill_injected(1, "kill", 200.0)
    j.emit("fault", fault(1, "replace", 200.5))
    j.emit("fault", fault(0, "replace", 201.0))
    j.emit("fault", fault(2, "replace", 202.0))
    assert [(r.kind, r.worker, r.injected, r.phases_ms["detected"]) for r in j.faults] == [
        ("stall", -1, True, 3000.0), ("comm", -1, False, 0.0), ("kill", 1, True, 500.0),
        ("exit", 0, False, 0.0), ("hang", 2, True, 101_000.0)]


# ------------------------------------------------------------------ real jobs
SCRIPT = str(FIXTURES / "hang_train.py")
# 80: the last drill (step 35) leaves ~4.5 s of training (less when a replacement is slow to
# come: a job that must still answer `ftrun status` after it holds at its end, --hold)
STEPS = ("--steps", "80")


def all_equal_to(out: Path, reference: dict[str, torch.Tensor], workers: list[int]) -> None:
    ps = params(out)
    assert sorted(ps) == workers
    assert all(bitwise_equal(p, reference) for p in ps.values())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ref")
    r = run_ftrun("--nproc", "3", SCRIPT, "--out", str(out), *STEPS, timeout=150)
    assert r.returncode == 0, r.stderr
    ps = params(out)
    assert sorted(ps) == [0, 1, 2] and bitwise_equal(ps[0], ps[1]) and bitwise_equal(ps[0], ps[2])
    return ps[0]


@pytest.mark.slow
def test_spinning_stopped_and_deadlocked_ranks_are_replaced(reference, tmp_path: Path) -> None:
    """One run, three hangs in turn: each rank is found by progress alone and replaced."""
    r = run_ftrun("--nproc", "3", "--hang-timeout", "2", SCRIPT, "--out", str(tmp_path),
                  *STEPS, "--fault", "spin:1:10", "--fault", "stop:2:25",
                  "--fault", "lock:0:40:after", timeout=240)
    assert r.returncode == 0, r.stderr
    hangs = [ln for ln in r.stderr.splitlines() if ln.startswith("ftrun: hang:")]
    assert len(hangs) == 3, r.stderr
    assert "rank 1 made no progress" in hangs[0] and "in step 10's own code" in hangs[0]
    assert "collective 1 of step 10; killing worker 1" in hangs[0]
    assert "rank 2 is stopped" in hangs[1] and "killing worker 2" in hangs[1]
    assert "rank 0 made no progress" in hangs[2] and "in user code before step 41" in hangs[2]
    assert "survived 3/3 faults" in r.stderr
    all_equal_to(tmp_path, reference, [3, 4, 5])


def start_job(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(ftrun_cmd(*args), env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def status() -> dict:
    return job_status(os.environ.copy()) or {}


def by_rank(doc: dict) -> dict[int, dict]:
    return {w["rank"]: w for w in doc.get("workers", []) if w["role"] == "member"}


@pytest.mark.slow
def test_a_slow_rank_and_a_long_phase_are_no_hang(reference, tmp_path: Path,
                                                  private_run_dir: Path) -> None:
    """Default timeout, derived from step times; rank 1's step time varies 5x at random and
    rank 0 spends 14 s in `ft.long_phase("eval")` while its peers wait for it."""
    out = tmp_path / "o"
    out.mkdir()
    job = start_job("--nproc", "3", SCRIPT, "--out", str(out), *STEPS, "--vary", "1:5",
                    "--long", "0:40:14")
    try:
        def peers_waited_past_the_timeout() -> dict:
            doc = status()
            ws = by_rank(doc)
            timeout = doc.get("hang_timeout_s") or 1e9
            return doc if len(ws) == 3 and ws[0]["phase"] == "in long phase 'eval'" and all(
                ws[r]["phase"] == "in collective 1 of step 41" and
                ws[r]["since_progress_s"] > timeout + 0.5 for r in (1, 2)) else {}

        doc = wait_for(peers_waited_past_the_timeout, 60, "peers waiting past the timeout")
        assert 10.0 <= doc["hang_timeout_s"] < 300  # derived from measured step times
        assert doc["faults"] == []
        assert job.wait(120) == 0
    finally:
        if job.poll() is None:
            job.kill()
        _, err = job.communicate(timeout=60)
    assert "ftrun: hang:" not in err and "survived" not in err, err
    all_equal_to(out, reference, [0, 1, 2])


@pytest.mark.slow
def test_a_stuck_communicator_is_rebuilt_then_its_ranks_replaced(
        reference, tmp_path: Path, private_run_dir: Path) -> None:
    """stall: rank 1's collective never completes (every rank waits in it) until the
    communicator is rebuilt. wedge: rank 2's thread never comes back from it, so the rebuilt
    communicator is stuck too and rank 2 is replaced."""
    out, hold = tmp_path / "o", tmp_path / "hold"
    out.mkdir()
    job = start_job("--nproc", "3", "--hang-timeout", "2", SCRIPT, "--out", str(out), *STEPS,
                    "--step-time", "0.1", "--hold", str(hold))
    try:
        def stepping() -> bool:
            doc = status()
            ws = by_rank(doc)
            return bool(doc.get("ft_api")) and len(ws) == 3 and all(
                (w["step"] or 0) > 3 for w in ws.values())

        wait_for(stepping, 60, "3 workers stepping")
        pids = {r: w["pid"] for r, w in by_rank(status()).items()}
        r = ftrun_out("inject-fault", "--rank", "1", "--kind", "stall", "--at-step", "15")
        assert r.returncode == 0, r.stdout + r.stderr
        doc = status()
        rebuild = doc["faults"][-1]
        assert rebuild["decision"] == "rebuild" and rebuild["recovered"]
        assert "every rank has waited" in rebuild["reason"]
        assert {r: w["pid"] for r, w in by_rank(doc).items()} == pids  # nobody replaced
        r = ftrun_out("inject-fault", "--rank", "2", "--kind", "wedge", "--at-step", "35")
        assert r.returncode == 0, r.stdout + r.stderr
        faults = status()["faults"]  # the job holds after its last step until `hold`
        assert [f["decision"] for f in faults] == ["rebuild", "rebuild", "replace"]
        assert [f["kind"] for f in faults] == ["stall", "wedge", "hang"]  # the detector's
        assert faults[-1]["rank"] == 2
        hold.touch()
        assert job.wait(120) == 0
    finally:
        if job.poll() is None:
            job.kill()
        _, err = job.communicate(timeout=60)
    assert "never reached it: replacing rank 2" in err, err
    all_equal_to(out, reference, [0, 1, 3])


def ftrun_out(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ftrun_cmd(*args), capture_output=True, text=True, timeout=180,
                          env=os.environ.copy())
