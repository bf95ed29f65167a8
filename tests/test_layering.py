"""Each layer imports only from layers below it; the worker side and `status` stay light."""
import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).parent.parent / "ftrun"

LAYERS = [  # lowest first
    {"errors", "timeouts", "spec", "states", "exits", "_exit", "xid", "faultkinds"},
    {"policy", "gpuhealth", "membership"},
    {"procs", "store", "logs", "report", "rendezvous", "progress", "control", "gpu", "wakeup",
     "workerspec", "_run_path", "cluster", "slots"},
    {"comm", "joining", "worker", "transfer", "buckets", "rng", "loader", "drills", "waits",
     "aligning"},
    {"journal", "jobview", "roster", "ports", "nodehooks", "recovery", "observe", "health",
     "agent", "coordinator", "follower"},
    {"cli", "commands", "launch_args", "render", "__main__", "__init__"},
]
WORKER_SIDE = {"comm", "joining", "worker", "transfer", "buckets", "rng", "loader", "drills",
               "waits", "aligning"}
HEAVY_FOR_WORKERS = {"typer", "rich", "pynvml", "psutil"}


def layer_of(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if module in names:
            return i
    raise AssertionError(f"ftrun/{module}.py is in no layer: add it to LAYERS")


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "ftrun":
                found.update(f"ftrun.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_layers_import_only_downwards() -> None:
    for path in PKG.glob("*.py"):
        me = path.stem
        for imp in imports_of(path):
            if imp.startswith("ftrun.") and imp.count(".") == 1:
                other = imp.split(".")[1]
                if me == "__init__" or other == me:
                    continue
                assert layer_of(other) <= layer_of(me), f"{me} imports {other} (upwards)"


def _graph() -> dict[str, set[str]]:
    """Module -> the ftrun modules it imports anywhere: at the top, in a function, or only
    for type checking (a type-only import back is still a circle in the design)."""
    graph: dict[str, set[str]] = {}
    for path in PKG.glob("*.py"):
        deps = {imp.split(".")[1] for imp in imports_of(path)
                if imp.startswith("ftrun.") and imp.count(".") == 1}
        graph[path.stem] = deps - {path.stem}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle_anywhere_type_only_imports_included() -> None:
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # it can fail


def test_no_helper_of_the_agent_holds_an_agent() -> None:
    graph = _graph()
    for helper in ("recovery", "health", "observe", "slots", "ports", "jobview", "journal"):
        assert not graph[helper] & {"agent", "nodehooks", "coordinator", "follower"}, helper


def test_worker_side_never_imports_launcher_or_ui() -> None:
    for me in WORKER_SIDE:
        path = PKG / f"{me}.py"
        if not path.exists():
            continue
        roots = {imp.split(".")[0] for imp in imports_of(path)}
        assert not roots & HEAVY_FOR_WORKERS, f"{me} imports {roots & HEAVY_FOR_WORKERS}"
        assert "ftrun.agent" not in imports_of(path) and "ftrun.cli" not in imports_of(path)


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60)
    return set(out.stdout.split())


def test_import_ftrun_is_light() -> None:
    mods = _modules_after("import ftrun")
    assert not {"torch", "typer", "rich", "pynvml"} & mods


def test_cli_module_does_not_import_torch() -> None:
    mods = _modules_after("import ftrun.cli, ftrun.launch_args")
    assert "torch" not in mods
