"""The launcher's options that name a choice, as enums: compared by member, never by text.

Owns: `OnFault`, `Redo`, `Comm`, `RdzvBackend` and `DrainOn`. Each is a `TextEnum`, so it
prints, serialises (JSON, the workers' environment, the shared-flags text) and compares as
the string the user typed: a spec built with a plain string is normalised to its member
(`RunSpec.__post_init__`).
Must not import: anything but the standard library and `core.states`.
"""

from __future__ import annotations

from ftrun.core.states import TextEnum


class OnFault(TextEnum):
    """--on-fault: what a fault of a script using the ftrun API does."""

    REPLACE = "replace"  # a spare or a new worker takes the lost rank
    SHRINK = "shrink"  # the job goes on with fewer ranks
    RESTART = "restart"  # torchrun's whole-group restart


class Redo(TextEnum):
    """--redo: after a fault, repeat the broken step or only its lost share."""

    STEP = "step"
    LOST = "lost"


class Comm(TextEnum):
    """--comm: how communicators are re-formed (the native reconfigure, or a fresh group)."""

    AUTO = "auto"
    NATIVE = "native"
    FRESH = "fresh"


class RdzvBackend(TextEnum):
    STATIC = "static"
    C10D = "c10d"
    ETCD = "etcd"


class DrainOn(TextEnum):
    """--drain-on: what drains a GPU ahead of its failure ("": nothing)."""

    NOTHING = ""
    DEGRADED = "degraded"
