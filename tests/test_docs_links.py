"""The README and the pages under docs/ hold together: every relative link reaches a file, every
`#anchor` a heading of it (GitHub's slugs), the README stays short, keeps the two set-up lines
`.ci/run` greps, and names every flag the real command line offers. Fast: no torch, no process."""
import re
from pathlib import Path

import typer.main

from ftrun.cli.commands import app
from ftrun.cli.launch_args import build_parser

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.md"))]
README_MAX_LINES = 200  # read in five minutes; the rest belongs in docs/

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is no heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    times: dict[str, int] = {}  # a repeated heading gets -1, -2, ... as on GitHub
    for line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = times[base] = times.get(base, -1) + 1
            found.add(f"{base}-{n}" if n else base)
    return found


def links(path: Path) -> list[str]:
    return [target for line in prose_lines(path.read_text())
            for target in LINK.findall(CODE_SPAN.sub("", line))]


def broken_links(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def test_the_slugs_are_githubs() -> None:
    assert slug("Healing: streamed, striped, bounded memory") == \
        "healing-streamed-striped-bounded-memory"
    assert slug("Re-forming the communicator: `--comm`") == "re-forming-the-communicator---comm"
    assert slug("4. GPU health") == "4-gpu-health"
    assert slug("Partitions: the coordinator's side is the job") == \
        "partitions-the-coordinators-side-is-the-job"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "a.md"
    page.write_text("# Top\n## Top\n```\n# not a heading\n```\n[ok](#top) [no](#not-a-heading) "
                    "[2nd](#top-1) [gone](b.md) `[code](c.md)` [web](https://example.com)\n")
    assert broken_links(page) == ["#not-a-heading: no heading #not-a-heading in a.md",
                                  "b.md: no such file"]


def test_every_relative_link_and_anchor_resolves() -> None:
    bad = {str(p.relative_to(ROOT)): broken_links(p) for p in PAGES}
    assert not {k: v for k, v in bad.items() if v}


def reachable(start: Path) -> set[Path]:
    seen, todo = {start.resolve()}, [start]
    while todo:
        page = todo.pop()
        for target in links(page):
            dest = (page.parent / target.partition("#")[0]).resolve()
            if dest.suffix == ".md" and dest.exists() and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    return seen


def test_every_docs_page_is_reached_from_the_readme() -> None:
    unlinked = {p.resolve() for p in (ROOT / "docs").glob("*.md")} - reachable(README)
    assert not unlinked, (f"no link from the README (or a page it links) reaches "
                          f"{sorted(p.name for p in unlinked)}: add one to 'Where to read more'")


def test_the_readme_is_short_and_keeps_the_set_up_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES
    # .ci/run runs the first line of each kind: `grep -m1 '^pip install'` and the tests' line
    assert next(x for x in lines if x.startswith("pip install")) == "pip install -e '.[test]'"
    assert next(x for x in lines if x.startswith("python -m pytest")) == \
        "python -m pytest -n 2 --dist loadfile --no-loadscope-reorder"


def named(flag: str, text: str) -> bool:
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


def test_the_readme_names_every_flag_of_the_command_line() -> None:
    text = README.read_text()
    missing = [a.option_strings[0] for a in build_parser({})._actions
               if a.option_strings and a.dest != "help"
               and not any(named(f, text) for f in a.option_strings)]
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        assert named(f"ftrun {name}", text), name
        missing += [f"{name} {p.opts[0]}" for p in command.params
                    if p.opts[0].startswith("-") and p.name != "help"
                    and not any(named(o, text) for o in p.opts)]
    assert not missing, f"the README does not name {missing}"
