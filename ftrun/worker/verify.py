"""Silent corruption, the replicas' side: their state fingerprinted and compared, the last
verified state kept, and a rollback to it.

Owns: `fingerprint` (per tensor of the registered state, two exact integer sums computed on
the tensor's own device: its bits read as integers, and their squares, both wrapping; a
flipped bit changes both, order and rounding play no part, and nothing but the 2 x k sums
leaves the device), `compare` (one MAX all-reduce tells whether every replica holds the same
bits; only then an all-gather names the replicas that differ from the majority), and
`Verifier`: every --verify-every committed steps, on every member at the same boundary, the
comparison; a verified state kept in host memory (one copy of the registered state, the
random streams included: what a rollback returns to); on a difference, the rollback and
what the worker tells its agent. Replicas are bitwise equal by construction (ftrun keeps them
so), so any difference is corruption. The random streams differ per rank by design: they are
kept, never compared. Must not import: typer, rich, NVML, the agent, worker.api. Torch is
imported lazily.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ftrun.protocol.rendezvous import Corruption, Request
from ftrun.worker.comm import Group, Interrupt

INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
# words summed at once: on a GPU few and large (each slice is 4 kernels; the int64
# temporaries stay ~256 MB); on a CPU small enough that they stay in cache (1 MB: ~6x
# faster than 1 << 24 for one 40 MB tensor, bench_verify.py's host)
SLICE_GPU, SLICE_CPU = 1 << 24, 1 << 17


def leaves_of(objects: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(name, tensor) of every tensor in the objects' state dicts, in a fixed order (a
    DTensor's local shard: shards are compared with their own replicas)."""
    import torch

    out: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            out.append((prefix, local.detach()))
        elif isinstance(value, Mapping):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)

    for name in sorted(objects):
        walk(name, objects[name].state_dict())
    return out


def fingerprint(tensors: Sequence[Any], device: Any) -> Any:
    """int64 [2 x len(tensors)]: per tensor, the sum of its bits read as integers, and of
    their squares (wrapping), on `device`. The widest integer words its bytes allow: int64
    where they come in eights (no conversion pass: ~6x faster on a CPU), else the element's
    own width, widened slice by slice. Replicas hold the same shapes: they read alike."""
    import torch

    sums = torch.zeros(2 * len(tensors), dtype=torch.int64, device=device)
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        words = _words(t.contiguous().reshape(-1))
        step = SLICE_CPU if words.device.type == "cpu" else SLICE_GPU
        for start in range(0, words.numel(), step):
            wide = words[start:start + step].to(torch.int64)  # no copy when int64 already
            sums[2 * i] += wide.sum()
            sums[2 * i + 1] += (wide * wide).sum()
    return sums


def _words(flat: Any) -> Any:
    """`flat`'s bytes as integers: int64 words where their count and address allow."""
    import torch

    nbytes = flat.numel() * flat.element_size()
    if nbytes % 8 == 0 and flat.data_ptr() % 8 == 0:
        return flat.view(torch.uint8).view(torch.int64)
    size = max(s for s in INT_OF_SIZE if flat.element_size() % s == 0)
    return flat.view(getattr(torch, INT_OF_SIZE[size]))


@dataclass(frozen=True)
class Verdict:
    """A comparison's outcome: every replica equal, or who differs from the majority
    (None: no majority, two replicas disagree) and the first tensor that differs."""

    equal: bool
    differing: tuple[int, ...] | None = ()  # ranks in the compared group
    tensor: str = ""


def compare(group: Group, sums: Any, names: Sequence[str], interrupt: Interrupt) -> Verdict:
    """Whether every member of `group` holds the same fingerprint (one MAX all-reduce of the
    sums and their negations); if not, the majority's and who differs (an all-gather)."""
    import torch

    if group.pg is None or group.size == 1:
        return Verdict(True)
    both = torch.cat([sums, -sums])
    group.run(lambda: group.pg.allreduce([both], _max_op()), interrupt)
    highest, lowest = both[:len(sums)], -both[len(sums):]
    if bool(torch.equal(highest, lowest)):
        return Verdict(True)
    rows = [torch.zeros_like(sums) for _ in range(group.size)]
    group.run(lambda: group.pg.allgather([rows], [sums]), interrupt)
    return blame([tuple(int(v) for v in r.tolist()) for r in rows], names)


def blame(rows: Sequence[tuple[int, ...]], names: Sequence[str]) -> Verdict:
    """Who differs from the majority's fingerprint (None: there is none: two replicas that
    disagree, or an even split), and the first tensor where any two differ. Pure."""
    if all(r == rows[0] for r in rows):
        return Verdict(True)
    first = next(i for i in range(len(rows[0])) if len({r[i] for r in rows}) > 1) // 2
    best = max(set(rows), key=rows.count)
    if 2 * rows.count(best) <= len(rows):
        return Verdict(False, None, names[first])
    return Verdict(False, tuple(r for r, row in enumerate(rows) if row != best), names[first])


