"""Seeing a run: Prometheus metrics, the timeline, `ftrun report` and its picture.

Units run on documents and event logs built here; one real drill run (3 gloo workers, a
kill, a hang and a simulated XID 79) is scraped with prometheus_client's own text parser and
compared with `ftrun status --json`, then reported on after it ends."""
import json
import os
import signal
import socket
import subprocess
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from conftest import FIXTURES, ftrun_cmd, wait_for
from jobstatus import job_status
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from statusdocs import document, worker

from ftrun.adapters import history, metrics
from ftrun.agent.journal import Journal
from ftrun.agent.timeline import (
    KEEPALIVE_S,
    PER_RANK_MAX,
    Timeline,
    line_of,
    sample_every_s,
)
from ftrun.cli import picture, runreport
from ftrun.cli.launch_args import parse_run_args
from ftrun.cli.main import main
from ftrun.core.errors import UsageError
from ftrun.protocol.status import Status


@pytest.fixture(autouse=True)
def _own_run_dir(private_run_dir):
    """Every test here sees only its own jobs and its own last run."""


def scrape_text(doc: dict | None) -> str:
    """What /metrics serves for the status document `doc` (None: before the agent serves)."""
    from prometheus_client import generate_latest

    status = None if doc is None else Status.from_json(doc)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics._Collector(lambda: status))
    return generate_latest(registry).decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def fault(i: int, kind: str, ms: float | None, phases: dict) -> dict:
    return {"id": i, "kind": kind, "rank": 0, "worker": 0, "at": 100.0 + i, "decision": "replace",
            "reason": "r", "injected": False, "generation": i, "recovered": ms is not None,
            "recovery_ms": ms, "phases_ms": phases, "lost_steps": 0, "committed_before": -1,
            "lost_from": None, "resumed_step": None}


def node(index: int, host: str, alive: bool) -> dict:
    return {"node": index, "host": host, "pid": 10 + index, "alive": alive,
            "role": "worker node", "snapshot": None}


DOC = document(
    generation=3, world_size=2, uptime_s=12.5, attempt=1, steps_per_s=4.0,
    workers=[
        worker(rank=0, worker_id=0, committed_step=41, step_time_ms=50.0),
        worker(rank=1, worker_id=3, committed_step=40, step_time_ms=75.0,
               straggler="1.9x the median"),
        worker(rank=-1, worker_id=4, role="spare")],
    faults=[fault(1, "kill", 120.0, {"detected": 5.0, "first_commit": 120.0}),
            fault(2, "gpu: GPU is lost", 3000.0, {"detected": 2000.0, "first_commit": 3000.0}),
            fault(3, "kill", None, {"detected": 7.0})],
    summary={"faults": 3, "recovered": 2, "p50_ms": 1560.0, "p95_ms": 2856.0,
             "max_ms": 3000.0, "lost_steps": 2, "time_lost_s": 3.1, "goodput": 0.75},
    gpus=[{"index": 0, "gpu": "GPU-a", "health": "failed", "excluded": True},
          {"index": 1, "gpu": "GPU-b", "health": "healthy", "excluded": False}],
    nodes=[node(0, "h0", True), node(1, "h1", False)],
)


