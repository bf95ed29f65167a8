"""The replicate dimension of HSDP (--shard-size): shard k's gradients averaged with shard k
of every other live replica group, then a step vote inside the group, so that a group commits a
step on all its ranks or on none (any live group can then heal any other).

Owns: `ReplicaSync`, the interface of `buckets.GradSync` for sharded models, and the flat
buffers it all-reduces. The replicate groups are the generation's groups that
`comm.build_group` builds (abandoned, rebuilt and healed over as the data-parallel group is);
the vote goes over the shard group (`sharded.ShardGroup`).
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported lazily.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

from ftrun.worker.comm import Abandoned, CommError, Group, Interrupt


class Voter(Protocol):
    """A replica group's shard group, as far as the vote goes (`sharded.ShardGroup`)."""

    def vote(self, ok: bool, switch: bool, generation: int) -> tuple[bool, bool]: ...


class ReplicaSync:
    """The replicate dimension of HSDP, with `buckets.GradSync`'s interface: after backward
    (FSDP has reduce-scattered inside the group), every wrapped parameter's local gradient
    shard is averaged over the generation's replicate group, abandonably; then the group
    votes, so that its ranks all apply the step or all repeat it."""

    def __init__(self, want_switch: Callable[[], bool], shard: Callable[[], Voter],
                 first_start: Callable[[], bool] = lambda: True,
                 before_wait: Callable[[], None] = lambda: None) -> None:
        self.want_switch = want_switch
        self.shard = shard
        self.first_start = first_start  # False: a stall drill holds this rank's part back
        self.before_wait = before_wait  # where a stall or wedge drill waits
        self.params: list[Any] = []
        self.enabled = True  # no_sync(): FSDP's own set_requires_gradient_sync decides
        self.generation = -1  # the step's: what the group's vote carries

    def add(self, params: list[Any], bucket_mb: float) -> None:
        for p in params:
            if p.requires_grad and all(p is not q for q in self.params):
                self.params.append(p)

    def prepare(self) -> None:
        """Nothing to allocate ahead: buffers are made per step."""

    def next_step(self, group: Group) -> None:
        """Nothing carries over from a step to the next but the generation it runs in."""
        self.generation = group.gen.number

    def drop(self) -> None:
        for p in self.params:
            p.grad = None

    zero = drop  # FSDP accumulates into a gradient that exists: none after a commit

    def abstain(self) -> None:
        """This rank cannot finish the step: its group must not wait for its vote."""
        with contextlib.suppress(CommError):
            self.shard().vote(False, False, self.generation)

    def finish(self, group: Group, interrupt: Interrupt) -> bool:
        """Raises CommError or Abandoned when the step failed on any rank of the group;
        True when some rank voted to switch to a planned generation."""
        import torch

        with torch.no_grad():
            grads = [_local(p.grad) for p in self.params if p.grad is not None]
        switch = self.want_switch()
        failure: CommError | Abandoned | None = None
        flats: list[Any] = []
        held = not self.first_start()
        try:
            if group.size > 1:
                flats = _flatten(grads)
                flats[0] = torch.cat([flats[0], torch.tensor(
                    [1.0 if switch else 0.0], dtype=flats[0].dtype, device=flats[0].device)])
                self.before_wait()
                if held:  # what a drill of a hung kernel leaves behind
                    raise CommError("this rank's part of the step was held back")
                for flat in flats:
                    group.allreduce(flat, interrupt)
                switch = bool(flats[0][-1].item() > 0)
        except (CommError, Abandoned) as exc:
            failure = exc
        ok, switch = self.shard().vote(failure is None, switch, group.gen.number)
        if failure is not None:
            raise failure
        if not ok:
            raise CommError("another rank of this replica group failed the step, or ran it in "
                            "another generation")
        if flats:
            flats[0] = flats[0][:-1]
            _scatter_back(grads, flats, group.size)
        return switch


def _local(t: Any) -> Any:
    """A gradient's own shard (a DTensor's local tensor; a plain tensor is its own)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _flatten(grads: list[Any]) -> list[Any]:
    """One flat buffer per dtype, in parameter order."""
    import torch

    by_dtype: dict[Any, list[Any]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g.reshape(-1))
    return [torch.cat(parts) for parts in by_dtype.values()]


def _scatter_back(grads: list[Any], flats: list[Any], size: int) -> None:
    offsets: dict[Any, int] = {}
    dtypes = list(dict.fromkeys(g.dtype for g in grads))  # _flatten's order
    for g in grads:
        flat = flats[dtypes.index(g.dtype)]
        start = offsets.get(g.dtype, 0)
        offsets[g.dtype] = start + g.numel()
        g.copy_(flat[start:start + g.numel()].view_as(g).div_(size))
