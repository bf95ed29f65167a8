"""The data loader behind `ft.loader(...)`: a step's global batch as a pure function of
(seed, step), split by the live membership, read ahead in reader processes.

Owns: the epoch-seeded index order (drop_last), a micro-batch's share for (rank, world size)
cut exactly as `batch_slice` cuts it (in a --redo lost make-up pass: the part of the lost
share worker/makeup.py names, read here, never ahead), and which micro-batches to read ahead
and keep. The
reader processes that read them (forked, never outliving the training process) and the
collation are `ftrun.worker.readers`.
Nothing here needs checkpointing: a batch depends only on the constructor's arguments, the
step and the membership, so a repeated step or a changed membership just asks again, and a
healed replacement needs nothing but its step. That is also what makes a committed step
consume its global batch exactly once, whatever faults, shrinks and grows came before it.
Must not import: typer, rich, NVML, psutil, the agent, worker.api. Torch is imported at use.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

from ftrun.core.errors import WorkerApiError
from ftrun.worker.readers import Key, Readers, read_items
from ftrun.worker.readers import ReaderTraceback as ReaderTraceback  # where tests import it

Membership = Callable[[], tuple[int, int, int]]  # live (rank, world_size, generation)
# --redo lost: (micro-batch size, step) -> this rank's positions in it during a make-up pass of
# that step (worker/makeup.py), None otherwise
MakeupCut = Callable[[int, int], "list[int] | None"]


def dist_membership() -> tuple[int, int, int]:
    """Outside ftrun: torch.distributed's rank and world size, or a world of one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), 0
    return 0, 1, 0


