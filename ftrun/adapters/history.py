"""Where `ftrun report --last` finds the last run: `<ftrun run dir>/last-run` names its log
directory; a temporary log directory removed after a clean run leaves its event log and
timeline in `<ftrun run dir>/history/<run>/` (the newest `KEEP` are kept).

Owns: remembering the last run, keeping a removed run's report files, finding them again.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from ftrun.adapters.control import run_dir

KEEP = 10  # runs kept under history/
LAST = "last-run"  # not a `.json`: those are live runs' files


def remember(run_id: str, log_run_dir: str | None) -> None:
    """This run is the last one started on this host (None: it keeps no log)."""
    _write_last({"run_id": run_id, "log_dir": log_run_dir, "pid": os.getpid()})


def keep(run_id: str, log_run_dir: str, files: tuple[str, ...]) -> str | None:
    """Copy `files` (what `ftrun report` reads) of a log directory about to be removed; their
    new home."""
    name = os.path.basename(os.path.normpath(log_run_dir)) or run_id
    home = os.path.join(run_dir(), "history", name)
    try:
        os.makedirs(home, exist_ok=True)
        for f in files:
            src = os.path.join(log_run_dir, f)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(home, f))
    except OSError:
        return None  # the report is lost with the run's logs: nothing else is
    _prune(os.path.dirname(home))
    last = last_run()
    if last is None or last[1] == log_run_dir:
        _write_last({"run_id": run_id, "log_dir": home, "pid": os.getpid()})
    return home


def last_run() -> tuple[str, str | None] | None:
    """(run id, its log directory or None when it kept none) of the last run, if any."""
    try:
        with open(os.path.join(run_dir(), LAST)) as f:
            doc = json.load(f)
        return str(doc["run_id"]), (str(doc["log_dir"]) if doc.get("log_dir") else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_last(doc: dict[str, object]) -> None:
    path = os.path.join(run_dir(), LAST)
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)


def _prune(history: str) -> None:
    entries = sorted((e for e in os.scandir(history) if e.is_dir()),
                     key=lambda e: e.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        shutil.rmtree(old.path, ignore_errors=True)
