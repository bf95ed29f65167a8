"""When a node that joined a running job may enter it, as a pure decision.

A node that joins while the job holds `--nnodes` MAX nodes is not turned away: it waits in
the coordinator's table, in join order, and enters (its workers as joiners, or as spares when
the world size is whole) as soon as a node is lost and the job has room again. Nothing but
the first in line is considered: nodes enter in the order they came.

Owns: `gathered` (whether the nodes of a new attempt are in: MAX of them, or MIN and a last
call; or why the wait failed), `why_refused` (a join the coordinator turns away for good:
another job's, an index in use, other shared flags), `why_wait` (None: admit now; else the
one-line reason it waits) and `Waiting`, which says each reason once per node instead of at
every pass of the coordinator's loop.
Must not import: anything beyond the standard library and `ftrun.core.node_flags`.
"""

from __future__ import annotations

from ftrun.core.node_flags import flags_differ


def gathered(count: int, nnodes: tuple[int, int], waited_s: float, enough_for_s: float | None,
             join_s: float, last_call_s: float) -> bool | str:
    """True: start the attempt with the `count` nodes in (this one included); False: wait
    on; a text: why the wait failed. `enough_for_s`: how long MIN nodes have been in."""
    nmin, nmax = nnodes
    if count >= nmax or (enough_for_s is not None and enough_for_s >= last_call_s):
        return True
    if count < nmin and waited_s > join_s:
        return f"only {count} of {nmin} nodes joined the rendezvous"  # the caller says where
    return False


def why_refused(*, rdzv_id: str, flags: str, joining_rdzv_id: str, joining_flags: str,
                index: int, index_taken: bool) -> str | None:
    """Why a joining node is turned away (it ends), or None: it may join. `flags` is the
    coordinator's text of the shared flags (core/node_flags.py), `joining_flags` the node's."""
    if joining_rdzv_id != rdzv_id:
        return f"this store serves --rdzv-id {rdzv_id!r}, not {joining_rdzv_id!r}"
    if index_taken:
        return f"node index {index} is taken"
    return flags_differ(flags, joining_flags)


def why_wait(nodes_in_job: int, nnodes_max: int, recovers_in_process: bool,
             uses_api: bool) -> str | None:
    """Why a waiting node cannot enter the running job now (`nodes_in_job` counts the
    coordinator and every node whose workers belong to the attempt), or None: admit it."""
    if nodes_in_job >= nnodes_max:
        return (f"the job is full ({nodes_in_job} of --nnodes max {nnodes_max} nodes); it "
                "enters when a node is lost")
    if not recovers_in_process:
        return "the job restarts its workers on a fault (--on-fault restart); it enters then"
    if not uses_api:
        return ("no worker has used the ftrun API (yet); it enters when one does, or at the "
                "next restart")
    return None


class Waiting:
    """The reason each waiting node was last given, so that a node hears each one once."""

    def __init__(self) -> None:
        self._told: dict[int, str] = {}

    def news(self, node: int, why: str) -> bool:
        """True when `why` is not what `node` was last told (then it is told now)."""
        if self._told.get(node) == why:
            return False
        self._told[node] = why
        return True

    def forget(self, node: int) -> None:
        self._told.pop(node, None)
