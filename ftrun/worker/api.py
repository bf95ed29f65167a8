"""The worker API a training script uses: init, wrap, register, loader, steps, batch_slice,
no_sync, sync, commit, long_phase.

Owns: this worker's committed step, the step protocol (sync: every gradient bucket reduced,
and under --verify-every each rank's local gradient checked against its peers'; commit: the
user stepped), the commit rule (a step is applied only if every collective of it
succeeded), random streams replayed when a step is repeated, what each step boundary runs
(a recovery: worker/recovering.py; the replicas compared and a snapshot: worker/boundary.py),
where this worker is for the hang detector (its progress slot; `ft.long_phase` pauses it),
the replica-group properties (a `sharded.ReplicaView`), a plain mode outside ftrun.
Must not import: typer, rich, NVML, the agent or the CLI. Torch is imported when init() runs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from ftrun.core.errors import WorkerApiError
from ftrun.core.spec import WorkerEnv
from ftrun.core.states import RecoveryMode, StepState
from ftrun.protocol.progress import Reporter
from ftrun.protocol.rendezvous import Request
from ftrun.worker import errorfile
from ftrun.worker.aligning import Healer, with_streams
from ftrun.worker.boundary import Boundary
from ftrun.worker.buckets import GradSync
from ftrun.worker.comm import Abandoned, CommError, Interrupt
from ftrun.worker.drills import Drills
from ftrun.worker.joining import connect, quiet_store_warnings, warm_up
from ftrun.worker.loader import Loader
from ftrun.worker.makeup import Makeup, redo_for
from ftrun.worker.member import Member, join
from ftrun.worker.recovering import Recovering
from ftrun.worker.replica_sync import ReplicaSync
from ftrun.worker.rng import RandomStreams
from ftrun.worker.sharded import ReplicaView, Sharding, shard_plainly
from ftrun.worker.snapshots import Snapshots
from ftrun.worker.verify import flip_bit


def init(backend: str | None = None, seed: int = 0) -> FaultTolerant:
    """Join the job. Under ftrun: fault tolerant. Under torchrun or plain python: the same API
    over torch.distributed's default group (or a world of one), without recovery."""
    import torch

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if WorkerEnv.recovers_in_process():
        return FaultTolerant(backend, seed, WorkerEnv.from_env())
    return FaultTolerant(backend, seed, None)


