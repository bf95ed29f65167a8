"""`ftrun drain`: a planned leave of a running job, followed phase by phase to its end.

Owns: sending the checked drain request to the job's deciding agent, then following the
drain in `ftrun status` (its token names it) and printing each phase as it happens, as
`inject-fault` prints a recovery; the exit code: 0 once the leavers are out and their ranks
served elsewhere (or the job shrank), 1 with one line when it cannot be done, 75 when the job
had nowhere to go and ends for its scheduler to requeue it.
Must not import: torch (a drain must work, fast, on a node without CUDA).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from ftrun.adapters import control
from ftrun.agent.journal import LOG_FILE
from ftrun.core.drains import DrainState
from ftrun.core.errors import FtrunError, UsageError
from ftrun.core.events import DrainFields
from ftrun.core.exits import EXIT_REQUEUE
from ftrun.protocol.control import DrainQueued, Preempted, read_reply
from ftrun.protocol.control_ops import check_request

WAIT_MARGIN_S = 60.0  # past its window, how long `ftrun drain` follows a swap that landed
# between two looks at the job: the phases carry the agent's own times, and a status document
# costs the agent CPU while its members swap
POLL_S = 0.25
SAY = {"requested": "requested", "ready": "replacement ready", "published": "swap published",
       "left": "leaver out", "first_commit": "first commit after the swap",
       "done": "done", "refused": "refused", "requeue": "requeue"}


def drain(run_id: str | None, rank: int | None, node: int | None, gpu: int | None,
          say: Callable[[str], None]) -> int:
    try:
        op = check_request({"op": "drain", "rank": rank, "node": node, "gpu": gpu})
    except FtrunError as exc:
        raise UsageError(exc.message, hint=exc.hint) from None
    agents = control.find_job(run_id)
    info = agents[0]  # the coordinator's, where several agents of the job share this host
    queued = read_reply(DrainQueued, control.request(info, op.to_wire()))
    say(f"ftrun: drain of {queued.what} (worker{'s' if len(queued.leavers) > 1 else ''} "
        f"{', '.join(map(str, queued.leavers))}) sent to job {info.run_id[:8]}")
    return outcome(follow(info, queued.token, say), queued.what, say)


def outcome(final: DrainFields | None, what: str, say: Callable[[str], None]) -> int:
    """The exit code of a followed drain (a one-line FtrunError when it was refused)."""
    if final is None:
        raise FtrunError(f"the drain of {what} did not end in time",
                         hint="see `ftrun status`: its drains show where it stands")
    if final.state == DrainState.DONE:
        return 0
    if final.state == DrainState.REQUEUE:
        say(f"ftrun: the job had nowhere to go: it ends with exit code {EXIT_REQUEUE} to be "
            "requeued")
        return EXIT_REQUEUE
    raise FtrunError(f"the drain of {what} was refused: {final.reason}",
                     hint="start spares (--spares), or allow a shrink (--on-fault shrink)")


def preempt(info: control.RunInfo, wire: dict[str, object], node: int | None,
            say: Callable[[str], None]) -> int:
    """`inject-fault --kind preempt`: the notice sent, then the node's drain followed."""
    before = max((d.drain for d in control.status(info).drains or ()), default=0)
    sent = read_reply(Preempted, control.request(info, wire))
    where = "this job's agent" if node is None else f"node {node}'s agent"
    say(f"ftrun: {where} (pid {sent.pid}) got its notice (SIGTERM): its ranks hand over "
        f"within {sent.window_s:g} s")
    return outcome(follow(info, "", say, after=before), f"node {node or 0}", say)


def follow(info: control.RunInfo, token: str, say: Callable[[str], None],
           after: int = 0) -> DrainFields | None:
    """Print the drain's phases as they come; its final record (None: it did not end). The
    drain is the one `token` names, or ("" token, a notice's) the first numbered above
    `after`."""
    told: set[str] = set()
    deadline = float("inf")
    row: DrainFields | None = None
    while time.time() < deadline:
        try:
            doc = control.status(info)
        except control.JobGone:  # a requeue ends the job: its event log has the last word
            final = _from_log(info, token, after) or row
            if final is not None:
                _say_phases(final, told, say)
            return final if final is not None and final.state == DrainState.REQUEUE else None
        except FtrunError:
            time.sleep(0.1)  # busy or shutting down: the next try tells which
            continue
        row = next((d for d in doc.drains or () if d.token == token and d.drain > after), row)
        if row is not None:
            deadline = min(deadline, (row.deadline or time.time()) + WAIT_MARGIN_S)
            _say_phases(row, told, say)
            if row.state in (DrainState.DONE, DrainState.REFUSED):
                return row
        time.sleep(POLL_S)
    return None


def _say_phases(row: DrainFields, told: set[str], say: Callable[[str], None]) -> None:
    for phase, ms in sorted(row.phases_ms.items(), key=lambda kv: kv[1]):
        if phase not in told:
            told.add(phase)
            say(f"ftrun: drain {row.drain}: {SAY.get(phase, phase)} +{ms:.0f} ms"
                + (f" ({row.reason})" if phase in ("requested", "refused") else "")
                + (f"; the members' boundary took {row.stall_ms:.0f} ms"
                   if phase == "done" and row.stall_ms is not None else ""))


def _from_log(info: control.RunInfo, token: str, after: int) -> DrainFields | None:
    """The drain's last record in the ended job's event log (None: none to read)."""
    path = os.path.join(info.log_dir or "", LOG_FILE)
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if '"drain"' in line]
    except (OSError, ValueError):
        return None
    rows = [DrainFields.of(e) for e in lines if e.get("event") == "drain"]
    rows = [r for r in rows if r.token == token and r.drain > after]
    return rows[-1] if rows else None
