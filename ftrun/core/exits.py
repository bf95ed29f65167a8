"""Naming how a process ended.

Owns: `describe_exit` ("3", "-9 (SIGKILL)") and `signal_name`.
Must not import: anything beyond the standard library.
"""

from __future__ import annotations

import signal


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"{returncode} ({signal_name(-returncode)})"
    return str(returncode)
