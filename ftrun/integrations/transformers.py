"""Hugging Face's Trainer with ftrun's in-process fault tolerance: `FaultTolerantTrainer` is a
`transformers.Trainer` subclass; a script replaces `Trainer(...)` with it and imports this
module before it builds its `TrainingArguments`.

Why a subclass and not a callback: a callback cannot run a step's forward and backward again,
and a broken step must be run again on the same batch; the subclass overrides
`training_step` (forward and backward until `ft.sync()` succeeds), the train sampler (the
live rank's share), `_run_epoch` (a replacement starts at the healed step's epoch and
batch), and `evaluate` (a long phase for the hang detector). Its callback commits each step
after the optimizer's, and runs the step protocol out at the end of training.

Under `ftrun` (in-process recovery), Accelerate runs as a single process on each worker: this
module hides torchrun's rank variables from it when imported, so that Accelerate neither
builds a process group nor wraps the model in DDP. ftrun's gradient buckets average the
gradients over the live group, and every worker evaluates on the whole eval set. The model,
optimizer, LR scheduler, the Trainer's progress (`TrainerState`) and the random streams are
registered; a replacement heals from a live replica before its first epoch starts. Outside
ftrun it is `transformers.Trainer`, unchanged.

Owns: that subclass and its callback. Must not import: typer, rich, NVML, the agent, the CLI.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

try:  # an optional extra: without it, one line that says how to get it
    from transformers import Trainer, TrainerCallback
except ImportError as exc:
    raise ImportError(f"ftrun.integrations.transformers needs Transformers ({exc}): "
                      "pip install 'ftrun[transformers]'") from None

from ftrun.integrations.stepping import StepDriver, under_ftrun
from ftrun.worker.rng import RandomStreams

__all__ = ["FaultTolerantTrainer"]

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
NO_CHECKPOINT = "/nonexistent/ftrun-healed-from-a-live-replica"  # the Trainer finds no files


def _hide_ranks_from_accelerate() -> dict[str, str]:
    """Under ftrun, Accelerate must see one process: ftrun owns data parallelism."""
    hidden = {k: os.environ.pop(k) for k in RANK_VARIABLES if k in os.environ}
    if torch.cuda.is_available():  # each worker on its own GPU, as Accelerate's DDP would be
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", f"cuda:{hidden.get('LOCAL_RANK', 0)}")
    return hidden


HIDDEN = _hide_ranks_from_accelerate() if under_ftrun() else {}


def _join() -> Any:
    """ftrun.init() with the rank variables it reads back in place, hidden again after."""
    import ftrun

    os.environ.update(HIDDEN)
    try:
        return ftrun.init()
    finally:
        HIDDEN.update({k: os.environ.pop(k) for k in RANK_VARIABLES if k in os.environ})


class TrainerProgress:
    """The Trainer's progress, healed with the model: a replacement starts where it is."""

    FIELDS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen")

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self._trainer.state, k) for k in self.FIELDS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self._trainer.state, key, value)


class FaultTolerantTrainer(Trainer):
    """`transformers.Trainer`, fault tolerant under ftrun. `bucket_mb`: the size of ftrun's
    gradient buckets. Every other argument is the Trainer's."""

    def __init__(self, *args: Any, bucket_mb: float = 25.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ft: Any = _join() if under_ftrun() else None
        self.bucket_mb = bucket_mb
        self.driver: StepDriver | None = None
        self._sampler: Any = None
        self._healed_at: int | None = None  # a replacement: the step it healed to
        self.repeats = 0  # steps run again after a failed sync (known at train end)
        self._healed_streams: dict[str, Any] | None = None
        if self.ft is not None:
            if not hasattr(Trainer, "_run_epoch"):
                raise RuntimeError("FaultTolerantTrainer needs transformers >= 5.24 (its "
                                   "Trainer._run_epoch is where a replacement resumes)")
            self.ft.wrap(self.model, bucket_mb=bucket_mb)
            self.add_callback(_Steps(self))

    # ------------------------------------------------------------------ data
    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        if self.ft is None:
            return super()._get_train_sampler(train_dataset)
        from torch.utils.data import DistributedSampler

        dataset: Any = train_dataset if train_dataset is not None else self.train_dataset
        world = self._world_size()
        self._sampler = DistributedSampler(dataset, num_replicas=world,
                                           rank=min(max(self.ft.rank, 0), world - 1),
                                           shuffle=True, seed=self.args.seed,
                                           drop_last=self.args.dataloader_drop_last)
        return self._sampler

    def _world_size(self) -> int:
        if self.ft.rank >= 0:
            return int(self.ft.world_size)
        return int(HIDDEN.get("WORLD_SIZE", "1"))  # a hot spare: the job's world size

    def _run_epoch(self, **kwargs: Any) -> Any:  # type: ignore[override]  # called by keyword
        """After a heal: skip the epochs the healed state finished, and the batches of the
        epoch it is in (the Trainer's own resume path, with no checkpoint files)."""
        if self._healed_at is None:
            return super()._run_epoch(**kwargs)
        per_epoch = kwargs["num_update_steps_per_epoch"]  # batches: no accumulation
        epoch, batches = divmod(self._healed_at, per_epoch)
        if kwargs["epoch"] < epoch:
            return None
        self._healed_at = None
        if batches:
            kwargs.update(resume_from_checkpoint=NO_CHECKPOINT, epochs_trained=epoch,
                          steps_trained_in_current_epoch=batches)
        return super()._run_epoch(**kwargs)

    # ------------------------------------------------------------------ a step
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """Forward and backward until ftrun's sync succeeds: a broken step is recovered and
        run again on the same batch, with the same random numbers."""
        if self.driver is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if self._healed_streams is not None:
            # a replacement: the random streams a live replica had at this step's start
            # (fetching the batches it skipped drew from them after the heal)
            RandomStreams().load_state_dict(self._healed_streams)
            self._healed_streams = None
        return self.driver.run(
            lambda: Trainer.training_step(self, model, inputs, num_items_in_batch))

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        phase = self.ft.long_phase("evaluation") if self.ft is not None \
            else contextlib.nullcontext()
        with phase:
            return super().evaluate(*args, **kwargs)

    # ------------------------------------------------------------------ the run
    def start_steps(self) -> None:
        """At train begin (model, optimizer and scheduler exist): register them, open the
        first step (a hot spare waits to be called in and heals there), and note where a
        healed replacement resumes."""
        if self.args.gradient_accumulation_steps != 1:
            raise RuntimeError("FaultTolerantTrainer under ftrun does not support "
                               "gradient_accumulation_steps > 1 yet: raise the batch size")
        objects: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer,
                                   "trainer_state": TrainerProgress(self)}
        if self.lr_scheduler is not None:
            objects["scheduler"] = self.lr_scheduler
        if getattr(self.accelerator, "scaler", None) is not None:  # fp16 on CUDA
            objects["scaler"] = self.accelerator.scaler
        self.ft.register(**objects)
        self.driver = StepDriver(self.ft, int(self.state.max_steps))
        step = self.driver.begin()
        if self._sampler is not None:
            self._sampler.rank = self.ft.rank  # read in its __iter__
        if step > 0:
            self._healed_at = step
            self._healed_streams = RandomStreams().state_dict()


class _Steps(TrainerCallback):
    """Opens the step protocol at train begin, commits after each optimizer step, and runs
    it out at train end."""

    def __init__(self, trainer: FaultTolerantTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.start_steps()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.driver is not None:
            self.trainer.driver.commit()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        driver, self.trainer.driver = self.trainer.driver, None
        if driver is not None:
            self.trainer.repeats = driver.repeats
            driver.finish()