def _max_op() -> Any:
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    return opts


@dataclass
class Verified:
    """The state of the last verified step, in host memory: what a rollback returns to."""

    step: int
    state: dict[str, Any]  # name -> a deep copy of its state_dict (the streams included)
    at: float


class Verifier:
    def __init__(self, every: int) -> None:
        self.every = every  # --verify-every: committed steps between two (0: off)
        self.last: Verified | None = None
        self.checks = 0
        self.seconds = 0.0  # spent fingerprinting, comparing and keeping

    def due(self, committed: int) -> bool:
        """A function of the committed step alone: every member, a replacement that just
        healed included, compares at the same boundaries (a boundary passed again, after a
        rollback or a recovery, compares again)."""
        return self.every > 0 and committed % self.every == 0

    def check(self, group: Group, compared: Mapping[str, Any], device: Any,
              interrupt: Interrupt) -> Verdict:
        """Compare the replicas' state (`compared`: the registered objects)."""
        started = time.perf_counter()
        named = leaves_of(compared)
        verdict = compare(group, fingerprint([t for _, t in named], device),
                          [n for n, _ in named], interrupt)
        self.checks += 1
        self.seconds += time.perf_counter() - started
        return verdict

    def keep(self, step: int, objects: Mapping[str, Any]) -> None:
        """`objects` (the registered ones and the streams) are verified at `step`: a copy in
        host memory is what a rollback returns to."""
        if self.last is not None and self.last.step == step:
            return  # this very state, kept already
        started = time.perf_counter()
        old = self.last.state if self.last is not None else {}
        self.last = Verified(step, {name: _to_host(o.state_dict(), old.get(name))
                                    for name, o in objects.items()}, time.time())
        self.seconds += time.perf_counter() - started

    def rollback(self, objects: Mapping[str, Any]) -> int:
        """Every object back to the last verified state; its step. Its tensors are copied
        into the object's own (a DTensor stays one, on its mesh: FSDP2's parameters)."""
        assert self.last is not None
        for name, obj in objects.items():
            obj.load_state_dict(_restore(obj.state_dict(), self.last.state[name]))
        return self.last.step


def ids_of(group: Group) -> tuple[int, ...]:
    """The worker ids of `group`'s ranks (a replicate group is part of its generation)."""
    return group.members if group.members is not None else group.gen.members


def _restore(live: Any, kept: Any) -> Any:
    """`kept` (a state dict in host memory) as the state to load: each tensor copied into
    the live one where it fits (in place), else a copy on the live one's device."""
    import torch

    if isinstance(kept, torch.Tensor):
        if isinstance(live, torch.Tensor):
            local = live.to_local() if hasattr(live, "to_local") else live
            if local.shape == kept.shape and local.dtype == kept.dtype:
                local.detach().copy_(kept)
                return live
            return kept.to(local.device, copy=True)
        return kept.clone()
    if isinstance(kept, Mapping):
        own = live if isinstance(live, Mapping) else {}
        return {k: _restore(own.get(k), v) for k, v in kept.items()}
    if isinstance(kept, (list, tuple)):
        same = isinstance(live, (list, tuple)) and len(live) == len(kept)
        restored = [_restore(live[i] if same else None, v) for i, v in enumerate(kept)]
        return restored if isinstance(kept, list) else tuple(restored)
    return copy.deepcopy(kept)


