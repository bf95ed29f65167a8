"""Shared by scripts/gpu/gpu_check.py and its sections: verdicts, the section's deadline, logging.

Imported, never run: gpu_check.py is the entry point. The section name and deadline live here
(set once by `enter` in the child) so that every module's `say` and `left` see the same ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")
SKIP_RC = 3
_name, _deadline = "", time.monotonic() + 600  # a child's section and its own deadline
JOBS: list[subprocess.Popen[bytes]] = []  # ftrun jobs a child started: killed when it leaves


def enter(section: str, deadline: float) -> None:
    """In the child: the section its lines are tagged with, and the monotonic deadline."""
    global _name, _deadline
    _name, _deadline = section, deadline


class Skip(Exception):
    """The section cannot run on this machine."""


class Failed(Exception):
    """An expectation was not met (the message says which)."""


def say(text: str) -> None:
    print(f"[{_name}] {text}", flush=True)


def check(ok: object, what: str) -> None:
    if not ok:
        raise Failed(what)


def left(cap: float) -> float:
    """A timeout of at most `cap` that ends before the section's deadline."""
    return max(3.0, min(cap, _deadline - time.monotonic()))


def ms_since(t: float) -> float:
    return 1000 * (time.monotonic() - t)


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0][:300] if lines else ""
    return text if isinstance(exc, (Failed, Skip)) else f"{type(exc).__name__}: {text}"


def where(exc: BaseException) -> None:
    """The innermost frame of an unexpected exception, and this repository's frames above it."""
    if isinstance(exc, (Failed, Skip)):
        return
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb[:-1] if f.filename.startswith(ROOT)][-3:] + tb[-1:]
    short = [os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT)
             else os.path.basename(f.filename) for f in frames]
    say("  at " + " <- ".join(f"{n}:{f.lineno} {f.name}"
                              for n, f in reversed(list(zip(short, frames, strict=True)))))


def parts(*steps: tuple[str, Callable[[], None]]) -> None:
    """Sub-checks of a section: each runs even when an earlier one failed."""
    failed = []
    for label, fn in steps:
        try:
            fn()
        except Exception as exc:
            where(exc)
            say(f"{label}: FAIL: {one_line(exc)}")
            failed.append(f"{label}: {one_line(exc)}")
    check(not failed, "; ".join(failed))
