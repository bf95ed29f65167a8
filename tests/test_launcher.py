"""The launcher with real processes (plain-Python workers, no torch in them)."""
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, ftrun_cmd, pid_alive, run_ftrun, wait_for

BEHAVE = str(FIXTURES / "behave.py")


def read_pids(d: Path, n: int, suffix: str = "pid") -> list[int]:
    wait_for(lambda: len(list(d.glob(f"*.{suffix}"))) == n, 30, f"{n} {suffix} files")
    return [int((d / f"{r}.{suffix}").read_text()) for r in range(n)]


def test_args_pass_through_with_local_rank_macro(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", str(FIXTURES / "dump_env.py"), str(tmp_path), "${local_rank}",
                  "--nproc", "9", "$HOME", "a$$b")
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        doc = json.loads((tmp_path / f"env_{rank}.json").read_text())
        assert doc["argv"][1:] == [str(tmp_path), str(rank), "--nproc", "9", "$HOME", "a$b"]


def test_module_mode(tmp_path) -> None:
    r = run_ftrun("--nproc", "1", "-m", "dump_env", str(tmp_path),
                  env={"PYTHONPATH": str(FIXTURES)})
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "env_0.json").read_text())
    assert doc["name"] == "__main__" and doc["argv"][0].endswith("dump_env.py")


