"""The control channel against hostile or broken input: malformed requests, a raced run
directory, stale files, very large replies, and a job that dies under a drill."""
import json
import math
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for
from statusdocs import document, worker

from ftrun.adapters import control, control_server
from ftrun.cli.main import main
from ftrun.core.errors import FtrunError
from ftrun.core.faultkinds import FaultKind
from ftrun.protocol.control_ops import InjectOp, StatusOp, check_request

# Each gets a one-line refusal; none may end the server thread or the agent's main loop.
JUNK = [
    (b'{"op":"inject","kind":"slow","rank":0,"arg":"fast"}\n', "--delay must be a number"),
    (b'{"op":"inject","kind":"kill","rank":0,"at_step":"5"}\n', "--at-step must be an integer"),
    (b'{"op":"inject","kind":"slow","rank":0,"arg":-1}\n', "--delay must be a number"),
    (b'{"op":"inject","kind":"slow","rank":0,"arg":NaN}\n', "not nan"),
    (b'{"op":"inject","kind":"slow","rank":0,"arg":Infinity}\n', "not inf"),
    (b'{"op":"inject","kind":"kill","rank":"0"}\n', "--rank must be an integer"),
    (b'{"op":"inject","kind":"kill","rank":0,"at_step":1e400}\n', "--at-step must be"),
    (b'{"op":"inject","kind":"kill","rank":0,"at_step":99999999999999999999}\n', "--at-step"),
    (b'{"op":"inject","kind":["kill"],"rank":0}\n', "unknown fault kind"),
    (b'{"op":"inject","kind":"kill","rank":0,"bogus":1}\n', "unknown field 'bogus'"),
    (b"[" * 60_000 + b"\n", "nested too deeply"),
    (b"\xff\xfe\x00 not json\n", "not JSON"),
    (b"[1, 2]\n", "must be a JSON object, not list"),
    (b'"status"\n', "must be a JSON object, not str"),
    (b'{"op":"melt"}\n', "unknown request 'melt'"),
    (b'{"op":{"op":"status"}}\n', "unknown request"),
    (b"{}\n", "unknown request None"),
]


@pytest.fixture(autouse=True)
def _own_run_dir(private_run_dir):
    """Every test here sees only its own jobs."""


