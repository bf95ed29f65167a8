"""The healing options: --heal-chunk-mb and --heal-sources, checked before anything starts.

Owns: turning them into the `RunSpec` fields, with a one-line error for a value ftrun cannot
use.
Must not import: torch, typer, rich, the agent, the worker library.
"""

from __future__ import annotations

import argparse
from typing import Any

from ftrun.cli.values import float_value, int_value
from ftrun.core.errors import UsageError
from ftrun.core.spec import HEAL_CHUNK_MB, HEAL_SOURCES

DEFAULT_CHUNK_MB = f"{HEAL_CHUNK_MB:g}"
DEFAULT_SOURCES = str(HEAL_SOURCES)
MAX_CHUNK_MB = 4096.0  # one staging buffer per peer is this big


def heal_fields(ns: argparse.Namespace) -> dict[str, Any]:
    chunk_mb = float_value(ns.heal_chunk_mb, "--heal-chunk-mb", positive=True, unit="MB")
    if chunk_mb > MAX_CHUNK_MB:
        raise UsageError(f"--heal-chunk-mb {chunk_mb:g} is over {MAX_CHUNK_MB:g}",
                         hint="a heal holds a few chunks per peer beside the state: give "
                         f"{DEFAULT_CHUNK_MB} (the default) or a few hundred at most")
    return {"heal_chunk_mb": chunk_mb,
            "heal_sources": int_value(ns.heal_sources, "--heal-sources", minimum=1)}
