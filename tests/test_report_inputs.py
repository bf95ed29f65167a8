"""`ftrun report` on a log directory someone else wrote: crafted and malformed lines.

Every malformed line is left out and counted (no "internal error", no NaN in the picture, no
RecursionError); every text that reaches the page is escaped; nothing from the log drives
the terminal.
"""
import json
import re
from pathlib import Path

import pytest

from ftrun.cli import picture, runreport
from ftrun.cli.loglines import line_problem
from ftrun.cli.main import main

SCRIPT = "</title></polyline><script>alert(1)</script><polyline>"
GOOD_EVENTS = [
    {"t": 100.0, "event": "started", "attempt": 0, "world_size": 2},
    {"t": 101.0, "event": "fault", "worker": 1, "rank": 1, "why": f"<b>{SCRIPT}",
     "decision": "replace", "reason": "r", "detected_at": 101.01},
    {"t": 101.02, "event": "generation", "generation": 1, "world_size": 2, "urgent": True,
     "published_at": 101.02, "reason": "r"},
    {"t": 101.3, "event": "recovered", "generation": 1, "first_commit": 101.3, "step": 5},
    {"t": 102.0, "event": "restart", "attempt": 1,
     "reason": "[bold red]shout[/] \x1b]0;retitled\x07 \x1b[2J"},
]
BAD_EVENTS = [  # each is one line that once ended in "internal error" or worse
    "[1, 2]", '"a string"', "7", "null", "{}",
    '{"t": "soon", "event": "started"}',
    '{"t": NaN, "event": "started"}',
    '{"t": Infinity, "event": "started"}',
    '{"t": 1e308, "event": "started"}',
    '{"t": 100.5, "event": 5}',
    '{"t": 100.5, "event": "fault", "worker": "x", "rank": 0, "decision": "d", "reason": "r"}',
    '{"t": 100.5, "event": "fault", "worker": 1.5, "rank": 0, "decision": "d", "reason": "r"}',
    '{"t": 100.5, "event": "fault", "worker": 1, "decision": "d", "reason": "r"}',
    '{"t": 100.5, "event": "fault", "worker": 1, "rank": 0, "decision": [], "reason": "r"}',
    '{"t": 100.5, "event": "generation", "generation": 1, "urgent": true, '
    '"published_at": 100.5}',
    '{"t": 100.5, "event": "recovered", "generation": "1"}',
    '{"t": 100.5, "event": "resumed", "step": 3}',
    '{"t": 100.5, "event": "snapshot", "step": "ten", "blocking_ms": NaN}',
    '{"t": 100.5, "event": "injected", "worker": 1, "kind": "kill", "at": -Infinity}',
    "[" * 100_000 + "]" * 100_000,
    '{"t": 100.5, "event": "started", "world_size": true}',
    '{"t": 103.0, "event": "cut off',
]
GOOD_SAMPLES = [{"t": t, "world_size": 2, "step_max": s, "step_min": s - 1,
                 "steps": {"0": s, "1": s - 1}} for t, s in ((100.5, 1), (101.5, 6), (102.5, 9))]
GOOD_SAMPLES.append({"t": 102.8, "world_size": 2, "step_max": 10})  # no per-rank steps
BAD_SAMPLES = [
    json.dumps({"t": 101.0, "world_size": 2, "steps": {SCRIPT: 3}}),
    '{"t": "x", "world_size": 2}', '{"t": NaN, "world_size": 2}',
    '{"t": 101.0, "steps": [1, 2]}', '{"t": 101.0, "steps": {"0": "3"}}',
    '{"t": 101.0, "steps": {"0": NaN}}', '{"t": 101.0, "world_size": "2"}',
    '{"t": 101.0, "step_max": 1.5}', "[]", "{" * 50_000,
]


def crafted_run(tmp_path: Path) -> Path:
    run = tmp_path / f"job_{SCRIPT.replace('/', '|')}"  # the title is the directory's name
    run.mkdir()
    events = [json.dumps(e) for e in GOOD_EVENTS]
    lines = events[:2] + BAD_EVENTS[:11] + events[2:] + BAD_EVENTS[11:]
    (run / "events.jsonl").write_text("\n".join(lines) + "\n")
    samples = [json.dumps(s) for s in GOOD_SAMPLES]
    (run / "timeline.jsonl").write_text("\n".join(samples[:1] + BAD_SAMPLES + samples[1:])
                                        + "\n")
    return run


