"""The planned-leave options: --drain-window, --drain-signal and --drain-on, checked before
anything starts.

Owns: turning them into the `RunSpec` fields, with a one-line error for a value ftrun cannot
use; the drain signal joins the signals the agent handles (--signals-to-handle, read here).
Must not import: torch, typer, rich, the agent, the worker library.
"""

from __future__ import annotations

import argparse
import signal
from typing import Any

from ftrun.cli.values import float_value
from ftrun.core.errors import UsageError

DEFAULT_WINDOW = "30"  # GKE gives a spot VM about 30 s between its notice and the take
DRAIN_ON = ("degraded",)


def drain_fields(ns: argparse.Namespace) -> dict[str, Any]:
    window = float_value(ns.drain_window, "--drain-window", positive=False)
    name = _signal_name(str(ns.drain_signal or ""), "--drain-signal",
                        "a catchable signal, e.g. SIGUSR1 (Slurm: --signal=B:USR1@120)")
    on = str(ns.drain_on or "").strip().lower()
    if on and on not in DRAIN_ON:
        raise UsageError(f"--drain-on {on!r} is not known", hint="use --drain-on degraded")
    handled = tuple(_signal_name(s, "--signals-to-handle", "use names like SIGTERM,SIGINT,"
                                 "SIGUSR1") for s in str(ns.signals_to_handle).split(","))
    handled = tuple(filter(None, handled))
    signals = handled if not name or name in handled else (*handled, name)
    return {"drain_window": window, "drain_signal": name, "drain_on": on,
            "signals_to_handle": signals}


def _signal_name(text: str, option: str, hint: str) -> str:
    """`usr1` -> `SIGUSR1` ("" stays ""), or a UsageError: not a signal a process can handle."""
    name = text.strip().upper()
    if name and not name.startswith("SIG"):
        name = "SIG" + name
    if name and (not hasattr(signal, name) or name in ("SIGKILL", "SIGSTOP")):
        raise UsageError(f"{option}: {name} cannot be handled", hint=hint)
    return name
