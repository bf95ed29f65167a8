"""A Lightning strategy with ftrun's in-process fault tolerance:
`Trainer(strategy=FaultTolerantStrategy(), devices=N, ...)`, nothing else changes.

Under `ftrun` (in-process recovery) the strategy does not wrap the model in DDP: ftrun's
gradient buckets average the gradients while backward runs, `ft.sync()` finishes them inside
Lightning's optimizer closure (before clipping and the `on_before_optimizer_step` hooks), and
a step whose sync fails is recovered and run again on the same batch (the closure runs
forward and backward once more). The model, the optimizers, the LR schedulers, a precision
scaler and the fit loop's progress are registered, so a replacement heals from a live replica
before its fit loop starts and continues at the same batch (its train loader skips the
batches of the epoch already done). Lightning's own collectives outside the step (barrier,
broadcast, reduce of logged values) are rank-local: see docs/integrations/lightning.md.
Outside ftrun (plain `python`, `torchrun`, Lightning's own launcher) it is Lightning's
`DDPStrategy`, unchanged.

Owns: that strategy. Must not import: typer, rich, NVML, the agent, the CLI. Lightning and
torch are imported here (this module is only imported by a script that uses Lightning).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

try:  # an optional extra: without it, one line that says how to get it
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.strategies.strategy import Strategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
except ImportError as exc:
    raise ImportError(f"ftrun.integrations.lightning needs Lightning ({exc}): "
                      "pip install 'ftrun[lightning]'") from None

from ftrun.integrations.lightning_state import LoopRecorder, LoopState, ResumingLoader
from ftrun.integrations.stepping import StepBroke, StepDriver, under_ftrun

__all__ = ["FaultTolerantStrategy"]


class FaultTolerantStrategy(DDPStrategy):
    """Lightning's DDP, fault tolerant under ftrun. `bucket_mb`: the size of ftrun's gradient
    buckets (DDP's `bucket_cap_mb`); other keyword arguments go to `DDPStrategy` (used
    outside ftrun)."""

    strategy_name = "ftrun"

    def __init__(self, bucket_mb: float = 25.0, **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        self.bucket_mb = bucket_mb
        self.managed = under_ftrun()  # decided at once: Lightning asks for ranks early
        self.ft: Any = None  # ftrun's FaultTolerant once the environment is set up
        self.driver: StepDriver | None = None  # while fitting under ftrun
        self.loop_state: LoopState | None = None
        self._finished = False  # the driver ran out its steps (or left the job)
        self._phase: AbstractContextManager[None] | None = None

    # ------------------------------------------------------------------ ranks
    @property
    def global_rank(self) -> int:
        if not self.managed or self.ft is None:
            return super().global_rank
        # a hot spare not called in yet: a valid rank that is not rank zero (it learns its
        # own, and its sampler takes it, when it is called in)
        return self.ft.rank if self.ft.rank >= 0 else max(0, self.world_size - 1)

    @property
    def world_size(self) -> int:
        if not self.managed or self.ft is None or self.ft.rank < 0:
            return super().world_size
        return int(self.ft.world_size)

    @property
    def root_device(self) -> torch.device:
        """Under ftrun: ftrun's device (a hot spare's local rank is past `devices`)."""
        if not self.managed:
            return super().root_device
        if self.ft is not None:
            return self.ft.device
        assert self.parallel_devices is not None
        first = self.parallel_devices[0]
        return first if first.type == "cpu" else torch.device(first.type, self.local_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if not self.managed:
            return super().distributed_sampler_kwargs
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _rank_zero_follows(self) -> None:
        """Lightning's rank-zero-only helpers follow this worker's live rank."""
        rank = self.global_rank if self.ft is None or self.ft.rank >= 0 else -1
        rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        if not self.managed:
            super().setup_environment()
            return
        Strategy.setup_environment(self)  # the accelerator's device; no process group
        from lightning.fabric.utilities.seed import reset_seed

        import ftrun

        reset_seed()
        self.ft = ftrun.init(backend=self._process_group_backend)
        self._rank_zero_follows()

    def setup(self, trainer: Any) -> None:
        if not self.managed:
            super().setup(trainer)
            return
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            _check_supported(trainer)
            self.ft.wrap(self.model, bucket_mb=self.bucket_mb)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            from lightning.fabric.utilities.optimizer import _optimizers_to_device

            _optimizers_to_device(self.optimizers, self.root_device)
            self._start_steps(trainer)

    def _start_steps(self, trainer: Any) -> None:
        """Register what a replacement pulls, then open the first step: the group is built
        there, and a hot spare waits to be called in and heals (its fit loop included)."""
        self.loop_state = LoopState(trainer)
        # Lightning broadcasts a SIGTERM flag from rank 0 before every batch, over the default
        # group: after a recovery a joiner's broadcast would pair with a survivor's gradient
        # bucket. ftrun's agent forwards SIGTERM to every worker, so each one checks its own.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: _sigterm_here(trainer)
        trainer.callbacks.append(LoopRecorder(self.loop_state))
        objects: dict[str, Any] = {"model": self.lightning_module}
        objects.update({f"optimizer{i}": opt for i, opt in enumerate(self.optimizers)})
        objects.update({f"scheduler{i}": config.scheduler
                        for i, config in enumerate(self.lr_scheduler_configs)})
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            objects["scaler"] = scaler
        self.ft.register(**objects, fit_loop=self.loop_state)
        _zero_in_place(self.optimizers)
        self.driver = StepDriver(self.ft, _total_steps(trainer))
        self.driver.begin()
        self._rank_zero_follows()

    def process_dataloader(self, dataloader: object) -> object:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if not self.managed or trainer is None or not trainer.training:
            return dataloader
        progress = trainer.fit_loop.epoch_loop.batch_progress
        return ResumingLoader(dataloader, lambda: progress.current.completed,
                              lambda: self.global_rank)

    # ------------------------------------------------------------------ a step
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """Forward and backward (Lightning's closure), ftrun's sync, then Lightning's
        precision plugin steps the optimizer on the global average. A broken sync: recover
        and run the closure again on the same batch."""
        driver = self.driver
        if driver is None or self._finished:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def synced_closure() -> Any:
            result = closure()
            if not driver.synced():
                raise StepBroke  # out of optimizer.step() before it touches a parameter
            return result

        while True:
            driver.begin()
            try:
                output = Strategy.optimizer_step(self, optimizer, synced_closure, model,
                                                 **kwargs)
            except StepBroke:
                driver.broke()
                continue
            driver.commit()
            return output

    # ------------------------------------------------------------------ phases
    def on_validation_start(self) -> None:
        """A validation is a legitimately long phase: the hang detector leaves it alone."""
        if self.ft is not None and self._phase is None:
            self._phase = self.ft.long_phase("validation")
            self._phase.__enter__()

    def on_validation_end(self) -> None:
        if self._phase is not None:
            phase, self._phase = self._phase, None
            phase.__exit__(None, None, None)

    def on_train_end(self) -> None:
        if self.driver is not None and not self._finished:
            self._finished = True
            self.driver.finish()

    @property
    def repeats(self) -> int:
        """Steps this worker ran again after a failed sync (0 outside ftrun)."""
        return self.driver.repeats if self.driver is not None else 0

    # ------------------------------------------------------------------ collectives
    # Under ftrun the live group belongs to the step protocol: a collective outside it would
    # pair with a peer's gradient bucket after a recovery. These stay on this rank.
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.managed:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return super().broadcast(obj, src) if not self.managed else obj

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return super().reduce(tensor, group, reduce_op) if not self.managed else tensor

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        if not self.managed:
            return super().reduce_boolean_decision(decision, all)
        return decision

    def all_gather(self, tensor: torch.Tensor, group: Any = None,
                   sync_grads: bool = False) -> torch.Tensor:
        if not self.managed:
            return super().all_gather(tensor, group, sync_grads)
        raise RuntimeError("all_gather is not available under ftrun's FaultTolerantStrategy "
                           "(a collective outside the training step is not fault tolerant)")

    def teardown(self) -> None:
        if self.driver is not None and not self._finished:  # left fitting by an exception
            self._finished = True
            self.ft.close()
        super().teardown()


def _zero_in_place(optimizers: Sequence[Any]) -> None:
    """Lightning zeroes the gradients before each backward with torch's default
    (`set_to_none=True`): autograd then allocates every gradient afresh and ftrun's bucket
    hooks copy each one into its bucket, every step. Zeroed in place, the gradients stay the
    views of the buckets that `ft.commit()` leaves them, and backward accumulates into them
    (no allocation, no copy). A `zero_grad(set_to_none=True)` the user asks for is kept."""
    for opt in optimizers:
        opt.zero_grad = functools.partial(opt.zero_grad, set_to_none=False)


def _sigterm_here(trainer: Any) -> None:
    if getattr(trainer, "received_sigterm", False):
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        raise SIGTERMException()


def _check_supported(trainer: Any) -> None:
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise RuntimeError("FaultTolerantStrategy under ftrun needs automatic optimization "
                           "(a manual step cannot be run again after a failed sync)")
    if trainer.accumulate_grad_batches != 1:
        raise RuntimeError("FaultTolerantStrategy under ftrun does not support "
                           "accumulate_grad_batches > 1 yet: raise the batch size instead")


def _total_steps(trainer: Any) -> int:
    total = trainer.estimated_stepping_batches
    if total == float("inf"):
        raise RuntimeError("FaultTolerantStrategy under ftrun needs a known number of steps: "
                           "set max_steps (or max_epochs with a sized train dataloader)")
    return int(total)
