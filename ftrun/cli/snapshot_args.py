"""The snapshot options: --snapshot-every, --snapshot-interval, --snapshot-dir,
--snapshot-keep, --resume, and --verify-every (a snapshot lands on a verified step), checked
before anything starts.

Owns: turning those options into `RunSpec` fields, with a one-line error for each bad value
(a --resume directory that holds no complete snapshot, or only other users' ones, included).
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ftrun.cli.values import float_value, int_value
from ftrun.core.errors import UsageError
from ftrun.core.options import OnFault
from ftrun.protocol.snapshots import disk_snapshots, read_manifest, unsafe


def snapshot_fields(ns: argparse.Namespace) -> dict[str, Any]:
    every = int_value(ns.snapshot_every, "--snapshot-every", minimum=0)
    interval = float_value(ns.snapshot_interval, "--snapshot-interval", positive=False)
    if interval < 0:
        raise UsageError(f"--snapshot-interval must be >= 0, got {interval}",
                         hint="seconds between snapshots (0: off)")
    if every and interval:
        raise UsageError("--snapshot-every and --snapshot-interval cannot be used together",
                         hint="snapshot by committed steps or by time, not both")
    snapshot_dir = _directory(ns.snapshot_dir, "--snapshot-dir")
    resume = _directory(ns.resume, "--resume")
    if resume:
        _check_resumable(resume)
    if (every or interval or resume) and ns.on_fault == OnFault.RESTART:
        raise UsageError("snapshots need in-process recovery, not --on-fault restart",
                         hint="use --on-fault replace or shrink")
    return {"snapshot_every": every, "snapshot_interval": interval,
            "snapshot_dir": snapshot_dir,
            "snapshot_keep": int_value(ns.snapshot_keep, "--snapshot-keep", minimum=1),
            "resume": resume,
            "verify_every": int_value(ns.verify_every, "--verify-every", minimum=0),
            "verify_grads_every": int_value(ns.verify_grads_every, "--verify-grads-every",
                                            minimum=0)}


def _directory(raw: object, flag: str) -> str:
    path = os.path.abspath(os.path.expanduser(str(raw))) if raw else ""
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {raw} is a file, not a directory", hint=f"fix {flag}")
    return path


def _check_resumable(path: str) -> None:
    if not os.path.isdir(path):
        raise UsageError(f"--resume {path}: no such directory",
                         hint="give the --snapshot-dir of the earlier run")
    found = [path] if read_manifest(path) is not None else [
        p for _, p in disk_snapshots(path) if read_manifest(p) is not None]
    if not found:
        raise UsageError(f"--resume {path} holds no complete snapshot",
                         hint="give the --snapshot-dir of the earlier run, or one of its "
                              "step-N directories")
    refused = [why for p in found if (why := unsafe(p)) is not None]
    if len(refused) == len(found):  # a pickle is code: only this user's own are ever read
        raise UsageError(f"--resume {path}: {refused[0]}",
                         hint="resume only from snapshots that you wrote")
