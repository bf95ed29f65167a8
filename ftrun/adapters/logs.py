"""Worker output: torchrun's log-directory layout, -r/--redirects, -t/--tee and prefixes.

Owns: the run and attempt directories, the per-worker stream plumbing (files, pipes, reader
threads that copy tee'd lines to the console with `[default0]:` prefixes, line by line).
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import string
import tempfile
import threading
from dataclasses import dataclass, field
from typing import IO

from ftrun.core import timeouts
from ftrun.core.spec import STDERR, STDOUT, RunSpec

_CONSOLE_LOCK = threading.Lock()
_READ_SIZE = 65536
PARTIAL_LINE_MAX = 65536  # a line without newline goes to the console in pieces of this size
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def _write_console(fd: int, data: bytes) -> None:
    with _CONSOLE_LOCK:
        while data:
            data = data[os.write(fd, data):]


@dataclass
class WorkerStreams:
    """What one worker's stdout/stderr are connected to, and the threads that copy them."""

    stdout: int | IO[bytes] | None
    stderr: int | IO[bytes] | None
    error_file: str
    log_dir: str | None
    _to_close_after_spawn: list[int] = field(default_factory=list)
    _pumps: list[threading.Thread] = field(default_factory=list)
    _files: list[IO[bytes]] = field(default_factory=list)

    def after_spawn(self) -> None:
        for fd in self._to_close_after_spawn:
            os.close(fd)
        self._to_close_after_spawn.clear()
        for pump in self._pumps:
            pump.start()

    def close(self) -> None:
        for fd in self._to_close_after_spawn:  # spawn failed
            os.close(fd)
        self._to_close_after_spawn.clear()
        for pump in self._pumps:
            if pump.is_alive() or pump.ident is not None:
                pump.join(timeouts.LOG_DRAIN_S)
        for f in self._files:
            f.close()


class RunLogs:
    """`<log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/{stdout,stderr}.log,error.json`."""

    def __init__(self, spec: RunSpec, run_id: str) -> None:
        self.spec = spec
        self.disabled = spec.log_dir == os.devnull
        self.temporary = spec.log_dir is None
        self.base: str | None = None
        self.run_dir: str | None = None
        if not self.disabled:
            self.base = spec.log_dir or tempfile.mkdtemp(prefix="ftrun_")
            os.makedirs(self.base, exist_ok=True)
            self.run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=self.base)
        self.wrote_logs = False

    def worker_dir(self, attempt: int, local_rank: int, worker_id: int | None = None
                   ) -> str | None:
        """torchrun's `attempt_<n>/<local_rank>`; a replacement started during the attempt
        gets `<local_rank>.w<worker id>` so it never overwrites the lost worker's files."""
        if self.run_dir is None:
            return None
        name = str(local_rank) if worker_id is None else f"{local_rank}.w{worker_id}"
        path = os.path.join(self.run_dir, f"attempt_{attempt}", name)
        os.makedirs(path, exist_ok=True)
        return path

    def keep_error(self, attempt: int, name: str, text: str) -> str:
        """Store another node's worker error file as `attempt_<n>/<name>/error.json`."""
        if not text or self.run_dir is None:
            return ""
        where = os.path.join(self.run_dir, f"attempt_{attempt}", name)
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, "error.json"), "w") as f:
            f.write(text)
        return os.path.join(where, "error.json")

    def streams_for(self, attempt: int, local_rank: int, rank: int,
                    worker_id: int | None = None) -> WorkerStreams:
        wdir = self.worker_dir(attempt, local_rank, worker_id)
        streams = WorkerStreams(
            stdout=None, stderr=None, log_dir=wdir,
            error_file=os.path.join(wdir, "error.json") if wdir else "",
        )
        redirect = self.spec.redirects.for_rank(local_rank) | self.spec.tee.for_rank(local_rank)
        tee = self.spec.tee.for_rank(local_rank)
        visible = self.spec.console_visible(local_rank)
        prefix = self._prefix(local_rank, rank).encode()
        for bit, name, console_fd in ((STDOUT, "stdout", 1), (STDERR, "stderr", 2)):
            target = self._stream(streams, wdir, name, console_fd, prefix,
                                  to_file=bool(redirect & bit) or not visible,
                                  to_console=visible and (bool(tee & bit) or not redirect & bit))
            setattr(streams, name, target)
        return streams

    def _stream(self, streams: WorkerStreams, wdir: str | None, name: str, console_fd: int,
                prefix: bytes, to_file: bool, to_console: bool) -> int | IO[bytes] | None:
        if not to_file:
            return None if to_console else _devnull(streams)
        file: IO[bytes] | None = None
        if wdir is not None:
            # kept open for the worker's lifetime; WorkerStreams.close() closes it
            file = open(os.path.join(wdir, f"{name}.log"), "ab", buffering=0)  # noqa: SIM115
            streams._files.append(file)
            self.wrote_logs = True
        if not to_console:
            return file if file is not None else _devnull(streams)
        read_fd, write_fd = os.pipe()
        streams._to_close_after_spawn.append(write_fd)
        pump = threading.Thread(target=_pump, args=(read_fd, file, console_fd, prefix),
                                name=f"ftrun-tee-{name}", daemon=True)
        streams._pumps.append(pump)
        return write_fd

    def _prefix(self, local_rank: int, rank: int) -> str:
        template = os.environ.get(PREFIX_TEMPLATE_ENV)
        if template is None:
            return f"[{self.spec.role}{local_rank}]:"
        return string.Template(template).safe_substitute(
            role_name=self.spec.role, rank=rank, local_rank=local_rank)

    def removable(self, succeeded: bool) -> bool:
        """A temporary log directory that holds nothing worth keeping, after this result."""
        return self.temporary and succeeded and not self.wrote_logs and bool(self.base)

    def cleanup(self, succeeded: bool) -> bool:
        """Drop a temporary log directory that holds nothing worth keeping. True if removed."""
        if self.removable(succeeded) and self.base:
            shutil.rmtree(self.base, ignore_errors=True)
            return True
        return False


