"""Workers forked from the zygote: started as python would start them, visible as forked, and
the fallbacks (--no-zygote, a failing or threaded --preload, the zygote killed mid-run).

The launcher runs plain-Python fixtures (no torch): the zygote then preloads no torch."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, ftrun_cmd, pid_alive, run_ftrun, wait_for

from ftrun.adapters.zygote import Target, wants_torch
from ftrun.protocol.zygote import Fork, Forked, Ready, Refused, decode, recv, send

PROBE = str(FIXTURES / "zygote_probe.py")


def probes(out: Path) -> dict[str, dict]:
    return {p.stem.removeprefix("probe_"): json.loads(p.read_text())
            for p in out.glob("probe_*.json")}


def events(logs: Path, kind: str) -> list[dict]:
    found = []
    for path in logs.glob("*/events.jsonl"):
        found += [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == kind]
    return found


def test_forked_workers_start_as_python_would_start_them(tmp_path) -> None:
    runs = {}
    for name, flags in (("forked", ["--preload", "colorsys"]), ("exec", ["--no-zygote"])):
        out = tmp_path / name
        out.mkdir()
        r = run_ftrun("--nproc", "2", "--log-dir", str(tmp_path / f"logs_{name}"), *flags,
                      PROBE, str(out), timeout=60)
        assert r.returncode == 0, r.stderr
        assert "probe rank 1 on stdout" in r.stdout and "probe rank 0 on stderr" in r.stderr
        runs[name] = probes(out)
    forked, spawned = runs["forked"], runs["exec"]
    assert sorted(forked) == sorted(spawned) == ["0_0", "1_0"]
    by_agent = events(tmp_path / "logs_forked", "spawned")
    assert [e["via"] for e in by_agent] == ["zygote", "zygote"]
    assert [e["via"] for e in events(tmp_path / "logs_exec", "spawned")] == ["exec", "exec"]
    for key in ("0_0", "1_0"):
        f, s = forked[key], spawned[key]
        assert f["zygote"] == by_agent[0]["zygote"] != 0 and s["zygote"] == 0
        assert f["zygote"] != f["ppid"]  # forked by the zygote, yet the agent's child
        assert f["sid"] == f["pgid"] == f["pid"]
        assert f["preloaded"] == ["colorsys"] and s["preloaded"] == []
        assert f["argv"] == [PROBE, str(tmp_path / "forked")]
        for k in ("name", "path0", "cwd", "file", "main_is_me", "fds", "stdin",
                  "sigint", "sigterm", "sigpipe", "blocked", "rank_env", "restart"):
            assert f[k] == s[k], (k, f[k], s[k])
    assert forked["0_0"]["ppid"] == forked["1_0"]["ppid"]


def test_a_preload_that_fails_to_import_is_a_one_line_error(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", "--preload", "no_such_module_xq", PROBE, str(tmp_path))
    assert r.returncode == 2
    assert "--preload no_such_module_xq: ModuleNotFoundError" in r.stderr
    assert "drop it from --preload" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("probe_*.json"))  # no worker started


def test_a_bad_preload_name_is_refused_before_anything_starts(tmp_path) -> None:
    r = run_ftrun("--preload", "not a module", PROBE, str(tmp_path))
    assert r.returncode == 2 and "is not a module name" in r.stderr


def test_a_preload_that_starts_threads_falls_back_to_new_processes(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", "--log-dir", str(tmp_path / "logs"), "--preload",
                  "threaded_mod", PROBE, str(tmp_path), env={"PYTHONPATH": str(FIXTURES)})
    assert r.returncode == 0, r.stderr
    assert "importing threaded_mod started threads" in r.stderr
    assert "(drop threaded_mod from --preload)" in r.stderr
    assert [e["via"] for e in events(tmp_path / "logs", "spawned")] == ["exec", "exec"]
    assert all(p["zygote"] == 0 for p in probes(tmp_path).values())


def test_the_zygote_killed_mid_run_falls_back_and_the_job_finishes(tmp_path) -> None:
    logs = tmp_path / "logs"
    proc = subprocess.Popen(ftrun_cmd("--nproc", "2", "--max-restarts", "1", "--log-dir",
                                      str(logs), PROBE, str(tmp_path), "--fail-first"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        first = wait_for(lambda: len(probes(tmp_path)) == 2 and events(logs, "spawned"), 30,
                         "the first attempt's workers")
        assert isinstance(first, list)
        zygote = first[0]["zygote"]
        assert zygote and all(e["via"] == "zygote" for e in first)
        os.kill(zygote, signal.SIGKILL)
        (tmp_path / "go").touch()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"the zygote (pid {zygote}) is gone; starting workers as new processes" in err
    spawned = events(logs, "spawned")
    assert [e["via"] for e in spawned] == ["zygote", "zygote", "exec", "exec"]
    assert sorted(probes(tmp_path)) == ["0_0", "0_1", "1_0", "1_1"]


def test_a_fork_the_agent_gave_up_on_never_runs_its_script(tmp_path) -> None:
    """The answer (the worker's pid) comes a moment after the agent stopped waiting for it
    (a loaded host), so the agent starts that worker as a new process: the forked one, in a
    session of its own and already the agent's child, must end before its first line, or
    the job would hold two processes of one worker (a CI run had one join a shard group it
    was not in and fail there). A fork the agent takes runs as usual."""
    code = r'''
import os, select, sys, time
from ftrun.adapters import zygote as zmod
from ftrun.adapters.procs import become_subreaper, reap_strays
assert become_subreaper()
out, script = sys.argv[1], sys.argv[2]
null = os.open(os.devnull, os.O_WRONLY)

def ready():
    z = zmod.Zygote(sys.executable, dict(os.environ), (), with_torch=False)
    assert z.wait_ready() is zmod.ZygoteState.READY
    return z

def fork(z, name):
    return z.fork(zmod.Target(False, script, (os.path.join(out, name),)), {**os.environ},
                  null, null)

z = ready()
taken = fork(z, "taken")
deadline = time.monotonic() + 30
while taken.process.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)
z.close()

def late(self, timeout_s):
    select.select([self._sock], [], [], 10)  # the pid is there...
    self._lost()  # ...but the agent stopped waiting a moment before
    raise zmod.ZygoteGone(f"no answer within {timeout_s:g} s")

z = ready()
zmod.Zygote._answer = late
try:
    fork(z, "dropped")
except zmod.ZygoteGone:
    pass
deadline, strays = time.monotonic() + 15, 0
while strays < 1 and time.monotonic() < deadline:  # the forked one, handed to this process
    strays += reap_strays(set())
    time.sleep(0.05)
time.sleep(0.5)  # a script that did run would have written its file by now
print(strays, *sorted(os.listdir(out)))
'''
    script = tmp_path / "mark.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').close()\n")
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", code, str(out), str(script)],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["1", "taken"], (r.stdout, r.stderr)


def test_a_fork_asked_for_while_the_zygote_warms_up_waits_for_it(tmp_path) -> None:
    """The zygote warms torch up at its first quiet moment (~1.4 s of CPU; on a loaded host
    it outlasted the agent's wait for a fork's answer): it says so first, and a fork
    asked for meanwhile waits for the warm-up instead of giving up on the zygote. Here the
    wait for an answer is cut to 10 ms, so only the warm-up's notice keeps the fork."""
    code = r'''
import os, select, sys, time
from ftrun.adapters import zygote as zmod
from ftrun.adapters.procs import become_subreaper
from ftrun.core import timeouts
assert become_subreaper()
z = zmod.Zygote(sys.executable, dict(os.environ), (), with_torch=True)
assert z.wait_ready() is zmod.ZygoteState.READY
assert select.select([z._sock], [], [], 30)[0]  # quiet: it warms up, and said so
timeouts.ZYGOTE_FORK_S = 0.01
null = os.open(os.devnull, os.O_WRONLY)
worker = z.fork(zmod.Target(False, sys.argv[1], (sys.argv[2],)), {**os.environ}, null, null)
deadline = time.monotonic() + 30
while worker.process.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)
print(worker.process.poll(), z.state.value, os.path.exists(sys.argv[2]))
z.close()
'''
    script = tmp_path / "mark.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').close()\n")
    r = subprocess.run([sys.executable, "-c", code, str(script), str(tmp_path / "ran")],
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["0", "ready", "True"], (r.stdout, r.stderr[-2000:])


# ------------------------------------------------------------------ units
def test_messages_round_trip_with_their_descriptors() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        r, w = os.pipe()
        try:
            req = Fork(False, "train.py", ("--x", "1"), {"RANK": "0"}, "/tmp")
            send(ours, req, (w, w))
            got, fds = recv(theirs, 1.0)
            assert got == req and len(fds) == 2
            for fd in fds:
                os.close(fd)
        finally:
            os.close(r)
            os.close(w)
        send(theirs, Ready(7, ("torch",), 1.5, 100))
        assert recv(ours, 1.0)[0] == Ready(7, ("torch",), 1.5, 100)
    assert decode(b'{"type": "Refused", "why": "threads", "module": "m", "detail": "d"}') == \
        Refused("threads", "m", "d")
    assert decode(b'{"type": "Forked", "pid": 3}') == Forked(3)


def test_only_python_command_lines_are_forked() -> None:
    py = "/usr/bin/python3"
    assert Target.of([py, "-u", "t.py", "a"], py) == Target(False, "t.py", ("a",))
    assert Target.of([py, "-u", "-m", "pkg.mod", "a"], py) == Target(True, "pkg.mod", ("a",))
    assert Target.of(["./run.sh", "a"], py) is None  # --no-python
    assert Target.of(["/other/python", "-u", "t.py"], py) is None  # PYTHON_EXEC elsewhere


def test_torch_is_preloaded_only_for_scripts_that_import_it(tmp_path) -> None:
    plain, uses = tmp_path / "plain.py", tmp_path / "uses.py"
    plain.write_text("import json\nprint('no torch here')\n")
    uses.write_text("import os\nif True:\n    from torch import nn\n")
    assert not wants_torch(str(plain), module=False, run_path=False)
    assert wants_torch(str(uses), module=False, run_path=False)
    assert wants_torch("pkg.train", module=True, run_path=False)
    assert wants_torch(str(tmp_path / "missing.py"), module=False, run_path=False)
    for line in ("import os, torch", "import sys as s, torch.nn as nn", "import torchvision",
                 "from ftrun import init", "import lightning as L"):
        uses.write_text(f"{line}\n")
        assert wants_torch(str(uses), module=False, run_path=False), line
    for line in ("# import torch", "x = 'import torch'", "import mytorch", "import os, json"):
        plain.write_text(f"{line}\n")
        assert not wants_torch(str(plain), module=False, run_path=False), line


def test_ctrl_c_while_the_zygote_still_imports_stops_the_run_at_once(tmp_path) -> None:
    proc = subprocess.Popen(ftrun_cmd("--preload", "slow_mod", "--log-dir", str(tmp_path / "logs"),
                                      PROBE, str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "PYTHONPATH": str(FIXTURES)})
    try:
        time.sleep(6)  # past the agent's own start-up: it waits for the zygote's 30 s import
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)  # not the zygote's 30 s, nor its 180 s limit
    finally:
        proc.kill()
    assert proc.returncode != 0 and "received SIGINT" in err, err
    assert "Traceback" not in err and not events(tmp_path / "logs", "spawned"), err  # none ran


def test_orphans_handed_to_the_agent_are_reaped_and_its_own_children_left() -> None:
    code = r'''
import os, time
from ftrun.adapters.procs import Adopted, become_subreaper, reap_strays
assert become_subreaper()
def orphan(code):
    r, w = os.pipe()
    if os.fork() == 0:
        pid = os.fork()
        if pid == 0:
            os._exit(code)
        os.write(w, str(pid).encode())
        os._exit(0)
    return int(os.read(r, 32))
mine = orphan(7)
time.sleep(0.3)  # it exited and was handed to this process, as a forked worker is
reap_strays({mine})  # leaves it to its owner
code = Adopted(mine).poll()
reap_strays(set())
stray = orphan(0)
time.sleep(0.3)
reaped = reap_strays(set())  # the stray and its parent
try:
    left = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)
except ChildProcessError:
    left = "none"
print(code, reaped, left)
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.split() == ["7", "2", "none"], (r.stdout, r.stderr)


def test_forked_workers_import_and_draw_as_python_would(tmp_path) -> None:
    """From a folder holding a clone named `ftrun` and a `torch.py` that is not torch, with
    OMP_NUM_THREADS=4 (OpenBLAS starts its pool at import): the zygote still forks, and each
    worker has the installed packages, python's __file__, its own seeds and 4 threads."""
    job = tmp_path / "job"
    (job / "ftrun").mkdir(parents=True)  # a clone's folder: a namespace package to python
    (job / "ftrun" / "README.md").write_text("a clone of ftrun\n")
    (job / "torch.py").write_text("raise ImportError('the working directory was imported')\n")
    (job / "sub").mkdir()
    (job / "sub" / "fidelity.py").write_text((FIXTURES / "fork_fidelity.py").read_text())
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    # the installed command, as a user types it (`python -m ftrun` would put the folder's
    # torch.py before torch in the agent itself, as `python -m torch.distributed.run` does)
    launcher = str(Path(sys.executable).parent / "ftrun")
    r = subprocess.run([launcher, "--nproc", "2", "--max-restarts", "1", "--log-dir", str(logs),
                        "sub/fidelity.py", str(out)], cwd=job, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "4"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "starting workers as new processes" not in r.stderr
    assert [e["via"] for e in events(logs, "spawned")] == ["zygote"] * 4
    docs = {p.stem: json.loads(p.read_text()) for p in out.glob("fidelity_*.json")}
    assert sorted(docs) == ["fidelity_0_0", "fidelity_0_1", "fidelity_1_0", "fidelity_1_1"]
    for doc in docs.values():
        assert doc["zygote"] != 0 and doc["has_init"]
        assert not doc["torch_file"].startswith(str(job))
        assert not doc["ftrun_file"].startswith(str(job))
        assert doc["file"] == str(job / "sub" / "fidelity.py")
        assert doc["loader"] == "SourceFileLoader"
        assert doc["threads"] == 4
    for key in ("torch_rand", "random", "numpy"):
        values = [str(doc[key]) for doc in docs.values()]
        assert len(set(values)) == 4 or key == "numpy" and values == ["None"] * 4, (key, values)


def test_what_a_preload_starts_ends_with_the_job_and_its_prints_are_shown(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    # capture_output waits for every holder of the job's stdout and stderr to close them
    r = run_ftrun("--nproc", "1", "--preload", "spawner_mod", PROBE, str(tmp_path), timeout=60,
                  env={"PYTHONPATH": str(FIXTURES), "SPAWNER_PID_FILE": str(pid_file)})
    assert r.returncode == 0, r.stderr
    assert "spawner_mod: preloaded" in r.stdout
    assert [p["zygote"] != 0 for p in probes(tmp_path).values()] == [True]
    child = int(pid_file.read_text())
    wait_for(lambda: not pid_alive(child), 5, "the preload's process to end")


def test_a_stalled_preload_is_named_and_its_exit_status_reported(tmp_path) -> None:
    release = tmp_path / "release"
    proc = subprocess.Popen(ftrun_cmd("--nproc", "1", "--preload", "stalling_mod", PROBE,
                                      str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "STALL_UNTIL": str(release),
                                 "PYTHONPATH": str(FIXTURES)})
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the notice comes ~10 s after the zygote started
            seen.append(line)
            if "the zygote is still importing" in line:
                break
        release.touch()  # the import ends now, with os._exit(3)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = "".join(seen) + rest
    assert proc.returncode == 0, err  # the workers start as new processes
    # 10 s after the zygote started, or later when the agent's own start-up took longer
    assert re.search(r"the zygote is still importing stalling_mod after 1\d s \(--preload "
                     r"stalling_mod", err), err
    assert "the zygote exited with 3 while importing stalling_mod; starting workers as new " \
        "processes" in err
    assert [p["zygote"] for p in probes(tmp_path).values()] == [0]


def test_the_zygote_warms_torch_before_its_first_fork_where_workers_outnumber_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked cold, each worker pays torch's first optimizer, save and load (~1.4 s of CPU)
    itself: free with a core each, queued where they and the agent outnumber the cores."""
    from ftrun.adapters.zygote import warm_first, zygote_argv

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert not warm_first(8) and warm_first(16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert warm_first(2) and not warm_first(1)
    assert zygote_argv("py", 3, True, (), True)[-1] == "--warm-first"
    assert "--warm-first" not in zygote_argv("py", 3, False, (), True)  # no torch to warm


def test_a_run_forked_from_a_warmed_zygote_ends_without_the_bindings_leak_report(
        tmp_path) -> None:
    """The zygote freezes its objects (gc.freeze) and its warm-up imports triton; left
    frozen at exit, triton's bindings printed ~30 lines of "nanobind: leaked ..." per
    process at the end of every run (the zygote's and each worker's)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: its bindings' leak report cannot appear")
    script = tmp_path / "ends.py"
    script.write_text("import ftrun\nprint('ended')\n")
    r = run_ftrun("--nproc", "2", str(script), timeout=90)  # warmed first on 2 cores
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ended") == 2
    assert "nanobind" not in r.stderr, r.stderr[-2000:]
