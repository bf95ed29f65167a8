"""The local control channel of a run: a Unix socket private to the user, and its client.

Owns: the per-user run directory (`$XDG_RUNTIME_DIR/ftrun` or `/tmp/ftrun-<uid>`, mode 0700,
never a symlink nor someone else's) holding `<name>.sock` (mode 0600) and `<name>.json` (who
and what), finding this user's runs (what dead ones left there is removed, and their
shared-memory slots), the wire format (one JSON object per line), and the torch-free client
of `ftrun status` and `ftrun inject-fault` (`status()`: the job's document as its
`protocol.status` record). The server is adapters/control_server.py's.
Must not import: torch, typer, rich, the agent, control_server.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ftrun.adapters.leftovers import alive, remove_dead_slots
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError
from ftrun.protocol.control_ops import StatusOp
from ftrun.protocol.status import Status

MAX_REPLY = 64 << 20  # a status document of a very large job; bounds the client's memory
_MAX_META = 1 << 16  # a `<name>.json` file larger than this was not written by ftrun
_NO_RUN_DIR_HINT = "set FTRUN_RUN_DIR to a directory of your own"


def run_dir() -> str:
    """The run directory, created if missing; refused if it is a symlink or not this user's,
    made private (0700) if it is this user's with group or other permissions."""
    base = os.environ.get("FTRUN_RUN_DIR")
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "ftrun") if xdg else f"/tmp/ftrun-{os.getuid()}"
    base = os.path.abspath(base)  # also drops a trailing slash, which would follow a link
    try:
        os.makedirs(os.path.dirname(base), exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(base, 0o700)
    except OSError as exc:
        raise FtrunError(f"cannot create the run directory {base} ({exc.strerror})",
                         hint=_NO_RUN_DIR_HINT) from None
    _make_private(base)
    return base


def _make_private(base: str) -> None:
    if os.path.islink(base):
        raise FtrunError(f"the run directory {base} is a symbolic link, which another user "
                         "could point anywhere", hint=f"remove it, or {_NO_RUN_DIR_HINT}")
    try:  # checked through the opened directory: a link swapped in after islink() fails here
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise FtrunError(f"cannot use {base} as the run directory ({exc.strerror})",
                         hint=_NO_RUN_DIR_HINT) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise FtrunError(f"the run directory {base} belongs to uid {st.st_uid}, not to you",
                             hint=f"remove it, or {_NO_RUN_DIR_HINT}")
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    pid: int
    script: str
    started_at: float
    socket: str
    log_dir: str | None
    job: str | None = None  # what one multi-node job's agents share (its rendezvous)

    @property
    def alive(self) -> bool:
        return alive(self.pid)


def _ending(pid: int, grace_s: float = timeouts.JOB_EXIT_GRACE_S) -> bool:
    """The agent that closed a connection unanswered is gone, or dead and not yet reaped by
    its parent (a zombie: `kill -0` still finds it), within `grace_s` (its sockets close a
    moment before it becomes one). A live one means: try again."""
    import psutil

    deadline = time.monotonic() + grace_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return not alive(pid)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


class JobGone(FtrunError):
    """The job's control socket is gone or has no listener: the job has ended."""


def one_line(what: object) -> str:
    return " ".join(str(what).split())[:300]


def recv_line(conn: socket.socket, limit: int, total_s: float) -> bytes:
    """Bytes up to and including the first newline (or the peer closing), at most `limit`
    of them, within `total_s`; each wait for more is also bounded by the socket's timeout."""
    deadline = time.monotonic() + total_s
    data = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise FtrunError(f"no complete message within {total_s:g} s",
                             hint="the other side is stalled")
        conn.settimeout(min(left, timeouts.CONTROL_REQUEST_S))
        chunk = conn.recv(1 << 16)
        if not chunk:
            return bytes(data)
        data += chunk
        if len(data) > limit:
            raise FtrunError(f"message larger than {limit} bytes",
                             hint="a request is one small JSON object")
        if b"\n" in chunk:
            return bytes(data)


def send_doc(conn: socket.socket, doc: dict[str, Any]) -> None:
    conn.sendall(json.dumps(doc).encode() + b"\n")


def write_private(path: str, data: bytes) -> None:
    """Replace `path` with a 0600 file holding data, never writing through a planted link."""
    tmp = f"{path}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # readers see the whole file or none


# ---------------------------------------------------------------- client side
def list_runs() -> list[RunInfo]:
    """This user's live runs, oldest first. What dead ones left (a whole process tree
    SIGKILLed: its guardian could not clean up) is removed on the way: their run files here
    and their shared-memory snapshot slots."""
    remove_dead_slots()
    base = run_dir()
    runs = []
    for name in sorted(os.listdir(base)):
        info = _read_run(base, name) if name.endswith(".json") else None
        if info is None:
            continue
        if info.alive:
            runs.append(info)
            continue
        # the socket's name comes from the file's, never from its contents: a stale file
        # must not be able to name what gets deleted
        for stale in (os.path.join(base, name), info.socket):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
    return sorted(runs, key=lambda r: r.started_at)


def _read_run(base: str, name: str) -> RunInfo | None:
    """The run a `<name>.json` describes; None for anything ftrun did not write."""
    try:  # not through a link, and a FIFO does not block the read
        fd = os.open(os.path.join(base, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > _MAX_META:
            return None
        try:
            doc = json.loads(f.read(_MAX_META))
        except (OSError, ValueError, RecursionError):
            return None
    if not isinstance(doc, dict):
        return None
    run_id, pid, script = doc.get("run_id"), doc.get("pid"), doc.get("script")
    started, log_dir, job = doc.get("started_at"), doc.get("log_dir"), doc.get("job")
    if (not isinstance(run_id, str) or not isinstance(script, str)
            or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0
            or not isinstance(started, (int, float)) or not isinstance(log_dir, (str, type(None)))
            or not isinstance(job, (str, type(None)))):
        return None
    sock = os.path.join(base, name[: -len(".json")] + ".sock")
    return RunInfo(run_id, pid, script, float(started), sock, log_dir, job)


def jobs_of(runs: Sequence[RunInfo]) -> list[list[RunInfo]]:
    """Runs grouped by job, oldest first: the agents of one multi-node job that share this
    host (tests, loopback clusters) are one job, each serving the whole job's document."""
    by_job: dict[str, list[RunInfo]] = {}
    for r in runs:  # without --rdzv-id, each agent of a job has a run id of its own
        by_job.setdefault(r.job or f"id:{r.run_id}", []).append(r)
    return sorted(by_job.values(), key=lambda agents: agents[0].started_at)


def find_run(run_id: str | None, node: int | None = None) -> RunInfo:
    """The agent to ask about the job (`run_id`: a prefix; None: the only job): the job's
    oldest agent on this host, or the one that runs node `node`."""
    agents = find_job(run_id)
    return agents[0] if node is None else agent_of_node(agents, node)


def find_job(run_id: str | None) -> list[RunInfo]:
    """The agents on this host of the job `run_id` names (a prefix; None: the only job),
    oldest first, or a one-line FtrunError."""
    jobs = jobs_of(list_runs())
    if run_id:
        jobs = [agents for agents in jobs if any(a.run_id.startswith(run_id) for a in agents)]
        if not jobs:
            raise FtrunError(f"no running ftrun job with id {run_id!r}",
                             hint="`ftrun status` lists your jobs")
        if len(jobs) > 1:
            raise FtrunError(f"{len(jobs)} jobs match {run_id!r}", hint="give more of the id")
    if not jobs:
        raise FtrunError("no ftrun job is running for this user",
                         hint="start one with `ftrun --nproc N script.py`")
    if len(jobs) > 1:
        listing = ", ".join(f"{a[0].run_id[:8]} ({os.path.basename(a[0].script)})" for a in jobs)
        raise FtrunError(f"{len(jobs)} jobs are running: {listing}",
                         hint="pick one with --run-id")
    return jobs[0]


def agent_of_node(agents: Sequence[RunInfo], node: int) -> RunInfo:
    """The agent of `node` among one job's agents here, asked which node each runs: a
    coordinator (or a single-node job's agent) runs node 0, a follower says so."""
    here: dict[int, RunInfo] = {}
    for info in agents:
        try:
            doc = status(info)
        except FtrunError:
            continue  # ending, busy, or another version: not the one to show
        if doc.served_by:
            here.setdefault(doc.served_by.node, info)
        elif doc.note is None:  # a follower without the coordinator's view says nothing
            here.setdefault(0, info)
    if node in here:
        return here[node]
    nodes = ", ".join(map(str, sorted(here))) or "none that answered"
    raise FtrunError(f"no agent of job {agents[0].run_id[:8]} on this host runs node {node} "
                     f"(nodes here: {nodes})", hint="run `ftrun status` on that node's host")


def status(info: RunInfo) -> Status:
    """The job's status document, read strictly (a one-line FtrunError if it is not one)."""
    return Status.from_json(request(info, StatusOp().to_wire()))


def request(info: RunInfo, doc: dict[str, Any],
            timeout_s: float = timeouts.CONTROL_REQUEST_S) -> dict[str, Any]:
    """Send one request and read the whole reply (up to MAX_REPLY bytes). Raises JobGone when
    the job's socket is gone or dead, FtrunError for any other failure or a refusal."""
    name = info.run_id[:8]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(info.socket)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                send_doc(s, doc)  # refused at once (busy), its answer is there to read
            raw = recv_line(s, MAX_REPLY, timeouts.CONTROL_REPLY_S)
        except (FileNotFoundError, ConnectionRefusedError):
            raise JobGone(f"job {name} has ended", hint="`ftrun status` lists running jobs") \
                from None
        except OSError as exc:
            if not info.alive:
                raise JobGone(f"job {name} has ended", hint="`ftrun status` lists running "
                              "jobs") from None
            if isinstance(exc, TimeoutError):
                raise FtrunError(f"job {name} did not answer within {timeout_s:g} s (its "
                                 f"agent, pid {info.pid}, is alive)", hint="it may be stopped "
                                 "(SIGSTOP, a debugger), overloaded or shutting down; try "
                                 "again") from None
            raise FtrunError(f"job {name} did not answer ({exc})",
                             hint="it may be shutting down; try again") from None
        except FtrunError as exc:
            raise FtrunError(f"job {name} did not answer: {exc.message}", hint="try again") \
                from None
    if not raw:
        if _ending(info.pid):
            raise JobGone(f"job {name} has ended", hint="`ftrun status` lists running jobs")
        raise FtrunError(f"job {name} closed the connection without answering", hint="try again")
    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError):
        reply = None
    if not isinstance(reply, dict):
        raise FtrunError(f"job {name} sent a malformed reply", hint="try again")
    if not reply.get("ok", False):
        raise FtrunError(one_line(reply.get("error", "request refused")),
                         hint=one_line(reply.get("hint", "")))
    return reply
