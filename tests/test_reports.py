"""What the launcher reports after faults: summary figures, restarts, root causes, hints."""
import os
import subprocess
import sys

from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for

from ftrun.adapters.report import hint_for
from ftrun.agent.journal import FaultRecord, Journal, summarize

BEHAVE = str(FIXTURES / "behave.py")


def test_overlapping_recoveries_are_not_counted_twice() -> None:
    recs = [FaultRecord(id=1, kind="kill", worker=1, rank=1, at=100.0, recovery_ms=500.0),
            FaultRecord(id=2, kind="kill", worker=2, rank=2, at=100.1, recovery_ms=400.0),
            FaultRecord(id=3, kind="kill", worker=2, rank=2, at=110.0, recovery_ms=250.0)]
    s = summarize(recs, run_seconds=75.0)
    assert (s["time_lost_s"], s["goodput"]) == (0.75, 0.99)


def test_a_restart_counts_its_downtime_and_the_steps_it_recomputes() -> None:
    seen: list[str] = []
    j = Journal(lambda kind, f: seen.append(kind))
    j.emit("started", {"attempt": 0})
    j.emit("fault", {"worker": 0, "rank": 0, "why": "exited with 1", "decision": "restart-group",
                     "reason": "r", "committed_before": 41})
    j.emit("restart", {"attempt": 1, "reason": "r"})
    j.emit("started", {"attempt": 1})
    (rec,) = j.faults
    assert rec.recovered and rec.decision == "restart-group" and rec.lost_steps == 41
    assert rec.lost_from is not None and j.started_at <= rec.lost_from <= rec.at
    assert rec.recovery_ms is not None
    assert rec.phases_ms["restarted"] == rec.recovery_ms >= 0
    s = summarize(j.faults, run_seconds=1000.0)
    assert s["recovered"] == 1 and s["lost_steps"] == 41
    assert s["time_lost_s"] >= round(rec.at - rec.lost_from, 3)  # the attempt's work is redone


def test_a_plain_scripts_failure_is_a_fault_record_answered_by_the_restart() -> None:
    j = Journal(lambda kind, f: None)
    j.emit("failure", {"reason": "rank 1 exited with 3; restarting", "rank": 1})
    j.emit("restart", {"attempt": 1, "reason": "r"})
    j.emit("started", {"attempt": 1})
    (rec,) = j.faults
    assert (rec.kind, rec.decision, rec.recovered, rec.lost_steps) == (
        "failure", "restart-group", True, 0)
    assert rec.lost_from is None  # a plain script's own checkpoints decide what is redone


def test_one_fault_has_one_origin_the_generations_fault_time() -> None:
    """A lost node (or a coordinator taken over) is detected after it was last seen: the
    generation counts from the last sign of life, and so do the workers' phases; the fault
    record and the summary count from there too, not from the detection."""
    import io

    from ftrun.cli.render import notice

    j = Journal(lambda kind, f: None)
    j.emit("fault", {"worker": 1, "rank": 1, "why": "node 0 lost", "decision": "replace",
                     "reason": "r", "detected_at": 1000.5})
    j.emit("generation", {"generation": 4, "world_size": 2, "reason": "r", "urgent": True,
                          "published_at": 1000.6})
    recovered = {"worker": 2, "generation": 4, "fault_at": 1000.2, "published_at": 1000.6,
                 "noticed": 1000.62, "rebuilt": 1000.7, "healed": 0.0, "step": 80,
                 "first_commit": 1000.764}
    j.emit("recovered", recovered)
    (rec,) = j.faults
    assert rec.at == 1000.2 and rec.phases_ms["detected"] == 300.0
    assert rec.phases_ms["published"] == 400.0 and rec.recovery_ms == 564.0
    assert summarize(j.faults, 100.0)["p50_ms"] == 564.0
    shown = io.StringIO()
    notice("recovered", recovered, shown)
    assert shown.getvalue().rstrip().endswith("committed +564)"), shown.getvalue()


def test_no_oom_hint_for_a_signal_ftrun_sent() -> None:
    assert "OOM" in hint_for(-9, False)
    hint = hint_for(-9, False, "kill")
    assert "ftrun sent this signal itself" in hint and "OOM killer" in hint.split("not ")[-1]


def test_restarts_show_in_the_summary_with_their_cost(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", "--max-restarts", "3", BEHAVE, "--exit-rank", "0:5",
                  "--fail-attempts", "2", "--sleep", "0.2")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "survived" in ln)
    assert "survived 2/2 faults (2 by restarting every worker)" in line
    assert "goodput 1.00" not in line and "time lost 0.0 s" not in line


