"""Command-line values: integers and numbers, checked, with one-line errors.

Owns: `int_value` and `float_value`, shared by the launch options.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import math

from ftrun.core.errors import UsageError


def int_value(raw: object, flag: str, minimum: int | None) -> int:
    try:
        value = int(str(raw))
    except ValueError:
        raise UsageError(f"{flag} {raw!r} is not an integer",
                         hint=f"pass a whole number to {flag}") from None
    if minimum is not None and value < minimum:
        raise UsageError(f"{flag} must be >= {minimum}, got {value}", hint=f"fix {flag}")
    return value


def float_value(raw: object, flag: str, positive: bool, unit: str = "seconds") -> float:
    try:
        value = float(str(raw))
    except ValueError:
        raise UsageError(f"{flag} {raw!r} is not a number",
                         hint=f"pass {unit} to {flag}") from None
    if not math.isfinite(value):  # nan compares false with everything; inf never expires
        raise UsageError(f"{flag} must be a finite number, got {raw}",
                         hint=f"pass {unit} to {flag}")
    if positive and value <= 0:
        raise UsageError(f"{flag} must be > 0, got {value}", hint=f"fix {flag}")
    return value
