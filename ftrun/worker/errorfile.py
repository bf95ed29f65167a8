"""A clean process exit for fault-tolerant workers.

Owns: remembering the exit status a script asked for, writing torch's error file for an
uncaught exception, and, at interpreter exit, ending the process with it through os._exit
once every open file's buffer is flushed (stdio, and files a script never closed, as the
interpreter's teardown would). An FT worker has threads blocked in
C++ calls (the generation watcher's store wait, waits on abandoned ops) and may hold leaked
gloo groups whose C++ threads still run; tearing C++ statics down under them crashed exits
here (SIGSEGV, or SIGABRT "terminate called without an active exception"), which the agent
would take for a new fault.
Known limit: the status of `sys.exit(n)`, `exit(n)`, `quit(n)` and of an uncaught exception is
kept; a bare `raise SystemExit(n)` at top level is not visible to Python code at exit and
leaves with 0.
Every atexit handler runs, as at a normal exit: those registered after `ftrun.init()` before
`_leave` (atexit runs the last registered first), the earlier ones (multiprocessing's clean-up
of its semaphores, logging's flush, the script's own) from `_leave`, each once.
Must not import: torch, typer, rich, ftrun modules other than core.leaving.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from ftrun.core.leaving import leave

_state: dict[str, Any] = {"armed": False, "installed": False, "code": 0}
_LATER: list[Callable[..., Any]] = []  # atexit handlers registered after _leave: run before it
_register, _unregister = atexit.register, atexit.unregister


def arm() -> None:
    """From now on the exit skips C++ teardown (an FT worker arms this in ftrun.init())."""
    _state["armed"] = True


def install() -> None:
    if _state["installed"]:
        return
    _state["installed"] = True
    real_exit, real_hook = sys.exit, sys.excepthook

    def exit_(status: object = None) -> None:
        _state["code"] = _code_of(status)
        real_exit(status)  # type: ignore[arg-type]

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _state["code"] = _code_of(value.code) if isinstance(value, SystemExit) else 1
        write_error_file(value)
        one_line = getattr(value, "one_line", None)  # ftrun's own errors: one line, a hint
        if callable(one_line) and not os.environ.get("FTRUN_DEBUG"):
            print(f"ftrun: error: {one_line()}", file=sys.stderr, flush=True)
            return
        real_hook(kind, value, tb)

    sys.exit = exit_  # type: ignore[assignment]
    for name in ("exit", "quit"):  # the site builtins raise SystemExit themselves
        if callable(getattr(builtins, name, None)):
            setattr(builtins, name, exit_)
    sys.excepthook = hook
    _register(_leave)
    atexit.register = _register_later  # type: ignore[assignment]
    atexit.unregister = _unregister_later


def _register_later(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    _LATER.append(func)
    return _register(func, *args, **kwargs)


def _unregister_later(func: Callable[..., Any]) -> None:
    _LATER[:] = [f for f in _LATER if f != func]
    _unregister(func)


def exit_code() -> int:
    """The status the process leaves with, as far as Python code has said (0 so far)."""
    return int(_state["code"])


def write_error_file(exc: BaseException) -> None:
    """torch's `@record` error-file format, so the agent's report shows this traceback (a
    replacement's own error when it keeps failing). A file `@record` wrote is kept."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    doc = {"message": {"message": f"{type(exc).__name__}: {exc}",
                       "extraInfo": {"py_callstack": stack,
                                     "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(doc, f)


def _code_of(status: object) -> int:
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    print(status, file=sys.stderr)
    return 1


def _leave() -> None:
    if not _state["armed"]:
        return
    for func in (*_LATER, _leave):  # these ran (or are running): not twice
        _unregister(func)
    leave(_state["code"])  # runs the handlers registered before ftrun.init(), as exit does
