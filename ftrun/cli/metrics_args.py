"""The metrics options: --metrics-port (or FTRUN_METRICS_PORT) and --metrics-addr, checked
before anything starts.

Owns: turning those options into `RunSpec` fields, with a one-line error for each bad value.
Whether the port is free is found out when the agent binds it, before any worker starts.
Must not import: torch, typer, rich, the agent, prometheus_client (`adapters.metrics` imports
it only when a server starts).
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Mapping
from typing import Any

from ftrun.adapters.metrics import METRICS_PORT_ENV, port_source
from ftrun.core.errors import UsageError

__all__ = ["METRICS_PORT_ENV", "metrics_fields"]


def metrics_fields(ns: argparse.Namespace, env: Mapping[str, str] | None = None
                   ) -> dict[str, Any]:
    """`env`: where the parser took the port's default from, so that an error names what the
    user set (--metrics-port, or FTRUN_METRICS_PORT)."""
    raw = ns.metrics_port
    if raw is None or str(raw).strip() == "":
        return {"metrics_port": None, "metrics_addr": _addr(ns.metrics_addr)}
    named = port_source(str(raw), env or {})
    try:
        port = int(str(raw))
    except ValueError:
        raise UsageError(f"{named} {raw!r} is not a port number",
                         hint=f"give 1-65535, or 0 for any free port (--metrics-port or "
                              f"{METRICS_PORT_ENV})") from None
    if not 0 <= port <= 65535:
        raise UsageError(f"{named} must be 0-65535, got {port}",
                         hint="give 1-65535, or 0 for any free port")
    return {"metrics_port": port, "metrics_addr": _addr(ns.metrics_addr)}


def _addr(raw: object) -> str:
    text = str(raw or "").strip()
    if text in ("localhost", ""):
        return "127.0.0.1"
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise UsageError(f"--metrics-addr {raw!r} is not an IP address",
                         hint="give an address of this host, e.g. 127.0.0.1 or 0.0.0.0") from None
    return text
