"""ftrun: a torchrun replacement with native fault tolerance.

Importing this package from a training script must stay cheap: it pulls no torch,
typer, rich or NVML until a worker-side function is called.
"""

from __future__ import annotations

__version__ = "0.1.0"
