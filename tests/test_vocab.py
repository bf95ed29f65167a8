"""One vocabulary per concept: fault kinds, worker phases, the progress slot's bytes and the
worker's recovery mode. Pure Python, no torch, no processes.

The literals below were produced by the code before the vocabulary moved into enums (the
tuples of strings it used, and the slot bytes its writers produced): the on-disk format and
every printed or serialised name must stay exactly these.
"""

import itertools
import json
import signal
from pathlib import Path

from ftrun.core.faultkinds import (
    AGENT_SIGNALS,
    ALL_KINDS,
    GPU_KINDS,
    GROUP_DRILLS,
    NODE_KINDS,
    SLOT_DRILLS,
    WORKER_ONLY,
    FaultKind,
)
from ftrun.core.states import PAUSED_PHASES, Phase, RecoveryMode
from ftrun.protocol.progress import SIZE, Progress, Reporter, Slot, pack, unpack

OLD_DRILL_KINDS = ("kill", "segv", "exit", "exception", "hang", "slow", "comm", "spin",
                   "deadlock", "stall", "wedge")
CORRUPTION_KINDS = ("bitflip", "gradflip")  # appended (#53): the slot's indices go on
OLD_GPU_KINDS = ("xid", "ecc", "thermal")
NODE_KINDS_NOW = ("net-down",)  # appended: the slot's drill indices are unchanged
NOTICE_KINDS_NOW = ("preempt",)  # appended (#48): a node's notice, not a slot drill
OLD_WORKER_ONLY = ("exit", "exception", "slow", "comm", "spin", "deadlock", "stall", "wedge",
                   *CORRUPTION_KINDS)
OLD_PHASES = ("", "step", "collective", "optimizer", "user", "long", "recovering")

# a slot holding KNOWN, as the old Slot writers laid it out
KNOWN = Progress(step=7, last_commit=1.5, step_time=0.25, step_started=2.75, rank=3,
                 generation=2, drill_seq=5, drill_kind=6, drill_at=9, drill_arg=0.5,
                 collective_started=3.125, compute_time=0.0625, phase=Phase.COLLECTIVE,
                 phase_started=4.5, collective=2, step_p95=0.375, label="eval")
KNOWN_BYTES = bytes.fromhex(
    "0700000000000000000000000000f83f000000000000d03f0000000000000640"
    "0300000000000000020000000000000005000000000000000600000000000000"
    "0900000000000000000000000000e03f0000000000000940000000000000b03f"
    "020000000000000000000000000012400200000000000000000000000000d83f"
    "6576616c00000000000000000000000000000000000000000000000000000000"
)
# a fresh slot after Slot.reset()
RESET_BYTES = bytes.fromhex(
    "ffffffffffffffff000000000000000000000000000000000000000000000000"
    "ffffffffffffffffffffffffffffffff00000000000000000000000000000000"
    "ffffffffffffffff000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000"
)
# the slot after the Reporter's calls in test_slot_writers_lay_out_the_old_bytes
REPORTED_BYTES = bytes.fromhex(
    "0100000000000000000000000050594000000000000000000000000000605940"
    "0000000000000000020000000000000003000000000000000900000000000000"
    "0400000000000000000000000000d03f0000000000000000cdccccccccccdc3f"
    "05000000000000000000000000a0594002000000000000000000000000000000"
    "6576616c00000000000000000000000000000000000000000000000000000000"
)


# ------------------------------------------------------------------ fault kinds
def test_fault_kinds_keep_the_old_names_and_orders() -> None:
    assert (*OLD_DRILL_KINDS, *CORRUPTION_KINDS) == SLOT_DRILLS and GPU_KINDS == OLD_GPU_KINDS
    assert WORKER_ONLY == OLD_WORKER_ONLY and GROUP_DRILLS == ("stall", "wedge")
    assert ALL_KINDS == (*OLD_DRILL_KINDS, *OLD_GPU_KINDS, *NODE_KINDS_NOW,
                         *NOTICE_KINDS_NOW, *CORRUPTION_KINDS) == tuple(FaultKind)
    assert NODE_KINDS == NODE_KINDS_NOW
    assert AGENT_SIGNALS == {"kill": signal.SIGKILL, "segv": signal.SIGSEGV,
                             "hang": signal.SIGSTOP}
    assert set(AGENT_SIGNALS) | set(WORKER_ONLY) == set(SLOT_DRILLS)


def test_fault_kinds_read_print_and_serialise_as_their_strings() -> None:
    help_text = "kill, segv, exit, exception, hang, slow, comm, spin, deadlock, stall, wedge, " \
                "xid, ecc, thermal, net-down, preempt, bitflip, gradflip"
    assert ", ".join(ALL_KINDS) == help_text
    for kind in FaultKind:
        assert (str(kind), f"{kind}", f"{kind:>3}") == (kind.value, kind.value,
                                                         f"{kind.value:>3}")
        assert json.dumps({"kind": kind}) == json.dumps({"kind": kind.value})
        assert kind.value in ALL_KINDS and FaultKind(kind.value) is kind
    assert "hang" in AGENT_SIGNALS and AGENT_SIGNALS["kill"] == signal.SIGKILL  # plain keys
    assert "reboot" not in ALL_KINDS


