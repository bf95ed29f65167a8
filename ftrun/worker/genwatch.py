"""The generation watcher: a worker's thread that sees the next generation arrive.

Owns: `GenerationWatcher`, blocked on the store (its own connection) for the next generation
key, delivering each one to the `comm.Interrupt` the training loop checks, following a relay
that renumbers, and reconnecting when the job's store moves with a generation.
Must not import: typer, rich, NVML, the agent, torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

from ftrun.adapters.store import is_timeout
from ftrun.core import timeouts
from ftrun.core.errors import first_line
from ftrun.protocol.rendezvous import Generation, Store, gen_key
from ftrun.worker.comm import Interrupt


class GenerationWatcher:
    """A thread blocked on the store for the next generation key, with its own connection,
    so the training loop never polls the store. `arriving` runs before a generation is made
    known (the job's store moving with it: every client moves before its group is formed);
    True from it: this watcher's own store moved too, it reconnects."""

    def __init__(self, connect: Callable[[], Store], start_after: int, interrupt: Interrupt,
                 on_generation: Callable[[Generation], None] | None = None,
                 arriving: Callable[[Generation], bool] | None = None) -> None:
        self._connect = connect
        self._next = start_after + 1
        self._interrupt = interrupt
        self._on_generation = on_generation
        self._arriving = arriving
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ftrun-gen-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def observe(self, on_generation: Callable[[Generation], None]) -> None:
        """Call `on_generation` (on this thread) with each generation as it arrives."""
        self._on_generation = on_generation

    def _loop(self) -> None:
        try:
            store = self._connect()
        except Exception as exc:
            self._lost(exc)
            return
        while not self._stop.is_set():
            key = gen_key(self._next)
            try:
                store.wait([key], timedelta(seconds=timeouts.WATCH_POLL_S))
                gen = Generation.from_json(store.get(key))
            except Exception as exc:
                if is_timeout(exc):
                    continue
                self._lost(exc)
                return
            # a relay fills a number its new source never held with the next record: go on
            # from the record's own number
            expected, self._next = self._next, max(self._next, gen.number) + 1
            if gen.number < expected:
                continue  # not a generation after ours
            if self._arriving is not None and self._arriving(gen):
                try:
                    store = self._connect()
                except Exception as exc:
                    self._lost(exc)
                    return
            self._deliver(gen)

    def _deliver(self, gen: Generation) -> None:
        intr = self._interrupt
        intr.newest = gen
        if gen.urgent:
            intr.urgent_above = max(intr.urgent_above, gen.number)
        if self._on_generation is not None:
            self._on_generation(gen)
        intr.wake.set()

    def _lost(self, exc: Exception) -> None:
        if not self._stop.is_set():
            self._interrupt.store_lost = first_line(exc)
            self._interrupt.wake.set()
