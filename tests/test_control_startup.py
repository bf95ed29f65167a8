"""A control request at the first instant of a job meets a whole agent: nothing serves, nor is
listed by `ftrun status`, before the object it serves is built."""
import os
import signal
import subprocess
import time

import pytest
from conftest import FIXTURES, ftrun_cmd
from test_recovery_core import FakePort

from ftrun.adapters import control, control_server
from ftrun.adapters.slots import ProgressSlots
from ftrun.agent.control_plane import ControlPlane
from ftrun.agent.journal import Journal
from ftrun.agent.watch import HealthWatch
from ftrun.core.errors import FtrunError
from ftrun.core.spec import RunSpec


@pytest.fixture(autouse=True)
def _own_run_dir(private_run_dir):
    """Every test here sees only its own jobs."""


def test_a_server_is_neither_listed_nor_reachable_before_it_starts(private_run_dir) -> None:
    os.makedirs(private_run_dir, mode=0o700, exist_ok=True)
    info = control.RunInfo("s" * 16, os.getpid(), "fake.py", time.time(),
                           str(private_run_dir / "s.sock"), None)
    server = control_server.ControlServer(info, lambda req: {"ok": True, "seen": req["op"]})
    try:
        assert control.list_runs() == [] and not os.path.exists(info.socket)
        with pytest.raises(control.JobGone):
            control.request(info, {"op": "status"})
        server.start()
        assert [r.run_id for r in control.list_runs()] == [info.run_id]
        assert control.request(info, {"op": "status"})["seen"] == "status"
    finally:
        server.close()
    assert control.list_runs() == []
    control_server.ControlServer(info, lambda req: req).close()  # never started: closes quietly


def test_a_control_plane_serves_only_once_told_to(tmp_path) -> None:
    """Built, it is invisible (its agent may still be half-built); `serve()` opens it."""
    port = FakePort(RunSpec("train.py", nproc=2))
    slots = ProgressSlots(str(tmp_path))
    health = HealthWatch(port, slots)
    plane = ControlPlane(port, slots, Journal(port.emit), health, None)
    try:
        assert control.list_runs() == [] and not os.path.exists(plane.info.socket)
        plane.serve()
        doc = control.request(control.find_run(None), {"op": "status"})
        assert (doc["run_id"], doc["world_size"], doc["workers"]) == ("core", 2, [])
    finally:
        plane.close()
        health.close()
        slots.close()
    assert control.list_runs() == []


def test_requests_from_the_first_instant_of_a_job_meet_a_whole_agent(tmp_path) -> None:
    """status and inject-fault in a loop from launch: refusals while the job starts are fine,
    an internal error (a half-built agent answering) is not."""
    job = subprocess.Popen(ftrun_cmd("--nproc", "1", str(FIXTURES / "behave.py"), "--sleep",
                                     "2"), stdout=subprocess.DEVNULL,
                           stderr=open(tmp_path / "err", "w"),  # noqa: SIM115
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    answers: list[str] = []
    try:
        deadline = time.monotonic() + 60
        runs: list[control.RunInfo] = []
        while not runs and job.poll() is None and time.monotonic() < deadline:
            runs = control.list_runs()  # no sleep: the first instant is the point
        assert runs, "the job never showed up"
        ops = ({"op": "status"},
               {"op": "inject", "kind": "kill", "rank": 7})  # refused: no such rank
        while job.poll() is None and len(answers) < 400 and time.monotonic() < deadline:
            for op in ops:
                try:
                    answers.append("ok" if control.request(runs[0], op).get("ok") else "?")
                except control.JobGone:
                    break
                except FtrunError as exc:
                    answers.append(exc.message)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)
        job.wait(30)
    internal = [a for a in answers if "internal error" in a]
    assert not internal, internal[:3]
    assert "ok" in answers and any("no rank 7" in a or "no worker" in a for a in answers)