# ---------------------------------------------------------------- metrics, no processes
def test_the_metrics_say_what_the_status_document_says() -> None:
    got = samples(scrape_text(DOC))
    assert got[("ftrun_generation", ())] == 3 and got[("ftrun_world_size", ())] == 2
    assert got[("ftrun_restarts_total", ())] == 1
    assert got[("ftrun_committed_step", (("rank", "1"),))] == 40
    assert got[("ftrun_step_seconds", (("rank", "0"),))] == 0.05
    assert not any(k[0] == "ftrun_committed_step" and ("rank", "-1") in k[1] for k in got)
    assert got[("ftrun_faults_total", (("kind", "kill"),))] == 2
    assert got[("ftrun_faults_total", (("kind", "gpu"),))] == 1  # a label of few values
    assert got[("ftrun_faults_recovered_total", ())] == 2
    assert got[("ftrun_recovery_seconds_count", ())] == 2
    assert got[("ftrun_recovery_seconds_sum", ())] == pytest.approx(3.12)
    assert got[("ftrun_recovery_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[("ftrun_recovery_seconds_bucket", (("le", "+Inf"),))] == 2
    assert got[("ftrun_recovery_phase_seconds_count", (("phase", "detected"),))] == 3
    assert got[("ftrun_lost_steps_total", ())] == 2 and got[("ftrun_goodput_ratio", ())] == 0.75
    assert got[("ftrun_spares_ready", ())] == 1 and got[("ftrun_stragglers", ())] == 1
    assert got[("ftrun_gpu_healthy", (("gpu", "GPU-a"), ("index", "0")))] == 0
    assert got[("ftrun_gpu_healthy", (("gpu", "GPU-b"), ("index", "1")))] == 1
    assert got[("ftrun_node_up", (("host", "h1"), ("node", "1")))] == 0
    assert scrape_text(None) == ""  # before the agent serves a document: no samples


def test_metrics_options() -> None:
    assert parse_run_args(["t.py"]).metrics_port is None  # off unless asked for
    assert parse_run_args(["t.py"], env={"FTRUN_METRICS_PORT": "9400"}).metrics_port == 9400
    spec = parse_run_args(["--metrics-port", "0", "--metrics-addr", "0.0.0.0", "t.py"])
    assert (spec.metrics_port, spec.metrics_addr) == (0, "0.0.0.0")
    for argv, needle in ((["--metrics-port", "x"], "not a port number"),
                         (["--metrics-port", "70000"], "0-65535"),
                         (["--metrics-port", "1", "--metrics-addr", "here"], "not an IP")):
        with pytest.raises(UsageError, match=needle):
            parse_run_args([*argv, "t.py"])


def test_a_metrics_port_in_use_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(ftrun_cmd("--metrics-port", str(port), str(FIXTURES / "behave.py"),
                                     "--pidfile", str(tmp_path)),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"ftrun: error: --metrics-port {port}: 127.0.0.1:{port} is in use "
                        "(pick another port, or 0 for any free one)\n")
    assert not list(tmp_path.glob("*.pid"))  # no worker was started


# ---------------------------------------------------------------- timeline and report units
def test_the_timeline_writes_changes_keeps_alive_and_knows_the_rate(tmp_path: Path) -> None:
    def doc(first: int) -> Status:
        return Status.from_json(document(generation=1, world_size=2, workers=[
            worker(rank=0, committed_step=first), worker(rank=1, worker_id=1, committed_step=9)]))

    tl = Timeline(str(tmp_path))
    tl.sample(doc(10), 1000.0)
    tl.sample(doc(10), 1000.5)  # unchanged: not written
    tl.sample(doc(30), 1010.0)
    tl.sample(doc(30), 1010.0 + KEEPALIVE_S)  # unchanged for long: written
    tl.close()
    lines = runreport.read_jsonl(str(tmp_path / "timeline.jsonl"))
    assert [x["t"] for x in lines] == [1000.0, 1010.0, 1010.0 + KEEPALIVE_S]
    assert lines[0]["steps"] == {"0": 10, "1": 9} and lines[1]["step_max"] == 30
    assert tl.steps_per_s() == pytest.approx(20 / (20.0))  # 10 -> 30 over the last 20 s
    assert sample_every_s(1) == sample_every_s(16) == 0.5 and sample_every_s(512) == 16.0
    big = line_of(Status.from_json(document(workers=[
        worker(rank=r, worker_id=r, committed_step=r) for r in range(PER_RANK_MAX + 1)])))
    assert "steps" not in big and (big["step_min"], big["step_max"]) == (0, PER_RANK_MAX)


def test_a_replayed_log_dates_a_restart_by_the_log_not_by_now() -> None:
    lines = [{"t": 10.0, "event": "started", "attempt": 0, "world_size": 2},
             {"t": 11.0, "event": "injected", "worker": 1, "kind": "kill", "at": 11.0},
             {"t": 11.1, "event": "failure", "reason": "rank 1 exited", "rank": 1},
             {"t": 11.2, "event": "restart", "reason": "r", "attempt": 1},
             {"t": 13.0, "event": "started", "attempt": 1, "world_size": 2},
             {"t": 14.0, "event": "from-a-newer-ftrun"}]
    (rec,) = Journal.replay(lines).faults
    assert (rec.kind, rec.recovered, rec.recovery_ms) == ("kill", True, 2000.0)


def synthetic_run(tmp_path: Path) -> Path:
    """A run directory as an agent leaves it: one fault recovered, one snapshot, 3 samples."""
    run = tmp_path / "job_abc"
    run.mkdir()
    events = [{"t": 0.0, "event": "started", "attempt": 0, "world_size": 2},
              {"t": 1.0, "event": "fault", "worker": 1, "rank": 1, "why": "exit -9",
               "decision": "replace", "reason": "r", "detected_at": 1.01},
              {"t": 1.02, "event": "generation", "generation": 1, "world_size": 2, "urgent": True,
               "published_at": 1.02, "reason": "r"},
              {"t": 1.3, "event": "recovered", "generation": 1, "first_commit": 1.3, "step": 5},
              {"t": 2.0, "event": "snapshot", "step": 10, "blocking_ms": 3.0, "write_ms": 40.0}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events)
                                      + '{"t": 3.0, "event": "cut off')
    (run / "timeline.jsonl").write_text("".join(json.dumps(
        {"t": t, "world_size": 2, "step_max": s, "steps": {"0": s, "1": s}}) + "\n"
        for t, s in ((0.5, 1), (1.0, 4), (2.5, 12))))
    return run


def test_the_picture_marks_every_fault_and_the_report_finds_runs(tmp_path: Path,
                                                                 private_run_dir) -> None:
    run = synthetic_run(tmp_path)
    assert runreport.find_run_dir(str(tmp_path)) == str(run)  # a --log-dir holding runs
    rec = runreport.load_run(str(run))
    rep = runreport.build_report(rec)
    assert rep["summary"]["faults"] == 1 and rep["faults_by_kind"] == {"exit -9": 1}
    assert rep["phases_ms"]["recovery"]["max"] == 290.0  # from its detection: no drill
    assert rep["last_step"] == 12
    assert rep["snapshots"]["count"] == 1 and rep["world_sizes"] == [2]
    out = tmp_path / "p.html"
    assert picture.write_html(picture.chart_of(rec), str(out), "t") == 1
    page = out.read_text()
    assert page.count('class="fault"') == 1 and page.count('class="snapshot"') == 1
    assert page.count('class="rank"') == 2 and "phase-first_commit" in page
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no ftrun event log"):
        runreport.find_run_dir(str(tmp_path / "empty"))
    history.remember("r1", None)
    assert main(["report", "--last"]) == 1  # a run that kept no log: one line


def test_a_png_picture_through_the_report_extra(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the optional 'report' extra is not installed")
    rec = runreport.load_run(str(synthetic_run(tmp_path)))
    out = tmp_path / "run.png"
    assert picture.write_png(picture.chart_of(rec), str(out), "t") == len(rec.faults) == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_png_without_matplotlib_is_one_line(tmp_path: Path, capsys) -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed here")
    assert main(["report", str(synthetic_run(tmp_path)), "--out", str(tmp_path / "r.png")]) == 2
    assert capsys.readouterr().err == ("ftrun: error: a PNG picture needs matplotlib (pip "
                                       "install 'ftrun[report]', or use --out FILE.html)\n")


def test_report_errors_are_one_line(capsys) -> None:
    assert main(["report"]) == 1
    assert capsys.readouterr().err == ("ftrun: error: no ftrun run is recorded on this host yet "
                                       "(run a job first, or give its log directory)\n")
    assert main(["report", "/nonexistent/x"]) == 2
    assert "no such directory" in capsys.readouterr().err


# ---------------------------------------------------------------- a real drill run
def inject(*args: str) -> None:
    r = subprocess.run(ftrun_cmd("inject-fault", *args), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def status() -> dict:
    doc = job_status()
    assert doc is not None, "no job answered"
    return doc


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return samples(resp.read().decode())


@pytest.mark.slow
def test_a_drill_run_is_scraped_as_its_status_says_and_reported_after(tmp_path: Path) -> None:
    port, logs = free_port(), tmp_path / "logs"
    agent = subprocess.Popen(
        ftrun_cmd("--nproc", "3", "--metrics-port", str(port), "--gpu-backend", "sim",
                  "--hang-timeout", "2", "--log-dir", str(logs), str(FIXTURES / "ft_train.py"),
                  "--steps", "100000", "--step-time", "0.03"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "err", "w"), start_new_session=True)  # noqa: SIM115
    try:
        wait_for(lambda: (d := status_or_none()) and len(d["workers"]) == 3 and all(
            (w["step"] or 0) > 3 for w in d["workers"]), 120, "3 workers stepping")
        inject("--rank", "1", "--kind", "kill")  # each waits for its recovery
        inject("--rank", "2", "--kind", "hang")
        inject("--gpu", "0", "--kind", "xid", "--xid", "79")
        before, got, after = status(), scrape(port), status()
        assert before["faults"] == after["faults"] and len(before["faults"]) == 3
        kinds = Counter(metrics.kind_label(f["kind"]) for f in before["faults"])
        assert {k[1][0][1]: v for k, v in got.items() if k[0] == "ftrun_faults_total"} == kinds
        assert got[("ftrun_faults_recovered_total", ())] == 3
        assert got[("ftrun_recovery_seconds_count", ())] == 3
        assert got[("ftrun_recovery_seconds_sum", ())] == pytest.approx(
            sum(f["recovery_ms"] for f in before["faults"]) / 1000)
        assert got[("ftrun_lost_steps_total", ())] == before["summary"]["lost_steps"]
        assert got[("ftrun_generation", ())] == before["generation"] == after["generation"]
        assert got[("ftrun_world_size", ())] == 3
        assert got[("ftrun_gpu_healthy", (("gpu", before["gpus"][0]["gpu"]), ("index", "0")))] == 0
        ranks = {dict(k[1])["rank"] for k in got if k[0] == "ftrun_committed_step"}
        assert ranks == {"0", "1", "2"} and before["metrics"] == f"http://127.0.0.1:{port}/metrics"
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(60)
    r = subprocess.run(ftrun_cmd("report", "--last", "--json"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    events = [json.loads(x) for x in (Path(rep["run_dir"]) / "events.jsonl").open()]
    assert rep["faults"] == after["faults"]  # replayed from the log: the live journal's records
    assert rep["summary"]["faults"] == sum(e["event"] == "fault" for e in events) == 3
    assert rep["fault_markers"] == 3 and rep["faults_by_kind"]["kill"] == 1
    assert rep["gpu_events"][-1]["health"] == "failed"
    page = Path(rep["picture"]).read_text()
    assert page.count('class="fault"') == 3 and page.count('class="rank"') == 3
    text = subprocess.run(ftrun_cmd("report", str(logs)), capture_output=True, text=True,
                          timeout=60)
    assert text.returncode == 0 and "faults: 3" in text.stdout and "picture:" in text.stdout


def status_or_none() -> dict | None:
    return job_status()


VOLATILE = {"ftrun_uptime_seconds", "ftrun_goodput_ratio"}  # move with time


def test_a_live_jobs_scrape_is_its_status_document(tmp_path: Path) -> None:
    """/metrics against `ftrun status --json` of a running job (a plain script that restarts
    once): every sample the agent serves is what its status document says, and the document
    carries what the metrics read (no drift between the live document and the collector)."""
    port = free_port()
    agent = subprocess.Popen(
        ftrun_cmd("--nproc", "2", "--max-restarts", "1", "--metrics-port", str(port),
                  str(FIXTURES / "behave.py"), "--exit-rank", "1:3", "--fail-attempts", "1",
                  "--sleep", "60"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "err", "w"), start_new_session=True)  # noqa: SIM115
    try:
        doc = wait_for(lambda: (d := status_or_none()) and d["attempt"] == 1 and len(
            d["workers"]) == 2 and d, 60, "the job running again after its restart")
        got = scrape(port)
        after = status()
        assert Status.from_json(after).to_json() == after  # the records hold all of it
        assert after["faults"] == doc["faults"] and after["attempt"] == 1  # settled
        want = samples(scrape_text(doc))
        assert {k: v for k, v in got.items() if k[0] not in VOLATILE} == {
            k: v for k, v in want.items() if k[0] not in VOLATILE}
        assert got[("ftrun_restarts_total", ())] == doc["attempt"] == 1
        assert got[("ftrun_generation", ())] == doc["generation"]
        assert got[("ftrun_world_size", ())] == doc["world_size"] == 2
        assert got[("ftrun_spares_ready", ())] == 0
        assert got[("ftrun_faults_recovered_total", ())] == sum(
            bool(f["recovered"]) for f in doc["faults"])
        assert got[("ftrun_lost_steps_total", ())] == doc["summary"]["lost_steps"]
        assert doc["summary"]["goodput"] <= got[("ftrun_goodput_ratio", ())] <= after[
            "summary"]["goodput"] < 1  # the restart's time is lost, less of it as time goes
        assert sum(v for k, v in got.items() if k[0] == "ftrun_faults_total") == len(
            doc["faults"]) == 1
        assert doc["uptime_s"] <= got[("ftrun_uptime_seconds", ())] <= after["uptime_s"]
        assert doc["metrics"] == f"http://127.0.0.1:{port}/metrics"
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(30)


def test_without_metrics_port_nothing_serves_metrics(tmp_path: Path) -> None:
    import psutil

    agent = subprocess.Popen(ftrun_cmd("--nproc", "1", str(FIXTURES / "behave.py"), "--sleep",
                                       "30"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        doc = wait_for(status_or_none, 60, "the job running")
        assert doc["metrics"] is None
        proc = psutil.Process(agent.pid)
        conns = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6
        listening = {c.laddr.port for c in conns("tcp") if c.status == psutil.CONN_LISTEN}
        for p in listening:  # the store's port, which is not an HTTP metrics endpoint
            with pytest.raises(Exception):  # noqa: B017
                urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics", timeout=2)
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(30)


def test_a_clean_run_without_log_dir_is_still_reported_last(tmp_path: Path,
                                                            private_run_dir) -> None:
    r = subprocess.run(ftrun_cmd("--nproc", "2", str(FIXTURES / "ft_train.py"), "--steps", "40"),
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert not list(tmp_path.glob("ftrun_*/*/events.jsonl"))  # the temporary logs are gone
    r = subprocess.run(ftrun_cmd("report", "--last", "--json"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert Path(rep["run_dir"]).parent == private_run_dir / "history"
    assert rep["summary"]["faults"] == 0 and rep["fault_markers"] == 0
    assert rep["last_step"] == 39 and rep["world_sizes"] == [2]
