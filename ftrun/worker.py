"""The worker API a training script uses: init, wrap, register, steps, batch_slice, commit.

Owns: this worker's view of the job (generation, rank, committed step), gradient all-reduce
over the live group, the commit rule (a step is applied only if every collective of it
succeeded), recovery at the next step boundary (rebuild the group, align on the highest
committed step, heal from an up-to-date peer), where this worker is for the agent's hang
detector (a few stores into its progress slot per step; `ft.long_phase` pauses it), and a
plain mode for runs outside ftrun.
Must not import: typer, rich, NVML, the agent or the CLI. Torch is imported when init() runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from ftrun import _exit, timeouts
from ftrun.comm import (
    Abandoned,
    CommError,
    GenerationWatcher,
    Group,
    Interrupt,
    build_group,
    never_completes,
)
from ftrun.errors import WorkerApiError
from ftrun.grads import FlatGrads
from ftrun.joining import connect, native_group, plain_group, quiet_store_warnings, warm_up
from ftrun.progress import Reporter, hang_here
from ftrun.rendezvous import Generation, heal_plan, latest_number, post_request, read_generation
from ftrun.spec import WorkerEnv
from ftrun.transfer import pack, recv_state, send_state, unpack


def init(backend: str | None = None, seed: int = 0) -> FaultTolerant:
    """Join the job. Under ftrun: fault tolerant. Under torchrun or plain python: the same API
    over torch.distributed's default group (or a world of one), without recovery."""
    import torch

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if os.environ.get("FTRUN_FT_MODE") == "inprocess" and "FTRUN_WORKER_ID" in os.environ:
        return FaultTolerant(backend, seed, WorkerEnv.from_env())
    return FaultTolerant(backend, seed, None)


