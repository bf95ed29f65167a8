"""Gradients in one flat buffer, averaged with a single all-reduce per step.

Owns: the flat buffer (every gradient, then one flag element for the step-boundary vote) and
making each `param.grad` a view into it, so that autograd accumulates in place and no copy is
made on the way in or out (as DDP's gradient_as_bucket_view). Falls back to copying when a
gradient was replaced (set to None by a zero_grad, or a dtype other than the buffer's).
Must not import: typer, rich, NVML, the agent. Torch is imported lazily.
"""

from __future__ import annotations

from typing import Any


class FlatGrads:
    def __init__(self, params: list[Any], device: Any) -> None:
        import torch

        self.params = params
        dtypes = {p.dtype for p in params}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total + 1, dtype=self.dtype, device=device)
        self.views = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    @property
    def flag(self) -> Any:
        return self.flat[-1:]

    def gather(self) -> Any:
        """Make the buffer hold this step's gradients; bind grads as views where possible."""
        for p, view in zip(self.params, self.views, strict=True):
            grad = p.grad
            if grad is not None and grad.data_ptr() == view.data_ptr():
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            if p.dtype == self.dtype and view.device == p.device:
                p.grad = view
        return self.flat

    def scatter(self) -> None:
        """Hand averaged gradients back to params whose grad is not a view of the buffer."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view.to(p.dtype).clone() if p.grad is None else p.grad.copy_(view)
