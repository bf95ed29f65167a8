"""This node's own network link, taken down and up again: `ftrun inject-fault --kind net-down`.

Owns: whether this agent may change its link (root, the `ip` tool, and a network namespace of
its own: never the host's, whose link carries everything else, a login included), which
device carries its traffic to the coordinator, and the drill: the link down now, up again
after the duration, from a thread; up again at the latest when the agent ends.
Must not import: torch, typer, rich, the agent or the CLI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

from ftrun.core.errors import FtrunError

IP_COMMAND_S = 5.0  # one `ip` command
NAMESPACE_HINT = ("run each node in a network namespace of its own to rehearse a partition "
                  "(tests/netlab.py shows how), or pull a cable by hand")


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_COMMAND_S)
    if done.returncode != 0:
        raise FtrunError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()[:160]}",
                         hint="net-down needs root (CAP_NET_ADMIN) in the node's namespace")
    return done.stdout


def refusal() -> str | None:
    """Why this agent must not take its link down (None: it may)."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed on this node"
    if os.geteuid() != 0:
        return "the agent runs without root: it cannot change a link"
    if _named_namespace():
        return None
    try:
        own = os.stat("/proc/self/ns/net").st_ino
        host = os.stat("/proc/1/ns/net").st_ino
    except OSError:
        return "cannot tell whether the agent has a network namespace of its own"
    if own == host:
        return ("the agent runs in the host's own network namespace: taking its link down "
                "would cut the whole host off")
    return None


def _named_namespace() -> str:
    """The name of this process's network namespace when it is one `ip netns` made."""
    try:
        return _ip("netns", "identify", str(os.getpid())).strip()
    except (FtrunError, OSError, subprocess.TimeoutExpired):
        return ""


def device_to(host: str) -> str:
    """The device this node reaches `host` through (the device holding it, if it is ours)."""
    fields = _ip("-o", "route", "get", host).split()
    device = fields[fields.index("dev") + 1] if "dev" in fields else ""
    if fields[:1] == ["local"]:  # our own address: the device it is assigned to
        held = _ip("-o", "addr", "show", "to", host).split()
        device = held[1] if len(held) > 1 else device
    return device


def drill_target(host: str) -> tuple[str, str]:
    """(device, "") when a net-down drill may cut the link towards `host`, else ("", why)."""
    why = refusal()
    if why is not None:
        return "", why
    try:
        device = device_to(host)
    except (FtrunError, OSError, subprocess.TimeoutExpired) as exc:
        return "", f"cannot find the link towards {host} ({str(exc)[:120]})"
    if not device or device == "lo":
        return "", f"it reaches {host} over loopback: there is no link to cut"
    return device, ""


class LinkDrill:
    """One net-down drill at a time; the link is always restored, by the timer or `close`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: str | None = None

    def start(self, device: str, duration_s: float) -> None:
        with self._lock:
            if self._down is not None:
                raise FtrunError(f"a net-down drill already holds {self._down} down",
                                 hint="wait for it to end")
            _ip("link", "set", "dev", device, "down")
            self._down = device
            self._done.clear()
        self._thread = threading.Thread(target=self._restore_after, args=(duration_s,),
                                        name="ftrun-net-down", daemon=True)
        self._thread.start()

    def _restore_after(self, duration_s: float) -> None:
        self._done.wait(duration_s)
        why = self.restore()
        if why is not None:
            with self._lock:
                self._failed = why  # the agent says so at its next pass

    def take_failure(self) -> str | None:
        """Why the link did not come back up after its drill, once (None: it did)."""
        with self._lock:
            failed, self._failed = self._failed, None
        return failed

    def restore(self) -> str | None:
        """The link up again now (if a drill holds it down); why that failed, if it did."""
        with self._lock:
            if self._down is None:
                return None
            device, self._down = self._down, None
        self._done.set()
        try:
            _ip("link", "set", "dev", device, "up")
        except (FtrunError, OSError, subprocess.TimeoutExpired) as exc:
            return f"could not bring {device} up again after the net-down drill ({exc})"
        return None
