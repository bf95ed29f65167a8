"""A worker that abandoned a communicator leaves through os._exit with the status it asked for."""
import os
import subprocess
import sys

import pytest

PROLOGUE = ("from ftrun.worker import errorfile\nerrorfile.install()\nerrorfile.arm()\n"
            "import atexit\n")


@pytest.mark.parametrize("body, code", [
    ("pass", 0),
    ("import sys; sys.exit(3)", 3),
    ("raise ValueError('x')", 1),
    ("import sys; sys.exit('bye')", 1),
    ("exit(6)", 6),  # the site builtins, which raise SystemExit themselves
    ("quit(7)", 7),
])
def test_exit_status_is_kept(body: str, code: int) -> None:
    late = "atexit.register(lambda: print('user atexit ran', flush=True))\n"
    r = subprocess.run([sys.executable, "-c", PROLOGUE + late + body], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == code, r.stderr
    assert "user atexit ran" in r.stdout  # handlers registered after ftrun's still run


def test_not_armed_exits_normally() -> None:
    r = subprocess.run([sys.executable, "-c", "from ftrun.worker import errorfile\n"
                        "errorfile.install()\n"
                        "import sys; sys.exit(5)"], capture_output=True, timeout=30)
    assert r.returncode == 5


def test_handlers_registered_before_ftrun_run_once_as_at_a_normal_exit(tmp_path) -> None:
    """multiprocessing registers its clean-up when torch is imported, before ftrun.init():
    skipped, a spawn-context queue left its semaphores in /dev/shm on every run."""
    code = (
        "import atexit, multiprocessing, os, sys\n"
        "atexit.register(lambda: print('early ran', flush=True))\n"
        "q = multiprocessing.get_context('spawn').Queue()\n"
        "print('sems', q._rlock._semlock.name, q._wlock._semlock.name if q._wlock else '',"
        " q._sem._semlock.name, flush=True)\n"
        + PROLOGUE +
        "atexit.register(lambda: print('late ran', flush=True))\n"
        "def dropped(): print('unregistered ran', flush=True)\n"
        "atexit.register(dropped)\n"
        "atexit.unregister(dropped)\n"
        "sys.exit(4)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 4, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1:] == ["late ran", "early ran"], r.stdout  # once each, last registered first
    names = [n for n in lines[0].split()[1:] if n]
    assert names and all(n.startswith("/mp-") for n in names), lines[0]
    leaked = [n for n in names if os.path.exists(f"/dev/shm/sem.{n[1:]}")]
    assert not leaked, leaked


def test_files_a_script_never_closed_keep_what_it_wrote(tmp_path) -> None:
    """The interpreter's teardown flushes the buffers of files still open; os._exit would
    not: a script's log it never closed lost its last lines. Text over binary, binary alone,
    an exception on the way out, a read-only file, a closed one and a dead weak proxy
    beside them."""
    text, raw, seen = (tmp_path / n for n in ("log.txt", "data.bin", "read.txt"))
    seen.write_text("x")
    code = (PROLOGUE +
            f"log = open({str(text)!r}, 'w')\nlog.write('step 1\\n' * 1000 + 'last line')\n"
            f"data = open({str(raw)!r}, 'wb')\ndata.write(b'\\x01' * 10)\n"
            f"keep = [open({str(seen)!r}), open({str(seen)!r}, 'a')]\nkeep[1].close()\n"
            "import weakref\nclass Gone: pass\n"
            "dead = [weakref.proxy(Gone())]\n"  # tracked by the gc, raises on __class__
            "raise RuntimeError('on the way out')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "on the way out" in r.stderr, r.stderr
    assert "ReferenceError" not in r.stderr  # the exit went through os._exit, not teardown
    assert text.read_text().endswith("step 1\nlast line")
    assert raw.read_bytes() == b"\x01" * 10


def test_the_commands_exit_waits_for_its_threads_runs_its_handlers_and_flushes(tmp_path) -> None:
    """`ftrun` itself leaves through core.leaving (its torch teardown skipped): a non-daemon
    thread still working is waited for, as python waits, then the atexit handlers run, and
    a file left open keeps what was written to it, the thread's last line included."""
    log = tmp_path / "log.txt"
    code = (
        "import atexit, threading, time\n"
        "from ftrun.core.leaving import join_other_threads, leave\n"
        f"log = open({str(log)!r}, 'w')\n"
        "def work():\n"
        "    time.sleep(0.3)\n"
        "    log.write('thread done\\n')\n"
        "threading.Thread(target=work).start()\n"
        "atexit.register(lambda: log.write('handler ran\\n'))\n"
        "join_other_threads()\n"
        "leave(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 3, r.stderr
    assert log.read_text() == "thread done\nhandler ran\n"