class FaultTolerant:
    def __init__(self, backend: str, seed: int, wenv: WorkerEnv | None) -> None:
        import torch

        self.backend = backend
        self.seed = seed
        self._ft = wenv is not None
        self._models: list[Any] = []
        self._objects: dict[str, Any] = {}
        self._interrupt = Interrupt()
        self._broken: str | None = None  # why the current step or group failed
        self._pending_switch = False
        self._need_align = False
        self._commit_pending = False
        self._flat: Any = None
        self._report_first_commit: dict[str, Any] | None = None
        self._progress: Reporter | None = None
        self._slow = 0.0
        self._stall: tuple[str, int] | None = None  # a stall or wedge drill, its generation
        self.committed = 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = backend == "nccl" and torch.cuda.is_available()
        if cuda and wenv is not None:
            # torchrun's default (1) kills the process on a NCCL error; in-process recovery
            # needs the communicator aborted and the error raised (2, CleanUpOnly)
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        self.device = torch.device("cuda", self.local_rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        if wenv is None:
            self._group = plain_group(backend)
            return
        self.worker_id = wenv.worker_id
        quiet_store_warnings()
        _exit.install()
        _exit.arm()
        if wenv.spare:
            warm_up()
        if wenv.progress_dir:
            self._progress = Reporter(wenv.progress_dir, wenv.worker_id)
        self._connect = lambda: connect(wenv)
        self._store = connect(wenv)
        self._native = native_group(self._connect(), wenv, backend)
        if wenv.spare:
            # a hot spare returns at once, so the script builds its model now; steps()
            # announces it ready and waits there to be called in
            start = latest_number(self._store, timeouts.GENERATION_WAIT_S)
            self._group = Group(Generation(start, ()), -1, None)
            self._watcher = GenerationWatcher(lambda: connect(wenv), start, self._interrupt)
            return
        post_request(self._store, "hello", worker=self.worker_id, pid=os.getpid(), spare=False)
        gen = self._first_generation()
        self._watcher = GenerationWatcher(lambda: connect(wenv), gen.number, self._interrupt)
        rank = gen.rank_of(self.worker_id)
        assert rank is not None
        self._group = Group(gen, rank, None)  # built at the first steps() iteration
        self._need_align = gen.number > 0
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(gen.world_size))

    # ---------------------------------------------------------------- live view
    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def world_size(self) -> int:
        return self._group.size

    @property
    def generation(self) -> int:
        return self._group.gen.number

    # ---------------------------------------------------------------- user API
    def wrap(self, model: Any) -> Any:
        """Gradients of `model` are averaged over the live group at each commit."""
        self._models.append(model)
        self._flat = None
        return model

    def register(self, **objects: Any) -> None:
        """State a joining replica pulls from a healthy one (anything with state_dict())."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise WorkerApiError(f"ft.register({name}=...) needs state_dict/load_state_dict")
        self._objects.update(objects)

    def steps(self, total: int) -> Iterator[int]:
        """Yield the next uncommitted step until `total` steps are committed."""
        while True:
            self._reconcile()
            if self.committed >= total:
                if self._finished():
                    return
                continue
            self._commit_pending = True
            self._before_step()
            yield self.committed
            if self._commit_pending:
                raise WorkerApiError("each step must end with ft.commit(optimizer)")

    def batch_slice(self, global_batch: int) -> slice:
        """This rank's contiguous share of a global batch, from the live membership."""
        base, extra = divmod(global_batch, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def long_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """`with ft.long_phase("eval"):` a legitimately long phase (an evaluation, a
        checkpoint, a compile): the hang detector leaves this rank alone meanwhile, and
        `ftrun status` shows `name`. Outside ftrun it does nothing."""
        return self._progress.long_phase(str(name)) if self._progress else contextlib.nullcontext()

    def seed_for(self, step: int) -> int:
        """A seed from (seed, step, rank): a replacement reproduces what the lost rank did."""
        return (self.seed * 1_000_003 + step) * 65_537 + self.rank

    def commit(self, optimizer: Any) -> bool:
        """Average gradients; step the optimizer only if that succeeded. Grads are zeroed."""
        self._commit_pending = False
        switch = False
        if self._broken is None:
            if self._progress is not None:  # collective 1 of this step
                self._progress.collective_started(time.time())
            try:
                switch = self._sync_gradients()
            except (CommError, Abandoned) as exc:
                self._broken = str(exc)
        ok = self._broken is None
        if not ok:
            # an abandoned all-reduce is not cancelled and may still write into the buffer:
            # never let it near a later step's gradients
            self._flat = None
            optimizer.zero_grad(set_to_none=True)
        if ok:
            if self._progress is not None:
                self._progress.optimizer(time.time())
            optimizer.step()
            self.committed += 1
            if self._progress is not None:
                self._progress.committed(self.committed, self.rank, self.generation, time.time())
            self._pending_switch = self._pending_switch or switch
            if self._report_first_commit is not None:
                self._post("recovered", **self._report_first_commit, first_commit=time.time())
                self._report_first_commit = None
        optimizer.zero_grad(set_to_none=False)  # keeps grads as views of the flat buffer
        return ok

    def _before_step(self) -> None:
        if self._progress is None:
            return
        self._progress.step_started(self.committed, self.rank, self.generation, time.time())
        drill = self._progress.due_drill(self.committed)
        if drill is not None:
            self._apply_drill(*drill)
        if self._slow:  # a "slow" drill: this rank computes slower from now on
            time.sleep(self._slow)

    def _apply_drill(self, kind: str, arg: float) -> None:
        """A fault drill from `ftrun inject-fault`, acted out inside this worker."""
        print(f"ftrun: drill: {kind} on worker {self.worker_id} at step {self.committed}",
              file=sys.stderr, flush=True)
        if kind in ("kill", "segv", "hang"):
            sig = {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "hang": signal.SIGSTOP}[kind]
            os.kill(os.getpid(), sig)
        elif kind == "exit":
            sys.stdout.flush()
            os._exit(1)
        elif kind == "exception":
            raise RuntimeError(f"ftrun drill: exception injected at step {self.committed}")
        elif kind == "slow":
            self._slow = arg
        elif kind in ("spin", "deadlock"):
            hang_here(kind)
        elif kind in ("stall", "wedge"):  # in this step's collective
            self._stall = (kind, self.generation)
        elif kind == "comm":
            self._group.abandon()
            self._broken = "ftrun drill: communicator failure injected"
            self._post("comm_failed", worker=self.worker_id, generation=self.generation,
                       error=self._broken)

    def close(self) -> None:
        if self._ft:
            self._watcher.stop()

    # ---------------------------------------------------------------- gradients
    def _params(self) -> list[Any]:
        return [p for m in self._models for p in m.parameters() if p.requires_grad]

    def _sync_gradients(self) -> bool:
        """One all-reduce of every gradient plus a flag element: True when some rank has seen
        a planned (non-urgent) generation, so that every rank switches at the same step."""
        if self._flat is None:
            self._flat = FlatGrads(self._params(), self.device)
        flat = self._flat.gather()
        newest = self._interrupt.newest
        self._flat.flag.fill_(1.0 if newest is not None and newest.number > self.generation
                              else 0.0)
        if self.world_size > 1:
            if self._stall is not None:
                self._stalled(*self._stall)
            self._group.allreduce(flat, self._interrupt)
            flat[:-1].div_(self.world_size)
        self._flat.scatter()
        return bool(self._flat.flag.item() > 0)

    def _stalled(self, kind: str, generation: int) -> None:
        """A drill: this rank's collective never completes, as behind a hung kernel. A stall
        lasts until a newer generation abandons it (the rebuilt communicator works); a wedged
        thread never comes back."""
        if kind == "wedge":
            hang_here(kind)
        if generation != self.generation:
            self._stall = None
            return
        never_completes(self._interrupt, generation)

    # ---------------------------------------------------------------- recovery
    def _reconcile(self) -> None:
        if not self._ft:
            if self._broken:
                raise CommError(self._broken)
            return
        if self.rank < 0:
            self._await_assignment()
        urgent = self._interrupt.urgent_above > self.generation
        unbuilt = self._group.pg is None and self.world_size > 1
        if not (self._broken or self._pending_switch or self._need_align or urgent or unbuilt):
            return
        noticed = time.time()
        if self._progress is not None:
            self._progress.recovering(noticed)
        while True:
            try:
                target = self._target_generation()
                if target.number != self.generation or self._group.pg is None:
                    self._switch_to(target)
                rebuilt = time.time()
                self._align()
                break
            except Abandoned:
                continue
            except CommError as exc:
                self._broken = str(exc)
        gen = self._group.gen
        self._broken, self._pending_switch, self._need_align = None, False, False
        if gen.number == 0:
            return  # the first group of the run: nothing was recovered
        self._report_first_commit = {
            "worker": self.worker_id, "generation": gen.number, "fault_at": gen.fault_at,
            "published_at": gen.published_at, "noticed": noticed, "rebuilt": rebuilt,
            "healed": time.time(), "step": self.committed}

    def _target_generation(self) -> Generation:
        newest = self._interrupt.newest
        if newest is not None and newest.number > self.generation:
            return newest
        if self._pending_switch:  # a peer saw it first; our watcher will too, read it now
            number = latest_number(self._store, timeouts.GENERATION_WAIT_S)
            if number > self.generation:
                return read_generation(self._store, number, timeouts.GENERATION_WAIT_S)
        if self._broken:
            return self._await_newer(self._broken)
        return self._group.gen

    def _await_newer(self, why: str) -> Generation:
        """The group failed: the agent publishes a newer generation when it sees the fault;
        if it saw none (a lone communicator error), ask it for one."""
        start = time.monotonic()
        asked = suspected = False
        while True:
            newest = self._interrupt.newest
            if newest is not None and newest.number > self.generation:
                return newest
            if not suspected:  # a peer's connection broke: a node may be gone, look now
                self._post("suspect", worker=self.worker_id, generation=self.generation)
                suspected = True
            if self._interrupt.store_lost:
                raise WorkerApiError(f"lost the agent ({self._interrupt.store_lost})")
            waited = time.monotonic() - start
            if not asked and waited > timeouts.FAULT_CONFIRM_S:
                self._post("comm_failed", worker=self.worker_id, generation=self.generation,
                           error=why)
                asked = True
            if waited > timeouts.FAULT_CONFIRM_S + timeouts.GENERATION_WAIT_S:
                raise WorkerApiError(f"no new generation after a failure ({why})",
                                     hint="the ftrun agent did not respond")
            self._interrupt.wake.clear()
            if self._interrupt.newest is None or self._interrupt.newest.number <= self.generation:
                self._interrupt.wake.wait(0.5)

    def _switch_to(self, gen: Generation) -> None:
        rank = gen.rank_of(self.worker_id)
        if rank is None:
            print(f"ftrun: worker {self.worker_id} left the job (generation {gen.number}: "
                  f"{gen.reason})", file=sys.stderr, flush=True)
            raise SystemExit(0)
        self._group.abandon()
        self._group = Group(gen, rank, None)
        if self._progress is not None:  # out of the old collective: arrived in `gen`
            self._progress.recovering(time.time(), rank, gen.number)
        self._group = build_group(self._connect, gen, rank, self.backend, self.device,
                                  self._interrupt, self._native)
        self._need_align = gen.number > 0
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(gen.world_size))

    def _align(self) -> None:
        """Agree on the highest committed step; those behind load a peer's state."""
        import torch

        group = self._group
        if group.size == 1:
            return
        steps = torch.zeros(group.size, dtype=torch.int64, device=self.device)
        steps[group.rank] = self.committed
        group.allreduce(steps, self._interrupt)
        committed = [int(s) for s in steps.tolist()]
        plan = heal_plan(committed)
        if plan and not self._objects:
            raise WorkerApiError("a replica must heal but nothing is registered",
                                 hint="call ft.register(model=..., optimizer=...) before steps()")
        payload: list[Any] | None = None
        for dst, src in sorted(plan.items()):
            if src == group.rank:
                payload = payload if payload is not None else pack(self._objects, {})
                send_state(group, dst, payload, self._interrupt, self.device)
            elif dst == group.rank:
                unpack(recv_state(group, src, self._interrupt, self.device), self._objects)
        self.committed = max(committed)

    def _finished(self) -> bool:
        """Every member reached the end: one last collective so no one leaves a peer behind."""
        if not self._ft or self.world_size == 1:
            return True
        import torch

        if self._progress is not None:
            self._progress.collective_started(time.time())
        try:
            self._group.allreduce(torch.ones(1, device=self.device), self._interrupt)
            if self._progress is not None:
                self._progress.finished(time.time())
            return True
        except (CommError, Abandoned) as exc:
            self._broken = str(exc)
            return False

    def _await_assignment(self) -> None:
        """A hot spare, model built: tell the agent, then wait for a generation with us in."""
        if self._models:  # allocate and touch the gradient buffer now, not on the first step
            self._flat = FlatGrads(self._params(), self.device)
            self._flat.gather()
        self._post("hello", worker=self.worker_id, pid=os.getpid(), spare=True)
        deadline = time.monotonic() + timeouts.SPARE_ASSIGNMENT_S
        intr = self._interrupt
        while True:
            newest = intr.newest
            if newest is not None and newest.rank_of(self.worker_id) is not None:
                self._need_align = True
                return
            if intr.store_lost:
                raise WorkerApiError(f"lost the agent ({intr.store_lost})")
            if time.monotonic() > deadline:
                raise WorkerApiError("this spare was never called in",
                                     hint="raise timeouts.SPARE_ASSIGNMENT_S")
            intr.wake.clear()
            if intr.newest is newest:
                intr.wake.wait(1.0)

    def _first_generation(self) -> Generation:
        wait_s = timeouts.GENERATION_WAIT_S
        gen = read_generation(self._store, latest_number(self._store, wait_s), wait_s)
        while gen.rank_of(self.worker_id) is None:
            gen = read_generation(self._store, gen.number + 1, wait_s)
        return gen

    def _post(self, kind: str, **fields: Any) -> None:
        try:
            post_request(self._store, kind, **fields)
        except Exception as exc:  # the agent is gone; the next collective will say so
            self._interrupt.store_lost = str(exc)[:200]