@pytest.mark.parametrize("raw", [r for r in BAD_EVENTS if r[:2] != "[[" and r[-3:] != "off"])
def test_each_malformed_event_line_that_parses_has_a_reason(raw: str) -> None:
    assert line_problem(json.loads(raw), timeline=False) is not None


def test_a_crafted_log_is_reported_with_its_bad_lines_counted_and_nothing_live(
        tmp_path: Path, capsys, private_run_dir) -> None:
    run = crafted_run(tmp_path)
    out = tmp_path / "r.html"
    assert main(["report", str(run), "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert "internal error" not in captured.err and captured.err == ""
    rep = json.loads(captured.out)
    assert rep["skipped_lines"]["events.jsonl"]["count"] == len(BAD_EVENTS)
    assert rep["skipped_lines"]["events.jsonl"]["first"].startswith("line 3: not a JSON object")
    assert rep["skipped_lines"]["timeline.jsonl"]["count"] == len(BAD_SAMPLES)
    assert rep["summary"]["faults"] == 1 and rep["world_sizes"] == [2]  # the good lines count
    assert rep["last_step"] == 10 and rep["fault_markers"] == 1

    page = out.read_text()
    assert "<script" not in page.lower() and "<b>" not in page
    assert "&lt;script&gt;" in page  # the fault's kind, shown as text
    assert not re.search(r"\b(nan|inf)\b", page, re.IGNORECASE)
    # ranks 0 and 1, and the step_max-only sample's line: the crafted rank's was left out
    assert page.count('class="rank"') == 3

    assert main(["report", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "\x07" not in printed
    assert "[bold red]shout[/]" in printed  # shown as written, not as markup
    assert "skipped 22 malformed lines of events.jsonl (the first, line 3: not a JSON " \
           "object but list)" in printed
    assert f"skipped {len(BAD_SAMPLES)} malformed lines of timeline.jsonl" in printed


def test_every_text_that_reaches_the_page_is_escaped(tmp_path: Path) -> None:
    chart = picture.Chart(seconds=2.0, series={SCRIPT: [(0.0, 1), (1.0, 2)]},
                          world=[(0.0, 2)], faults=[picture.FaultMark(
                              0.5, SCRIPT, (("detected", 0.5, 0.6),), True)],
                          restarts=[], snapshots=[(1.0, 3)], top_step=2, top_world=2)
    out = tmp_path / "p.html"
    assert picture.write_html(chart, str(out), SCRIPT) == 1
    page = out.read_text()
    assert "<script" not in page and page.count("&lt;script&gt;alert(1)") == 5


def test_a_report_of_a_run_with_only_bad_lines_is_empty_not_an_error(tmp_path: Path) -> None:
    run = tmp_path / "job_x"
    run.mkdir()
    (run / "events.jsonl").write_text('{"t": NaN, "event": "started"}\n[]\n')
    rec = runreport.load_run(str(run))
    rep = runreport.build_report(rec)
    assert rep["summary"]["faults"] == 0 and rep["skipped_lines"]["events.jsonl"]["count"] == 2
    assert picture.write_html(picture.chart_of(rec), str(tmp_path / "p.html"), "t") == 0


@pytest.mark.parametrize("line", [
    {"t": 100.0, "event": "fault", "worker": 1, "rank": 1, "decision": 3, "reason": "x"},
    {"t": 100.0, "event": "healed", "worker": 1},  # a kind the field table does not check
    {"t": 100.0, "event": "drain", "drain": "one"},
])
def test_a_line_that_is_not_its_kinds_record_is_left_out_not_an_error(line: dict) -> None:
    """The replay reads each folded line as its record (core.events): a line the field table
    lets through but that is no such record ended `ftrun report` with an error."""
    from ftrun.agent.journal import Journal

    assert line_problem(line, timeline=False) is not None
    good = {"t": 100.0, "event": "fault", "worker": 1, "rank": 1, "decision": "replace",
            "reason": "x"}
    assert line_problem(good, timeline=False) is None
    assert len(Journal.replay([good]).faults) == 1
