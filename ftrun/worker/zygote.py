"""The zygote: one pre-imported, single-threaded process per node that forks workers.

Owns: importing torch, ftrun's worker side and the `--preload` modules once, checking that the
process is still safe to fork (one thread, no CUDA context), a warm-up of torch's lazy first
uses, and answering the agent's fork requests. A request is served by a double fork: the
middle process exits at once, so the worker is handed to the agent (a child subreaper), which
waits for it, signals its group and sees its exit through a pidfd as for any worker.
Run as `python -u -c ZYGOTE_BOOT --fd N [--torch] [--preload a,b]` (adapters.zygote: the
working directory off sys.path); it serves until the agent closes the socket, and dies with
the agent.
Must not import: typer, rich, NVML, the agent. Torch only when asked to (--torch).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import select
import signal
import socket
import sys
import time
from typing import NoReturn

from ftrun.adapters.zygote import rss_kb, thread_count
from ftrun.core import timeouts
from ftrun.protocol.zygote import (
    Accepted,
    ChannelClosed,
    Fork,
    Forked,
    ForkFailed,
    Importing,
    Ready,
    Refused,
    recv,
    send,
)
from ftrun.worker.forked import Plan, become_worker

# what ftrun.init() and a training step load lazily, so that a forked worker finds it loaded
TORCH_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim",
                 "ftrun.worker.api", "ftrun.worker.comm", "ftrun.worker.joining",
                 "ftrun.worker.transfer", "ftrun.worker.buckets", "ftrun.worker.aligning",
                 "ftrun.worker.loader", "ftrun.worker.rng")
WARM_WHEN_IDLE_S = 0.2  # no fork request for this long: time for torch's warm-up
WARM_UP = "torch (warm-up)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ftrun.worker.zygote")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--preload", default="")
    ap.add_argument("--warm-first", action="store_true")  # adapters.zygote.warm_first
    ns = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when the zygote ends
    agent_pid = os.getppid()
    sock = socket.socket(fileno=ns.fd)
    preloads = [m for m in ns.preload.split(",") if m]
    try:
        answer = preload(preloads, ns.torch, sock, ns.warm_first)
        send(sock, answer)
    except ChannelClosed:
        _leave()
    if isinstance(answer, Refused):
        _leave()
    plan = serve(sock, agent_pid, warmed=ns.warm_first)
    if plan is None:
        _leave()
    become_worker(plan)  # this process is a worker now; the interpreter exits after it


def _leave() -> NoReturn:
    """End the zygote without the interpreter's teardown: it holds nothing to flush but its
    streams, and torch's warm-up imports triton, whose bindings print ~60 lines of "nanobind:
    leaked ..." at a normal exit, at the end of every run."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def preload(modules: list[str], with_torch: bool, sock: socket.socket,
            warm: bool = False) -> Ready | Refused:
    started = time.monotonic()
    # torch.cuda.is_available() through NVML: no CUDA context, which would not survive fork
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    names = [*(TORCH_MODULES if with_torch else ()), *modules]
    for name in names:
        send(sock, Importing(name))  # the agent names it if the start is slow
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a module, too
            return Refused("preload", name, f"{type(exc).__name__}: {exc}")
        refusal = _unsafe_after(name)
        if refusal is not None:
            return refusal
    if warm and with_torch:
        send(sock, Importing(WARM_UP))
        _warm_torch()
        refusal = _unsafe_after(WARM_UP)
        if refusal is not None:
            return refusal
    gc.collect()
    gc.freeze()  # the collector then leaves these objects' pages shared with the workers
    return Ready(os.getpid(), tuple(names), round(time.monotonic() - started, 3),
                 rss_kb(os.getpid()))


def _unsafe_after(name: str) -> Refused | None:
    """Forking a process with threads can deadlock the child (a lock held mid-operation
    by a thread that does not exist there); CUDA does not survive fork at all."""
    threads = thread_count()
    if threads > 1:
        return Refused("threads", name, f"{threads - 1} thread(s) started at import")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return Refused("cuda", name, "CUDA initialised at import")
    return None


