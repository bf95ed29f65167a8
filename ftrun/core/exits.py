"""Naming how a process ended, and how ftrun's own end tells a scheduler what to do.

Owns: `describe_exit` ("3", "-9 (SIGKILL)"), `signal_name`, the notice signal a worker starts
ignoring (`ignored_notice`), and the launcher's exit code that
asks for a requeue (`EXIT_REQUEUE`; done and failed are `errors.EXIT_OK` and
`errors.EXIT_FAILURE`).
Must not import: anything beyond the standard library.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping

# The job was told its nodes will be taken (a preemption notice, a time limit) and had
# nowhere to go: it stopped cleanly (a snapshot where snapshots are on) and asks to be
# requeued. sysexits' EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
# done: 0; failed, do not requeue: 1 (any other code is a failure too)
EXIT_REQUEUE = 75
# a worker whose registered state differed from the majority of its replicas (silent
# corruption, #53) leaves with this code; its agent replaces it and suspects its GPU.
# sysexits' EX_DATAERR ("the input data was incorrect")
EXIT_CORRUPT = 65


def ignored_notice(env: Mapping[str, str]) -> int | None:
    """--drain-signal as a worker's environment names it (FTRUN_DRAIN_SIGNAL): the signal a
    worker starts with ignored. A scheduler's notice (Slurm's --signal) reaches every process
    of a job step, and its default action ends a process: it is for the agent alone."""
    name = env.get("FTRUN_DRAIN_SIGNAL", "")
    value = getattr(signal, name, None) if name.startswith("SIG") else None
    return int(value) if isinstance(value, signal.Signals) else None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"{returncode} ({signal_name(-returncode)})"
    return str(returncode)
