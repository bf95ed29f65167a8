import compileall
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
_SESSION_RUN_DIR: list[str] = []  # the run directory of this test process, removed at its end


def pytest_configure(config: pytest.Config) -> None:
    _compile_ftrun(config)
    _own_run_dir()


def _compile_ftrun(config: pytest.Config) -> None:
    """Python may run here with PYTHONDONTWRITEBYTECODE=1 (this host does): every process a
    test starts then compiled ftrun's sources anew, ~0.15 s of CPU for an agent and ~0.06 s
    for an `ftrun status` (8 of each, measured), ~180 processes in test_status_drills and
    test_leaks alone. Compiled once here, into the checkout's ignored __pycache__ folders,
    as an install's are (py_compile writes whatever that setting says; python still reads
    them). The fixtures' helper modules too: scripts import them."""
    if hasattr(config, "workerinput"):
        return  # an xdist worker: its controller compiled before starting it
    for folder in (FIXTURES.parent.parent / "ftrun", FIXTURES):
        compileall.compile_dir(folder, quiet=1)


def _own_run_dir() -> None:
    """This test process (one of `-n` xdist workers, or the only one) gets a run directory of
    its own: a job one test starts is never listed by another process's `ftrun status`, nor
    are the user's own jobs. Short, under /tmp: a socket path holds 107 bytes."""
    base = tempfile.mkdtemp(prefix="ftrun-t", dir="/tmp")
    _SESSION_RUN_DIR.append(base)
    os.environ["FTRUN_RUN_DIR"] = os.path.join(base, "run")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist (`-n 2 --dist loadfile --no-loadscope-reorder`), files holding long runs (a
    `slow` test) first, the others after, each file's tests in their own order: the long
    files start early and the many short ones fill the end, so neither process idles while
    the other finishes one long file."""
    if not getattr(config.option, "numprocesses", None):
        return  # one process: the files in their usual order
    long_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in long_files)


def pytest_unconfigure(config: pytest.Config) -> None:
    for base in _SESSION_RUN_DIR:
        shutil.rmtree(base, ignore_errors=True)


def ftrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ftrun", *args]


def run_ftrun(*args: str, timeout: float = 60, env: dict[str, str] | None = None,
              cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(ftrun_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd)


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture
def fixture_path() -> Callable[[str], str]:
    return lambda name: str(FIXTURES / name)


@pytest.fixture(autouse=True)
def _private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launchers started by a test keep their temporary log directories inside the test's."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.fixture
def private_run_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A run directory of the test's own: `ftrun status` sees only the test's jobs. Not under
    tmp_path: pytest's numbered base directories grow past what a Unix socket path allows."""
    d = Path(tempfile.mkdtemp(prefix="ftrun-test-", dir="/tmp")) / "run"
    monkeypatch.setenv("FTRUN_RUN_DIR", str(d))
    yield d
    shutil.rmtree(d.parent, ignore_errors=True)
