"""The `ftrun status` view: the status document as tables and lines for people.

Owns: `status_tables` (the header, the workers, planned leaves, the recent faults with
their reasons), its one-line parts (policy, replica groups, snapshot, heal, zygote,
verification, a drain), `print_status` and `watch_status` (refreshed in place).
Must not import: torch, the agent internals (it receives the `protocol.status` records).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from ftrun.cli.render import fault_table, fmt
from ftrun.core import events as ev
from ftrun.protocol.status import Heal, ReplicaGroup, Snapshot, Status, Zygote, ZygoteUp


def status_tables(doc: Status) -> list[Any]:
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_row("run", doc.run_id, "script", doc.script)
    head.add_row("uptime", f"{doc.uptime_s:.0f}s", "generation", str(doc.generation))
    head.add_row("world size", str(doc.world_size), "policy", policy_text(doc))
    rate = doc.steps_per_s
    head.add_row("steps/s", f"{rate:.2f} (last minute)" if rate is not None else "-",
                 "metrics", doc.metrics or "off (--metrics-port)")
    if doc.zygote:
        head.add_row("zygote", _zygote_text(doc.zygote), "", "")
    if doc.snapshot:
        head.add_row("snapshot", snapshot_text(doc.snapshot), "", "")
    if doc.verify_every is not None:
        head.add_row("verify", verify_text(doc), "", "")
    if doc.heal.state_bytes:
        head.add_row("heal", heal_text(doc.heal), "", "")
    if doc.replica_groups:
        head.add_row("replica groups", replica_groups_text(doc.replica_groups), "", "")
    if doc.nodes:
        served = doc.served_by
        head.add_row("nodes", str(sum(n.alive for n in doc.nodes)), "store",
                     (doc.endpoint or "") + (f" (this is node {served.node})" if served
                                             else " (this node)"))
    workers = Table(title="workers", title_justify="left")
    keys: tuple[str, ...] = ("rank", "local_rank", "worker_id", "pid", "state", "role", "step",
                             "committed_step", "step_time_ms", "since_progress_s", "phase",
                             "gpu")
    cols = ["rank", "local", "worker", "pid", "state", "role", "step", "committed", "step ms",
            "idle s", "phase", "gpu"]
    if doc.nodes:
        keys, cols = ("node", "host", *keys), ["node", "host", *cols]
    for col in cols:
        workers.add_column(col)
    for w in sorted(doc.workers, key=lambda w: (w.rank < 0, w.rank)):
        workers.add_row(*(fmt(getattr(w, k)) for k in keys))
    out: list[Any] = [head, workers]
    out += [drain_line(d, doc.started_at + doc.uptime_s) for d in (doc.drains or ())[-3:]]
    if doc.faults:
        out.append(fault_table("faults", doc.faults[-10:]))
        out += [f"  #{f.id}: {f.reason}" for f in doc.faults[-5:]]
    return out


def drain_line(d: ev.DrainFields, now: float) -> str:
    """`drain #1 rank 1: waiting, 24 s left (--drain-window): worker 1 hands over to ...`,
    or a finished one with its figures."""
    head = f"drain #{d.drain} {d.what}: {d.state}"
    if d.state in ("waiting", "published") and d.deadline is not None:
        head += f", {max(0.0, d.deadline - now):.0f} s left (--drain-window)"
    elif d.state == "done":
        took = d.phases_ms.get("done")
        head += f" in {took:.0f} ms" if took is not None else ""
        head += f", the members' boundary {d.stall_ms:.0f} ms" if d.stall_ms is not None else ""
    return f"{head}: {d.reason}"


def policy_text(doc: Status) -> str:
    """`replace (spares 1)`, or under --shard-size `a lost group out, then rejoined (groups of
    2, spare groups 1)`."""
    if doc.shard_size > 1:
        return (f"a lost group out, then rejoined (groups of {doc.shard_size}, spare groups "
                f"{doc.spares})")
    return f"{doc.policy} (spares {doc.spares})"


def replica_groups_text(groups: Sequence[ReplicaGroup]) -> str:
    """`0 training (ranks 0-1), 1 healing (ranks 2-3); starting: workers 6, 7`."""
    live = [f"{g.group} {g.state} (ranks {g.ranks[0]}-{g.ranks[-1]})"
            for g in groups if g.group is not None]
    starting = [", ".join(map(str, g.workers)) for g in groups if g.group is None]
    return "; ".join([", ".join(live)] + [f"starting: workers {w}" for w in starting])


def snapshot_text(s: Snapshot) -> str:
    """`step 150, 4 s ago, 120.3 MB, blocking 31 ms, write 412 ms` or `none written yet`."""
    failed = f"; {s.failed} failed, the last: {s.last_error}" if s.failed else ""
    if s.step is None:
        pending = f" (step {s.shm_step} in shared memory)" if s.shm_step is not None else ""
        return f"none written yet{pending}; to {s.dir}{failed}"
    return (f"step {s.step}, {s.age_s or 0:.0f} s ago, {(s.bytes or 0) / 1e6:.1f} MB, "
            f"blocking {s.blocking_ms or 0:.0f} ms, write {s.write_ms or 0:.0f} ms; "
            f"{s.path}{failed}")


def verify_text(doc: Status) -> str:
    """`every 100 committed steps; 1 silent corruption found (fault #3)`, or `off`."""
    if not doc.verify_every:
        return "off (--verify-every 0): silent corruption goes unseen"
    found = [f"#{f.id}" for f in doc.faults if f.rolled_back_to is not None]
    text = f"every {doc.verify_every} committed steps"
    if found:
        text += (f"; {len(found)} silent corruption{'s' if len(found) > 1 else ''} found "
                 f"(fault {', '.join(found)})")
    return text


def heal_text(h: Heal) -> str:
    """`state 1502.1 MB per replica; next heal ~0.80 s at 1.88 GB/s; 2 heals so far`."""
    est = (f"next heal ~{h.estimate_s:.2f} s at {h.gb_per_s or 0:.2f} GB/s"
           if h.estimate_s is not None else "no heal measured yet")
    return f"state {h.state_bytes / 1e6:.1f} MB per replica; {est}; {h.count} heals so far"


def _zygote_text(z: Zygote) -> str:
    """`ready, pid 41, 677 MB, 5 forks` or `off (--no-zygote)`."""
    if not isinstance(z, ZygoteUp):
        return f"{z.state} ({z.why_not or 'no zygote'})"
    return f"{z.state}, pid {z.pid}, {z.rss_kb / 1024:.0f} MB, {z.forks} forks"


def print_status(doc: Status, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    from rich.console import Console

    console = Console(file=stream, force_terminal=stream.isatty(), width=140)
    for part in status_tables(doc):
        console.print(part)


def watch_status(fetch: Callable[[], Status], period_s: float = 1.0) -> None:
    import time

    from rich.console import Group
    from rich.live import Live

    with Live(refresh_per_second=4, screen=False) as live:
        try:
            while True:
                live.update(Group(*status_tables(fetch())))
                time.sleep(period_s)
        except KeyboardInterrupt:
            return


