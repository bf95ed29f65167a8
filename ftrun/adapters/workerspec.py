"""How one worker is started: its command line and its environment, torchrun's way.

Owns: the worker argv (`python -u [-m] SCRIPT ARGS`, --no-python, --run-path, `${local_rank}`
substitution) and the `WorkerEnv` values for a worker of a run, and naming spawn failures.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import errno
import string
import sys
from collections.abc import Mapping

from ftrun.core.errors import FtrunError, UsageError
from ftrun.core.options import OnFault, RdzvBackend
from ftrun.core.spec import RunSpec, WorkerEnv


def worker_argv(spec: RunSpec, env: Mapping[str, str], local_rank: int) -> list[str]:
    python = env.get("PYTHON_EXEC", sys.executable)
    if spec.no_python:
        head: list[str] = []
    elif spec.run_path:
        head = [python, "-u", "-m", "ftrun.worker.run_path"]
    else:
        head = [python, "-u"] + (["-m"] if spec.module else [])
    macros = {"local_rank": str(local_rank)}
    return head + [string.Template(a).safe_substitute(macros)
                   for a in (spec.script, *spec.script_args)]


def worker_env(spec: RunSpec, env: Mapping[str, str], *, rank: int, local_rank: int,
               worker_id: int, restarts: int, run_id: str, master_addr: str, port: int,
               error_file: str, spare: bool, progress_dir: str, world_size: int | None = None,
               group_rank: int = 0, group_world_size: int = 1, relay: str = "") -> WorkerEnv:
    n = spec.nproc if world_size is None else world_size
    return WorkerEnv(
        rank=rank, local_rank=local_rank, world_size=n, local_world_size=spec.nproc,
        group_rank=group_rank, group_world_size=group_world_size, role_rank=rank,
        role_name=spec.role, role_world_size=n, master_addr=master_addr, master_port=port,
        restart_count=restarts, max_restarts=spec.max_restarts, run_id=run_id,
        use_agent_store=True,
        nccl_async_error_handling=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        error_file=error_file, worker_id=worker_id, attempt=restarts,
        ft_mode="restart" if spec.on_fault is OnFault.RESTART else "inprocess",
        spare=spare, comm=spec.comm, progress_dir=progress_dir, shard_size=spec.shard_size,
        relay=relay, heal_chunk_mb=spec.heal_chunk_mb, heal_sources=spec.heal_sources,
        redo=spec.redo,
        drain_signal=spec.drain_signal,
        verify_every=spec.verify_every, verify_grads_every=spec.verify_grads_every,
    )


def spawn_error(spec: RunSpec, exc: OSError) -> FtrunError:
    if exc.errno in (errno.ENOENT, errno.EACCES, errno.ENOEXEC):
        return UsageError(f"cannot start {spec.script!r}: {exc.strerror}",
                          hint="check the path, or drop --no-python to run it with python")
    return FtrunError(f"cannot start a worker: {exc.strerror}",
                      hint="the machine is out of processes or memory")


def static_port(spec: RunSpec) -> int | None:
    """torchrun's static store port; multi-node worker stores take a free port (the
    endpoint's port serves the agents' rendezvous store)."""
    if spec.standalone or spec.rdzv_backend is not RdzvBackend.STATIC or spec.nnodes_max > 1:
        return None
    return spec.master_port


def shared_env(spec: RunSpec, env: dict[str, str]) -> str | None:
    """What every worker of the run gets beside its own variables, set in `env`; a notice
    to show the user, or None."""
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(spec.signals_to_handle)
    if "OMP_NUM_THREADS" not in env and spec.nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
        return ("setting OMP_NUM_THREADS=1 for each worker (it was unset); export it "
                "yourself to tune")
    return None
