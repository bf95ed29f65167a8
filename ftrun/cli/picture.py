"""`ftrun report`'s picture: the committed step of every rank over time, the world size as a
band beneath it, each fault as a marker with its recovery phases shaded, restarts and
snapshots marked. A self-contained HTML file (inline SVG, no script, no network) by default,
or a PNG through matplotlib (the optional extra `ftrun[report]`). A log may come from anyone:
every text that reaches the page is escaped (`_e`), numbers are formatted as numbers.

Owns: `Chart`, the one model both writers draw (so both show the same marks), and the two
writers. Each returns how many fault markers it drew.
Must not import: torch, typer, rich, the agent; matplotlib only inside `write_png`.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftrun.cli.runreport import PHASE_ORDER, RunRecord
from ftrun.core.errors import UsageError

PHASE_COLOURS = {"detected": "#e15759", "published": "#f28e2b", "rebuilt": "#edc948",
                 "healed": "#59a14f", "first_commit": "#4e79a7", "restarted": "#b07aa1",
                 "resumed": "#9c755f"}
RANK_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
                "#ff9da7", "#9c755f", "#bab0ac")


@dataclass(frozen=True)
class FaultMark:
    t: float  # seconds after the run started
    label: str
    phases: tuple[tuple[str, float, float], ...]  # (phase, start s, end s), in order
    recovered: bool


@dataclass(frozen=True)
class Chart:
    seconds: float
    series: dict[str, list[tuple[float, int]]]  # rank -> (s, committed step)
    world: list[tuple[float, int]]  # (s, world size) where it changed
    faults: list[FaultMark]
    restarts: list[float]
    snapshots: list[tuple[float, int]]
    top_step: int
    top_world: int


def chart_of(run: RunRecord) -> Chart:
    t0 = run.t0
    series: dict[str, list[tuple[float, int]]] = {}
    world: list[tuple[float, int]] = []
    for line in run.timeline:
        t = float(line["t"]) - t0
        steps = line.get("steps") or {}
        if not steps and line.get("step_max") is not None:
            steps = {k: line[f"step_{k}"] for k in ("max", "min")
                     if line.get(f"step_{k}") is not None}
        for rank, step in steps.items():
            series.setdefault(str(rank), []).append((t, int(step)))
        if not world or world[-1][1] != int(line.get("world_size", 0)):
            world.append((t, int(line.get("world_size", 0))))
    faults = [FaultMark(f.at - t0, f"#{f.id} {f.kind} rank {f.rank}: {f.decision}"
                        + (f", {f.recovery_ms:.0f} ms" if f.recovery_ms is not None else ""),
                        _phases(f.at - t0, f.phases_ms), f.recovered) for f in run.faults]
    steps = [s for pts in series.values() for _, s in pts]
    return Chart(seconds=max(run.t1 - t0, 1e-3), series=series, world=world, faults=faults,
                 restarts=[float(e["t"]) - t0 for e in run.of_kind("restart")],
                 snapshots=[(float(e["t"]) - t0, int(e.get("step", 0)))
                            for e in run.of_kind("snapshot")],
                 top_step=max(steps, default=0), top_world=max((w for _, w in world), default=0))


def _phases(at: float, phases_ms: dict[str, float]) -> tuple[tuple[str, float, float], ...]:
    """Consecutive spans: each phase from the end of the one before to its own end."""
    out, start = [], at
    for name in PHASE_ORDER:
        if name in phases_ms:
            end = at + max(0.0, phases_ms[name]) / 1000
            out.append((name, start, max(start, end)))
            start = max(start, end)
    return tuple(out)


# ------------------------------------------------------------------ HTML (inline SVG)
W, H, LEFT, TOP, PLOT_H, BAND_H = 1000, 420, 60, 20, 300, 50


def write_html(chart: Chart, path: str, title: str) -> int:
    def x(t: float) -> float:  # seconds -> pixels
        return LEFT + (W - LEFT - 20) * t / chart.seconds

    def y(step: float) -> float:  # committed step -> pixels
        return TOP + PLOT_H - PLOT_H * step / max(chart.top_step, 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - 20}" height="{PLOT_H}" '
             'fill="none" stroke="#999"/>',
             f'<text x="{LEFT}" y="{TOP - 6}">committed step (0 to {chart.top_step})</text>']
    for fault in chart.faults:
        for name, a, b in fault.phases:
            parts.append(f'<rect class="phase phase-{name}" x="{x(a):.1f}" y="{TOP}" '
                         f'width="{max(1.5, x(b) - x(a)):.1f}" height="{PLOT_H}" '
                         f'fill="{PHASE_COLOURS[name]}" opacity="0.35"><title>{name} '
                         f'{(b - a) * 1000:.0f} ms</title></rect>')
    for i, (rank, pts) in enumerate(sorted(chart.series.items(), key=_rank_key)):
        line = " ".join(f"{x(t):.1f},{y(s):.1f}" for t, s in _held(pts, chart.seconds))
        parts.append(f'<polyline class="rank" points="{line}" fill="none" stroke-width="1.5" '
                     f'stroke="{RANK_COLOURS[i % len(RANK_COLOURS)]}"><title>rank {_e(rank)}'
                     '</title></polyline>')
    for t in chart.restarts:
        parts.append(f'<line class="restart" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{TOP}" '
                     f'y2="{TOP + PLOT_H}" stroke="#b07aa1" stroke-dasharray="6,3"/>')
    for t, step in chart.snapshots:
        parts.append(f'<path class="snapshot" d="M{x(t):.1f},{TOP + PLOT_H} l-4,8 h8 z" '
                     f'fill="#76b7b2"><title>snapshot of step {_e(step)}</title></path>')
    for fault in chart.faults:
        colour = "#e15759" if fault.recovered else "#000"
        parts.append(f'<g class="fault"><line x1="{x(fault.t):.1f}" x2="{x(fault.t):.1f}" '
                     f'y1="{TOP}" y2="{TOP + PLOT_H}" stroke="{colour}"/><path d="M'
                     f'{x(fault.t):.1f},{TOP} l-6,-10 h12 z" fill="{colour}"/><title>'
                     f'{_e(fault.label)}</title></g>')
    parts += _world_band(chart, x)
    parts.append(f'<text x="{LEFT}" y="{H - 4}">seconds (0 to {chart.seconds:.1f}); '
                 'shaded after each fault: ' + ", ".join(
                     f'<tspan fill="{c}">{n}</tspan>' for n, c in PHASE_COLOURS.items())
                 + "</text></svg>")
    doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}"
           f"</title></head><body><h3>{_e(title)}</h3>{''.join(parts)}"
           f"{_fault_list(chart)}</body></html>\n")
    with open(path, "w") as f:
        f.write(doc)
    return len(chart.faults)


def _world_band(chart: Chart, x: Callable[[float], float]) -> list[str]:
    base, top = TOP + PLOT_H + 20 + BAND_H, max(chart.top_world, 1)
    out = [f'<text x="4" y="{base - BAND_H / 2:.0f}">world</text>']
    for i, (t, size) in enumerate(chart.world):
        end = chart.world[i + 1][0] if i + 1 < len(chart.world) else chart.seconds
        h = BAND_H * size / top
        out.append(f'<rect class="world" x="{x(t):.1f}" y="{base - h:.1f}" '
                   f'width="{max(0.5, x(end) - x(t)):.1f}" height="{h:.1f}" fill="#bab0ac">'
                   f'<title>world size {_e(size)}</title></rect>')
    return out


def _fault_list(chart: Chart) -> str:
    rows = "".join(f"<li>+{f.t:.2f} s: {_e(f.label)} (" + ", ".join(
        f"{n} {(b - a) * 1000:.0f} ms" for n, a, b in f.phases) + ")</li>" for f in chart.faults)
    return f"<ol>{rows}</ol>" if rows else "<p>no faults</p>"


def _e(value: object) -> str:
    """Any value as text that cannot close an element or an attribute of the page."""
    return html.escape(str(value), quote=True)


def _held(points: list[tuple[float, int]], end: float) -> list[tuple[float, int]]:
    """A step line: the timeline writes a point when the step changes, so each value holds
    until the next point (a hang shows flat, not as a slope), the last one until `end`."""
    out: list[tuple[float, int]] = []
    for t, s in points:
        if out:
            out.append((t, out[-1][1]))
        out.append((t, s))
    if out:
        out.append((end, out[-1][1]))
    return out


def _rank_key(item: tuple[str, Any]) -> tuple[int, str]:
    return (int(item[0]), "") if item[0].isdigit() else (1 << 30, item[0])


# ------------------------------------------------------------------ PNG (matplotlib)
def write_png(chart: Chart, path: str, title: str) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise UsageError("a PNG picture needs matplotlib",
                         hint="pip install 'ftrun[report]', or use --out FILE.html") from None

    fig, (ax, band) = plt.subplots(2, 1, sharex=True, figsize=(11, 5.5),
                                   gridspec_kw={"height_ratios": [5, 1]})
    for fault in chart.faults:
        for name, a, b in fault.phases:
            ax.axvspan(a, max(b, a + chart.seconds / 2000), color=PHASE_COLOURS[name],
                       alpha=0.35, lw=0)
    for i, (rank, pts) in enumerate(sorted(chart.series.items(), key=_rank_key)):
        held = _held(pts, chart.seconds)
        ax.plot([t for t, _ in held], [s for _, s in held], lw=1.2, label=f"rank {rank}",
                color=RANK_COLOURS[i % len(RANK_COLOURS)])
    for t in chart.restarts:
        ax.axvline(t, color="#b07aa1", ls="--", lw=1)
    if chart.snapshots:
        ax.plot([t for t, _ in chart.snapshots], [0] * len(chart.snapshots), "^",
                color="#76b7b2", label="snapshot")
    drawn = 0
    for fault in chart.faults:
        ax.axvline(fault.t, color="#e15759" if fault.recovered else "black", lw=0.8)
        ax.plot([fault.t], [chart.top_step], "v", color="#e15759", ms=7)
        drawn += 1
    ax.set_ylabel("committed step")
    ax.set_title(title)
    ax.set_xlim(0, chart.seconds)
    handles = ax.get_legend_handles_labels()[0] + [
        Patch(color=c, alpha=0.35, label=n) for n, c in PHASE_COLOURS.items()]
    ax.legend(handles=handles, loc="lower right", fontsize=7, ncol=6)
    if chart.world:
        band.fill_between([t for t, _ in chart.world] + [chart.seconds],
                          [w for _, w in chart.world] + [chart.world[-1][1]], step="post",
                          color="#bab0ac")
    band.set_ylim(0, chart.top_world + 1)
    band.set_ylabel("world")
    band.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
