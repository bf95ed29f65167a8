"""Naming how a process ended, and how ftrun's own end tells a scheduler what to do.

Owns: `describe_exit` ("3", "-9 (SIGKILL)"), `signal_name`, and the launcher's exit code that
asks for a requeue (`EXIT_REQUEUE`; done and failed are `errors.EXIT_OK` and
`errors.EXIT_FAILURE`).
Must not import: anything beyond the standard library.
"""

from __future__ import annotations

import signal

# The job was told its nodes will be taken (a preemption notice, a time limit) and had
# nowhere to go: it stopped cleanly (a snapshot where snapshots are on) and asks to be
# requeued. sysexits' EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
# done: 0; failed, do not requeue: 1 (any other code is a failure too)
EXIT_REQUEUE = 75


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"{returncode} ({signal_name(-returncode)})"
    return str(returncode)
