"""A worker's recovery at a step boundary: the move to the generation due, the alignment, and
what a make-up needs from it.

Owns: `Recovering`, which the worker API calls at every step boundary of a run under ftrun: a
hot spare waiting to be called in; when a recovery is due (member.py says what and when),
the move into the generation (a new communicator), the alignment on the highest committed
step (aligning.py; after a total loss the newest snapshot loads first, worker/snapshots.py),
the make-up's agreement (`--redo lost`, worker/makeup.py), a move abandoned by a newer
generation tried again, and the recovery's report settled; past training, a replacement
served (rebuild, heal, the final collective). The streams are put back to the step's start
before a peer heals from this worker.
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ftrun.core.states import RecoveryMode
from ftrun.protocol.progress import Reporter
from ftrun.protocol.rendezvous import Generation, Request
from ftrun.worker.aligning import Healer, align, with_streams
from ftrun.worker.comm import Abandoned, CommError, Interrupt
from ftrun.worker.makeup import Redo
from ftrun.worker.member import Member
from ftrun.worker.rng import RandomStreams
from ftrun.worker.sharded import ReplicaView
from ftrun.worker.snapshots import Snapshots


class Recovering:
    def __init__(self, member: Member, objects: dict[str, Any], streams: RandomStreams,
                 healer: Healer, redo: Redo, snapshots: Snapshots | None,
                 replicas: ReplicaView, interrupt: Interrupt, device: Any,
                 progress: Reporter | None, post: Callable[[Request], None],
                 prepare: Callable[[], None]) -> None:
        """`objects`: the registered ones (the API's own dict: registered later, seen here);
        `prepare`: a hot spare allocates its gradient buckets while it waits."""
        self.member, self.objects, self.streams = member, objects, streams
        self.healer, self.redo, self.snapshots, self.replicas = healer, redo, snapshots, replicas
        self.interrupt, self.device, self.progress = interrupt, device, progress
        self.post, self.prepare = post, prepare

    def reconcile(self, committed: int, replay: Callable[[], bool]) -> int:
        """The committed step to go on from, once whatever the boundary owes is done
        (`replay`: the streams back to the step's start)."""
        member = self.member
        if member.rank < 0:  # a hot spare, model built
            self.prepare()  # allocate the gradient buckets now, not on the first step
            member.await_assignment()
        if not member.due():
            return committed
        noticed = time.time()
        if self.progress is not None:
            self.progress.recovering(noticed)
        replay()  # before a peer heals from us: the streams of the step's start
        while True:
            try:
                member.move()
                rebuilt = time.time()
                committed = self._align(committed)
                self.redo.after_align(member.group, committed, self.interrupt, self.device,
                                      member.generation_record)
                break
            except Abandoned:
                continue
            except CommError as exc:
                member.broke(str(exc))
        member.settle(noticed, rebuilt, committed)
        return committed

    def state_objects(self) -> dict[str, Any]:
        """What travels and is kept: the registered objects and the random streams."""
        return with_streams(self.objects, self.streams)

    def _align(self, committed: int) -> int:
        """Agree on the highest committed step; those behind load a peer's state (after a
        total loss, the newest snapshot first)."""
        snapshots = self.snapshots
        if snapshots is not None and snapshots.resuming and self.objects:
            resumed = snapshots.resume(self.state_objects())
            if resumed is not None:
                committed = resumed.step
                self.post(resumed)
        sharding = self.replicas.sharding
        mesh = sharding.group().mesh if sharding is not None else None
        return align(self.member.group, committed, self.objects, self.streams, self.interrupt,
                     self.device, mesh, self.healer)

    def serve_at_end(self, committed: int, replay: Callable[[], bool],
                     compared: Callable[[], bool]) -> None:
        """A replacement comes in after training: rebuild with it, heal it, then the
        collectives it runs at the end of its ft.steps(): the final compare (`compared`:
        False when its collective failed, and a recovery follows) and the last one. Nothing
        of this replica's own was recovered."""
        self.member.escalate(RecoveryMode.ALIGN)
        while True:
            committed = self.reconcile(committed, replay)
            if compared() and self.member.finished():
                break
        self.member.recovered = None

    def trained(self, committed: Callable[[], int], replay: Callable[[], bool],
                compared: Callable[[], bool]) -> None:
        """Out of ft.steps() with the final state; at the script's end this worker waits
        for its peers' (member.py), serving any replacement that comes in."""
        def serve(gen: Generation) -> None:
            self.serve_at_end(committed(), replay, compared)

        self.member.trained(committed, serve)