def test_no_python_runs_the_executable(tmp_path) -> None:
    exe = tmp_path / "job.sh"
    exe.write_text('#!/bin/sh\necho "$RANK $1" > "$2/out_$RANK"\n')
    exe.chmod(0o755)
    r = run_ftrun("--nproc", "2", "--no-python", str(exe), "${local_rank}", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert sorted(p.read_text() for p in tmp_path.glob("out_*")) == ["0 0\n", "1 1\n"]


def test_run_path_reports_the_traceback(tmp_path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import os\nif os.environ['RANK'] == '0':\n    raise KeyError('run-path')\n")
    r = run_ftrun("--nproc", "1", "--run-path", str(script))
    assert r.returncode == 1
    assert "KeyError: 'run-path'" in r.stderr and "rank      : 0" in r.stderr


@pytest.mark.parametrize("code", [0, 3])
def test_exit_code(code) -> None:
    sleep = "0" if code == 0 else "30"  # a sibling still running gets terminated
    r = run_ftrun("--nproc", "2", BEHAVE, "--exit-rank", f"1:{code}", "--sleep", sleep)
    assert r.returncode == (0 if code == 0 else 1)
    if code:
        assert "rank 1 exited with 3; no restarts allowed" in r.stderr
        assert "exitcode  : 3" in r.stderr and "terminated by launcher" in r.stderr


def test_restart_then_success_counts_restarts(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", "--max-restarts", "3", str(FIXTURES / "dump_env.py"),
                  str(tmp_path), env={})
    assert r.returncode == 0
    r = run_ftrun("--nproc", "2", "--max-restarts", "3", "--log-dir", str(tmp_path / "logs"),
                  BEHAVE, "--exit-rank", "0:5", "--fail-attempts", "2", "--sleep", "0.2")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("restart ") == 2
    run_dir = next((tmp_path / "logs").iterdir())
    attempts = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("attempt_"))
    assert attempts == ["attempt_0", "attempt_1", "attempt_2"]


def test_restarts_exhausted(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", "--max-restarts", "2", BEHAVE, "--exit-rank", "1:4",
                  "--sleep", "5")
    assert r.returncode == 1
    assert "all 2 restarts used" in r.stderr and "Restarts used: 2/2" in r.stderr


def test_sigkilled_worker_gets_a_hint() -> None:
    r = run_ftrun("--nproc", "2", BEHAVE, "--kill-self-rank", "0", "--sleep", "5")
    assert r.returncode == 1
    assert "-9 (SIGKILL)" in r.stderr and "OOM killer" in r.stderr


def test_record_error_file_traceback_is_the_root_cause(tmp_path) -> None:
    parent = tmp_path / "parent_error.json"
    r = run_ftrun("--nproc", "2", str(FIXTURES / "record_fail.py"),
                  env={"TORCHELASTIC_ERROR_FILE": str(parent)})
    assert r.returncode == 1
    assert "ValueError: boom rank 1" in r.stderr and "rank      : 1 (local_rank: 1)" in r.stderr
    doc = json.loads(parent.read_text())
    assert "boom rank 1" in doc["message"]["message"] and doc["message"]["errorCode"] == 1


def _start(tmp_path: Path, *extra: str, nproc: int = 2) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ftrun_cmd("--nproc", str(nproc), *extra, BEHAVE, "--pidfile", str(tmp_path),
                  "--record-signals", str(tmp_path), "--sleep", "120"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_is_forwarded_then_exit_1(tmp_path, sig) -> None:
    proc = _start(tmp_path)
    pids = read_pids(tmp_path, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    for rank in (0, 1):
        assert (tmp_path / f"{rank}.sig").read_text().split() == [sig.name]
    assert not any(pid_alive(p) for p in pids)
    assert f"received {sig.name}; forwarded to 2 workers" in err


def test_sigterm_ignored_then_sigkill_after_shutdown_timeout(tmp_path) -> None:
    proc = subprocess.Popen(
        ftrun_cmd("--nproc", "1", "--shutdown-timeout", "1", BEHAVE, "--pidfile", str(tmp_path),
                  "--ignore-term", "--sleep", "120"),
        env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    (pid,) = read_pids(tmp_path, 1)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 1 and not pid_alive(pid)
    assert time.monotonic() - t0 >= 0.9  # the grace was honoured before SIGKILL


def test_custom_signal_to_handle(tmp_path) -> None:
    proc = _start(tmp_path, "--signals-to-handle", "SIGUSR1,SIGTERM", nproc=1)
    read_pids(tmp_path, 1)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert (tmp_path / "0.sig").read_text().split() == ["SIGUSR1"]


def test_no_orphans_after_launcher_sigkill(tmp_path) -> None:
    proc = subprocess.Popen(
        ftrun_cmd("--nproc", "2", BEHAVE, "--pidfile", str(tmp_path), "--grandchild",
                  "--sleep", "120"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    pids = read_pids(tmp_path, 2) + read_pids(tmp_path, 2, "child")
    assert all(pid_alive(p) for p in pids)
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "workers and grandchildren gone")


def test_tee_prefixes_and_log_layout(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", "--tee", "3", "--log-dir", str(tmp_path), BEHAVE, "--print", "3")
    assert r.returncode == 0
    for rank in (0, 1):
        for i in range(3):
            assert f"[default{rank}]:out {rank} {i}\n" in r.stdout
            assert f"[default{rank}]:err {rank} {i}\n" in r.stderr
    (run_dir,) = tmp_path.iterdir()
    out1 = run_dir / "attempt_0" / "1" / "stdout.log"
    assert out1.read_text() == "".join(f"out 1 {i}\n" for i in range(3))
    assert (run_dir / "attempt_0" / "0" / "stderr.log").read_text().startswith("err 0 0\n")


def test_redirect_only_and_prefix_template(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", "-r", "1", "-t", "0:2", "--log-dir", str(tmp_path), BEHAVE,
                  "--print", "2", env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${rank}|x]: "})
    assert r.returncode == 0
    assert "out " not in r.stdout  # stdout redirected for every rank
    assert "[0|x]: err 0 1\n" in r.stderr  # rank 0's stderr is tee'd with the template
    assert "err 1 1\n" in r.stderr and "[1|x]" not in r.stderr  # rank 1's stderr untouched
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "attempt_0" / "1" / "stdout.log").read_text() == "out 1 0\nout 1 1\n"


def test_local_ranks_filter_hides_but_keeps_output(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", "--local-ranks-filter", "1", "--log-dir", str(tmp_path), BEHAVE,
                  "--print", "1")
    assert r.returncode == 0
    assert "out 1 0" in r.stdout and "out 0 0" not in r.stdout
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "attempt_0" / "0" / "stdout.log").read_text() == "out 0 0\n"


def test_temporary_log_dir_removed_after_clean_success(tmp_path) -> None:
    r = run_ftrun("--nproc", "1", BEHAVE, env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 0 and list(tmp_path.iterdir()) == []
    r = run_ftrun("--nproc", "1", BEHAVE, "--exit-rank", "0:2", env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 1 and len(list(tmp_path.iterdir())) == 1  # kept for the post-mortem


@pytest.mark.slow
@pytest.mark.parametrize("fixed_port", [False, True], ids=["free-port", "master-port"])
def test_gloo_restart_comes_up_on_a_fresh_store(tmp_path, fixed_port) -> None:
    """torchrun's shared store makes this restart hang (pytorch#135712); ftrun must finish,
    also when the store has to come back on the same --master-port."""
    from ports import free_port

    port = ["--master-port", str(free_port())] if fixed_port else []
    r = run_ftrun("--nproc", "2", "--max-restarts", "1", *port,
                  str(FIXTURES / "gloo_restart.py"), str(tmp_path), timeout=90)
    assert r.returncode == 0, r.stderr
    done = [(tmp_path / f"done_{i}").read_text().split() for i in (0, 1)]
    assert [d[0] for d in done] == ["1", "1"]



@pytest.mark.parametrize("endpoint, needle", [
    ("host:abc", "port 'abc' is not a number"),  # was a 600 s retry loop with C++ traces
    ("[::1", "is not [IPV6] or [IPV6]:PORT"),
    ("localhost:70000", "port 70000 is out of range"),  # was an internal error
])
def test_bad_c10d_endpoint_is_one_line_exit_2(endpoint, needle) -> None:
    r = run_ftrun("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                  BEHAVE, timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("ftrun: error: ") and r.stderr.count("\n") == 1
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_directory_with_main_runs_as_python_runs_it(tmp_path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(FIXTURES / "dump_env.py", app / "__main__.py")
    (tmp_path / "ftrun").mkdir()
    (tmp_path / "python").mkdir()
    r = run_ftrun("--nproc", "1", "app", str(tmp_path / "ftrun"), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    subprocess.run([sys.executable, "app", str(tmp_path / "python")], cwd=tmp_path, check=True,
                   env={**os.environ, "RANK": "0"}, timeout=30)
    by_ftrun, by_python = (json.loads((tmp_path / d / "env_0.json").read_text())
                           for d in ("ftrun", "python"))
    assert by_ftrun["argv"] == ["app", str(tmp_path / "ftrun")]
    assert by_ftrun["argv"][0] == by_python["argv"][0] == "app"
    assert by_ftrun["name"] == "__main__"


def test_directory_without_main_is_refused(tmp_path) -> None:
    r = run_ftrun("--nproc", "1", str(tmp_path))
    assert r.returncode == 2 and "is a directory without __main__.py" in r.stderr


def test_single_node_store_listens_on_loopback_only(tmp_path) -> None:
    import psutil
    from test_tee import store_answers

    gate, logs = tmp_path / "gate", tmp_path / "logs"
    gate.mkdir()
    proc = subprocess.Popen(ftrun_cmd("--nproc", "2", "--log-dir", str(logs),
                                      str(FIXTURES / "unterminated.py"), "0", "1", str(gate)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: store_answers(logs), 60, "the agent's store to answer on loopback")
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        (gate / "write").touch()
        (gate / "exit").touch()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        proc.kill()
        proc.wait()
    assert listening and all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening


@pytest.mark.parametrize("nnodes, workers_at, listens_on", [
    (1, "127.0.0.1", "127.0.0.1"), (1, "localhost", "127.0.0.1"),
    (2, "127.0.0.1", "0.0.0.0"),  # other nodes may know this host by a name that is loopback here
])
def test_workers_store_interface(nnodes, workers_at, listens_on) -> None:
    from ftrun.adapters.store import HostedStore
    from ftrun.core.spec import RunSpec

    hosted = HostedStore.for_workers(RunSpec("t.py", nnodes_max=nnodes), 0, workers_at)
    try:
        assert hosted.host == listens_on
    finally:
        hosted.close()
