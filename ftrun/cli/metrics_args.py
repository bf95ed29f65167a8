"""The metrics options: --metrics-port (or FTRUN_METRICS_PORT) and --metrics-addr, checked
before anything starts.

Owns: turning those options into `RunSpec` fields, with a one-line error for each bad value.
Whether the port is free is found out when the agent binds it, before any worker starts.
Must not import: torch, typer, rich, the agent, prometheus_client.
"""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any

from ftrun.core.errors import UsageError

METRICS_PORT_ENV = "FTRUN_METRICS_PORT"


def metrics_fields(ns: argparse.Namespace) -> dict[str, Any]:
    raw = ns.metrics_port
    if raw is None or str(raw).strip() == "":
        return {"metrics_port": None, "metrics_addr": _addr(ns.metrics_addr)}
    try:
        port = int(str(raw))
    except ValueError:
        raise UsageError(f"--metrics-port {raw!r} is not a port number",
                         hint=f"give 1-65535, or 0 for any free port (also {METRICS_PORT_ENV})"
                         ) from None
    if not 0 <= port <= 65535:
        raise UsageError(f"--metrics-port must be 0-65535, got {port}",
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
