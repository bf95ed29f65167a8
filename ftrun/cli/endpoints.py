"""Host and port values of the command line: `HOST`, `HOST:PORT`, `[IPV6]`, `[IPV6]:PORT`.

Owns: `parse_endpoint` (one endpoint, checked, one-line errors naming the flag) and
`port_value`; shared by the store's --rdzv-endpoint and etcd's list of members.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import re

from ftrun.cli.values import int_value as _int
from ftrun.core.errors import UsageError

_HOST_RE = re.compile(r"[\w.-]+")  # a host name or an IPv4 address
_IPV6_RE = re.compile(r"[\w.:%-]+")  # inside brackets (a zone like %eth0 included)


def port_value(raw: object, flag: str = "--master-port") -> int:
    port = _int(raw, flag, minimum=0)
    if port > 65535:
        raise UsageError(f"{flag}: port {port} is out of range", hint="use 1-65535")
    return port


def parse_endpoint(text: str) -> tuple[str, int | None]:
    """`HOST`, `HOST:PORT`, `[IPV6]` or `[IPV6]:PORT` -> (host, port or None)."""
    text = text.strip()
    hint = "use HOST[:PORT], e.g. node0:29400, or [IPV6]:PORT"
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise UsageError(f"--rdzv-endpoint {text!r} is not [IPV6] or [IPV6]:PORT",
                             hint="close the bracket, e.g. [::1]:29400")
        valid, port = bool(_IPV6_RE.fullmatch(host)), rest[1:] if rest else None
    else:
        if text.count(":") > 1:
            raise UsageError(f"--rdzv-endpoint {text!r}: an IPv6 address needs brackets",
                             hint="e.g. [::1]:29400")
        host, sep, tail = text.partition(":")
        valid, port = bool(_HOST_RE.fullmatch(host)), tail if sep else None
    if not valid:
        raise UsageError(f"--rdzv-endpoint {text!r} has no valid host", hint=hint)
    if port is None:
        return host, None
    if not port.isdigit():
        raise UsageError(f"--rdzv-endpoint {text!r}: port {port!r} is not a number", hint=hint)
    return host, port_value(port, "--rdzv-endpoint")
