"""Leaving a process as the interpreter would, less the interpreter's teardown.

Owns: `leave` (the atexit handlers not yet run, every open file's buffer flushed, then
os._exit) and `flush_open_files`. Two processes use it: an FT worker (whose C++ threads
crash a teardown) and the `ftrun` command itself, which imported torch for its store: freeing
torch's ~300,000 objects at teardown costs ~0.7 s of CPU on a 2-core host after the job's
work is done, and only the memory the kernel takes back anyway is freed by it.
What is skipped: `__del__` of objects still alive at exit (CPython does not promise it) and C++
static destructors. What is kept: atexit handlers (logging's flush, multiprocessing's clean-up,
weakref.finalize's, a script's own), each once, and what the teardown would write.
Must not import: anything outside the standard library (a worker imports this early).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """End the process with `code`: run the atexit handlers still registered (each once:
    running them unregisters them), flush what the teardown would, and skip the rest."""
    atexit._run_exitfuncs()
    with contextlib.suppress(Exception):  # whatever a file does, the process still leaves
        flush_open_files()
    os._exit(code)


def join_other_threads() -> None:
    """What the interpreter does before its atexit handlers: wait for every non-daemon
    thread (as long as it takes, as python does: such a thread is the program's own work)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def flush_open_files() -> None:
    """What the interpreter's own teardown would write: the buffers of every file still
    open (a script's log it never closed lost its lines at os._exit), text layers before
    the binary ones below them, stdio included."""
    # by type: isinstance reads __class__, which a dead weakref.proxy raises on
    found = [o for o in gc.get_objects() if issubclass(type(o), io.IOBase)]
    # twice over the binary layer: one over another (a GzipFile over a file) in either order
    for layer in (io.TextIOBase, io.BufferedIOBase, io.BufferedIOBase, io.RawIOBase):
        for stream in (o for o in found if isinstance(o, layer)):
            with contextlib.suppress(Exception):  # closed, read-only, a broken pipe: nothing
                if not stream.closed and stream.writable():
                    stream.flush()
    for std in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            std.flush()