def _devnull(streams: WorkerStreams) -> IO[bytes]:
    f = open(os.devnull, "wb")  # noqa: SIM115 - closed by WorkerStreams.close()
    streams._files.append(f)
    return f


def _pump(read_fd: int, file: IO[bytes] | None, console_fd: int, prefix: bytes) -> None:
    """Copy a worker's pipe to its log file (raw) and the console (prefixed), line by line.

    Only the chunk just read is searched for a newline, and a partial line (a progress bar
    redrawn with `\r`) goes out once it reaches PARTIAL_LINE_MAX: re-searching or holding an
    unbounded line made output without newlines quadratic in time and unbounded in memory.
    """
    pending = bytearray()
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while True:
            chunk = pipe.read(_READ_SIZE)
            if not chunk:
                break
            # a failed write (a full disk, a closed console pipe) must never stop the
            # draining, or the worker blocks on a full pipe
            if file is not None:
                with contextlib.suppress(OSError):
                    _write_file(file, chunk)
            out = _take_lines(pending, chunk, prefix)
            if out:
                with contextlib.suppress(OSError):
                    _write_console(console_fd, out)
    if pending:
        with contextlib.suppress(OSError):
            _write_console(console_fd, prefix + pending + b"\n")


def _take_lines(pending: bytearray, chunk: bytes, prefix: bytes) -> bytes:
    """Add `chunk` to the partial line in `pending` and return what is ready for the console:
    the complete lines, each prefixed, or the partial line itself once it is too long (ended
    with a newline of its own, so that no other worker's line lands in its middle)."""
    last = chunk.rfind(b"\n")
    if last < 0:
        pending += chunk
        pieces = []
        while len(pending) >= PARTIAL_LINE_MAX:
            pieces.append(prefix + pending[:PARTIAL_LINE_MAX] + b"\n")
            del pending[:PARTIAL_LINE_MAX]
        return b"".join(pieces)
    head = bytes(pending) + chunk[:last] if pending else chunk[:last]
    pending[:] = chunk[last + 1:]
    return b"".join(prefix + line + b"\n" for line in head.split(b"\n"))


def _write_file(file: IO[bytes], data: bytes) -> None:
    """The whole chunk: an unbuffered file may take part of it per call."""
    view = memoryview(data)
    while view:
        written = file.write(view)
        if not written:  # nothing taken (never for a regular file): do not spin
            return
        view = view[written:]
