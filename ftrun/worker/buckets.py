"""Gradient sync overlapped with backward: buckets of gradients all-reduced as they are ready.

Owns: laying the wrapped parameters' gradients out in buckets of about `bucket_mb` (reverse
parameter order, as autograd produces them; sized as DDP sizes them, the first closed at
FIRST_BUCKET_BYTES so the first all-reduce starts early in backward; one flat buffer per
bucket, `param.grad` a view into it so autograd accumulates in place and nothing is copied
in or out in a steady step), the post-accumulate-grad hooks that start each bucket's
all-reduce as soon as its last gradient arrives (divided by the world size first, as DDP
does, so nothing is left to average after the wait), `no_sync` (gradients accumulate
locally), and finishing a step's sync: start what is left, wait for every bucket while
watching for a newer generation, and hand the result back to any `param.grad` not a view.
Buckets are always started in index order, so every rank issues the same collectives in the
same order whatever order its gradients arrive in. The layout is a function of the parameters
and `bucket_mb` alone, never of an observed arrival order: a replacement lays out exactly the
buckets its peers use, and a replaced run reduces every element in the same order as the
fault-free run (bitwise-equal results with 3 or more ranks). The step-boundary vote (a planned
generation seen by some rank) is one extra element at the end of the last bucket. Under
`--redo lost` (`keep`): a copy of each full pass's local gradients, taken as each bucket
starts (an all-reduce writes in place, and an abandoned one goes on writing), and `blend`:
a bucket weighed by its share of the batch before it starts (an uneven share; in a make-up
pass, its part of the lost share, added to the kept copy), then averaged over the pass's
world size (worker/makeup.py decides the weights).
Must not import: typer, rich, NVML, the agent. Torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ftrun.core import timeouts
from ftrun.core.errors import WorkerApiError, first_line
from ftrun.worker.comm import REAPER, CommError, Group, Interrupt

# DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES): the gradients that
# arrive first start their all-reduce without waiting for a full bucket behind them
FIRST_BUCKET_BYTES = 2**20


class Bucket:
    def __init__(self, params: list[Any], device: Any, flag: bool, slots: int = 0) -> None:
        """`flag`: the last bucket, with the step-boundary vote as its last element and, in
        front of it, `slots` more: each rank's local gradient norm (--verify-every)."""
        import torch

        self.params = params
        self.dtype = params[0].dtype
        total = sum(p.numel() for p in params)
        self.extra = 1 + slots if flag else 0
        self.flat = torch.zeros(total + self.extra, dtype=self.dtype, device=device)
        self.views: list[Any] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.size = len(params)  # parameters; the bucket is complete when ready == size
        self.ready = 0
        self.work: Any = None
        self.started = False
        self.flagged = flag  # its last element is the step-boundary vote

    def grads(self) -> Any:
        return self.flat[:-self.extra] if self.extra else self.flat

    def take(self, p: Any, view: Any) -> None:
        """Make the bucket hold `p`'s gradient; bind the grad as a view where possible."""
        grad = p.grad
        if grad is view or grad is not None and grad.data_ptr() == view.data_ptr():
            return  # autograd accumulated into the view: the steady case
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        if view.device == p.device:
            p.grad = view


