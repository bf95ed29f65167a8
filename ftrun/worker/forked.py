"""A worker forked from the zygote turning into what `python -u SCRIPT ARGS` would have started.

Owns: what a forked child sets before the script runs (its session, becoming the agent's child
and dying with it, stdio, environment and the thread pools it sizes, working directory, signal
dispositions and mask, seeds drawn from the OS, `sys.argv`, `sys.path`, a fresh `__main__`
with python's `__file__` and `__loader__`), then running the script or module and leaving as
the interpreter would: exit status, traceback, atexit handlers, flushed stdio.
Must not import: typer, rich, NVML, the agent. Torch only if the zygote imported it.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import gc
import importlib.machinery
import io
import os
import random
import runpy
import select
import signal
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

from ftrun.adapters.procs import die_with_parent
from ftrun.core import timeouts
from ftrun.core.exits import ignored_notice
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
    go_fd: int  # the zygote writes a byte once the agent took this worker; EOF: it did not


def become_worker(plan: Plan) -> None:
    """Runs in the forked child; returns when the script has run (the interpreter then exits
    as `python script.py` does), or leaves the process at once if it cannot be a worker."""
    os.setsid()  # pid == pgid == sid, as for a spawned worker: the agent signals the group
    os.write(plan.report_fd, str(os.getpid()).encode())
    os.close(plan.report_fd)
    if not _taken(plan.go_fd):
        os._exit(137)  # the agent gave up on this fork and starts the worker anew
    if not _adopted_by(plan.agent_pid):
        os._exit(137)  # the agent is gone: a worker must never outlive it
    _set_stdio(plan.stdout, plan.stderr)
    _reset_signals()
    req = plan.request
    _set_environment(req.env)
    if (notice := ignored_notice(req.env)) is not None:  # the agent's, as a spawn's
        signal.signal(notice, signal.SIG_IGN)
    _fresh_seeds()
    os.chdir(req.cwd)
    global ZYGOTE_PID
    ZYGOTE_PID = plan.zygote_pid
    # registered before the script's own handlers, so run after them: the zygote froze its
    # objects (gc.freeze) to keep their pages shared; left frozen, the exit never frees them
    # and triton's bindings, which torch's warm-up imports, print ~30 lines of "nanobind:
    # leaked ..." as the interpreter ends
    atexit.register(gc.unfreeze)
    run(req)


def _taken(go_fd: int) -> bool:
    """Whether the agent took this worker (the zygote says so with one byte; it closes the
    pipe, or dies, when the agent did not)."""
    try:
        ready = select.select([go_fd], [], [], timeouts.ZYGOTE_GO_S)[0]
        return bool(ready) and os.read(go_fd, 1) == b"1"
    finally:
        os.close(go_fd)


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
    _size_thread_pools(env)


def _fresh_seeds() -> None:
    """A new interpreter draws these from the OS; forked workers would all share the zygote's
    (random reseeds itself at fork, torch and numpy do not)."""
    random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # the CPU generator now, the CUDA ones lazily (no context is made)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _size_thread_pools(env: dict[str, str]) -> None:
    """The zygote imported with one thread per pool (so that it could fork); the pools get
    what this worker's environment, or a new interpreter's default, asks for."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(_threads(env, "OMP_NUM_THREADS", "MKL_NUM_THREADS")
                              or _physical_cores())
    if "numpy" in sys.modules:
        _set_openblas_threads(_threads(env, "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                                       "OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))


def _threads(env: dict[str, str], *names: str) -> int:
    """The first of `names` set to a positive count (as the libraries read them); 0: none."""
    for name in names:
        value = env.get(name, "").split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def _physical_cores() -> int:
    """torch's own default for intra-op threads."""
    import psutil  # only here: a worker whose environment names a count never loads it

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


_OPENBLAS_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads", "openblas_set_num_threads64_")


def _set_openblas_threads(count: int) -> None:
    """numpy's OpenBLAS sized its pool when the zygote imported it (one thread)."""
    with open("/proc/self/maps") as maps:  # the loaded shared objects, as dl_iterate_phdr
        libraries = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    for path in libraries:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _OPENBLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(count)
                break


def run(req: Fork) -> None:
    """Run the script as __main__ with the worker's argv, as `python -u` would."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    as_main = getattr(runpy, "_run_module_as_main")  # noqa: B009 - what `python -m` runs
    sys.argv = [req.target, *req.args]  # for -m, runpy puts the module's path in argv[0]
    if req.module:
        _path_first(os.getcwd())
        _run_guarded(lambda: as_main(req.target, alter_argv=True))
        return
    if not os.path.isfile(req.target):  # a directory or a zip archive with a __main__.py
        _path_first(req.target)
        _run_guarded(lambda: as_main("__main__", alter_argv=False))
        return
    _path_first(os.path.dirname(os.path.realpath(req.target)))
    path = os.path.join(os.getcwd(), req.target)  # python's __file__: absolute, not resolved
    main.__file__ = path
    main.__dict__["__cached__"] = None
    main.__dict__["__loader__"] = importlib.machinery.SourceFileLoader("__main__", path)
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    _run_guarded(lambda: exec(code, main.__dict__))


def _path_first(entry: str) -> None:
    """What python puts first on sys.path for a script, a module or a directory: nothing
    under PYTHONSAFEPATH (the zygote's own first entry, its working directory, is gone)."""
    if not os.environ.get("PYTHONSAFEPATH"):
        sys.path.insert(0, entry)


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
