"""What a worker reports that the agent only records: each report as its event's record.

Owns: `event_of`, pure: a worker's report (a protocol request: a heal, a resume from a
snapshot, its state's size, a generation's first commit) as the `core.events` record the
journal and the event log take, with what the agent adds (a heal's rate).
Must not import: torch, typer, rich, the agent's other modules.
"""

from __future__ import annotations

from ftrun.core.events import (
    Fields,
    HealedFields,
    RecoveredFields,
    ResumedFields,
    StateSizeFields,
    fields_from,
)
from ftrun.protocol.rendezvous import Healed, Recovered, Resumed, StateSize

Report = Healed | Recovered | Resumed | StateSize


def event_of(report: Report) -> Fields:
    match report:
        case Healed():
            rate = report.nbytes / report.seconds / 1e9 if report.seconds > 0 else 0.0
            return fields_from(HealedFields, report, gb_per_s=round(rate, 3))
        case Resumed():
            return fields_from(ResumedFields, report)
        case StateSize():
            return fields_from(StateSizeFields, report)
        case Recovered():
            return fields_from(RecoveredFields, report)
