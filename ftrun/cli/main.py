"""The `ftrun` command: a thin layer over the agent (and, for subcommands, over the API).

Owns: dispatching `ftrun [OPTIONS] SCRIPT` to the launcher and named subcommands to the
typer app, the one error table (one line + hint, exit code), and printing results.
Must not import: torch at module level (subcommands such as `status` must stay torch-free).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from ftrun.core.errors import EXIT_FAILURE, FtrunError, UsageError
from ftrun.core.exits import EXIT_REQUEUE
from ftrun.core.leaving import join_other_threads, leave
from ftrun.core.options import RdzvBackend

if TYPE_CHECKING:
    from ftrun.agent.node import Agent
    from ftrun.core.spec import RunSpec

DEBUG_ENV = "FTRUN_DEBUG"


def console() -> NoReturn:
    """The `ftrun` command (its console script and `python -m ftrun`): `main`, then the exit
    without the interpreter's teardown (`core.leaving`). A launch imported torch for its store:
    its teardown alone was ~0.7 s of CPU after every job. argparse's --help and usage errors
    raise SystemExit inside `main` and leave the usual way."""
    code = main()
    join_other_threads()
    leave(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _launch(args)
    except FtrunError as exc:
        print(f"ftrun: error: {exc.one_line()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ftrun: interrupted", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"ftrun: internal error: {type(exc).__name__}: {exc} "
              f"(set {DEBUG_ENV}=1 for a traceback, and please report it)", file=sys.stderr)
        return EXIT_FAILURE


SUBCOMMANDS = ("status", "inject-fault", "drain", "report")


def _subcommand(args: list[str]) -> int:
    from ftrun.cli.commands import app

    try:
        # click returns a command's typer.Exit code, outside standalone mode, as its value
        code = app(args, prog_name="ftrun", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    except Exception as exc:  # click's (typer vendors its own copy): one line, exit 2
        if type(exc).__name__ == "Exit":
            return int(getattr(exc, "exit_code", 0))
        if type(exc).__name__ == "Abort":
            return EXIT_FAILURE
        if hasattr(exc, "format_message"):
            print(f"ftrun: error: {exc.format_message()} (see ftrun {args[0]} --help)",
                  file=sys.stderr)
            return int(getattr(exc, "exit_code", 2))
        raise
    return code if isinstance(code, int) else 0


def _launch(args: list[str]) -> int:
    if args and args[0] in SUBCOMMANDS:
        return _subcommand(args)
    from ftrun.cli.launch_args import parse_run_args

    spec = parse_run_args(args, gpu_count=_cuda_device_count)
    _check_entrypoint(spec.script, spec.module, spec.no_python)

    from ftrun.adapters.report import copy_to_parent_error_file, root_cause
    from ftrun.cli import render

    started = time.time()
    result = _agent_for(spec).run()
    ended = ("" if result.exit_code in (0, EXIT_REQUEUE) else
             "was interrupted" if result.signal_received else "failed")
    render.print_run_summary(result.faults, time.time() - started, ended=ended)
    if result.exit_code == EXIT_REQUEUE:
        print(f"ftrun: {result.reason} (exit code {EXIT_REQUEUE}: requeue this job; `ftrun "
              "--resume DIR ...` continues it from the snapshot)", file=sys.stderr, flush=True)
    if result.cause is not None:
        render.print_failure(spec.entry_name, result.cause, result.exits, result.restarts_used,
                             spec.max_restarts, result.log_dir)
        parent = os.environ.get("TORCHELASTIC_ERROR_FILE")
        try:
            copy_to_parent_error_file(root_cause(result.cause, result.exits), parent)
        except OSError as exc:
            print(f"ftrun: could not write TORCHELASTIC_ERROR_FILE {parent}: {exc.strerror}",
                  file=sys.stderr)
    return result.exit_code


def _agent_for(spec: RunSpec) -> Agent:
    """One node: the agent alone. Many: the agent coordinating where the store is served,
    else following."""
    from ftrun.adapters.threadnames import name_os_threads
    from ftrun.agent.node import Agent
    from ftrun.cli import render
    from ftrun.cluster.link import endpoint_of, is_multinode, try_host

    name_os_threads()  # `top -H`, py-spy and per-thread CPU tell the agent's threads apart
    agent: Agent
    if not is_multinode(spec):
        agent = Agent(spec, emit=render.notice)
    elif spec.rdzv_backend is RdzvBackend.ETCD:
        from ftrun.cluster.elect import elected

        agent = Agent(spec, elected, emit=render.notice)
    else:
        ep = endpoint_of(spec)
        hosted = try_host(spec, ep)
        if hosted is not None:
            from ftrun.cluster.coordinating import Coordinating

            agent = Agent(spec, lambda host: Coordinating(host, hosted, ep), emit=render.notice)
        else:
            from ftrun.cluster.following import Following

            agent = Agent(spec, lambda host: Following(host, ep), emit=render.notice)
    # the agent's store outlives its clients by design (a killed worker, a vanished peer);
    # that is reported in one line, not as c10d's C++ warning with a stack. Set after the
    # agent took its copy of the environment: workers keep the user's setting
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return agent


def _check_entrypoint(script: str, module: bool, no_python: bool) -> None:
    if module:
        return  # resolved by the worker's python, with the worker's sys.path
    if no_python:
        found = shutil.which(script) if os.sep not in script else (
            script if os.path.isfile(script) and os.access(script, os.X_OK) else None)
        if not found:
            raise UsageError(f"executable not found: {script}",
                             hint="check the name and PATH, or drop --no-python")
        return
    if os.path.isdir(script):  # `python DIR` runs DIR/__main__.py, and so do the workers
        if not os.path.isfile(os.path.join(script, "__main__.py")):
            raise UsageError(f"{script} is a directory without __main__.py",
                             hint="name the script inside it, or add a __main__.py")
        return
    if not os.path.isfile(script):
        raise UsageError(f"training script not found: {script}",
                         hint="check the path; it is relative to the current directory")


def _cuda_device_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
