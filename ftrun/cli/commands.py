"""`ftrun status`, `ftrun inject-fault`, `ftrun drain` and `ftrun report`: typer commands over
the control client and the run's files.

Owns: the subcommands' arguments (checked with the job's own request checks), the drill
schedule (--every/--count) and waiting for the drill's recoveries; a job that ends before
its drill settles is an error. `--chaos` is checked here and run by chaos_run.py (its plan
and summary: chaos.py). Rendering lives in render.py, the report's numbers in
runreport.py, its picture in picture.py.
Must not import: torch (a status check must work, fast, on a node without CUDA).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from typing import Optional

import typer

from ftrun.adapters import control
from ftrun.cli import render
from ftrun.core.errors import FtrunError, UsageError
from ftrun.core.faultkinds import ALL_KINDS, CORRUPTION_DRILLS, FaultKind
from ftrun.gpu.verdicts import GpuSample as _Sample
from ftrun.gpu.verdicts import Health, classify
from ftrun.protocol.control import GpuInjected, Injected, NetDowned, read_reply
from ftrun.protocol.control_ops import check_request
from ftrun.protocol.status import Fault, Status

app = typer.Typer(add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False,
                  help="ftrun: see what a job is doing, and rehearse its failures.")
DRILL_WAIT_S = 120.0  # how long inject-fault waits for the drill's recoveries


@app.command()
def status(run_id: Optional[str] = typer.Option(None, "--run-id", help="the job (a prefix is enough)"),  # noqa: UP045,E501
           as_json: bool = typer.Option(False, "--json", help="print a stable JSON document"),
           watch: bool = typer.Option(False, "--watch", help="refresh in place"),
           node: Optional[int] = typer.Option(None, "--node", help="a multi-node job: ask the agent of this node (on this host)"),  # noqa: UP045,E501
           ) -> None:
    """Show a running job: generation, workers, recent faults and their recovery phases."""
    if run_id is None and node is None and not watch and not as_json:
        jobs = control.jobs_of(control.list_runs())  # a job's agents on this host: one job
        if len(jobs) > 1:
            render.print_runs([agents[0] for agents in jobs])
            return
    from ftrun.cli import status_view  # loaded for this command alone

    info = control.find_run(run_id, node)
    if watch:
        status_view.watch_status(lambda: control.status(info))
        return
    doc = control.status(info)
    if as_json:
        print(json.dumps(doc.to_json(), indent=2, sort_keys=True))
    else:
        status_view.print_status(doc)


@app.command()
def report(run_dir: Optional[str] = typer.Argument(None, help="a run's log directory, or a --log-dir holding runs (default: the last run)"),  # noqa: UP045,E501
           last: bool = typer.Option(False, "--last", help="the last run started on this host"),
           as_json: bool = typer.Option(False, "--json", help="print the numbers as JSON"),
           out: Optional[str] = typer.Option(None, "--out", help="the picture: FILE.html (default: report.html in the run directory) or FILE.png (needs matplotlib)"),  # noqa: UP045,E501
           ) -> None:
    """Sum up a run: faults, recovery phases, time lost, goodput, and a picture of it."""
    from ftrun.cli import picture, runreport

    if run_dir is not None and last:
        raise UsageError("give a run directory or --last, not both", hint="drop one of them")
    run = runreport.load_run(runreport.find_run_dir(run_dir))
    rep = runreport.build_report(run)
    path = os.path.abspath(out) if out else os.path.join(run.path, "report.html")
    chart = picture.chart_of(run)
    title = f"ftrun run {os.path.basename(run.path)}"
    write = picture.write_png if path.endswith(".png") else picture.write_html
    try:
        markers = write(chart, path, title)
    except OSError as exc:
        raise FtrunError(f"cannot write the picture {path} ({exc.strerror})",
                         hint="pass --out with a writable path") from None
    rep = {**rep, "picture": path, "fault_markers": markers}
    if as_json:
        print(json.dumps(rep, indent=2, sort_keys=True, default=str))
    else:
        render.print_report(rep)


@app.command("inject-fault")
def inject_fault(
    kind: Optional[str] = typer.Option(None, "--kind", help="one of " + ", ".join(ALL_KINDS)),  # noqa: UP045,E501
    rank: Optional[int] = typer.Option(None, "--rank", help="the rank to break"),  # noqa: UP045
    gpu: Optional[int] = typer.Option(None, "--gpu", help="the GPU to break (xid kinds)"),  # noqa: UP045,E501
    run_id: Optional[str] = typer.Option(None, "--run-id", help="the job (a prefix is enough)"),  # noqa: UP045,E501
    at_step: int = typer.Option(-1, "--at-step", help="let the worker fail when it reaches this step"),  # noqa: E501
    every: float = typer.Option(0.0, "--every", help="seconds between repeated faults (--chaos: their mean)"),  # noqa: E501
    count: int = typer.Option(0, "--count", show_default=False, help="how many faults (default 1; --chaos: no limit)"),  # noqa: E501
    delay: float = typer.Option(0.5, "--delay", help="slow: extra seconds per step"),
    bit: Optional[int] = typer.Option(None, "--bit", help="bitflip: which bit of the rank's registered state (default: one at random)"),  # noqa: UP045,E501
    xid: Optional[int] = typer.Option(None, "--xid", help="the XID for --kind xid"),  # noqa: UP045
    node: Optional[int] = typer.Option(None, "--node", help="the node whose link to cut (net-down), or whose agent gets a notice (preempt)"),  # noqa: UP045,E501
    duration: float = typer.Option(0.0, "--duration", help="net-down: seconds the link stays down; --chaos: seconds of chaos"),  # noqa: E501
    chaos_mode: bool = typer.Option(False, "--chaos", help="random faults of mixed kinds, one at a time (--every, --duration or --count)"),  # noqa: E501
    kinds: Optional[str] = typer.Option(None, "--kinds", help="--chaos: the kinds to draw from, a,b,c (default: all the job supports)"),  # noqa: UP045,E501
    seed: int = typer.Option(0, "--seed", help="--chaos: the plan's seed (same seed, same plan)"),  # noqa: E501
    spread: str = typer.Option("exponential", "--spread", help="--chaos: gaps exponential or uniform"),  # noqa: E501
) -> None:
    """Break a running job on purpose and print how it recovered, phase by phase."""
    if chaos_mode:
        if kind is not None or rank is not None or gpu is not None or node is not None:
            raise UsageError("--chaos draws kinds and ranks itself: drop --kind, --rank, --gpu "
                             "and --node", hint="choose kinds with --kinds kill,exit")
        _chaos(run_id, every, count, duration, kinds, seed, spread)
        return
    if kind is None:
        raise UsageError("Missing option '--kind'", hint="e.g. --kind kill --rank 1, or --chaos")
    count = count or 1
    if kind not in ALL_KINDS:
        raise UsageError(f"unknown fault kind {kind!r}", hint="use " + ", ".join(ALL_KINDS))
    if not math.isfinite(every) or every < 0:
        raise UsageError(f"--every must be a number of seconds >= 0, not {every}",
                         hint="e.g. --every 5 --count 3")
    if count < 1 or (count > 1 and every <= 0):
        raise UsageError("--count N needs --every SECONDS > 0", hint="e.g. --every 5 --count 3")
    try:  # the job checks the same way; checking here first gives a usage error, exit 2
        drill = check_request({"op": "inject", "kind": kind, "rank": rank, "gpu": gpu,
                               "at_step": at_step, "arg": delay, "xid": xid, "node": node,
                               "duration": duration, "bit": bit})
    except FtrunError as exc:
        raise UsageError(exc.message, hint=exc.hint) from None
    if kind == FaultKind.PREEMPT:
        from ftrun.cli import drain as planned

        agents = control.find_job(run_id)
        info = agents[0] if node is None else control.agent_of_node(agents, node)
        code = planned.preempt(info, drill.to_wire(), node, lambda line: print(line, flush=True))
        if code:
            raise typer.Exit(code)
        return
    info, first = _agent_for_drill(control.find_job(run_id), rank)
    before = len(first.faults)
    for i in range(count):
        if i:
            time.sleep(every)
        try:
            reply = control.request(info, drill.to_wire())
        except control.JobGone:
            raise control.JobGone(f"job {info.run_id[:8]} ended before the drill was injected "
                                  f"({i}/{count} faults injected)",
                                  hint="see its log directory") from None
        if node is not None:
            cut = read_reply(NetDowned, reply)
            print(f"ftrun: node {node} ({cut.device or cut.host}) takes its link down for "
                  f"{duration:g} s", flush=True)
        elif gpu is not None:
            broken = read_reply(GpuInjected, reply)
            print(f"ftrun: injected {kind} {xid or ''} into GPU {gpu} ({broken.uuid})",
                  flush=True)
        else:
            hit = read_reply(Injected, reply)
            print(f"ftrun: injected {kind} into rank {hit.rank} (worker {hit.worker}, pid "
                  f"{hit.pid})", flush=True)
    benign_xid = kind == FaultKind.XID and xid_is_benign(xid)
    if kind in (FaultKind.ECC, FaultKind.THERMAL):
        print("ftrun: a degraded reading, no fault: `ftrun status` shows the GPU's health "
              "(with --drain-on degraded its rank is handed over to a spare)", flush=True)
        return
    if kind == FaultKind.SLOW or benign_xid:
        return
    if kind in CORRUPTION_DRILLS and not first.verify_every:
        print("ftrun: the job does not compare its replicas (--verify-every 0): the flip goes "
              "unseen and is trained on", flush=True)
        return
    if kind == FaultKind.NET_DOWN:  # a cut node's own agent cannot see the job meanwhile
        print("ftrun: see the node dropped, fenced and rejoining with `ftrun status` on the "
              "coordinator (node 0)")
        return
    if not first.ft_api:  # a plain script: torchrun semantics, no in-process record
        print("ftrun: the job does not use the ftrun worker API: it restarts or stops as "
              "torchrun would; see `ftrun status`")
        return
    faults, ended = _wait_for_recoveries(info, before, count)
    render.print_drill(faults)
    if ended:
        settled = sum(1 for f in faults if f.settled)
        raise control.JobGone(f"job {info.run_id[:8]} ended before the drill completed "
                              f"({settled}/{count} faults settled)",
                              hint="see its log directory for why")


@app.command("drain")
def drain(rank: Optional[int] = typer.Option(None, "--rank", help="the rank that leaves"),  # noqa: UP045,E501
          node: Optional[int] = typer.Option(None, "--node", help="every rank of this node leaves"),  # noqa: UP045,E501
          gpu: Optional[int] = typer.Option(None, "--gpu", help="the rank on this GPU (of this host's node) leaves"),  # noqa: UP045,E501
          run_id: Optional[str] = typer.Option(None, "--run-id", help="the job (a prefix is enough)"),  # noqa: UP045,E501
          ) -> None:
    """Hand a rank (a node's, a GPU's) over to a spare at a step boundary, phase by phase."""
    from ftrun.cli import drain as planned  # loaded for this command alone

    code = planned.drain(run_id, rank, node, gpu, lambda line: print(line, flush=True))
    if code:
        raise typer.Exit(code)


def _chaos(run_id: str | None, every: float, count: int, duration: float, kinds: str | None,
           seed: int, spread: str) -> None:
    """`--chaos`: the plan checked, run against the job, summed up (chaos.py, chaos_run.py)."""
    from ftrun.cli import chaos, chaos_run

    spec = chaos.ChaosSpec(every, spread, seed, chaos.parse_kinds(kinds), duration, count)
    chaos.check_spec(spec)
    agents = control.find_job(run_id)
    if len(agents) > 1:
        raise UsageError("--chaos drills a job with one agent on this host",
                         hint="run it against a single-node job")
    info = agents[0]
    spec = replace(spec, kinds=chaos.kinds_for(control.status(info), spec.kinds))
    print(f"ftrun: chaos on job {info.run_id[:8]}: {','.join(spec.kinds)}, every "
          f"{every:g} s ({spread}), seed {seed}", flush=True)
    result = chaos_run.run(info, spec, lambda line: print(line, flush=True))
    rows, overall = chaos.summary(result.faults, result.injected, result.window_s)
    print("\n".join(chaos.summary_lines(rows, overall, result.window_s)), flush=True)
    if result.error is not None:
        raise result.error
    if result.unsettled or (result.stopped and count and len(result.injected) < count):
        raise control.JobGone(f"job {info.run_id[:8]} ended before the chaos completed "
                              f"({len(result.injected)} drills sent, {result.unsettled} "
                              "faults not settled)", hint="see its log directory for why")
    if result.stopped:
        print(f"ftrun: chaos: {result.stopped}; every fault it sent had settled", flush=True)


def _agent_for_drill(agents: list[control.RunInfo], rank: int | None
                     ) -> tuple[control.RunInfo, Status]:
    """The agent to send the drill to, and the job's document: a rank's drill goes to the
    agent of the node that runs the rank when several agents of the job share this host."""
    info = agents[0]
    doc = control.status(info)
    if rank is None or len(agents) == 1:
        return info, doc
    nodes = {w.node or 0 for w in doc.workers if w.rank == rank}
    if len(nodes) != 1:
        return info, doc  # not running now: the job's agent says so
    info = control.agent_of_node(agents, nodes.pop())
    return info, control.status(info)


def _wait_for_recoveries(info: control.RunInfo, before: int,
                         count: int) -> tuple[list[Fault], bool]:
    """The drill's faults once each is recovered or decided (or DRILL_WAIT_S passed), and
    whether the job ended before that."""
    deadline = time.monotonic() + DRILL_WAIT_S
    faults: list[Fault] = []
    while time.monotonic() < deadline:
        try:
            faults = list(control.status(info).faults[before:])
        except control.JobGone:
            return faults, True
        except FtrunError:
            pass  # busy or shutting down: the next try tells which
        else:
            if len(faults) >= count and all(f.settled for f in faults):
                return faults, False
        time.sleep(0.2)
    return faults, False


def xid_is_benign(xid: int | None) -> bool:
    """An XID that fails no GPU (an application error, info): no recovery to wait for."""
    return xid is None or classify(None, _Sample(), (xid,)).health is not Health.FAILED
