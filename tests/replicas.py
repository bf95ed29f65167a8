"""What training tests compare: the parameters each rank saved, bitwise."""
from pathlib import Path

import torch


def params(out: Path) -> dict[int, dict[str, torch.Tensor]]:
    """rank -> its saved parameters (`params_<rank>.pt` under `out`)."""
    return {int(p.stem.split("_")[1]): torch.load(p) for p in out.glob("params_*.pt")}


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
