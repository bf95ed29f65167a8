"""The launch flags every node of a multi-node job must be started with alike.

Owns: which `RunSpec` fields shape what the workers of different nodes do together (the
collectives of a replica group, the snapshot agreement and its boundaries, the step a fault
repeats or makes up, the heal plan every member computes, how communicators are rebuilt),
the text of them a joining node sends (`shared_flags`), and the pure decision whether a
joining node's text differs from the coordinator's, with the reason (`flags_differ`).
A node started with other values would enter collectives its peers never run, or skip
theirs, and the job would wait out a collective timeout instead of saying why at the join.
Flags that are a node's own stay out: --nproc, --spares, --snapshot-dir, --resume (a path
each node reads locally), logs and metrics.
Must not import: anything but the standard library and `ftrun.core.spec`.
"""

from __future__ import annotations

import json

from ftrun.core.spec import RunSpec

# (RunSpec field, the command-line flag that sets it)
SHARED_FLAGS: tuple[tuple[str, str], ...] = (
    ("shard_size", "--shard-size"),
    ("snapshot_every", "--snapshot-every"),
    ("snapshot_interval", "--snapshot-interval"),
    ("redo", "--redo"),
    ("on_fault", "--on-fault"),
    ("comm", "--comm"),
    ("heal_chunk_mb", "--heal-chunk-mb"),
    ("heal_sources", "--heal-sources"),
)


def shared_flags(spec: RunSpec) -> str:
    """This node's values of the shared flags, as its join carries them."""
    return json.dumps({flag: getattr(spec, name) for name, flag in SHARED_FLAGS},
                      sort_keys=True)


def flags_differ(coordinator: str, joining: str) -> str | None:
    """None when a joining node may enter; else the one-line reason it is refused. An empty
    text is an agent older than this check: let in, as before."""
    if not joining:
        return None
    ours = json.loads(coordinator)
    try:
        theirs = json.loads(joining)
    except (ValueError, RecursionError):
        theirs = None
    if not isinstance(theirs, dict):
        return "its launch flags are unreadable"
    differing = [f"{flag} {_shown(theirs.get(flag))} (the job's: {_shown(ours.get(flag))})"
                 for _, flag in SHARED_FLAGS if theirs.get(flag) != ours.get(flag)]
    if not differing:
        return None
    return (f"this node was started with {', '.join(differing)}; start every node with the "
            "same " + ", ".join(flag for _, flag in SHARED_FLAGS))


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    return format(value, "g") if isinstance(value, float) else str(value)
