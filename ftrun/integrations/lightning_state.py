"""What a Lightning run needs beside its model and optimizers for a replacement to continue at
the same batch: the fit loop's progress, and a train loader that resumes mid-epoch.

Owns: `LoopState` (the fit loop's progress as Lightning saves it in a checkpoint at the end of
a training batch, taken at every batch end and loaded into a replacement's fresh loop),
`LoopRecorder` (the callback that takes it), and `ResumingLoader` (skips the batches of the
current epoch the loop has already completed, read when its iterator starts).
Must not import: typer, rich, NVML, the agent. Lightning is imported by the caller.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch

try:  # an optional extra: without it, one line that says how to get it
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:
    raise ImportError(f"ftrun.integrations.lightning needs Lightning ({exc}): "
                      "pip install 'ftrun[lightning]'") from None


class LoopState:
    """The fit loop's state_dict at the last training batch's end (what ModelCheckpoint with
    `every_n_train_steps` saves): a replacement loads it before its fit loop starts, and
    Lightning's own restart logic resumes at the next batch."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self.taken: dict[str, Any] = {}
        self.loaded = False

    def take(self) -> None:
        """Every batch: Lightning builds the progress counters afresh (dataclasses' asdict),
        so only each loop's own entry (`<loop>.state_dict`, with what stateful loaders
        return: it may be their live state) is copied (a deep copy of the whole: 108 us a
        batch here, this: 62 us)."""
        taken = self._trainer.fit_loop.state_dict()
        for key, value in taken.items():
            if key.endswith("state_dict") and value:
                taken[key] = copy.deepcopy(value)
        self.taken = taken

    def state_dict(self) -> dict[str, Any]:
        return {"fit_loop": self.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.taken = state["fit_loop"]
        if self.taken:
            self._trainer.fit_loop.load_state_dict(copy.deepcopy(self.taken))
            self.loaded = True


class LoopRecorder(Callback):
    """Takes the loop's state at each training batch's end, after the step is committed."""

    def __init__(self, state: LoopState) -> None:
        self.state = state

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.state.take()


class ResumingLoader:
    """A train DataLoader that, when its iterator starts, skips the batches of this epoch the
    fit loop has completed already (none at an epoch's start; after a replacement loaded a
    mid-epoch loop state, the batches up to the one it continues at). Its sampler's rank and
    world size is held (`--on-fault replace`), so its distributed sampler only takes the live
    rank (a hot spare learns it when called in). Attributes are the wrapped loader's."""

    def __init__(self, loader: Any, completed: Any, rank: Any) -> None:
        self.loader = loader
        self._completed = completed  # () -> batches of the current epoch already completed
        self._rank = rank  # () -> this worker's live rank

    def __iter__(self) -> Iterator[Any]:
        sampler: Any = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
            sampler.rank = self._rank()  # DistributedSampler reads it in its own __iter__
        skip = int(self._completed())
        if not skip:
            yield from self.loader
            return
        # a resume after a heal: the iterator's base seed and the skipped batches must not
        # draw from the random streams just healed (the survivors drew those at the epoch's
        # start, before the step they are at)
        with torch.random.fork_rng(devices=[]):
            batches = iter(self.loader)
            for _ in range(skip):
                next(batches, None)
        yield from batches

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    # Lightning saves and loads a stateful loader with its checkpoints; the position lives in
    # the loop's own progress, so there is nothing else to keep
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
