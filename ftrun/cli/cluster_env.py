"""Launch defaults a cluster scheduler already knows, so that `srun ftrun --nproc 8 train.py`
needs no rendezvous flags: what `slurm_env.resolve_slurm` fills in is set on the parsed
launch arguments, and the line that says where each value came from is printed. (PyTorchJob's
PET_* variables are the parser's own defaults.)

Owns: which of those settings the user gave (`given_settings`), applying a scheduler's
settings to the parsed arguments, and expanding a Slurm node list
with `scontrol show hostnames` where scontrol is installed (slurm_env's parser otherwise).
Must not import: torch, the agent, the worker library.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from ftrun.cli.slurm_env import SCHEDULED, hostnames, resolve_slurm
from ftrun.core import timeouts


def scheduler_defaults(ns: argparse.Namespace, given: Mapping[str, str], env: Mapping[str, str],
                       notice: Callable[[str], None]) -> None:
    """Fill in what Slurm knows and the user did not give (`given`: the settings the user
    gave, argparse dests), and say in one line what was taken from where."""
    settings = resolve_slurm(env, given, expand=expand_nodelist, rdzv_conf=ns.rdzv_conf or "")
    if settings is None:
        return
    for dest, value in settings.values.items():
        setattr(ns, dest, value)
    notice(settings.note)


def given_settings(bare: argparse.ArgumentParser, argv: Sequence[str],
                   env: Mapping[str, str]) -> dict[str, str]:
    """The settings a scheduler knows that the user gave (argparse dests): on the command line
    (`argv` parsed again by `bare`, the launch parser without PET_* defaults, with no default
    at all for these) or as PET_* variables (PyTorchJob's)."""
    bare.set_defaults(**dict.fromkeys(SCHEDULED))
    ns = bare.parse_args(list(argv))
    pet = {d: env[f"PET_{d.upper()}"] for d in SCHEDULED if env.get(f"PET_{d.upper()}")}
    if pet.get("standalone") == "0":
        del pet["standalone"]
    typed = {d: str(getattr(ns, d)) for d in SCHEDULED if getattr(ns, d) not in (None, False)}
    return {**pet, **typed}


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm node list: Slurm's own expansion where scontrol is installed,
    else ftrun's parser of the bracket syntax."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            done = subprocess.run([scontrol, "show", "hostnames", nodelist], text=True,
                                  capture_output=True, timeout=timeouts.SCONTROL_S)
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    return hostnames(nodelist)
