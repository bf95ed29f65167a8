"""One file descriptor that wakes the agent's event loop: for handled signals and for other
threads (the request reader, the control server, the GPU monitor).

Owns: installing and restoring the handlers of --signals-to-handle, the signal wakeup fd, the
list of signals received, and a thread-safe `wake()`.
Must not import: torch, typer, rich, other ftrun modules.
"""

from __future__ import annotations

import contextlib
import select
import signal
import socket
from typing import Any


class Wakeup:
    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)
        self.signals: list[int] = []
        self._old_handlers: dict[int, Any] = {}
        self._old_fd = -1

    def install(self, names: tuple[str, ...]) -> None:
        self._old_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for name in names:
            signum = getattr(signal, name)
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)

    def pop_signal(self) -> int | None:
        return self.signals.pop(0) if self.signals else None

    def wake(self) -> None:
        """From any thread: make the loop's select() return."""
        with contextlib.suppress(OSError):
            self._writer.send(b"\0")

    def wait(self, timeout_s: float) -> None:
        """Block until woken (or a signal), at most `timeout_s`; then drain."""
        select.select([self.reader], [], [], timeout_s)
        self.drain()

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self.reader.recv(4096):
                pass

    def close(self) -> None:
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self._old_fd)
        self.reader.close()
        self._writer.close()