def raw_request(path: str, data: bytes) -> dict:
    """Bytes straight into a control socket; the reply, parsed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(1 << 16):
            reply += chunk
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1, reply[:200]
    return json.loads(reply)


def serve(run_dir, handler) -> control_server.ControlServer:
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    info = control.RunInfo("t" * 16, os.getpid(), "fake.py", time.time(),
                           str(run_dir / "t.sock"), None)
    return control_server.ControlServer(info, handler).start()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---------------------------------------------------------------- the server, in process
def test_server_answers_junk_with_one_line_and_keeps_serving(private_run_dir) -> None:
    def handler(req: dict) -> dict:
        return {"ok": True, **check_request(req).to_wire()}

    server = serve(private_run_dir, handler)
    try:
        for data, needle in JUNK:
            reply = raw_request(server.info.socket, data)
            assert reply["ok"] is False and needle in reply["error"], (data[:60], reply)
            assert "\n" not in reply["error"] + reply.get("hint", "")
        # too large, and never finished: refused too
        big = raw_request(server.info.socket, b'{"op": "' + b"x" * 70_000 + b'"}\n')
        assert big["ok"] is False and "larger than 65536 bytes" in big["error"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(server.info.socket)
            s.sendall(b'{"op": "sta')
            reply = json.loads(s.recv(1 << 16))
        assert reply["ok"] is False and "no complete request within" in reply["error"]
        assert control.request(server.info, {"op": "status"}) == {"ok": True, "op": "status"}
    finally:
        server.close()


def test_a_reply_over_100_kb_is_read_in_full(private_run_dir) -> None:
    workers = [worker(rank=i, worker_id=i, phase="w" * 200) for i in range(2000)]
    server = serve(private_run_dir, lambda req: {"ok": True, **document(workers=workers)})
    try:
        assert len(json.dumps(workers)) > 400_000
        assert control.request(server.info, {"op": "status"})["workers"] == workers
        # and through the CLI, as `ftrun status --json` reads it
        r = run_ftrun("status", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["workers"] == workers
    finally:
        server.close()


def test_a_closed_or_dead_socket_means_the_job_ended(private_run_dir) -> None:
    server = serve(private_run_dir, lambda req: {"ok": True})
    info = server.info
    server.close()  # a clean shutdown removes the socket
    with pytest.raises(control.JobGone, match="has ended"):
        control.request(info, {"op": "status"})
    # a launcher killed with SIGKILL leaves its socket file behind, with nobody listening
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(info.socket)
    with pytest.raises(control.JobGone, match="has ended"):
        control.request(info, {"op": "status"})


# ---------------------------------------------------------------- the run directory
def test_a_symlinked_run_dir_is_refused(tmp_path, monkeypatch) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    for value in (str(link), str(link) + "/"):
        monkeypatch.setenv("FTRUN_RUN_DIR", value)
        r = run_ftrun("status")
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert f"the run directory {link} is a symbolic link" in r.stderr
    # a launcher refuses it too, before starting any worker
    r = run_ftrun("--nproc", "1", str(FIXTURES / "behave.py"), "--pidfile", str(tmp_path))
    assert r.returncode == 1 and "is a symbolic link" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.glob("*.pid"))
    assert list(target.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory away needs root")
def test_a_run_dir_of_another_user_is_refused(private_run_dir) -> None:
    private_run_dir.mkdir(mode=0o700)
    os.chown(private_run_dir, 65534, 65534)
    r = run_ftrun("status")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "belongs to uid 65534, not to you" in r.stderr


def test_a_loose_run_dir_of_this_user_is_made_private(private_run_dir) -> None:
    private_run_dir.mkdir()
    private_run_dir.chmod(0o777)
    assert run_ftrun("status").returncode == 1  # no job
    assert stat.S_IMODE(private_run_dir.stat().st_mode) == 0o700


def test_a_stale_run_file_cannot_name_what_is_deleted(tmp_path, private_run_dir) -> None:
    private_run_dir.mkdir(mode=0o700)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    doc = {"run_id": "stale", "pid": dead_pid(), "script": "x.py", "started_at": 1.0,
           "socket": str(victim), "log_dir": None}
    (private_run_dir / "stale.json").write_text(json.dumps(doc))
    (private_run_dir / "stale.sock").write_text("")  # what the dead launcher left
    # files ftrun never wrote are left alone, whatever they say
    (private_run_dir / "odd.json").write_text(json.dumps({**doc, "pid": "1"}))
    (private_run_dir / "link.json").symlink_to(tmp_path / "nowhere.json")
    r = run_ftrun("status")
    assert r.returncode == 1 and "no ftrun job is running" in r.stderr
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in private_run_dir.iterdir()) == ["link.json", "odd.json"]


# ---------------------------------------------------------------- inject-fault's options
@pytest.mark.parametrize("extra, needle", [
    (["--kind", "slow", "--delay", "-1"], "--delay must be a number of seconds 0..86400, not -1"),
    (["--kind", "slow", "--delay", "nan"], "not nan"),
    (["--kind", "slow", "--delay", "inf"], "not inf"),
    (["--kind", "exception", "--at-step", "-5"], "--at-step must be an integer -1.."),
    (["--kind", "kill", "--every", "nan", "--count", "2"], "--every must be a number"),
    (["--kind", "kill", "--every", "-1"], "--every must be a number"),
])
def test_inject_fault_rejects_bad_values(extra, needle, capsys) -> None:
    assert main(["inject-fault", "--rank", "0", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_checked_requests_are_typed() -> None:
    req = check_request({"op": "inject", "kind": "slow", "rank": 1, "arg": 2})
    assert req == InjectOp(FaultKind.SLOW, rank=1, gpu=None, at_step=-1, arg=2.0, xid=None)
    assert req.to_wire() == {"op": "inject", "kind": "slow", "rank": 1, "gpu": None,
                             "at_step": -1, "arg": 2.0, "xid": None, "node": None,
                             "duration": 0.0}
    assert type(req.arg) is float and check_request({"op": "status"}) == StatusOp()
    for bad in (math.nan, -math.inf, True, "1", [1], 1e9):
        with pytest.raises(FtrunError):
            check_request({"op": "inject", "kind": "slow", "rank": 1, "arg": bad})


def test_a_finished_run_leaves_no_socket_or_run_file(private_run_dir) -> None:
    r = run_ftrun("--nproc", "2", str(FIXTURES / "behave.py"), "--sleep", "0.2")
    assert r.returncode == 0, r.stderr
    left = sorted(p.name for p in private_run_dir.glob("*"))
    assert left == ["history", "last-run"], left  # for `ftrun report --last`: no socket, no run
    (kept,) = (private_run_dir / "history").iterdir()  # its temporary logs went: their report
    assert sorted(p.name for p in kept.iterdir()) == ["events.jsonl", "timeline.jsonl"]


# ---------------------------------------------------------------- against a running job
def start_ft_job(tmp_path, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        ftrun_cmd("--nproc", "2", "--log-dir", str(tmp_path / "logs"),
                  str(FIXTURES / "ft_train.py"), "--steps", str(steps), "--step-time", "0.01"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)


def wait_for_progress(private_run_dir) -> str:
    def ready() -> str | None:
        r = run_ftrun("status", "--json")
        if r.returncode:
            return None
        doc = json.loads(r.stdout)
        return r.stdout if doc["ft_api"] and all((w["step"] or 0) > 2
                                                 for w in doc["workers"]) else None

    wait_for(ready, 90, "a training job with progress")
    (sock,) = private_run_dir.glob("*.sock")
    return str(sock)


@pytest.mark.slow
def test_junk_in_a_running_jobs_socket_leaves_it_running(tmp_path, private_run_dir) -> None:
    job = start_ft_job(tmp_path, steps=400)  # long enough to outlast the junk
    try:
        sock = wait_for_progress(private_run_dir)
        for data, needle in JUNK:
            reply = raw_request(sock, data)
            assert reply["ok"] is False and needle in reply["error"], (data[:60], reply)
        r = run_ftrun("status", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["faults"] == []
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, err[-2000:]


@pytest.mark.slow
def test_inject_fault_fails_when_the_job_dies_under_the_drill(tmp_path, private_run_dir) -> None:
    job = start_ft_job(tmp_path, steps=100_000)
    try:
        wait_for_progress(private_run_dir)
        drill = subprocess.Popen(  # due at a step never reached: it waits for the recovery
            ftrun_cmd("inject-fault", "--rank", "1", "--kind", "exception",
                      "--at-step", str(10**9)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: "drill" in (tmp_path / "logs").joinpath(
            os.listdir(tmp_path / "logs")[0], "events.jsonl").read_text(), 30, "the drill")
        job.send_signal(signal.SIGKILL)  # the launcher dies; its socket file stays behind
        out, err = drill.communicate(timeout=60)
    finally:
        job.kill()
        job.wait(timeout=60)
    assert drill.returncode == 1, out + err
    # killed after its reply: the drill ends unsettled; before it (the drill journaled, its
    # answer not yet sent): the job has ended. Never "try again" for a job that is gone
    assert err.count("\n") == 1 and ("ended before the drill completed (0/1" in err
                                     or "has ended" in err), err
    assert "Traceback" not in err