class FaultTolerant:
    def __init__(self, backend: str, seed: int, wenv: WorkerEnv | None) -> None:
        import torch

        self.backend = backend
        self.seed = seed
        self._managed = wenv is not None  # run by an ftrun agent: faults recover in-process
        self._objects: dict[str, Any] = {}
        self._interrupt = Interrupt()
        self._state = StepState.IDLE
        self._progress: Reporter | None = None
        self._streams = RandomStreams()
        self._replay: tuple[int, dict[str, Any]] | None = None  # a step's start: its streams
        self.committed = 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = backend == "nccl" and torch.cuda.is_available()
        if cuda and wenv is not None:
            # torchrun's default (1) kills the process on a NCCL error; in-process recovery
            # needs the communicator aborted and the error raised (2, CleanUpOnly)
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            # the NCCL watchdog's monitor kills a process whose watchdog seems stuck, whatever
            # the above says (pytorch#155916): a long in-process recovery must not be killed
            os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
        self.device = torch.device("cuda", self.local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self._sync: GradSync | ReplicaSync = GradSync(
            self.device, self._wants_switch, self._bucket_starting, self._in_collective)
        self._drills = Drills(None, -1, self._comm_failed)
        self._snapshots = Snapshots(wenv) if wenv is not None else None
        # every boundary: the replicas compared where due, a snapshot where due
        self._boundary = Boundary(wenv.verify_every if wenv is not None else 0,
                                  self._snapshots, wenv.worker_id if wenv else 0, self._post)
        self._healer = Healer.of(wenv, self._post)
        sharding = None  # --shard-size: replica groups (HSDP)
        if wenv is not None and wenv.shard_size > 1:
            sharding = Sharding(wenv.shard_size, lambda: connect(wenv), wenv.worker_id,
                                backend, self.device, spare=wenv.spare)
            self._sync = ReplicaSync(self._wants_switch, sharding.group,
                                     self._bucket_starting, self._in_collective)
            self._boundary.shards = sharding.group  # a rollback takes every shard along
        self._replicas = ReplicaView(lambda: (self.rank, self.world_size), sharding,
                                     None if wenv is not None else self._shard_plainly)
        # --redo: what a broken step leaves, and how a pass's shares are weighed
        self._redo = redo_for(wenv, self._sync, lambda: (self.rank, self.world_size))
        if wenv is None:
            self._member = Member.plain(backend)
            if int(os.environ.get("FTRUN_SHARD_SIZE", "1")) > 1:  # torchrun, like --shard-size
                self._replicas.shards(int(os.environ["FTRUN_SHARD_SIZE"]))
            return
        self.worker_id = wenv.worker_id
        quiet_store_warnings()
        errorfile.install()
        errorfile.arm()
        if wenv.spare:
            warm_up()
        if wenv.progress_dir:
            self._progress = Reporter(wenv.progress_dir, wenv.worker_id)
        self._drills = Drills(self._progress, self.worker_id, self._comm_failed,
                              lambda n, seed: flip_bit(self._objects, n, seed))
        self._member = join(wenv, backend, self.device, self._interrupt, self._progress,
                            sharding)
        self._member.before_leaving = self._final_snapshot
        if wenv.verify_every > 0 and wenv.verify_grads_every > 0 and \
                isinstance(self._sync, GradSync):
            self._boundary.check_gradients(self._sync, wenv.verify_grads_every,
                                           lambda: self.committed, self._drills.tamper)
        self._recovering = Recovering(
            self._member, self._objects, self._streams, self._healer, self._redo,
            self._snapshots, self._replicas, self._interrupt, self.device, self._progress,
            self._post, self._sync.prepare)

    # ---------------------------------------------------------------- live view
    @property
    def rank(self) -> int:
        return self._member.rank

    @property
    def world_size(self) -> int:
        return self._member.group.gen.world_size

    @property
    def generation(self) -> int:
        return self._member.generation

    @property
    def shard_mesh(self) -> Any:
        """--shard-size: a 1-D DeviceMesh over this rank's replica group, for
        `fully_shard(module, mesh=ft.shard_mesh)`; ftrun averages across the groups."""
        return self._replicas.shards().group().mesh

    @property
    def replica_rank(self) -> int:
        return self._replicas.placement().replica_rank

    @property
    def num_replicas(self) -> int:
        return self._replicas.placement().num_replicas

    @property
    def shard_rank(self) -> int:
        return self._replicas.placement().shard_rank

    def _shard_plainly(self, size: int) -> Sharding:
        """Outside ftrun: replica groups over torch's default group; this worker's group
        becomes their replicate dimension, averaged by a ReplicaSync."""
        wrapped = isinstance(self._sync, GradSync) and bool(self._sync.params)
        sharding, self._member.group, self._sync = shard_plainly(
            size, self._member.group, self.rank, wrapped, self.backend, self.device,
            self._wants_switch)
        return sharding

    # ---------------------------------------------------------------- user API
    def wrap(self, model: Any, bucket_mb: float = 25.0) -> Any:
        """Gradients of `model` are averaged over the live group: bucket by bucket while
        backward runs (buckets of about `bucket_mb`), finished by sync()."""
        self._sync.add(list(model.parameters()), bucket_mb)
        return model

    def register(self, **objects: Any) -> None:
        """State a joining replica pulls from a healthy one (anything with state_dict():
        models, optimizers, schedulers, scalers). The random streams travel with it."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise WorkerApiError(f"ft.register({name}=...) needs state_dict/load_state_dict")
        self._objects.update(objects)

    def loader(self, dataset: Any, global_batch_size: int, **options: Any) -> Loader:
        """Step s's global batch, a fixed list of dataset indices; `batch(step, micro, accum)`
        reads this rank's part (ftrun.worker.loader.Loader: shuffle, seed, num_workers)."""
        return Loader(dataset, global_batch_size, **options, makeup=self._redo.cut,
                      membership=lambda: (self.rank, self.world_size, self.generation))

    def steps(self, total: int) -> Iterator[int]:
        """Yield the next uncommitted step until `total` steps are committed. Once they are,
        this worker stays, at its script's end, until every member's script has ended
        (script_end.py: a rank lost meanwhile is replaced and heals from it)."""
        if self._member.stage == "trained":  # a second loop: not past training after all
            self._member.tell("training", self.committed)
        while True:
            self._reconcile()
            done = self.committed >= total
            if self._managed and not self._boundary_passed(done):
                continue  # rolled back, or the comparison's collective failed
            if done:
                if self._member.finished():
                    self._trained()
                    return
                continue
            if self._behind_in_group():  # follow the group's newest generation first
                self._member.escalate(RecoveryMode.SWITCH)
                self._reconcile()
                if self.committed >= total:
                    continue
            self._start_step()
            yield self.committed
            if self._state in (StepState.RUNNING, StepState.SYNCED):
                raise WorkerApiError("each step must end with ft.commit()",
                                     hint="ft.sync(), your optimizer step, then ft.commit(); "
                                          "or ft.commit(optimizer)")

    def batch_slice(self, global_batch: int) -> slice | list[int]:
        """This rank's contiguous share of a global batch, from the live membership; in a
        make-up pass, its part of the lost share (a list of positions if not contiguous)."""
        return self._redo.batch_slice(global_batch, self.rank, self.world_size)

    @property
    def makeup(self) -> Makeup | None:
        """None in a full pass; in a make-up pass (--redo lost), this rank's part of the lost
        share (`samples`: what ft.batch_slice or ft.loader handed out so far in this pass)."""
        return self._redo.makeup

    def long_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """`with ft.long_phase("eval"):` a legitimately long phase (an evaluation, a
        checkpoint, a compile): the hang detector leaves this rank alone meanwhile, and
        `ftrun status` shows `name`. Outside ftrun it does nothing."""
        return self._progress.long_phase(str(name)) if self._progress else contextlib.nullcontext()

    def seed_for(self, step: int) -> int:
        """A seed from (seed, step, rank): a replacement reproduces what the lost rank did."""
        return (self.seed * 1_000_003 + step) * 65_537 + self.rank

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally, with no communication (DDP's no_sync)."""
        self._sync.enabled = False
        try:
            yield
        finally:
            self._sync.enabled = True

    def sync(self) -> bool:
        """Wait for this step's gradient buckets (and start any still missing). True: every
        wrapped parameter's .grad holds the global average, on every rank. False: the step
        broke; do not step the optimizer, steps() repeats it."""
        if self._state is not StepState.RUNNING:
            raise WorkerApiError(f"ft.sync() in a step that is {self._state.value}",
                                 hint="call it once per step, after backward, before commit")
        switch = finished = False
        member = self._member
        if not member.mode.broken:
            self._bucket_starting()  # a comm drill fires here if no bucket started it
        if not member.mode.broken:
            if self._progress is not None:  # collective 1 of this step
                self._progress.collective_started(time.time())
            try:
                finished = True  # it votes, whatever it raises
                switch = self._sync.finish(member.group, self._interrupt)
            except (CommError, Abandoned) as exc:
                member.broke(str(exc))
        if member.mode.broken:
            if not finished:  # broken before: its replica group still counts on one vote
                self._sync.abstain()
            self._redo.broke(self.committed, member.group.gen, self._sync)  # before drop()
            # an abandoned all-reduce is not cancelled and may still write into its bucket:
            # never let it near a later step's gradients
            self._sync.drop()
            self._state = StepState.FAILED
            return False
        if switch:
            member.escalate(RecoveryMode.SWITCH)
        if self._boundary.rejects(self.committed, member.group):
            self._sync.drop()  # a rank's gradient far off: the step repeats, applied nowhere
            self._state = StepState.FAILED
            return False
        self._state = StepState.SYNCED
        if self._progress is not None:
            self._progress.optimizer(time.time())
        return True

    def commit(self, *optimizers: Any) -> bool:
        """After a successful sync() and the user's optimizer step: the step is committed.
        `commit(opt, ...)` without sync() syncs, steps each optimizer only if the sync
        succeeded, and zeroes the gradients. True when the step was committed."""
        if self._state is StepState.FAILED:
            return False  # the step broke: nothing is committed, steps() repeats it
        if self._state in (StepState.IDLE, StepState.COMMITTED):
            raise WorkerApiError(f"ft.commit() in a step that is {self._state.value}",
                                 hint="commit once per step, inside `for step in ft.steps(n)`")
        if not optimizers and self._state is not StepState.SYNCED:
            raise WorkerApiError("ft.commit() without a successful ft.sync() in this step",
                                 hint="call ft.sync() first, or ft.commit(optimizer)")
        if self._state is StepState.RUNNING and not self.sync():
            return False
        for opt in optimizers:
            opt.step()
        self.committed += 1
        self._state = StepState.COMMITTED
        self._healer.committed(self._state_objects)
        if self._progress is not None:
            self._progress.committed(self.committed, self.rank, self.generation, time.time())
        self._member.first_commit(*self._redo.committed())
        self._sync.zero()  # grads stay views of their buckets
        return True

    def close(self) -> None:
        if self._managed and self._member.stage != "trained":  # else it serves at the end
            self._member.stop()

    # ---------------------------------------------------------------- a step
    def _start_step(self) -> None:
        if self._managed and not self._replay_streams():
            self._replay = (self.committed, self._streams.state_dict())
        self._state = StepState.RUNNING
        self._member.step_started()
        self._redo.start_pass(self.committed)
        self._sync.next_step(self._member.group)
        if self._progress is not None:
            self._progress.step_started(self.committed, self.rank, self.generation, time.time())
        self._drills.before_step(self.committed, self.generation)

    def _replay_streams(self) -> bool:
        """A step that failed is repeated: its random streams go back to the step's start."""
        if self._replay is None or self._replay[0] != self.committed:
            return False
        self._streams.load_state_dict(self._replay[1])
        return True

    def _behind_in_group(self) -> bool:
        """Under --shard-size: a rank of this replica group is in a newer generation."""
        if not self._managed:
            return False
        try:
            return self._replicas.behind(self.generation, self._snapshots)
        except CommError as exc:  # a peer died: the agent takes the group out
            self._member.broke(str(exc))
            return True

    def _comm_failed(self, why: str) -> None:  # a comm drill
        self._member.comm_failed(why)

    def _wants_switch(self) -> bool:
        return self._member.wants_switch()

    def _bucket_starting(self) -> bool:
        return self._drills.bucket_starting(self.generation)

    def _in_collective(self) -> None:
        self._drills.in_collective(self._interrupt, self.generation)

    # ---------------------------------------------------------------- recovery
    def _reconcile(self) -> None:
        """Whatever the boundary owes before the next step (worker/recovering.py)."""
        member = self._member
        if not self._managed:
            if member.mode.broken:
                raise CommError(member.why)
            return
        self.committed = self._recovering.reconcile(self.committed, self._replay_streams)

    @property
    def _state_objects(self) -> dict[str, Any]:  # what is kept and restored: streams too
        return with_streams(self._objects, self._streams)

    def _boundary_passed(self, done: bool, committing: bool = True) -> bool:
        """The replicas compared where due (worker/boundary.py); False: the loop goes round
        again (a rollback, or the compare's collective failed: a recovery follows). Serving a
        late replacement, `committing` is False: no snapshot follows the compare."""
        try:
            step = self._boundary.passed(
                self._member.group, self.committed, self._objects, self._state_objects,
                self.device, self._interrupt, committing and self._state is StepState.COMMITTED,
                done)
        except (CommError, Abandoned) as exc:
            self._member.broke(str(exc))
            return False
        kept = step == self.committed
        if not kept:
            self.committed, self._state, self._replay = step, StepState.IDLE, None
        return kept

    def _final_snapshot(self) -> None:
        """Every member leaves at this boundary (a notice with nowhere to go): the node's
        replica takes the snapshot a requeued job resumes from."""
        if self._state is StepState.COMMITTED:
            self._boundary.final_snapshot(self._member.group, self.committed, self._objects,
                                          self._state_objects, self.device, self._interrupt)

    def _trained(self) -> None:  # at the script's end it waits for its peers', serving
        if self._managed:
            self._recovering.trained(lambda: self.committed, self._replay_streams,
                                     lambda: self._boundary_passed(True, committing=False))

    def _post(self, request: Request) -> None:
        self._member.post(request)