def _warm_torch() -> None:
    """Pay torch's lazy first uses once here (the first optimizer imports ~900 modules,
    ~0.8 s), what a hot spare pays while it waits, on tensors too small to start a thread
    pool; the RNG is left as it was."""
    import torch

    from ftrun.worker.joining import warm_up

    state = torch.random.get_rng_state()
    warm_up()
    torch.nn.functional.linear(torch.ones(1, 2), torch.ones(2, 2)).sum()
    torch.random.set_rng_state(state)


def serve(sock: socket.socket, agent_pid: int, warmed: bool = False) -> Plan | None:
    """Answer fork requests until the agent closes the socket. Returns in a forked worker
    only, with its orders. Unless it `warmed` before its first fork (more workers than
    cores), torch's warm-up waits for the first quiet moment: the first workers, a core
    each, are not kept waiting for it."""
    cold = "torch" in sys.modules and not warmed
    while True:
        if cold and not select.select([sock], [], [], WARM_WHEN_IDLE_S)[0]:
            cold = False
            try:  # a fork asked for meanwhile waits for the warm-up: the agent hears why
                send(sock, Importing(WARM_UP))
            except ChannelClosed:
                return None
            _warm_torch()
            if _unsafe_after(WARM_UP) is not None:
                return None  # the agent sees the zygote gone and starts new processes
            gc.freeze()
        try:
            msg, fds = recv(sock, timeout_s=None)  # idle until asked: the agent owns our life
        except ChannelClosed:
            return None
        if not isinstance(msg, Fork) or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            send(sock, ForkFailed(f"expected a fork request with 2 descriptors, got {msg}"))
            continue
        plan = _fork(msg, fds[0], fds[1], agent_pid, sock)
        if plan is not None:
            return plan


def _fork(req: Fork, stdout: int, stderr: int, agent_pid: int,
          sock: socket.socket) -> Plan | None:
    """Fork the worker through a middle process; None here, its Plan in the worker. The
    worker runs its script only once the agent said it took it (`Accepted`): an agent that
    gave up waiting starts the worker anew, and the forked one must then never run."""
    read_fd, write_fd = os.pipe()
    go_read, go_write = os.pipe()
    zygote_pid = os.getpid()
    try:
        middle = os.fork()
    except OSError as exc:  # out of processes or memory: the agent starts this one itself
        for fd in (read_fd, write_fd, go_read, go_write, stdout, stderr):
            os.close(fd)
        send(sock, ForkFailed(f"fork: {exc.strerror}"))
        return None
    if middle == 0:
        try:
            if os.fork() != 0:
                os._exit(0)  # the worker is handed to the agent as this process ends
            for fd in (read_fd, go_write):
                os.close(fd)
            sock.close()
            return Plan(req, stdout, stderr, write_fd, agent_pid, zygote_pid, go_read)
        except BaseException:  # noqa: BLE001 - never back into the zygote's loop
            os._exit(1)
    for fd in (write_fd, go_read, stdout, stderr):
        os.close(fd)
    try:
        pid = _read_pid(read_fd)
    finally:
        os.close(read_fd)
        os.waitpid(middle, 0)  # once the middle is gone, the worker is the agent's child
    try:
        _hand_over(sock, pid, go_write)
    finally:
        os.close(go_write)  # unless it said go, the worker reads EOF and ends
    return None


def _hand_over(sock: socket.socket, pid: int, go_write: int) -> None:
    """Tell the agent the worker's pid and, once it took it, the worker to go; a worker the
    agent did not take is killed (it has not run a line of its script)."""
    if not pid:
        send(sock, ForkFailed("the forked worker did not start"))
        return
    try:
        send(sock, Forked(pid))
        answer, fds = recv(sock, timeouts.ZYGOTE_ACCEPT_S)
    except ChannelClosed:
        answer, fds = None, []
    for fd in fds:
        os.close(fd)
    if answer == Accepted(pid):
        os.write(go_write, b"1")
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _read_pid(read_fd: int) -> int:
    """The worker's pid, written once it leads its own session; 0 if it never was."""
    deadline = time.monotonic() + timeouts.ZYGOTE_PID_S
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([read_fd], [], [], left)[0]:
            break
        chunk = os.read(read_fd, 32)
        if not chunk:
            break
        data += chunk
    return int(data) if data.isdigit() else 0


if __name__ == "__main__":
    main()