class GradSync:
    def __init__(self, device: Any, want_switch: Callable[[], bool],
                 first_start: Callable[[], bool], before_wait: Callable[[], None]) -> None:
        self.device = device
        self.bucket_bytes = 25 * 2**20
        self.want_switch = want_switch  # this rank saw a planned generation: vote to switch
        # the step's first bucket is about to start; False: hold the step's buckets back
        self.first_start = first_start
        self._held = False
        self.before_wait = before_wait  # the step's sync is about to wait for its buckets
        self.params: list[Any] = []
        self.enabled = True  # False inside no_sync()
        self.group: Group | None = None  # the step's group; None: do not start anything
        self._buckets: list[Bucket] | None = None
        self._slots: dict[int, tuple[Bucket, Any]] = {}  # id(param) -> (bucket, its view)
        self._next = 0  # the next bucket to start
        self.keep = False  # --redo lost: copy each bucket's local gradients as it starts
        self.kept: list[Any] = []  # the copies, by bucket index
        self._kept_now = 0  # buckets copied in this pass
        # how this pass's gradients enter the sum (worker/makeup.py: Blend); None: as they are
        self.blend: Callable[[], Any] = lambda: None
        # --verify-every: each rank's local gradient norm travels in the last bucket, one
        # slot a rank, and a rank far above its peers' fails the step (worker/verify.py)
        self.check_norms = False
        self.norms_due: Callable[[], bool] = lambda: True  # this step's are checked
        self._norming = False  # ...as next_step found
        self.tamper: Callable[[Any], None] = lambda grads: None  # a gradflip drill
        self.norms: list[float] = []  # after a sync: every rank's log2 local gradient norm
        self._sq: Any = None  # this rank's squared norm so far in this pass
        self._norm_slots = 0  # the norm slots the buckets were laid out with

    # ---------------------------------------------------------------- layout
    def add(self, params: list[Any], bucket_mb: float) -> None:
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        for p in params:
            if p.requires_grad and all(p is not q for q in self.params):
                p.register_post_accumulate_grad_hook(self._on_ready)
                self.params.append(p)
        self.drop()

    def _layout(self) -> list[Bucket]:
        if self._buckets is None:
            groups = bucket_groups(self.params, self.bucket_bytes)
            self._norm_slots = self.group.size if self.check_norms and self.group else 0
            self._buckets = [Bucket(ps, self.device, i == len(groups) - 1,
                                    self._norm_slots if i == len(groups) - 1 else 0)
                             for i, ps in enumerate(groups)]
            self._slots = {id(p): (b, view) for b in self._buckets
                           for p, view in zip(b.params, b.views, strict=True)}
            self._next = 0
        return self._buckets

    def prepare(self) -> None:
        """Allocate the buckets now (a hot spare, before it is called in)."""
        if self.params:
            self._layout()

    def drop(self) -> None:
        """Forget the buffers (an abandoned all-reduce may still write into them): grads go
        back to None and the next step lays out fresh buckets."""
        if self._buckets is not None:
            for b in self._buckets:
                if b.work is not None and self.group is not None:
                    REAPER.hold_op(self.group.pg, b.work, b.work.is_completed,
                                   timeouts.COLLECTIVE_S)
        for p in self.params:
            p.grad = None
        self._buckets = None
        self._slots = {}

    # ---------------------------------------------------------------- during backward
    def _on_ready(self, p: Any) -> None:
        """Runs once per parameter per backward: kept to a dict look-up and a few checks."""
        if not self.enabled or self.group is None or self.group.pg is None:
            return
        slot = self._slots.get(id(p)) if self._buckets is not None else None
        if slot is None:
            self._layout()
            slot = self._slots[id(p)]
        bucket, view = slot
        if bucket.started:
            raise WorkerApiError("a gradient changed after its bucket's all-reduce started "
                                 "(a second backward in one step)",
                                 hint="run the backward of every micro-batch but the last "
                                      "inside `with ft.no_sync():`")
        if p.grad is not view:
            bucket.take(p, view)
        bucket.ready += 1
        if bucket.ready == bucket.size:
            buckets = self._buckets or []
            while self._next < len(buckets) and buckets[self._next].ready == \
                    buckets[self._next].size:
                self._start(buckets[self._next])

    def _start(self, bucket: Bucket) -> None:
        assert self.group is not None
        if self._next == 0:
            self._held = not self.first_start()
            if self._norming:  # a gradflip drill waits for a step whose norms are checked
                self.tamper(bucket.grads())  # before anything reads them
            self._sq = None
        bucket.started = True
        self._next += 1
        last = self._next == len(self._buckets or ())
        if last:
            bucket.flat[-1:].fill_(1.0 if self.want_switch() else 0.0)
        divisor = self._keep_or_blend(bucket, self._next - 1)
        if self._norming:
            self._add_norm(bucket, last)
        elif last and self._norm_slots:  # nothing of this rank: no stale sum goes round
            bucket.flat[-1 - self._norm_slots:-1].zero_()
        if divisor > 1:  # averaged before the sum, as DDP does: no pass over the buckets
            bucket.grads().div_(divisor)  # after the wait, the step's exposed tail
        if self._held or self.group.pg is None or self.group.size == 1:
            return
        try:
            bucket.work = self.group.pg.allreduce([bucket.flat])
        except RuntimeError as exc:  # the group broke: sync() reports it
            bucket.work = _Failed(first_line(exc))

    def _add_norm(self, bucket: Bucket, last: bool) -> None:
        """This rank's local gradient, as it enters the sum: its squared norm, added up on
        its device (no sync); the last bucket carries log2 of the norm in this rank's slot
        (a zero gradient reads as -100: never above its peers)."""
        import torch

        sq = torch.linalg.vector_norm(bucket.grads(), dtype=torch.float32) ** 2
        self._sq = sq if self._sq is None else self._sq + sq
        if last and self.group is not None:
            slots = bucket.flat[-1 - self._norm_slots:-1]
            slots.zero_()
            slots[self.group.rank] = torch.log2(torch.sqrt(self._sq).clamp_min(1e-30))

    def _keep_or_blend(self, bucket: Bucket, index: int) -> int:
        """Keep or blend the bucket's local gradients (--redo lost); the divisor of its
        average: the group's size, or in a make-up the broken pass's world size."""
        blend = self.blend() if self.keep else None
        if self.keep and (blend is None or not blend.makeup):  # a full pass: kept as it is
            if len(self.kept) <= index:
                self.kept.append(None)
            held = self.kept[index]
            if held is None or held.shape != bucket.flat.shape or held.dtype != bucket.dtype:
                self.kept[index] = held = bucket.flat.clone()
            else:
                held.copy_(bucket.flat)
            self._kept_now += 1
        if blend is None:
            return self.group.size if self.group is not None else 1
        grads = bucket.grads()  # weighed by its share of the batch (worker/makeup.py)
        if blend.part != 1.0:
            grads.mul_(blend.part)
        if blend.kept is not None:  # a make-up: its share of the lost work joins the kept pass
            kept = self.kept[index][:grads.numel()]
            grads.add_(kept) if blend.kept == 1.0 else grads.add_(kept, alpha=blend.kept)
        return blend.divisor

    def keep_rest(self) -> bool:
        """The step broke: copy the local gradients of the buckets that never started. True
        when every bucket's local gradients of this pass are kept."""
        if not self.keep or not self.params:
            return False
        buckets = self._layout()
        for index in range(self._next, len(buckets)):
            b = buckets[index]
            for p, view in zip(b.params, b.views, strict=True):
                b.take(p, view)
            self._keep_or_blend(b, index)
        return self._kept_now == len(buckets)

    # ---------------------------------------------------------------- the step's end
    def finish(self, group: Group, interrupt: Interrupt) -> bool:
        """Every bucket reduced and averaged; True when some rank voted to switch to a
        planned generation. Raises CommError or Abandoned when the step failed."""
        self.group = group
        buckets = self._layout()
        for b in buckets[self._next:]:
            for p, view in zip(b.params, b.views, strict=True):
                b.take(p, view)
            b.ready = len(b.params)
        while self._next < len(buckets):
            self._start(buckets[self._next])
        if group.size > 1:
            self.before_wait()
        for b in buckets:
            if isinstance(b.work, _Failed):
                raise CommError(b.work.error)
            if b.work is not None:
                work, b.work = b.work, None
                group.wait(work, interrupt)
        for b in buckets:  # averaged as each started: bind the grads that are not views
            for p, view in zip(b.params, b.views, strict=True):
                grad = p.grad  # a view of its bucket but where it cannot be (another device)
                if grad is not view and (grad is None or grad.data_ptr() != view.data_ptr()):
                    p.grad = view.to(p.dtype).clone() if grad is None else grad.copy_(view)
        tail = buckets[-1].flat[-1 - self._norm_slots:].tolist()  # one read: norms, vote
        self.norms = [float(v) for v in tail[:-1]] if self._norming else []
        return bool(tail[-1] > 0)

    def next_step(self, group: Group) -> None:
        """A new step begins on `group`: every bucket may start again (laid out again when
        the norms' slots no longer fit the group's size)."""
        self.group = group
        if self.check_norms and self._buckets is not None and \
                self._norm_slots != group.size:
            self.drop()
        self._norming = self.check_norms and self.norms_due()
        self._held = False
        self._kept_now = 0
        if self._buckets is not None:
            for b in self._buckets:
                b.ready, b.started, b.work = 0, False, None
            self._next = 0

    def abstain(self) -> None:
        """Data parallel: no peer waits for a vote of this rank's."""

    def zero(self) -> None:
        if self._buckets is not None:
            for b in self._buckets:
                b.flat.zero_()


def bucket_groups(params: list[Any], bucket_bytes: int) -> list[list[Any]]:
    """The parameters of each bucket: reverse parameter order, one dtype per bucket, each
    closed once it holds `bucket_bytes` (DDP's rule: a bias next to a large weight joins it
    instead of costing an all-reduce of its own), the first once it holds FIRST_BUCKET_BYTES.
    Depends on nothing but its arguments: every rank, and every replacement, lays out the
    same buckets."""
    groups: list[list[Any]] = []
    cap, size, closed = min(bucket_bytes, FIRST_BUCKET_BYTES), 0, True
    for p in reversed(params):
        if closed or groups[-1][0].dtype != p.dtype:
            if groups:
                cap = bucket_bytes
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
        closed = size >= cap
    return groups


class _Failed:
    """Stands for a bucket whose all-reduce could not even start."""

    def __init__(self, error: str) -> None:
        self.error = error

    def is_completed(self) -> bool:
        return True
