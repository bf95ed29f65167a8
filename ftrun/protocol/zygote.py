"""What an agent and its zygote say to each other.

Owns: the message types on the agent<->zygote socket and their wire format: one JSON object
per SOCK_SEQPACKET message (the socket keeps message boundaries), a fork request carrying the
worker's stdout and stderr as SCM_RIGHTS.
Must not import: torch, typer, rich, ftrun packages other than core.
"""

from __future__ import annotations

import json
import select
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_MESSAGE = 4 << 20  # a fork request carries the worker's whole environment


@dataclass(frozen=True)
class Ready:
    """Zygote -> agent, once: its preloads are in and it forks on request."""

    pid: int
    preloaded: tuple[str, ...]
    seconds: float  # how long the preloads took
    rss_kb: int


@dataclass(frozen=True)
class Importing:
    """Zygote -> agent, before each `--preload` module: what a slow start is waiting on."""

    module: str


@dataclass(frozen=True)
class Refused:
    """Zygote -> agent, once, instead of Ready: it cannot fork workers safely."""

    why: str  # "preload": a module failed to import; "threads"; "cuda"
    module: str
    detail: str


@dataclass(frozen=True)
class Fork:
    """Agent -> zygote: start one worker (stdout and stderr ride along as descriptors)."""

    module: bool  # python -m TARGET
    target: str  # the script path or module name
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "."


@dataclass(frozen=True)
class Forked:
    """Zygote -> agent: the worker runs, in a session of its own, as the agent's child."""

    pid: int


@dataclass(frozen=True)
class Accepted:
    """Agent -> zygote, after Forked: the agent holds the worker's pid, so the worker may run
    its script. Without it (the agent gave up waiting and starts the worker anew) the forked
    one ends before the script: one process per worker, never two."""

    pid: int


@dataclass(frozen=True)
class ForkFailed:
    error: str


Message = Ready | Importing | Refused | Fork | Forked | Accepted | ForkFailed
_TYPES: dict[str, type[Message]] = {t.__name__: t for t in (Ready, Importing, Refused, Fork,
                                                              Forked, Accepted, ForkFailed)}
_TUPLES = {"preloaded", "args"}


class ChannelClosed(Exception):
    """The other side is gone (EOF), or said nothing within the time allowed."""


def send(sock: socket.socket, msg: Message, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps({"type": type(msg).__name__, **asdict(msg)}).encode()
    try:
        if fds:
            socket.send_fds(sock, [data], list(fds))
        else:
            sock.sendall(data)
    except OSError as exc:
        raise ChannelClosed(f"cannot send: {exc.strerror or exc}") from exc


def recv(sock: socket.socket, timeout_s: float | None) -> tuple[Message, list[int]]:
    """The next message and the descriptors that came with it; None timeout: wait for it."""
    if timeout_s is not None and not select.select([sock], [], [], timeout_s)[0]:
        raise ChannelClosed(f"no answer within {timeout_s:g} s")
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 2)
    except OSError as exc:
        raise ChannelClosed(f"cannot receive: {exc.strerror or exc}") from exc
    if not data:
        raise ChannelClosed("closed")
    return decode(data), fds


def decode(data: bytes) -> Message:
    raw = json.loads(data)
    kind = _TYPES.get(raw.pop("type", ""))
    if kind is None:
        raise ChannelClosed(f"unknown message {data[:80]!r}")
    fields: dict[str, Any] = {k: tuple(v) if k in _TUPLES else v for k, v in raw.items()}
    return kind(**fields)
