"""How the agent starts worker processes: forked from the zygote, or as new processes.

Owns: the run's zygote (started with the run, waited for at the first worker), making the
agent a child subreaper so that forked workers are its children, falling back to new
processes (said once) when the zygote is off, refused, or gone, reaping orphans the kernel
hands to the agent, and the zygote's figures for `ftrun status`.
Must not import: torch, typer, rich, the worker library, the agent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from ftrun.adapters.procs import Spawned, become_subreaper, reap_strays, spawn
from ftrun.adapters.wakeup import Wakeup
from ftrun.adapters.zygote import (
    MemorySampler,
    Target,
    Zygote,
    ZygoteGone,
    ZygoteState,
    wants_torch,
    warm_first,
)
from ftrun.core.errors import UsageError
from ftrun.core.events import EventSink, notice
from ftrun.core.exits import describe_exit
from ftrun.core.spec import RunSpec
from ftrun.protocol.status import Forked, ZygoteOff, ZygoteUp

_NEW = "starting workers as new processes"


class WorkerStarter:
    def __init__(self, spec: RunSpec, emit: EventSink, wakeup: Wakeup | None = None,
                 guard: Callable[[int], None] | None = None) -> None:
        self.spec = spec
        self.emit = emit
        self.wakeup = wakeup  # the agent's: a signal stops the wait for the zygote
        self.guard = guard  # the guardian's watch: the zygote's group dies with the agent
        self.zygote: Zygote | None = None
        self.subreaper = False
        self.state = "off"  # what `ftrun status` shows: off | starting | ready | gone | refused
        self.why_not = "--no-zygote" if not spec.zygote else ""
        self._memory = MemorySampler()  # the forked workers' memory, for `ftrun status`

    def open(self, env: Mapping[str, str]) -> None:
        """Start the zygote now: it imports torch while the agent sets up the run."""
        spec = self.spec
        if not spec.zygote or spec.no_python:
            self.why_not = self.why_not or "--no-python"
            return
        self.subreaper = become_subreaper()
        if not self.subreaper:
            self._give_up(f"this kernel refuses a child subreaper; {_NEW}", "off")
            return
        python = env.get("PYTHON_EXEC", sys.executable)
        try:
            self.zygote = Zygote(python, env, spec.preload,
                                 wants_torch(spec.script, spec.module, spec.run_path),
                                 warm_first(spec.nproc + spec.spares))
        except OSError as exc:
            self._give_up(f"cannot start the zygote ({exc.strerror}); {_NEW}")
            return
        if self.guard is not None:
            self.guard(self.zygote.pid)  # what a --preload starts, too
        self.state = "starting"

    def start(self, argv: Sequence[str], env: Mapping[str, str],
              stdout: int | IO[bytes] | None, stderr: int | IO[bytes] | None) -> Spawned:
        """One worker: forked from the zygote when it can, else a new process."""
        zygote = self._usable()
        target = Target.of(argv, zygote.python) if zygote is not None else None
        if zygote is not None and target is not None:
            try:
                return zygote.fork(target, env, _fd(stdout, 1), _fd(stderr, 2))
            except ZygoteGone as exc:
                self._give_up(f"the zygote (pid {zygote.pid}) cannot fork any more ({exc}); "
                              f"{_NEW} from now on")
        return spawn(argv, env, stdout, stderr)

    def wait_for_zygote(self) -> None:
        """Until the zygote is ready (or not to be used), or a signal reaches the agent: the
        agent then starts no worker, where start() would start them as new processes."""
        self._usable()

    def _usable(self) -> Zygote | None:
        zygote = self.zygote
        if zygote is None:
            return None
        state = zygote.wait_ready(wakeup=self.wakeup, on_slow=self._slow)
        if state is ZygoteState.STARTING:  # the agent is stopping: no reason to wait on
            self._give_up("interrupted while the zygote started", "gone", quiet=True)
            return None
        if state is ZygoteState.READY and zygote.alive():
            self.state = "ready"
            return zygote
        if state is ZygoteState.REFUSED:
            self._refused(zygote)
        elif state is ZygoteState.READY:
            self._give_up(f"the zygote (pid {zygote.pid}) is gone; {_NEW} from now on")
        elif zygote.exit_code is not None:
            self._give_up(f"the zygote exited with {describe_exit(zygote.exit_code)} while "
                          f"importing {zygote.importing or 'its first module'}; {_NEW}")
        else:
            self._give_up(f"the zygote did not get ready; {_NEW}")
        return None

    def _slow(self, module: str, waited_s: float) -> None:
        hint = (f" (--preload {module}: a stuck import? it may be dropped from --preload)"
                if module in self.spec.preload else "")
        self._notice(f"the zygote is still importing {module or 'its first module'} after "
                     f"{waited_s:.0f} s{hint}")

    def _refused(self, zygote: Zygote) -> None:
        r = zygote.refused
        assert r is not None
        mine = r.module in self.spec.preload
        if r.why == "preload" and mine:
            self._give_up(f"--preload {r.module} failed to import", "refused", quiet=True)
            raise UsageError(f"--preload {r.module}: {r.detail}",
                             hint="install it, or drop it from --preload")
        if r.why == "preload":
            self._give_up(f"the zygote could not import {r.module} ({r.detail}); {_NEW}")
            return
        what = "started threads" if r.why == "threads" else "initialised CUDA"
        hint = f" (drop {r.module} from --preload)" if mine else ""
        self._give_up(f"importing {r.module} {what} ({r.detail}), and forking that process "
                      f"could deadlock or break its workers: {_NEW}{hint}", "refused")

    def _give_up(self, why: str, state: str = "gone", quiet: bool = False) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        self.state, self.why_not = state, why
        if not quiet:
            self._notice(why)

    def _notice(self, text: str) -> None:
        notice(self.emit, text)

    def reap_strays(self, workers: Sequence[int], guardian: int) -> None:
        """Orphans the kernel handed to the agent (a dead worker's children) are reaped."""
        if self.subreaper:
            owned = {*workers, guardian, *([self.zygote.pid] if self.zygote else [])}
            reap_strays(owned)

    def zygote_pid(self, spawned: Spawned) -> int:
        """The zygote a worker was forked from (0: started as a new process)."""
        return self.zygote.pid if spawned.via == "zygote" and self.zygote else 0

    def describe(self, forked: Sequence[int] = ()) -> ZygoteUp | ZygoteOff:
        """The zygote for `ftrun status`, with the memory of the `forked` workers."""
        z = self.zygote
        if z is None:
            return ZygoteOff(state=self.state, why_not=self.why_not)
        return ZygoteUp(state=self.state, pid=z.pid, rss_kb=z.rss_kb(), forks=z.forks,
                        preloaded=tuple(z.ready.preloaded) if z.ready else (),
                        preload_s=z.ready.seconds if z.ready else None,
                        workers=tuple(Forked.from_json({"pid": pid, **mem}) for pid, mem
                                      in zip(forked, self._memory.of(forked), strict=True)))

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        if self.subreaper:
            become_subreaper(False)
            self.subreaper = False


def _fd(stream: int | IO[bytes] | None, console: int) -> int:
    if stream is None:
        return console
    return stream if isinstance(stream, int) else stream.fileno()
