"""The process's random streams as replica state.

Owns: `RandomStreams`, registered by the worker library beside the user's objects, so that a
healed replacement continues with the random streams of the replica it healed from (torch's
CPU generator, CUDA's generators once CUDA is initialised, Python's `random`, and numpy's
global generator when the script has imported numpy), and `capture`/`restore` of the same
streams around a step, so that a step repeated after a fault draws the same numbers again.
Must not import: typer, rich, NVML, the agent, numpy (it is used only if already imported).
"""

from __future__ import annotations

import random
import sys
from typing import Any


class RandomStreams:
    """Anything with state_dict/load_state_dict can be healed; so can the RNGs."""

    def state_dict(self) -> dict[str, Any]:
        import torch

        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_initialized():  # (is_available() asks NVML: ~40 us, every step)
            state["cuda"] = torch.cuda.get_rng_state_all()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            state["numpy"] = numpy.random.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        torch.set_rng_state(state["torch"].cpu())
        random.setstate(_tuples(state["python"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
        numpy = sys.modules.get("numpy")
        if "numpy" in state and numpy is not None:
            numpy.random.set_state(state["numpy"])


def _tuples(value: Any) -> Any:
    """random.setstate wants tuples; a state that travelled may hold lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value
