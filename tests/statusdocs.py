"""Whole status documents for unit tests: every key an agent writes, with plausible values,
and the parts a test cares about given (the readers take `protocol.status.Status` records,
which a partial document is not)."""
from __future__ import annotations

from typing import Any

from ftrun.protocol.status import Status


def worker(**over: Any) -> dict[str, Any]:
    """A worker row; `committed_step` follows `step` unless given."""
    row: dict[str, Any] = {
        "worker_id": 0, "rank": 0, "local_rank": 0, "pid": 100, "state": "running",
        "role": "member", "step": None, "committed_step": None, "step_time_ms": None,
        "since_progress_s": None, "phase": None, "cpu": "busy", "gpu": None, "health": None,
        "straggler": None}
    row.update(over)
    return row


def fault(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": 1, "kind": "kill", "worker": 0, "rank": 0, "at": 100.0, "decision": "replace",
        "reason": "r", "injected": True, "generation": 1, "recovered": True,
        "recovery_ms": 100.0, "phases_ms": {"detected": 1.0}, "lost_steps": 0,
        "committed_before": 10, "lost_from": None, "resumed_step": None,
        "redone_samples": 8, "redone_fraction": 0.2857, "redone_s": 0.31, "short_steps": 2,
        "rolled_back_to": None}
    doc.update(over)
    return doc


def document(**over: Any) -> dict[str, Any]:
    """A single node's document (no zygote, snapshots off, nothing measured yet)."""
    doc: dict[str, Any] = {
        "run_id": "run", "script": "t.py", "pid": 1, "started_at": 1000.0, "uptime_s": 1.0,
        "generation": 0, "world_size": 1, "policy": "replace", "spares": 0, "shard_size": 1,
        "attempt": 0, "log_dir": None, "ft_api": True, "workers": [], "hang_timeout_s": None,
        "faults": [], "summary": {"faults": 0, "recovered": 0, "p50_ms": None,
                                  "p95_ms": None, "max_ms": None, "lost_steps": 0,
                                  "time_lost_s": 0.0, "goodput": None},
        "heal": {"state_bytes": 0, "count": 0, "bytes_total": 0, "seconds": [],
                 "gb_per_s": None, "estimate_s": None, "last": None},
        "steps_per_s": None, "gpus": [], "metrics": None, "replica_groups": None,
        "snapshot": None}
    doc.update(over)
    return doc


def status(**over: Any) -> Status:
    return Status.from_json(document(**over))