def share(n: int, rank: int, world_size: int) -> slice:
    """Contiguous shares of n items; the first n % world_size ranks get one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def _int(name: str, value: Any, low: int) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise WorkerApiError(f"ft.loader: {name} must be an integer, not {value!r}") from None
    if number < low:
        raise WorkerApiError(f"ft.loader: {name} must be >= {low}, not {number}")
    return number


def _mix(seed: int, epoch: int) -> int:
    """One generator seed per (seed, epoch); neighbouring seeds give unrelated orders."""
    return (seed * 6364136223846793005 + epoch * 1442695040888963407 + 1) % 2**63


class Loader:
    """`batch(step, micro, accum)`: this rank's part of micro-batch `micro` of step `step`."""

    def __init__(self, dataset: Any, global_batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, num_workers: int = 0, membership: Membership | None = None,
                 prefetch: int | None = None, makeup: MakeupCut | None = None) -> None:
        try:
            length = len(dataset)
        except TypeError:
            raise WorkerApiError("ft.loader needs a dataset with len() and [index]",
                                 hint="a map-style dataset, like torch's Dataset") from None
        self.global_batch_size = _int("global_batch_size", global_batch_size, 1)
        if length < self.global_batch_size:
            raise WorkerApiError(
                f"ft.loader: the dataset has {length} items, fewer than one global batch "
                f"of {self.global_batch_size}", hint="use a smaller global_batch_size")
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = _int("seed", seed, -(2**62))
        self.num_workers = _int("num_workers", num_workers, 0)
        self.prefetch = None if prefetch is None else _int("prefetch", prefetch, 1)
        self.steps_per_epoch = length // self.global_batch_size  # drop_last
        self._length = length
        self._membership = membership or dist_membership
        self._makeup = makeup
        self._orders: dict[int, Any] = {}
        self.stats = {"read_ahead": 0, "read_here": 0, "discarded": 0}
        self._readers: Readers | None = None
        if self.num_workers:
            self._readers = Readers(dataset, self.num_workers)
            # a loader dropped without close() still takes its readers with it
            self._finalizer = weakref.finalize(self, self._readers.close)

    # ------------------------------------------------------------- pure index maps
    def epoch_of(self, step: int) -> int:
        return _int("step", step, 0) // self.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        """The global batch of `step`: a fixed list of dataset indices."""
        epoch, pos = divmod(_int("step", step, 0), self.steps_per_epoch)
        lo, hi = pos * self.global_batch_size, (pos + 1) * self.global_batch_size
        if not self.shuffle:
            return list(range(lo, hi))
        order: list[int] = self._order(epoch)[lo:hi].tolist()
        return order

    def share_of(self, step: int, micro: int, accum: int, rank: int,
                 world_size: int) -> list[int]:
        """Indices rank `rank` of `world_size` reads for micro-batch `micro` of `accum`."""
        accum = _int("accum", accum, 1)
        if self.global_batch_size % accum:
            raise WorkerApiError(
                f"ft.loader: accum={accum} does not divide global_batch_size="
                f"{self.global_batch_size}", hint="pick accum among its divisors")
        micro = _int("micro", micro, 0)
        if micro >= accum:
            raise WorkerApiError(f"ft.loader: micro={micro} is out of range for accum={accum}",
                                 hint="micro runs from 0 to accum - 1")
        size = self.global_batch_size // accum
        if not 0 <= rank < world_size:
            raise WorkerApiError(f"ft.loader: membership gave rank {rank} of {world_size}")
        if size < world_size:
            raise WorkerApiError(
                f"ft.loader: a micro-batch of {size} items leaves some of {world_size} ranks "
                "with none", hint="use global_batch_size >= accum * world_size")
        mine = share(size, rank, world_size)
        start = micro * size
        return self.indices(step)[start + mine.start:start + mine.stop]

    def _order(self, epoch: int) -> Any:
        order = self._orders.get(epoch)
        if order is None:
            import torch

            gen = torch.Generator().manual_seed(_mix(self.seed, epoch))
            order = torch.randperm(self._length, generator=gen)
            if len(self._orders) >= 2:  # this epoch and the one read ahead into
                del self._orders[max(self._orders, key=lambda e: abs(e - epoch))]
            self._orders[epoch] = order
        return order

    # ------------------------------------------------------------------ reading
    def batch(self, step: int, micro: int = 0, accum: int = 1) -> Any:
        """This rank's part of micro-batch `micro` (of `accum`) of step `step`, collated."""
        rank, world_size, _generation = self._membership()
        key: Key = (step, micro, accum, rank, world_size)
        indices = self.share_of(*key)
        if self._makeup is not None:  # a make-up pass: this rank's part of the lost share
            size = self.global_batch_size // accum
            positions = self._makeup(size, step)
            if positions is not None:
                micro_batch = self.indices(step)[micro * size:(micro + 1) * size]
                self.stats["read_here"] += 1
                return read_items(self.dataset, [micro_batch[i] for i in positions])
        readers = self._readers
        if readers is None or not readers.alive():
            self.stats["read_here"] += 1
            return read_items(self.dataset, indices)
        upcoming = self._upcoming(key)
        # a generation change that keeps (rank, world_size) changes no share: only the
        # key decides what is still good
        self.stats["discarded"] += readers.keep(set(upcoming[1]) | {key})
        for ahead in upcoming[0]:
            if not readers.has(ahead):
                readers.submit(ahead, self.share_of(*ahead))
        found, value = readers.take(key)
        if found:
            self.stats["read_ahead"] += 1
            return value
        self.stats["read_here"] += 1
        return read_items(self.dataset, indices)

    def _upcoming(self, key: Key) -> tuple[list[Key], list[Key]]:
        """(micro-batches to read ahead, read-ahead work still worth keeping). Kept: up to a
        step more than is read ahead, so a step repeated after a failure keeps the next one's."""
        step, micro, accum, rank, world_size = key
        depth = self.prefetch or max(accum, self.num_workers)
        here = step * accum + micro
        keys = [(p // accum, p % accum, accum, rank, world_size)
                for p in range(here + 1, here + depth + accum + 1)]
        return keys[:depth], keys

    # ---------------------------------------------------------------- lifecycle
    def worker_pids(self) -> list[int]:
        return list(self._readers.pids) if self._readers is not None else []

    def close(self) -> None:
        """Stop the reader processes (bounded: LOADER_CLOSE_S, then SIGKILL). Idempotent."""
        if self._readers is not None:
            self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """Not needed for resuming (a batch is pure in the step); registering the loader
        makes a healed replica check that it reads the same data as its peers."""
        return {"seed": self.seed, "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size, "dataset_len": self._length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, mine in self.state_dict().items():
            if state.get(name) != mine:
                raise WorkerApiError(
                    f"ft.loader: {name} is {mine} here but {state.get(name)} on the replica "
                    "this one heals from", hint="build the loader alike on every rank")