def _to_host(value: Any, before: Any = None) -> Any:
    """A copy of `value` in host memory; `before`, the copy kept last time, lends its tensors
    where they fit (no allocation, no page faults: most of a copy's cost on a CPU)."""
    import torch

    if isinstance(value, torch.Tensor):
        local = (value.to_local() if hasattr(value, "to_local") else value).detach()
        if isinstance(before, torch.Tensor) and before.shape == local.shape and \
                before.dtype == local.dtype and before.data_ptr() != local.data_ptr():
            return before.copy_(local)
        return local.to("cpu", copy=True)
    if isinstance(value, Mapping):
        lent = before if isinstance(before, Mapping) else {}
        return {k: _to_host(v, lent.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        same = isinstance(before, (list, tuple)) and len(before) == len(value)
        copies = [_to_host(v, before[i] if same else None) for i, v in enumerate(value)]
        return copies if isinstance(value, list) else tuple(copies)
    return copy.deepcopy(value)


def flip_bit(objects: Mapping[str, Any], n: int, seed: int) -> str:
    """A bitflip drill: bit `n` of the registered state (its tensors' bytes one after the
    other, in `leaves_of`'s order; -1: one drawn at random with `seed`) flipped in place.
    What was flipped, in words."""
    import random

    import torch

    named = leaves_of(objects)
    total = sum(t.numel() * t.element_size() * 8 for _, t in named)
    if total == 0:
        return "nothing is registered: no bit flipped"
    n = random.Random(seed).randrange(total) if n < 0 else n
    if n >= total:
        return f"bit {n} is past the registered state's {total} bits: no bit flipped"
    at = n
    for name, t in named:
        bits = t.numel() * t.element_size() * 8
        if at < bits:
            byte, bit = divmod(at, 8)
            flat = t.reshape(-1).view(torch.uint8)  # the live tensor's own bytes
            flat[byte] ^= 1 << bit
            return f"bit {bit} of byte {byte} of {name} (bit {n} of the state's {total})"
        at -= bits
    raise AssertionError("unreachable: n < total")


OUTLIER_LOG2 = 10.0  # a local gradient norm 2^10 times its peers' median fails the step
NO_GRADIENT = -99.0  # a rank whose local gradient is all zero reads below this: no peer


def grad_outlier(norms: Sequence[float]) -> int | None:
    """The rank whose local gradient norm (log2) is not finite while another's is, or more
    than OUTLIER_LOG2 above its peers' median (ranks without a gradient left out); None: none
    is (every rank's not finite is the model's own divergence, not one rank's). Pure."""
    import math
    import statistics

    if not any(math.isfinite(v) for v in norms):
        return None
    for rank, value in enumerate(norms):
        if not math.isfinite(value):
            return rank
        peers = [v for r, v in enumerate(norms) if r != rank and v > NO_GRADIENT]
        if peers and value - statistics.median(peers) > OUTLIER_LOG2:
            return rank
    return None


GO, REPEAT, COMPARE = "", "repeat", "compare"  # what a step's local gradients ask for


class GradCheck:
    """--verify-every also checks every step's local gradients as they are reduced: a rank
    far above its peers fails the step on every rank (nothing of it is applied) and the step
    is repeated. One gone in the repeat was a corruption of the computation (told to the
    agent, found "gradient"). One seen again is either the data's or the product of a
    corrupt state (a flipped bit in that rank's optimizer state blows its parameters up):
    the replicas' state is compared at once; equal, the step goes on (the data's, kept);
    not, the boundary rolls back as for any corrupt state."""

    def __init__(self, sync: Any, worker_id: int, post: Callable[[Request], None]) -> None:
        """`sync`: the buckets' GradSync, whose last reduction left every rank's norm."""
        self.sync = sync
        self.worker_id = worker_id
        self.post = post
        self._first: tuple[int, int, float] | None = None  # (step, rank, when) of an
        # outlier being redone
        self._kept = -1  # a step whose outlier the replicas' comparison cleared

    def judge(self, step: int, group: Group) -> str:
        """After a step's reduction (`step`: the steps committed before it): GO, REPEAT the
        step, or COMPARE the replicas' state before it is tried again."""
        norms = self.sync.norms
        suspect = grad_outlier(norms)
        first, self._first = self._first, None
        again = first is not None and first[0] == step
        if suspect is None:
            if again and first is not None:  # gone in the repeat: no property of the data
                self._tell_corruption(step, first[1], first[2], group)
            return GO
        if self._kept == step:
            if group.rank == 0:
                say(f"step {step}: rank {suspect}'s local gradient is again far above its "
                    "peers', and the replicas' state is equal: the data's, kept")
            return GO
        if again:
            if group.rank == 0:
                say(f"step {step}: rank {suspect}'s local gradient is again far above its "
                    "peers' in the repeat: the replicas' state is compared first")
            return COMPARE
        self._first = (step, suspect, time.time())
        if group.rank == 0:
            say(f"step {step}: rank {suspect}'s local gradient norm is 2^{norms[suspect]:.1f} "
                f"against its peers' 2^{_median_others(norms, suspect):.1f}: the step is "
                "repeated, nothing of it applied")
        return REPEAT

    def compared(self, step: int, equal: bool) -> None:
        """The replicas were compared at `step` for a persisting outlier: equal, it is the
        data's; not, the boundary rolled back."""
        self._kept = step if equal else -1

    def _tell_corruption(self, step: int, rank: int, found_at: float, group: Group) -> None:
        if group.rank != 0:
            return
        ids = ids_of(group)
        blamed = ids[rank] if rank < len(ids) else -1
        say(f"silent corruption at step {step}: worker {blamed} (rank {rank})'s local "
            "gradient was far off, and not in the repeat: caught before the commit")
        now = time.time()
        self.post(Corruption(self.worker_id, group.gen.number, step, step,
                             str(blamed), "its local gradient", "gradient", found_at, now,
                             found_at))


def _median_others(norms: Sequence[float], rank: int) -> float:
    import statistics

    peers = [v for r, v in enumerate(norms) if r != rank]
    return statistics.median(peers) if peers else float("nan")


def say(text: str) -> None:
    """One line for the operator, on the worker's stderr."""
    import sys

    print(f"ftrun: {text}", file=sys.stderr, flush=True)