def test_every_drill_crosses_the_slot_as_itself(tmp_path: Path) -> None:
    rep = Reporter(str(tmp_path), 0)
    agent = Slot(str(tmp_path / "0"), create=False)
    for seq, kind in enumerate(OLD_DRILL_KINDS, start=1):
        agent.write_drill(seq, kind, -1, 0.5)  # what the agent passes: the request's string
        assert agent.read().drill_kind == OLD_DRILL_KINDS.index(kind)
        got = rep.due_drill(0)
        assert got == (kind, 0.5) and got is not None and got[0] is FaultKind(kind)


# ------------------------------------------------------------------ phases
def test_phases_keep_the_slot_order() -> None:
    assert tuple(Phase) == OLD_PHASES
    assert [p.value for p in Phase] == list(OLD_PHASES)
    assert not Phase.NONE and all(p for p in Phase if p is not Phase.NONE)  # `or "step"`
    assert PAUSED_PHASES == ("long", "recovering")
    assert {"step": 1}[Phase.STEP] == 1 and f"{Phase.LONG}" == "long"


# ------------------------------------------------------------------ the slot's bytes
def test_layout_packs_the_old_bytes() -> None:
    assert len(KNOWN_BYTES) == len(RESET_BYTES) == len(REPORTED_BYTES) == SIZE == 160
    assert pack(KNOWN) == KNOWN_BYTES
    assert unpack(KNOWN_BYTES) == KNOWN
    assert unpack(RESET_BYTES) == Progress(drill_kind=0)
    assert pack(Progress(drill_kind=0)) == RESET_BYTES
    assert unpack(pack(Progress())) == Progress()  # an unwritten phase code reads as NONE
    cut = unpack(pack(Progress(label="x" * 40)))
    assert cut.label == "x" * 32


def test_slot_writers_lay_out_the_old_bytes(tmp_path: Path) -> None:
    slot = Slot(str(tmp_path / "0"), create=True)
    slot.reset()
    assert (tmp_path / "0").read_bytes() == RESET_BYTES
    rep = Reporter(str(tmp_path), 0)
    slot.write_drill(3, "stall", 4, 0.25)
    rep.step_started(0, 1, 0, 100.0)
    rep.collective_started(100.5)
    rep.optimizer(101.0)
    rep.committed(1, 1, 0, 101.25)
    rep.step_started(1, 1, 0, 101.5)
    rep.collective_started(101.75)
    rep.collective_started(102.0)
    rep.long_phase_entered("eval", 102.5)
    rep.recovering(103.0, 0, 2)  # inside the long phase: the slot keeps saying long
    assert (tmp_path / "0").read_bytes() == REPORTED_BYTES
    assert slot.read().phase is Phase.LONG and rep.due_drill(4) == ("stall", 0.25)


# ------------------------------------------------------------------ recovery mode
class OldFlags:
    """The worker's three flags before RecoveryMode, with the updates the old code made."""

    def __init__(self) -> None:
        self.broken: str | None = None
        self.pending_switch = False
        self.need_align = False

    def apply(self, event: str) -> None:
        if event == "broke":
            self.broken = "why"
        elif event == "switch":
            self.pending_switch = self.pending_switch or True
        else:
            self.need_align = True


EVENTS = {"broke": RecoveryMode.BROKEN, "switch": RecoveryMode.SWITCH, "align": RecoveryMode.ALIGN}


def test_recovery_mode_answers_as_the_old_flags_did() -> None:
    """Every order of events: the mode enters recovery exactly when a flag was set, reads the
    store when a switch was voted and awaits a newer generation when the group broke (and
    _target_generation asks in that order, so both at once still read the store first)."""
    for n in range(5):
        for events in itertools.product(EVENTS, repeat=n):
            old, mode = OldFlags(), RecoveryMode.NONE
            for event in events:
                old.apply(event)
                mode = mode.escalate(EVENTS[event])
            assert (mode is not RecoveryMode.NONE) == bool(
                old.broken or old.pending_switch or old.need_align), events
            assert mode.switch_voted == old.pending_switch, events
            assert mode.broken == (old.broken is not None), events


def test_escalate_is_a_join() -> None:
    modes = list(RecoveryMode)
    for a, b in itertools.product(modes, repeat=2):
        assert a.escalate(b) is b.escalate(a)
        assert a.escalate(b).escalate(a) is a.escalate(b)  # absorbs what it already covers
        assert RecoveryMode.NONE.escalate(a) is a and a.escalate(a) is a
    for a, b, c in itertools.product(modes, repeat=3):
        assert a.escalate(b).escalate(c) is a.escalate(b.escalate(c))
    assert RecoveryMode.SWITCH.escalate(RecoveryMode.BROKEN) is RecoveryMode.SWITCH_BROKEN
    assert RecoveryMode.ALIGN.escalate(RecoveryMode.BROKEN) is RecoveryMode.BROKEN
    assert RecoveryMode.SWITCH.escalate(RecoveryMode.ALIGN) is RecoveryMode.SWITCH
