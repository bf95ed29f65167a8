"""The launch flags every node of a multi-node job must be started with alike.

Owns: which `RunSpec` fields shape what the workers of different nodes do together (the
collectives of a replica group, the snapshot agreement and its boundaries, the step a fault
repeats or makes up, the heal plan every member computes, how communicators are rebuilt,
what a fault does to the job), the text of them a joining node sends (`shared_flags`), and
the pure decision whether a joining node's text differs from the coordinator's, with the
reason (`flags_differ`). A node started with other values would enter collectives its peers
never run, or skip theirs, and the job would wait out a collective timeout instead of
saying why at the join.
Two more must match only when a replica group spans nodes (--shard-size above a node's
--nproc): --nproc (a group is whole nodes) and whether --resume is given (the group agrees
on the step to resume from). The path --resume names, --spares, --snapshot-dir, logs and
metrics stay each node's own. Flags the coordinator alone acts on (--nnodes, --max-faults,
--min-nproc, --hang-timeout) govern from the coordinator whatever a joining node says.
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
    ("verify_every", "--verify-every"),
    ("verify_grads_every", "--verify-grads-every"),
)
# shared only when a replica group spans nodes: (RunSpec field, flag)
SPAN_FLAGS: tuple[tuple[str, str], ...] = (("nproc", "--nproc"), ("resume", "--resume"))
_SHOWN_MAX = 40  # a value shown in a refusal is cut here: the line stays one line


def shared_flags(spec: RunSpec) -> str:
    """This node's values of the shared flags, as its join carries them (of --resume, only
    whether it is given: the path is the node's own)."""
    values: dict[str, object] = {flag: getattr(spec, name) for name, flag in SHARED_FLAGS}
    values.update({"--nproc": spec.nproc, "--resume": bool(spec.resume)})
    return json.dumps(values, sort_keys=True)


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
        return "its launch flags are unreadable; run the same ftrun version on every node"
    flags = [flag for _, flag in SHARED_FLAGS]
    if _spans(ours) or _spans(theirs):
        flags += [flag for _, flag in SPAN_FLAGS]
    missing = [flag for flag in flags if flag not in theirs]
    if missing:
        return (f"its join lacks {', '.join(missing)}: it runs another ftrun version; run the "
                "same ftrun version on every node")
    differing = [f"{flag} {_shown(flag, theirs[flag])} (the coordinator's: "
                 f"{_shown(flag, ours.get(flag))})"
                 for flag in flags if theirs[flag] != ours.get(flag)]
    if not differing:
        return None
    return (f"this node was started with {', '.join(differing)}; start every node with the "
            "same " + ", ".join(flags))


def _spans(values: dict[str, object]) -> bool:
    """A replica group of these values spans nodes (RunSpec.groups_span_nodes)."""
    shard, nproc = values.get("--shard-size"), values.get("--nproc")
    return isinstance(shard, int) and isinstance(nproc, int) and shard > nproc


def _shown(flag: str, value: object) -> str:
    if flag == "--resume":
        return "given" if value else "not given"
    if value is None:
        return "unset"
    text = format(value, "g") if isinstance(value, float) else str(value)
    return text if len(text) <= _SHOWN_MAX else text[:_SHOWN_MAX - 3] + "..."
