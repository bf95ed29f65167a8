"""What went wrong, in words: worker failures, the root cause, hints, the error-file contract.

Owns: `WorkerExit` records, reading torch's `@record` error files, hints for common exit
statuses, the plain-text failure block, and which failure is the root cause (the first one
the agent saw, `root_cause`), the one copied to the launcher's own TORCHELASTIC_ERROR_FILE.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ftrun.core.exits import describe_exit

_HINTS = {
    -signal.SIGKILL: "SIGKILL that no one here sent: most often the kernel's OOM killer "
    "(check `dmesg` or the cgroup's memory.events)",
    -signal.SIGSEGV: "segmentation fault in native code "
    "(run with PYTHONFAULTHANDLER=1 for a stack)",
    -signal.SIGBUS: "bus error: often /dev/shm is too small for shared-memory tensors",
    -signal.SIGABRT: "aborted: a C++ exception or assertion in native code",
    -signal.SIGTERM: "terminated from outside the launcher",
}


@dataclass(frozen=True)
class WorkerExit:
    """One worker's end, as seen by the agent."""

    rank: int
    local_rank: int
    pid: int
    returncode: int
    detected_at: float  # monotonic, for ordering
    wall_time: float
    error_file: str = ""
    killed_by_launcher: bool = False
    sent_by_ftrun: str = ""  # why ftrun itself signalled it (a drill, a hang), if it did

    @property
    def failed(self) -> bool:
        return self.returncode != 0 and not self.killed_by_launcher


@dataclass(frozen=True)
class ErrorFileInfo:
    message: str
    traceback: str
    raw: dict[str, object]


def read_error_file(path: str) -> ErrorFileInfo | None:
    """Parse torch's `@record` error file (nested or flat form); None if absent or unreadable."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    msg = raw.get("message")
    if isinstance(msg, dict):
        extra = msg.get("extraInfo", {})
        tb = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        return ErrorFileInfo(message=str(msg.get("message", "")), traceback=str(tb), raw=raw)
    return ErrorFileInfo(message=str(msg or ""), traceback=str(msg or ""), raw=raw)


def hint_for(returncode: int, has_error_file: bool, sent_by_ftrun: str = "") -> str:
    if returncode < 0 and sent_by_ftrun:
        return (f"ftrun sent this signal itself (a '{sent_by_ftrun}' fault drill or detector), "
                f"not the OOM killer")
    if returncode in _HINTS:
        return _HINTS[returncode]
    if returncode > 0 and not has_error_file:
        return ("see the worker's stderr above; decorate main() with "
                "torch.distributed.elastic.multiprocessing.errors.record for a traceback here")
    return ""


def root_cause(ended_on: WorkerExit, others: Sequence[WorkerExit]) -> WorkerExit:
    """The first failure the agent observed: the earliest failed exit of the attempt (a
    fault survived before the one the job ended on counts), else `ended_on` itself."""
    failed = [e for e in (ended_on, *others) if e.failed]
    return min(failed, key=lambda e: e.detected_at, default=ended_on)  # a tie: `ended_on`


def failure_block(title: str, cause: WorkerExit, others: Sequence[WorkerExit],
                  restarts_used: int, max_restarts: int, log_dir: str | None) -> list[str]:
    """Plain lines, close to torchrun's ChildFailedError block, root cause first. `cause`:
    the exit the job ended on; the root cause is the first failure observed, which may be an
    earlier one."""
    root = root_cause(cause, others)
    info = read_error_file(root.error_file)
    lines = [f"{title} FAILED", "Root cause (first observed failure):"]
    lines += _describe(root, info)
    hint = hint_for(root.returncode, info is not None, root.sent_by_ftrun)
    if hint:
        lines.append(f"  hint      : {hint}")
    if root is not cause:  # with its traceback: a crash loop's why is the last failure's
        lines += ["The job ended on:", _one_line(cause),
                  *_traceback_lines(read_error_file(cause.error_file))]
    rest = [e for e in others if e is not cause and e is not root]
    if rest:
        lines.append("Other workers:")
    lines += [_one_line(e) for e in sorted(rest, key=lambda e: e.rank)]
    lines.append(f"Restarts used: {restarts_used}/{max_restarts}")
    if log_dir:
        lines.append(f"Logs: {log_dir}")
    return lines


def _one_line(e: WorkerExit) -> str:
    what = ("terminated by launcher" if e.killed_by_launcher
            else f"exit {describe_exit(e.returncode)}")
    return f"  rank {e.rank} (local_rank {e.local_rank}, pid {e.pid}): {what}"


def _describe(e: WorkerExit, info: ErrorFileInfo | None) -> list[str]:
    stamp = time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(e.wall_time))
    lines = [
        f"  time      : {stamp}",
        f"  host      : {socket.gethostname()}",
        f"  rank      : {e.rank} (local_rank: {e.local_rank})",
        f"  exitcode  : {describe_exit(e.returncode)} (pid: {e.pid})",
        f"  error_file: {e.error_file if info else '<none written>'}",
    ]
    if info is not None and info.traceback:
        lines += _traceback_lines(info)
    elif e.returncode < 0:
        lines.append(f"  traceback : killed by {describe_exit(e.returncode)}")
    return lines


def _traceback_lines(info: ErrorFileInfo | None) -> list[str]:
    if info is None or not info.traceback:
        return []
    return ["  traceback :", *("    " + ln for ln in info.traceback.rstrip().splitlines())]


def copy_to_parent_error_file(cause: WorkerExit, parent_path: str | None) -> None:
    """torchrun's contract: a launcher started under a scheduler hands the root cause up."""
    if not parent_path:
        return
    info = read_error_file(cause.error_file)
    if info is not None:
        doc: dict[str, object] = dict(info.raw)
        msg = doc.get("message")
        if isinstance(msg, dict):
            msg["errorCode"] = cause.returncode
    else:
        doc = {"message": {"message": f"worker rank {cause.rank} exited with "
                                      f"{describe_exit(cause.returncode)}",
                           "extraInfo": {"timestamp": str(int(cause.wall_time))},
                           "errorCode": cause.returncode}}
    os.makedirs(os.path.dirname(os.path.abspath(parent_path)), exist_ok=True)
    with open(parent_path, "w") as f:
        json.dump(doc, f)


def error_text(path: str, limit: int = 64 * 1024) -> str:
    """A worker's error file as text (the first `limit` bytes), "" when it wrote none."""
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read(limit)
