"""ftrun: a torchrun replacement with native fault tolerance.

Importing this package must stay cheap, for a training script and for the launcher alike: it
pulls no torch, typer, rich or NVML, and no worker module until a script asks for
`ftrun.init` or `ftrun.FaultTolerant` (the agent and `ftrun status` never do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftrun.worker.api import FaultTolerant, init

__all__ = ["FaultTolerant", "init"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The worker API, imported on first use (PEP 562)."""
    if name in __all__:
        from ftrun.worker import api

        value = getattr(api, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ftrun' has no attribute {name!r}")
