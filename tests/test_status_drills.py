"""`ftrun status` and `ftrun inject-fault`: argument handling, rendering, and drills against a
real running job (gloo, CPU)."""
import json
import os
import stat
import subprocess
import time

import pytest
from conftest import FIXTURES, ftrun_cmd, wait_for
from jobstatus import job_status
from statusdocs import fault, status, worker

from ftrun.agent.journal import FaultRecord, Journal, summarize
from ftrun.cli.main import main
from ftrun.protocol.status import Status


@pytest.fixture(autouse=True)
def _own_run_dir(private_run_dir):
    """Every test here sees only its own jobs."""


def ftrun_out(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ftrun_cmd(*args), capture_output=True, text=True, timeout=60,
                          env=os.environ.copy())


def test_status_with_no_job(capsys) -> None:
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert err == ("ftrun: error: no ftrun job is running for this user "
                   "(start one with `ftrun --nproc N script.py`)\n")


@pytest.mark.parametrize("argv, needle", [
    (["inject-fault", "--kind", "kill"], "exactly one of --rank, --gpu or --node"),
    (["inject-fault", "--kind", "kill", "--rank", "0", "--gpu", "1"], "exactly one of"),
    (["inject-fault", "--kind", "melt", "--rank", "0"], "unknown fault kind 'melt'"),
    (["inject-fault", "--rank", "0"], "Missing option '--kind'"),
    (["inject-fault", "--kind", "kill", "--rank", "0", "--count", "3"], "needs --every"),
    (["status", "--bogus"], "No such option: --bogus"),
    (["inject-fault", "--kind", "net-down", "--rank", "0"], "--kind net-down takes --node K"),
    (["inject-fault", "--kind", "kill", "--node", "1"], "--node takes --kind net-down"),
    (["inject-fault", "--kind", "net-down", "--node", "1"], "needs --duration SECONDS > 0"),
    (["inject-fault", "--kind", "net-down", "--node", "1", "--duration", "-2"],
     "--duration must be a number of seconds"),
    (["inject-fault", "--kind", "net-down", "--node", "1", "--rank", "0", "--duration", "1"],
     "exactly one of"),
])
def test_inject_fault_usage_errors(argv, needle, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_journal_folds_events_into_fault_phases(tmp_path) -> None:
    seen = []
    j = Journal(lambda k, f: seen.append(k), str(tmp_path / "events.jsonl"))
    j.drill_injected(3, "kill", 100.0)
    j.emit("fault", {"worker": 3, "rank": 1, "why": "exited with -9", "decision": "replace",
                     "reason": "r", "detected_at": 100.005, "committed_before": 41})
    j.emit("generation", {"generation": 1, "urgent": True, "published_at": 100.006,
                          "world_size": 3, "reason": "r"})
    j.emit("recovered", {"generation": 1, "rebuilt": 100.02, "healed": 100.03,
                         "first_commit": 100.1, "worker": 0, "step": 39})
    (rec,) = j.faults
    assert (rec.kind, rec.injected, rec.recovered, rec.recovery_ms) == ("kill", True, True, 100.0)
    assert rec.lost_steps == 2  # 41 committed before, training resumed from step 39
    assert rec.phases_ms == {"detected": 5.0, "published": 6.0, "rebuilt": 20.0, "healed": 30.0,
                             "first_commit": 100.0}
    j.close()
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["injected", "fault", "generation", "recovered"] == seen
    assert Journal.replay(lines).faults == j.faults  # `ftrun report` reads the same records


def test_summary_percentiles() -> None:
    recs = [FaultRecord(id=i, kind="kill", worker=i, rank=0, at=i * 10.0, recovery_ms=float(v))
            for i, v in enumerate([100, 200, 300, 400])]
    s = summarize(recs, run_seconds=10.0)  # apart: their recoveries do not overlap
    assert (s["p50_ms"], s["max_ms"], s["time_lost_s"], s["goodput"]) == (250.0, 400.0, 1.0, 0.9)


def test_status_rendering_of_a_document(capsys) -> None:
    from ftrun.cli.status_view import print_status

    print_status(status(
        run_id="abc", script="t.py", uptime_s=3.0, generation=2, world_size=2, policy="shrink",
        workers=[worker(pid=11, step=5, committed_step=4, step_time_ms=20.0,
                        since_progress_s=0.01)],
        faults=[fault(rank=1, decision="shrink", recovery_ms=42.0, reason="gone",
                      phases_ms={"detected": 1.0, "first_commit": 42.0})],
        zygote={"state": "ready", "pid": 77, "rss_kb": 693248, "forks": 5, "preloaded": [],
                "preload_s": 2.0, "workers": []},
        steps_per_s=12.5, metrics="http://127.0.0.1:9400/metrics"))
    out = capsys.readouterr().out
    assert "shrink" in out and "42" in out and "#1: gone" in out and "running" in out
    assert "ready, pid 77, 677 MB, 5 forks" in out
    assert "12.50 (last minute)" in out and "http://127.0.0.1:9400/metrics" in out


@pytest.mark.slow
def test_status_and_drills_on_a_running_job(tmp_path, private_run_dir) -> None:
    job = subprocess.Popen(
        ftrun_cmd("--nproc", "3", "--log-dir", str(tmp_path / "logs"),
                  str(FIXTURES / "ft_train.py"), "--steps", "100000", "--step-time", "0.01"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        def steps() -> object:
            doc = job_status()  # polled in this process; the command's own JSON is read below
            if doc is None:
                return None
            ws = doc["workers"]  # none while the zygote still imports torch
            return doc if len(ws) == 3 and all((w["step"] or 0) > 5 for w in ws) else None

        wait_for(steps, 60, "a running job with progress")
        doc = json.loads(ftrun_out("status", "--json").stdout)
        assert {"run_id", "generation", "world_size", "workers", "faults"} <= set(doc)
        assert sorted(w["rank"] for w in doc["workers"]) == [0, 1, 2]
        assert all({"rank", "pid", "state", "step"} <= set(w) for w in doc["workers"])
        # the socket and its directory are private to this user
        socks = list(private_run_dir.glob("*.sock"))
        assert len(socks) == 1
        assert stat.S_IMODE(socks[0].stat().st_mode) == 0o600
        assert stat.S_IMODE(private_run_dir.stat().st_mode) == 0o700
        assert "world size" in ftrun_out("status").stdout

        for kind, extra in (("kill", []), ("comm", []), ("exception", ["--at-step", "0"]),
                            ("segv", []), ("exit", [])):
            r = ftrun_out("inject-fault", "--rank", "1", "--kind", kind, *extra)
            assert r.returncode == 0, r.stderr
            assert "yes" in r.stdout, f"{kind}: not recovered\n{r.stdout}"
        r = ftrun_out("inject-fault", "--rank", "7", "--kind", "kill")
        assert r.returncode == 1 and "no rank 7 in this job (ranks here: 0, 1, 2)" in r.stderr
        r = ftrun_out("inject-fault", "--gpu", "0", "--kind", "xid", "--xid", "79")
        assert r.returncode == 1 and "only be injected into simulated GPUs" in r.stderr

        doc = json.loads(ftrun_out("status", "--json").stdout)
        assert Status.from_json(doc).to_json() == doc  # the records hold all of it, as it is
        faults = doc["faults"]
        assert [f["kind"] for f in faults] == ["kill", "comm", "exception", "segv", "exit"]
        for f in faults:
            assert f["recovered"] and f["rank"] == 1 and f["recovery_ms"] > 0
            assert f["committed_before"] > 0 and f["lost_steps"] == 0
            assert set(f["phases_ms"]) >= {"detected", "published", "rebuilt", "first_commit"}
        assert doc["generation"] == 5 and doc["world_size"] == 3
    finally:
        job.terminate()
        _, err = job.communicate(timeout=60)
    assert "survived 5/5 faults" in err
    events = next((tmp_path / "logs").iterdir()) / "events.jsonl"
    kinds = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert kinds.count("fault") == 5 and kinds.count("recovered") == 5 and "drill" in kinds


@pytest.mark.slow
def test_silent_faults_gpu_hang_stuck_straggler(tmp_path, private_run_dir) -> None:
    job = subprocess.Popen(
        ftrun_cmd("--nproc", "3", "--gpu-backend", "sim", "--hang-timeout", "1.5",
                  str(FIXTURES / "ft_train.py"), "--steps", "100000", "--step-time", "0.01"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)

    def status() -> dict:
        doc = job_status()
        assert doc is not None, "the job did not answer"
        return doc

    def members() -> dict[int, dict]:
        return {w["rank"]: w for w in status()["workers"] if w["role"] == "member"}

    try:
        wait_for(lambda: (d := job_status()) is not None
                 and len(ws := d["workers"]) == 3
                 and all((w["step"] or 0) > 5 for w in ws), 60, "progress")
        gpu1 = members()[1]["gpu"]
        # an application XID does not fail the GPU
        r = ftrun_out("inject-fault", "--gpu", "1", "--kind", "xid", "--xid", "13")
        assert r.returncode == 0
        time.sleep(1.0)  # a negative check: give a wrong verdict the time to show
        assert status()["faults"] == [] and members()[1]["health"] == "healthy"
        # XID 79: the worker on GPU 1 is replaced and GPU 1 is never used again
        r = ftrun_out("inject-fault", "--gpu", "1", "--kind", "xid", "--xid", "79")
        assert r.returncode == 0 and "yes" in r.stdout, r.stdout + r.stderr
        assert gpu1 not in {w["gpu"] for w in members().values()}
        # a frozen worker (SIGSTOP) is found within the hang timeout; survivors keep their pids
        before = {rank: w["pid"] for rank, w in members().items()}
        r = ftrun_out("inject-fault", "--rank", "2", "--kind", "hang")
        assert r.returncode == 0 and "yes" in r.stdout, r.stdout + r.stderr
        f = status()["faults"][-1]
        assert f["kind"] == "hang" and f["phases_ms"]["detected"] < 1500 + 2000
        after = {rank: w["pid"] for rank, w in members().items()}
        assert after[0] == before[0] and after[1] == before[1] and after[2] != before[2]
        # a main thread stuck outside any collective is found too
        ftrun_out("inject-fault", "--rank", "0", "--kind", "slow", "--delay", "1000")
        wait_for(lambda: len(status()["faults"]) == 3 and status()["faults"][-1]["recovered"],
                 60, "the stuck worker replaced")
        # a consistently slow rank is flagged, not killed
        ftrun_out("inject-fault", "--rank", "1", "--kind", "slow", "--delay", "0.15")
        flagged = wait_for(lambda: members()[1]["straggler"], 30, "a straggler flag")
        assert "rank 1 computes a step in" in flagged and len(status()["faults"]) == 3
    finally:
        job.terminate()
        _, err = job.communicate(timeout=60)
    assert "survived 3/3 faults" in err
