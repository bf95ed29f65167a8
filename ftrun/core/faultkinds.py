"""The fault kinds: what `ftrun inject-fault --kind` accepts, and who acts each one out.

Owns: `FaultKind` and the groups derived from it: the drills a worker's progress slot
carries (their order is the slot's format), the ones the agent acts out with a signal, the
ones only a worker can act out, the GPU kinds, the node kinds and the drills that stall a
whole group; and `FaultAction`, what a fault was answered with (the policy decides it,
`core.policy` re-exports it; a fault's event and `ftrun status` name it).
Must not import: anything beyond the standard library and ftrun.core.states.
"""

from __future__ import annotations

import signal

from ftrun.core.states import TextEnum


class FaultKind(TextEnum):
    # drills of a worker: the progress slot stores the index into SLOT_DRILLS, so this
    # order is the on-disk format (append new drills after WEDGE)
    KILL = "kill"
    SEGV = "segv"
    EXIT = "exit"
    EXCEPTION = "exception"
    HANG = "hang"  # SIGSTOP
    SLOW = "slow"
    COMM = "comm"  # its communicator fails, mid-backward
    SPIN = "spin"
    DEADLOCK = "deadlock"
    STALL = "stall"  # its collective never completes, until a new generation
    WEDGE = "wedge"  # its training thread blocks for good inside the collective
    # faults of a GPU (--gpu N)
    XID = "xid"
    ECC = "ecc"
    THERMAL = "thermal"
    # faults of a node (--node K)
    NET_DOWN = "net-down"  # its link down for --duration seconds
    # a planned leave: the node's agent gets its notice (SIGTERM), as a scheduler sends it
    PREEMPT = "preempt"
    # silent corruption (#53), acted out by the worker at a step's start: one bit of its
    # registered state (the slot's argument: which bit, -1: one drawn at random), or one
    # element of its local gradient in that step (an exponent bit: a huge value)
    BITFLIP = "bitflip"
    GRADFLIP = "gradflip"


GPU_KINDS = (FaultKind.XID, FaultKind.ECC, FaultKind.THERMAL)
NODE_KINDS = (FaultKind.NET_DOWN,)
NOTICE_KINDS = (FaultKind.PREEMPT,)  # --node K optional: the answering agent's node
SLOT_DRILLS = tuple(kind for kind in FaultKind
                    if kind not in GPU_KINDS + NODE_KINDS + NOTICE_KINDS)
# with no --at-step the agent sends these itself; with one, the worker signals itself. Keyed
# by str: a request's plain kind looks its signal up
AGENT_SIGNALS: dict[str, signal.Signals] = {
    FaultKind.KILL: signal.SIGKILL, FaultKind.SEGV: signal.SIGSEGV, FaultKind.HANG: signal.SIGSTOP}
WORKER_ONLY = tuple(kind for kind in SLOT_DRILLS if kind not in AGENT_SIGNALS)
# the whole group stuck in one collective: the rebuild that answers it names no worker
GROUP_DRILLS = (FaultKind.STALL, FaultKind.WEDGE)
# silent corruption: found at a later boundary (or step), maybe with no worker to blame
CORRUPTION_DRILLS = (FaultKind.BITFLIP, FaultKind.GRADFLIP)
ALL_KINDS = tuple(FaultKind)  # in `ftrun inject-fault --help`'s order


class FaultAction(TextEnum):
    """What a fault was answered with: the policy's decisions, and a silent corruption's,
    decided by the workers where they found it (ROLLBACK, REDO). It prints as its value:
    the `decision` of a fault in the event log and in `ftrun status`."""

    REPLACE = "replace"  # same world size: a spare or a new process takes the lost rank
    SHRINK = "shrink"  # go on without it now; grow back when a replacement is ready
    REBUILD = "rebuild"  # same members, a new communicator
    RESTART_GROUP = "restart-group"  # in-process recovery impossible: torchrun semantics
    FAIL = "fail"
    FAIL_AT_END = "fail-at-end"  # lost after training, not replaced: its post-training work
    # is lost; the others end their scripts, then the job fails
    NONE = "none"  # refused: nothing changes, the reason says why
    ROLLBACK = "rollback"  # silent corruption, no majority: every replica back to a verified step
    REDO = "redo"  # a corrupt local gradient caught before its commit: the step redone
