"""A running job's `ftrun status --json` document, read in the test's own process.

Tests poll a job's status in loops, hundreds of times a run. As a command, each poll was a new
interpreter (~0.4 s of CPU: typer loads pydantic), most of a core of a 2-core host taken from
the jobs under test while a test waited. Read here, it is the same request on the agent's
control socket (`control.find_run` then `control.status`, as `ftrun status --json` does) for a
few milliseconds (~2 ms in the agent that answers, ~1.4 ms here). The command itself is
tested where its output is the subject (test_status_drills, test_control_hardening,
test_hsdp's table, test_multinode's table).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ftrun.adapters import control
from ftrun.core.errors import FtrunError

# Reads this close together are spaced out: wait_for polls every 20 ms, and 50 reads a second
# took ~14 % of a core (agent and test) from the job under test; 10 a second, ~3 %.
READ_GAP_S = 0.1
_last_read_at = [0.0]
# The run directory is read from os.environ: one reader at a time. A thread of the test that
# started a process meanwhile would hand it the directory being read (no test does).
_ENV_LOCK = threading.Lock()


@contextmanager
def _run_dir_of(env: Mapping[str, str] | None) -> Iterator[None]:
    """FTRUN_RUN_DIR as `env` sets it (or leaves it unset), for the length of one read."""
    if env is None:
        yield
        return
    with _ENV_LOCK:
        saved = os.environ.get("FTRUN_RUN_DIR")
        wanted = env.get("FTRUN_RUN_DIR")
        _set_run_dir(wanted)
        try:
            yield
        finally:
            _set_run_dir(saved)


def _set_run_dir(value: str | None) -> None:
    if value is None:
        os.environ.pop("FTRUN_RUN_DIR", None)
    else:
        os.environ["FTRUN_RUN_DIR"] = value


def job_status(env: Mapping[str, str] | None = None, run_id: str | None = None
               ) -> dict[str, Any] | None:
    """What `ftrun status [--run-id RUN_ID] --json` prints, parsed (the run directory `env`
    names, else this process's); None where the command exits 1 (no job there yet, or gone)."""
    time.sleep(max(0.0, _last_read_at[0] + READ_GAP_S - time.monotonic()))
    try:
        return _read(env, run_id)
    finally:
        _last_read_at[0] = time.monotonic()


def _read(env: Mapping[str, str] | None, run_id: str | None) -> dict[str, Any] | None:
    with _run_dir_of(env):
        try:
            doc = control.status(control.find_run(run_id)).to_json()
        except FtrunError:
            return None
    return dict(json.loads(json.dumps(doc)))  # tuples as lists, as the command's JSON has them
