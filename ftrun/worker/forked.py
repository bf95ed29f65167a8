"""A worker forked from the zygote turning into what `python -u SCRIPT ARGS` would have started.

Owns: what a forked child sets before the script runs (its session, becoming the agent's child
and dying with it, stdio, environment, working directory, signal dispositions and mask,
`sys.argv`, `sys.path`, a fresh `__main__`), then running the script or module and leaving as
the interpreter would: exit status, traceback, atexit handlers, flushed stdio.
Must not import: typer, rich, NVML, the agent. Torch only if the zygote imported it.
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import signal
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

from ftrun.adapters.procs import die_with_parent
from ftrun.core import timeouts
from ftrun.protocol.zygote import Fork

ZYGOTE_PID = 0  # set in a forked worker: the zygote it came from (0: started as a new process)
_PYTHON_IGNORES = (signal.SIGPIPE, signal.SIGXFSZ)  # what CPython ignores at start-up


@dataclass
class Plan:
    """One forked child's orders, handed from the zygote's loop to the child's top level."""

    request: Fork
    stdout: int
    stderr: int
    report_fd: int  # tells the zygote our pid once we lead our own session
    agent_pid: int
    zygote_pid: int


def become_worker(plan: Plan) -> None:
    """Runs in the forked child; returns when the script has run (the interpreter then exits
    as `python script.py` does), or leaves the process at once if it cannot be a worker."""
    os.setsid()  # pid == pgid == sid, as for a spawned worker: the agent signals the group
    os.write(plan.report_fd, str(os.getpid()).encode())
    os.close(plan.report_fd)
    if not _adopted_by(plan.agent_pid):
        os._exit(137)  # the agent is gone: a worker must never outlive it
    _set_stdio(plan.stdout, plan.stderr)
    _reset_signals()
    req = plan.request
    _set_environment(req.env)
    os.chdir(req.cwd)
    global ZYGOTE_PID
    ZYGOTE_PID = plan.zygote_pid
    run(req)


def _adopted_by(agent_pid: int) -> bool:
    """Wait for the middle process to exit, which hands us to the agent (a subreaper); then
    die with the agent, as a spawned worker does."""
    deadline = time.monotonic() + timeouts.ZYGOTE_REPARENT_S
    while os.getppid() != agent_pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    die_with_parent()
    return os.getppid() == agent_pid  # the agent did not die before prctl took effect


def _set_stdio(stdout: int, stderr: int) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    for src, dst in ((devnull, 0), (stdout, 1), (stderr, 2)):
        if src != dst:
            os.dup2(src, dst)
    for fd in {devnull, stdout, stderr} - {0, 1, 2}:
        os.close(fd)
    # the zygote runs with -u: sys.stdout and sys.stderr are unbuffered writers on fds 1
    # and 2, which now lead where this worker's output goes


def _reset_signals() -> None:
    """The dispositions a fresh interpreter starts with; nothing blocked."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = (signal.default_int_handler if sig == signal.SIGINT else
                   signal.SIG_IGN if sig in _PYTHON_IGNORES else signal.SIG_DFL)
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            continue  # a real-time signal the libc reserves
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _set_environment(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        # OpenMP read the zygote's value when torch loaded; the worker's may differ
        torch.set_num_threads(int(threads))


def run(req: Fork) -> None:
    """Run the script as __main__ with the worker's argv, as `python -u` would."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    as_main = getattr(runpy, "_run_module_as_main")  # noqa: B009 - what `python -m` runs
    sys.argv = [req.target, *req.args]  # for -m, runpy puts the module's path in argv[0]
    if req.module:
        sys.path[0] = os.getcwd()
        _run_guarded(lambda: as_main(req.target, alter_argv=True))
        return
    if not os.path.isfile(req.target):  # a directory or a zip archive with a __main__.py
        sys.path[0] = req.target
        _run_guarded(lambda: as_main("__main__", alter_argv=False))
        return
    sys.path[0] = os.path.dirname(os.path.realpath(req.target))
    main.__file__ = req.target
    main.__dict__["__cached__"] = None
    with io.open_code(req.target) as f:
        code = compile(f.read(), req.target, "exec", dont_inherit=True)
    _run_guarded(lambda: exec(code, main.__dict__))


def _run_guarded(body: Callable[[], object]) -> None:
    """Uncaught exceptions are reported as python reports them at top level, without this
    module's frames, and end the process with status 1."""
    try:
        body()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1) from None
