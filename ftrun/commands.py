"""`ftrun status` and `ftrun inject-fault`: typer commands over the control client.

Owns: the subcommands' arguments, the drill schedule (--every/--count) and waiting for the
drill's recoveries. Rendering lives in render.py.
Must not import: torch (a status check must work, fast, on a node without CUDA).
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import typer

from ftrun import control, render
from ftrun.errors import FtrunError, UsageError
from ftrun.gpuhealth import GpuSample as _Sample
from ftrun.gpuhealth import Health, classify
from ftrun.progress import DRILL_KINDS

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="ftrun: see what a job is doing, and rehearse its failures.")
DRILL_WAIT_S = 120.0  # how long inject-fault waits for the drill's recoveries


@app.command()
def status(run_id: Optional[str] = typer.Option(None, "--run-id", help="the job (a prefix is enough)"),  # noqa: UP045,E501
           as_json: bool = typer.Option(False, "--json", help="print a stable JSON document"),
           watch: bool = typer.Option(False, "--watch", help="refresh in place")) -> None:
    """Show a running job: generation, workers, recent faults and their recovery phases."""
    if run_id is None and not watch and not as_json:
        runs = control.list_runs()
        if len(runs) > 1:
            render.print_runs(runs)
            return
    info = control.find_run(run_id)
    if watch:
        render.watch_status(lambda: control.request(info, {"op": "status"}))
        return
    doc = control.request(info, {"op": "status"})
    if as_json:
        doc.pop("ok", None)
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        render.print_status(doc)


@app.command("inject-fault")
def inject_fault(
    kind: str = typer.Option(..., "--kind", help="one of " + ", ".join(DRILL_KINDS) + ", xid"),
    rank: Optional[int] = typer.Option(None, "--rank", help="the rank to break"),  # noqa: UP045
    gpu: Optional[int] = typer.Option(None, "--gpu", help="the GPU to break (xid kinds)"),  # noqa: UP045,E501
    run_id: Optional[str] = typer.Option(None, "--run-id", help="the job (a prefix is enough)"),  # noqa: UP045,E501
    at_step: int = typer.Option(-1, "--at-step", help="let the worker fail when it reaches this step"),  # noqa: E501
    every: float = typer.Option(0.0, "--every", help="seconds between repeated faults"),
    count: int = typer.Option(1, "--count", help="how many faults"),
    delay: float = typer.Option(0.5, "--delay", help="slow: extra seconds per step"),
    xid: Optional[int] = typer.Option(None, "--xid", help="the XID for --kind xid"),  # noqa: UP045
) -> None:
    """Break a running job on purpose and print how it recovered, phase by phase."""
    if (rank is None) == (gpu is None):
        raise UsageError("give exactly one of --rank or --gpu", hint="e.g. --rank 1")
    if kind not in (*DRILL_KINDS, "xid", "ecc", "thermal"):
        raise UsageError(f"unknown fault kind {kind!r}",
                         hint="use " + ", ".join((*DRILL_KINDS, "xid", "ecc", "thermal")))
    if gpu is not None and kind not in ("xid", "ecc", "thermal"):
        raise UsageError(f"--gpu takes --kind xid, ecc or thermal, not {kind}",
                         hint="e.g. --gpu 0 --kind xid --xid 79")
    if count < 1 or every < 0 or (count > 1 and every <= 0):
        raise UsageError("--count N needs --every SECONDS > 0", hint="e.g. --every 5 --count 3")
    info = control.find_run(run_id)
    first = control.request(info, {"op": "status"})
    before = len(first["faults"])
    for i in range(count):
        if i:
            time.sleep(every)
        reply = control.request(info, {"op": "inject", "kind": kind, "rank": rank, "gpu": gpu,
                                       "at_step": at_step, "arg": delay, "xid": xid})
        if gpu is not None:
            print(f"ftrun: injected {kind} {xid or ''} into GPU {gpu} ({reply['uuid']})",
                  flush=True)
        else:
            print(f"ftrun: injected {kind} into rank {reply['rank']} (worker "
                  f"{reply['worker']}, pid {reply['pid']})", flush=True)
    if kind in ("slow", "thermal") or (kind == "xid" and xid_is_benign(xid)):
        return
    if not first.get("ft_api"):  # a plain script: torchrun semantics, no in-process record
        print("ftrun: the job does not use the ftrun worker API: it restarts or stops as "
              "torchrun would; see `ftrun status`")
        return
    faults = _wait_for_recoveries(info, before, count)
    render.print_drill(faults)


def _wait_for_recoveries(info: control.RunInfo, before: int, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + DRILL_WAIT_S
    faults: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            faults = control.request(info, {"op": "status"})["faults"][before:]
        except FtrunError:
            break  # the job ended (a drill can end it: that is the report)
        if len(faults) >= count and all(f["recovered"] or f["decision"] in ("fail",
                                                                            "restart-group")
                                        for f in faults):
            break
        time.sleep(0.2)
    return faults


def xid_is_benign(xid: int | None) -> bool:
    """An XID that fails no GPU (an application error, info): no recovery to wait for."""
    return xid is None or classify(None, _Sample(), (xid,)).health is not Health.FAILED
