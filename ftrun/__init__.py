"""ftrun: a torchrun replacement with native fault tolerance.

Importing this package from a training script must stay cheap: it pulls no torch,
typer, rich or NVML until `ftrun.init()` runs.
"""

from __future__ import annotations

from ftrun.worker.api import FaultTolerant, init

__all__ = ["FaultTolerant", "init"]
__version__ = "0.1.0"
