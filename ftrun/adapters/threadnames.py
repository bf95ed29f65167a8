"""The agent's threads named for the operating system as Python names them.

On Linux a thread's OS name (`/proc/<pid>/task/<tid>/comm`, `top -H`, `ps -L`, py-spy) is the
process's, "python", for every thread the threading module starts, up to Python 3.13 (3.14
names them itself). An agent coordinating 1,024 nodes runs a dozen threads (its loop, the
store servers, the status builder, the control server...); telling which one uses a core
(issue #52: the leader's CPU per fault, measured per thread) needs their names.

Owns: `name_os_threads()`, the process-wide hook, and `set_os_thread_name()`.
Must not import: torch, typer, rich, other ftrun modules.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import threading
from types import FrameType
from typing import Any

OS_NAME_BYTES = 15  # the kernel keeps 15 bytes and a NUL
_PR_SET_NAME = 15  # prctl(2)


@functools.cache
def _prctl() -> Any:
    """libc's prctl, loaded once (None where there is none)."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


def set_os_thread_name(name: str) -> bool:
    """The calling thread's OS name (its first 15 bytes); False where it could not be set
    (not Linux, no libc): a name is a convenience, never a reason to fail."""
    prctl = _prctl() if sys.platform.startswith("linux") else None
    if prctl is None:
        return False
    raw = name.encode("utf-8", "replace")[:OS_NAME_BYTES]
    return bool(prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0)


def name_os_threads() -> None:
    """From now on every thread the threading module starts names its OS thread after its
    Python name as it starts (threads started before keep theirs)."""
    if sys.platform.startswith("linux"):
        threading.setprofile(_name_then_step_aside)


def _name_then_step_aside(frame: FrameType, event: str, arg: Any) -> None:
    # threading calls sys.setprofile(hook) in a new thread before its run(); the first event
    # names the thread, and the hook removes itself so that nothing else is profiled
    sys.setprofile(None)
    set_os_thread_name(threading.current_thread().name)