def test_a_drill_kill_is_not_blamed_on_the_oom_killer(private_run_dir) -> None:
    job = subprocess.Popen(ftrun_cmd("--nproc", "2", BEHAVE, "--sleep", "60"),
                           env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def injected() -> bool:
            r = subprocess.run([sys.executable, "-m", "ftrun", "inject-fault", "--rank", "1",
                                "--kind", "kill"], capture_output=True, text=True, timeout=60)
            return r.returncode == 0  # refused while the job still starts its workers
        wait_for(injected, 30, "the drill to reach the job")
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 1
    report = err[err.index("Root cause"):]
    assert "exitcode  : -9 (SIGKILL)" in report
    assert "ftrun sent this signal itself (a 'kill' fault drill or detector)" in report
    assert "most often the kernel's OOM killer" not in report


def test_the_root_cause_is_the_first_failure_observed_not_the_last() -> None:
    from ftrun.adapters.report import WorkerExit, failure_block

    first = WorkerExit(rank=1, local_rank=1, pid=11, returncode=3, detected_at=10.0,
                       wall_time=1e9)
    stopped = WorkerExit(rank=2, local_rank=2, pid=12, returncode=-15, detected_at=15.0,
                         wall_time=1e9, killed_by_launcher=True)
    last = WorkerExit(rank=0, local_rank=0, pid=10, returncode=-9, detected_at=20.0,
                      wall_time=1e9)
    lines = failure_block("t.py", last, (first, stopped, last), 0, 0, None)
    root = lines.index("Root cause (first observed failure):")
    assert lines[root + 3] == "  rank      : 1 (local_rank: 1)"
    ended = lines.index("The job ended on:")
    assert lines[ended + 1] == "  rank 0 (local_rank 0, pid 10): exit -9 (SIGKILL)"
    assert lines[lines.index("Other workers:") + 1:-1] == [
        "  rank 2 (local_rank 2, pid 12): terminated by launcher"]
    alone = failure_block("t.py", last, (stopped, last), 0, 0, None)
    assert "The job ended on:" not in alone and "  rank      : 0 (local_rank: 0)" in alone


def test_a_run_that_ended_mid_recovery_is_not_summed_up_as_survived(capsys,
                                                                    monkeypatch) -> None:
    import time

    from ftrun.cli.render import print_run_summary

    now = time.time()
    # the summary's clock stands still, 10 ms past now: the time lost no longer depends on
    # how long this test took to get there (2.103 s once, and goodput 0.89, not 0.90)
    monkeypatch.setattr(time, "time", lambda: now + 0.01)
    done = FaultRecord(id=1, kind="kill", worker=0, rank=0, at=now - 10, decision="replace",
                       recovered=True, recovery_ms=100.0)
    open_ = FaultRecord(id=2, kind="kill", worker=1, rank=1, at=now - 2, decision="replace")
    print_run_summary([done, open_], 20.0, ended="failed")
    out = capsys.readouterr().err
    assert out.startswith("ftrun: recovered 1 of 2 faults; the job failed before fault #2 "
                          "(kill, rank 1) recovered, 2.0 s after it;"), out
    assert "survived" not in out and "goodput 1.00" not in out
    # 0.1 s + 2 s since the open fault (+ the 10 ms the clock stands at past it)
    assert "time lost 2.11 s; goodput 0.89" in out, out
    print_run_summary([open_], 20.0, ended="was interrupted")
    assert "recovered 0 of 1 faults; the job was interrupted before fault #2" in \
        capsys.readouterr().err
    print_run_summary([done], 20.0, ended="")
    assert capsys.readouterr().err.startswith("ftrun: survived 1/1 faults")


def test_the_summary_says_how_much_work_the_recoveries_redid(capsys) -> None:
    from ftrun.cli.render import print_run_summary

    def fault(i: int, redone: int | None, fraction: float | None) -> FaultRecord:
        return FaultRecord(id=i, kind="kill", worker=i, rank=i, at=100.0 + i,
                           decision="replace", recovered=True, recovery_ms=100.0,
                           redone_samples=redone, redone_fraction=fraction)

    print_run_summary([fault(1, 8, 0.2857), fault(2, -1, None), fault(3, 4, 0.1429)], 20.0)
    assert "max 100 ms; redone 12 samples (0.43 of a step); time lost" in \
        capsys.readouterr().err
    print_run_summary([fault(1, None, None)], 20.0)
    assert "redone" not in capsys.readouterr().err
