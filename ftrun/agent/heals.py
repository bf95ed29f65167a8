"""What the run's heals cost, and what the next one would: the `heal` part of `ftrun status`.

Owns: `HealLedger`, folded from `healed` and `state_size` events (by the journal, live or
replayed; their fields read as `core.events` records): the replicas' state size, each
heal's bytes, seconds and sources, the bandwidth measured so far and the estimated time of
the next heal, as the document's `Heal` record.
Must not import: torch, typer, rich, the CLI.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ftrun.core.events import HealedFields, StateSizeFields
from ftrun.protocol.status import Heal, HealDone

KEPT = 50  # the newest heals kept in the document


@dataclass
class HealLedger:
    state_bytes: int = 0  # the largest registered state a member reported
    heals: list[HealDone] = field(default_factory=list)
    count: int = 0
    bytes_total: int = 0
    seconds: list[float] = field(default_factory=list)  # every heal's, for the histogram

    def on_state_size(self, f: StateSizeFields) -> None:
        self.state_bytes = max(self.state_bytes, f.nbytes)

    def on_healed(self, f: HealedFields, at: float) -> None:
        self.count += 1
        self.bytes_total += f.nbytes
        self.seconds.append(f.seconds)
        self.state_bytes = max(self.state_bytes, f.nbytes)
        rate = round(f.nbytes / f.seconds / 1e9, 3) if f.seconds > 0 else None
        self.heals = [*self.heals[-(KEPT - 1):], HealDone(
            at=at, worker=f.worker, generation=f.generation, step=f.step, bytes=f.nbytes,
            seconds=round(f.seconds, 4), sources=f.sources, source_ranks=f.source_ranks,
            gb_per_s=rate)]

    def gb_per_s(self) -> float | None:
        """The median bandwidth of the heals so far (None before the first)."""
        rates = [h.gb_per_s for h in self.heals if h.gb_per_s]
        return statistics.median(rates) if rates else None

    def describe(self) -> Heal:
        rate = self.gb_per_s()
        estimate = (round(self.state_bytes / (rate * 1e9), 3)
                    if rate and self.state_bytes else None)
        return Heal(state_bytes=self.state_bytes, count=self.count,
                    bytes_total=self.bytes_total,
                    seconds=tuple(round(s, 4) for s in self.seconds), gb_per_s=rate,
                    estimate_s=estimate, last=self.heals[-1] if self.heals else None)
