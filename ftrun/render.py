"""Turning results into text for people: rich on a terminal, plain when piped.

Owns: printing agent notices and the end-of-run failure report.
Must not import: torch, the agent internals (it receives plain data).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

from ftrun.report import WorkerExit, failure_block

_PHASES = (("published", "published_at"), ("noticed", "noticed"), ("rebuilt", "rebuilt"),
           ("healed", "healed"), ("committed", "first_commit"))


def use_rich(stream: TextIO) -> bool:
    return stream.isatty()


def notice(kind: str, fields: Mapping[str, object], stream: TextIO = sys.stderr) -> None:
    text = _notice_text(kind, fields)
    if text:
        print(f"ftrun: {text}", file=stream, flush=True)


def _notice_text(kind: str, f: Mapping[str, object]) -> str | None:
    if kind == "notice":
        return str(f["text"])
    if kind == "failure":
        return str(f["reason"])
    if kind == "fault":
        return str(f["reason"])
    if kind == "generation":
        return f"generation {f['generation']}: {f['world_size']} workers ({f['reason']})"
    if kind == "recovered" and f.get("fault_at"):
        t0 = float(str(f["fault_at"]))
        phases = ", ".join(f"{name} +{(float(str(f[key])) - t0) * 1000:.0f}"
                           for name, key in _PHASES if f.get(key))
        return (f"generation {f['generation']} committed step {f['step']} "
                f"(ms after the fault: {phases})")
    if kind == "restart":
        return f"restart {f['attempt']} starting"
    if kind == "signal":
        if f["workers"]:
            return (f"received {f['signal']}; forwarded to {f['workers']} workers, "
                    f"SIGKILL in {f['grace_s']}s (send it again to kill now)")
        return f"received {f['signal']} again; killing the workers now"
    return None


def print_failure(title: str, cause: WorkerExit, exits: tuple[WorkerExit, ...],
                  restarts_used: int, max_restarts: int, log_dir: str | None,
                  stream: TextIO = sys.stderr) -> None:
    lines = failure_block(title, cause, exits, restarts_used, max_restarts, log_dir)
    if use_rich(stream):
        from rich.console import Console
        from rich.panel import Panel
        from rich.text import Text

        body = Text("\n".join(lines[1:]))
        Console(file=stream).print(Panel(body, title=f"[bold red]{lines[0]}", expand=False))
        return
    width = min(max(len(ln) for ln in lines), 60)
    print("\n".join(["=" * width, lines[0], "-" * width, *lines[1:], "=" * width]),
          file=stream, flush=True)
