"""What a worker or a run leaves behind, and who removes it.

Owns: ending what an exited worker left in its process group (at once, but for a
multiprocessing resource tracker, which unlinks the shared memory and semaphores the worker
leaked once the worker is gone, as it does after torchrun: it gets a moment to finish first),
the names of an agent's snapshot slot directories (the agent's pid in each, so that a later
run can tell a dead run's from a live one's), and removing this user's slot directories
whose agent is gone (a whole process tree SIGKILLed, its guardian with it).
Must not import: torch, typer, rich, psutil, any ftrun module but `core.timeouts` (`ftrun
status` sweeps through here).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import tempfile
import threading

from ftrun.core.timeouts import TRACKER_EXIT_S

_TRACKER = b"from multiprocessing.resource_tracker import main"
_SHM_DIR = re.compile(r"^ftrun-snap-.*-(\d+)-[A-Za-z0-9_]{8}$")
SHM_ROOT = "/dev/shm"


# ---------------------------------------------------------------- an exited worker's group
def end_group(pgid: int) -> None:
    """SIGKILL what an exited worker left in its process group (data-loader processes and
    the like). A resource tracker among them is spared until it exits (it reads the end of
    its pipe once every other holder is gone), at most TRACKER_EXIT_S, from a thread: killed
    at once it would leave the worker's leaked `psm_*` segments in /dev/shm for good."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, 0)  # the usual case, an empty group, costs no /proc scan
        trackers = _trackers(pgid)
        if not trackers:
            os.killpg(pgid, signal.SIGKILL)
            return
        _kill_members(pgid, spare=set(trackers))
        threading.Thread(target=_finish, args=(pgid, trackers), daemon=True,
                         name="ftrun-tracker-wait").start()


def _finish(pgid: int, trackers: dict[int, int]) -> None:
    """Wait for the trackers (their pidfds), kill those still there, then anything left."""
    fds = list(trackers.values())
    try:
        select.select(fds, [], [], TRACKER_EXIT_S)
        for fd in fds:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # a no-op once it has exited
        _kill_members(pgid, spare=set())
    finally:
        for fd in fds:
            os.close(fd)


def _trackers(pgid: int) -> dict[int, int]:
    """The group's resource trackers: pid -> a pidfd that pins it (no pid reuse)."""
    found = {}
    for pid in _members(pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if _TRACKER not in f.read():
                    continue
            found[pid] = os.pidfd_open(pid)
        except OSError:
            continue
    return found


def _kill_members(pgid: int, spare: set[int]) -> None:
    """SIGKILL every member of the group but `spare`, listed again until no new one shows
    (a member may fork between the listing and its kill)."""
    killed = set(spare)
    while left := [pid for pid in _members(pgid) if pid not in killed]:
        for pid in left:
            killed.add(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _members(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid` (zombies are dead enough)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            found.append(int(name))
    return found


# ---------------------------------------------------------------- slot directories
def shm_root() -> str:
    return SHM_ROOT if os.path.isdir(SHM_ROOT) else tempfile.gettempdir()


def shm_prefix(run_id: str) -> str:
    """An agent's shared-memory directory's name, up to mkdtemp's suffix: its pid names the
    owner, so a later agent can remove what a killed one (and its guardian) left."""
    return f"ftrun-snap-{run_id[:16]}-{os.getpid()}-"


def spill_prefix() -> str:
    """The same for its slots on disk, under the snapshot directory (which other hosts may
    share: only its own agent removes one)."""
    return f".slots-{os.getpid()}-"


def remove_dead_slots(root: str | None = None) -> list[str]:
    """This user's shared-memory slot directories in `root` (default: /dev/shm) whose agent
    is gone: removed, returned. Shared memory is this host's: a pid names a process here."""
    root = root or shm_root()
    removed = []
    for name in _listdir(root):
        m = _SHM_DIR.match(name)
        full = os.path.join(root, name)
        if m and not alive(int(m.group(1))) and _owned(full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(full)
    return removed


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _owned(path: str) -> bool:
    with contextlib.suppress(OSError):
        return os.lstat(path).st_uid == os.getuid()
    return False


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []
