"""Packages import only from packages below them, no module imports in a circle (type-only
imports included), the worker side and `ftrun status` stay light."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).parent.parent / "ftrun"

LAYERS = [  # packages, lowest first; a package may import itself and those below it
    {"core"},
    {"protocol", "gpu"},
    {"adapters"},
    {"worker"},
    {"integrations"},  # inside a worker, over a framework's loop (Lightning, Transformers)
    {"agent"},
    {"cluster"},
    {"cli"},
]
NEVER = {  # beside the layering: what a package must not import although it is lower
    "agent": {"worker", "integrations"},  # the agent never loads the worker library (nor
    "cluster": {"worker", "integrations"},  # torch with it)
    "cli": {"integrations"},
}
HEAVY_FOR_WORKERS = {"typer", "rich", "pynvml", "psutil"}
# the zygote is a process of the launcher's: it may read itself through psutil (its threads,
# its memory, the core count a forked worker's pools default to); a script's ftrun never does
ZYGOTE_MAY_USE = {"ftrun.worker.zygote": {"psutil"}, "ftrun.worker.forked": {"psutil"}}
STDLIB_ONLY = {"core"}


def package_of(module: str) -> str:
    """ftrun.agent.node and ftrun.agent -> agent; ftrun and ftrun.__main__ -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PKG / parts[1]).is_dir() else ""


def layer_of(package: str) -> int:
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    raise AssertionError(f"ftrun/{package}/ is in no layer: add it to LAYERS")


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports: at the top, in a function, or only for type checking."""
    found: set[str] = set()
    known = modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if f"{node.module}.{a.name}" in known)  # from ftrun.core import x
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        if path.name == "__init__.py":
            continue  # a package's docstring file: importing a module runs it first
        deps = {imp for imp in imports_of(path) if imp in known}
        graph[name] = {d for d in deps if known[d].name != "__init__.py"} - {name}
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


def test_every_module_lives_in_a_layered_package() -> None:
    for name in modules():
        if name not in ("ftrun", "ftrun.__main__"):
            layer_of(package_of(name) or name.split(".")[1])


MODULE_LINES_MAX = 400  # a module holds one idea a reader takes in at once


def test_every_module_is_at_most_400_lines() -> None:
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MODULE_LINES_MAX}
    assert long == {}, f"split these by idea, not by trimming: {long}"


def _assigned(tree: ast.AST) -> list[ast.expr]:
    targets: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets += node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets.append(node.target)
    flat: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets += t.elts
        else:
            flat.append(t)
    return flat


FROM_THE_AGENT_UP = ("agent", "cluster", "cli")  # the packages that hold the agent's objects


def _names_in(expr: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


def _held_records(tree: ast.Module, classes: set[str]) -> set[str]:
    """Attributes of `self` annotated as holding objects of a class the module defines
    (`self.faults: list[FaultRecord]`): what a loop over them yields is the module's own."""
    return {t.attr for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
            and isinstance(t := n.target, ast.Attribute)
            and isinstance(t.value, ast.Name) and t.value.id == "self"
            and _names_in(n.annotation) & classes}


def _own_objects(fn: ast.FunctionDef | ast.AsyncFunctionDef, classes: set[str],
                 held: set[str]) -> set[str]:
    """The names in `fn` bound to an object the module may change: itself (`self`, `cls`),
    a parameter annotated with a class the module defines, a local it builds from one (or
    from `cls`), what it takes out of its own collections of them (`for rec in self.faults`),
    or argparse's namespace it parsed (the parser's scratch, normalized before it becomes a
    spec)."""
    own = {"self", "cls"}
    args = fn.args
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        ann = a.annotation
        name = ann.id if isinstance(ann, ast.Name) else (
            ann.value if isinstance(ann, ast.Constant) else None)
        if name in classes:
            own.add(a.arg)

    def of_own_collection(expr: ast.expr) -> bool:  # self.x, enumerate(self.x)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.args:
            expr = expr.args[0]
        return (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name)
                and expr.value.id == "self" and expr.attr in held)

    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(call := node.value, ast.Call) and (
                (isinstance(call.func, ast.Name) and call.func.id in classes | {"cls"})
                or (isinstance(call.func, ast.Attribute) and call.func.attr == "parse_args")):
            own.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.Assign) and of_own_collection(node.value):
            own.update(*(_names_in(t) for t in node.targets))
        elif isinstance(node, (ast.For, ast.comprehension)) and of_own_collection(node.iter):
            own.update(_names_in(node.target))
    return own


def _writes_to_others(tree: ast.Module) -> list[ast.Attribute]:
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    held = _held_records(tree, classes)
    found: list[ast.Attribute] = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own = _own_objects(fn, classes, held)
            found += [t for t in _assigned(fn) if isinstance(t, ast.Attribute)
                      and not (isinstance(t.value, ast.Name) and t.value.id in own)]
    return found


def test_from_the_agent_up_an_object_changes_only_itself() -> None:
    """The seams are one-way: in agent/, cluster/ and cli/ an attribute is assigned only on
    `self` or on an object of a class the same module defines; the agent's records (a worker,
    a node, a remote worker, the hosted store, the supervise loop's outcome) and other
    modules' objects are told what happened through their methods (`Worker.ended`,
    `Node.gone`, `RemoteWorker.ended`, `Outcome.decide`, `ReplicaGroups.taken_out`, ...),
    never written (#49: 17 writes of the agent's attributes; then 18 of its records and of
    other modules' objects above the agent: `node.alive = False`, `w.exit = ...`; then 20
    inside the agent: `outcome.decision = ...`, `self.groups.out_since = ...`,
    `control_plane.membership = ...`, `workers.on_exit = ...`)."""
    writes = [f"{path.name}:{t.lineno}: {ast.unparse(t)}" for name, path in modules().items()
              if package_of(name) in FROM_THE_AGENT_UP
              for t in _writes_to_others(ast.parse(path.read_text()))]
    assert writes == []


IN_PLACE = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "add",
            "discard", "setdefault", "sort", "reverse"}
NOT_STATE = {"environ", "store"}  # the process's environment, a TCPStore's counters (remote)


def _root_and_depth(expr: ast.expr) -> tuple[str | None, int]:
    depth = 0
    while isinstance(expr, ast.Attribute):
        expr, depth = expr.value, depth + 1
    return (expr.id if isinstance(expr, ast.Name) else None), depth


def _changed_in_place(tree: ast.Module) -> list[str]:
    """Containers changed where they live (`x.items.append(...)`, `x.table[k] = ...`) on an
    object the module does not own, or one attribute further (`self.spares.refills.append`)."""
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    held = _held_records(tree, classes)
    found: list[str] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        own = _own_objects(fn, classes, held)
        for node in ast.walk(fn):
            changed: list[ast.expr] = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in IN_PLACE:
                changed.append(node.func.value)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = [node.target] if isinstance(node, ast.AugAssign) else node.targets
                changed += [t.value for t in targets if isinstance(t, ast.Subscript)]
            for c in changed:
                root, depth = _root_and_depth(c)
                if isinstance(c, ast.Attribute) and c.attr not in NOT_STATE and (
                        root not in own or depth >= 2):
                    found.append(f"{c.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_from_the_agent_up_no_object_changes_anothers_container() -> None:
    """The same rule for what an object holds: another module's list, set or table is
    changed through its owner's methods (`Spares.refill`, `Membership.said_hello`,
    `ReplicaGroups.take_joiners_to_start`), not in place (#49: `self.spares.refills.append`,
    `ms.api_users.add`, `redo` appending to the pool's lists it was handed)."""
    changed = [f"{path.name}:{line}" for name, path in modules().items()
               if package_of(name) in FROM_THE_AGENT_UP
               for line in _changed_in_place(ast.parse(path.read_text()))]
    assert changed == []


def _is_a_role(expr: ast.expr) -> bool:
    """`coord`, `cluster`, `role` or `x.cluster`: a role (agent/cluster.Cluster) held by
    another object."""
    if isinstance(expr, ast.Name):
        return expr.id in ("coord", "cluster", "role", "follower")
    return isinstance(expr, ast.Attribute) and expr.attr == "cluster"


def test_no_module_assigns_an_attribute_of_a_role_it_holds() -> None:
    """A role changes its own state: adopting a running attempt tells the coordinating role
    what it found (`Coordinating.decided`, `JobDirectory.ranked_as`) instead of writing its
    members, ranks and pending decision (#49: cluster/adoption.py wrote its members and pending
    decision, and each remote worker's rank)."""
    writes = [f"{path.name}:{t.lineno}" for name, path in modules().items()
              for t in _assigned(ast.parse(path.read_text()))
              if isinstance(t, ast.Attribute) and _is_a_role(t.value)]
    assert writes == []


def test_only_the_agents_loop_drives_a_role() -> None:
    """One loop at the top swaps roles on what `drive` returns (`agent.node.Agent.run`): no
    role drives the next from inside its own run (#49: a takeover ran the rest of the job
    nested in the follower's frame, through `Agent.take_over`)."""
    drives = [f"{path.name}:{node.lineno}" for name, path in modules().items()
              if name != "ftrun.agent.node"
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("drive", "take_over")]
    assert drives == []


SCRIPTS = PKG.parent / "scripts"
ACROSS_SCRIPT_FOLDERS = {("soak", "bench_recovery_worker")}  # the benchmarks' model, by path


def test_scripts_import_only_their_own_folder_and_in_no_circle() -> None:
    """scripts/ is grouped by purpose (bench, sim, soak, gpu): a script imports its own
    folder's modules, never another folder's (one named exception), and none in a circle
    (#49: bench_node_loss.py and bench_partition.py imported each other)."""
    folder_of = {p.stem: p.parent.name for p in SCRIPTS.glob("*/*.py")}
    graph: dict[str, set[str]] = {}
    across = []
    for path in SCRIPTS.glob("*/*.py"):
        mine = {m.split(".")[0] for m in imports_of(path)} & set(folder_of)
        graph[path.stem] = mine - {path.stem}
        across += [(path.parent.name, m) for m in mine if folder_of[m] != path.parent.name]
    assert set(across) <= ACROSS_SCRIPT_FOLDERS, across
    assert _cycle(graph) is None, _cycle(graph)


def test_every_event_is_emitted_as_its_record() -> None:
    """`emit_as(sink, XFields(...))` or `notice(sink, text)`, never `emit(Event.X, {...})`:
    a misspelt or missing field is a type error, not a line the journal cannot fold (#49:
    56 of 61 emits passed dict literals)."""
    loose = []
    for name, path in modules().items():
        if name == "ftrun.core.events":
            continue  # emit_as itself
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and len(node.args) >= 2
                    and isinstance(kind := node.args[0], ast.Attribute)
                    and isinstance(kind.value, ast.Name) and kind.value.id == "Event"
                    and not (isinstance(node.func, ast.Name) and node.func.id == "fields_of")):
                loose.append(f"{path.name}:{node.lineno}")
    assert loose == []


def test_packages_import_only_downwards() -> None:
    for name, path in modules().items():
        me = package_of(name)
        if not me:
            continue
        for imp in imports_of(path):
            other = package_of(imp) if imp.startswith("ftrun.") else ""
            if not other or other == me:
                continue
            assert layer_of(other) <= layer_of(me), f"{name} imports {imp} (upwards)"
            assert other not in NEVER.get(me, set()), f"{name} imports {imp}"


def test_the_core_imports_only_the_standard_library() -> None:
    for name, path in modules().items():
        if package_of(name) in STDLIB_ONLY:
            roots = {imp.split(".")[0] for imp in imports_of(path)} - {"__future__"}
            outside = {r for r in roots if r not in sys.stdlib_module_names and r != "ftrun"}
            assert not outside, f"{name} imports {outside}"
            assert all(package_of(i) == "core" for i in imports_of(path)
                       if i.startswith("ftrun.")), name


def test_no_import_cycle_anywhere_type_only_imports_included() -> None:
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # it can fail


def test_no_helper_of_the_agent_holds_an_agent() -> None:
    graph = _graph()
    agents = {"ftrun.agent.node", "ftrun.cluster.coordinating", "ftrun.cluster.following"}
    for helper in ("recovery", "replica_groups", "generations", "watch", "control_plane",
                   "ports", "jobview", "journal", "cluster", "workers", "services"):
        assert not graph[f"ftrun.agent.{helper}"] & agents, helper
    for helper in ("host", "jobnodes", "rejoin", "coordinating", "following"):
        assert "ftrun.agent.node" not in graph[f"ftrun.cluster.{helper}"], helper


def _classes() -> list[tuple[str, ast.ClassDef]]:
    return [(name, node) for name, path in modules().items()
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]


def _base_names(cls: ast.ClassDef) -> set[str]:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases
            if isinstance(b, ast.Name | ast.Attribute)}


def subclasses_of_the_agent(classes: list[tuple[str, ast.ClassDef]]) -> list[str]:
    """Classes whose bases include the agent, or a class that does (transitively)."""
    agentish = {"Agent"}
    grew = True
    while grew:
        found = {c.name for _, c in classes if _base_names(c) & agentish}
        grew = not found <= agentish
        agentish |= found
    return sorted(f"{m}.{c.name}" for m, c in classes if _base_names(c) & agentish)


def stubbed_mixins(classes: list[tuple[str, ast.ClassDef]]) -> list[str]:
    """Classes with a method whose body raises NotImplementedError (a Protocol's `...` is
    not one): a mixin that leans on its host class's methods."""
    out = []
    for module, cls in classes:
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and any(
                    isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n)
                    for n in ast.walk(fn)):
                out.append(f"{module}.{cls.name}.{fn.name}")
    return out


def test_nothing_subclasses_the_agent_and_no_mixin_carries_stubs() -> None:
    classes = _classes()
    assert subclasses_of_the_agent(classes) == []
    assert stubbed_mixins(classes) == []
    # both checks can fail
    fake = ast.parse("class NodeTable(Agent): pass\nclass Coordinator(NodeTable): pass\n"
                     "class Hooks:\n    def spawn(self):\n        raise NotImplementedError\n")
    fakes = [("x", c) for c in fake.body if isinstance(c, ast.ClassDef)]
    assert subclasses_of_the_agent(fakes) == ["x.Coordinator", "x.NodeTable"]
    assert stubbed_mixins(fakes) == ["x.Hooks.spawn"]


def test_the_cli_face_does_not_load_the_worker_library() -> None:
    mods = _modules_after("import ftrun.cli.main")
    assert not {m for m in mods if m.startswith("ftrun.worker")}, \
        sorted(m for m in mods if m.startswith("ftrun.worker"))


def test_worker_side_never_imports_launcher_or_ui() -> None:
    """The worker library and the integrations run in a user's training process."""
    for name, path in modules().items():
        if package_of(name) not in ("worker", "integrations"):
            continue
        roots = {imp.split(".")[0] for imp in imports_of(path)}
        heavy = roots & HEAVY_FOR_WORKERS - ZYGOTE_MAY_USE.get(name, set())
        assert not heavy, f"{name} imports {heavy}"


def test_a_scripts_worker_api_loads_nothing_heavy() -> None:
    mods = _modules_after("import ftrun\nftrun.init")
    assert "ftrun.worker.api" in mods and not HEAVY_FOR_WORKERS & mods


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60)
    return set(out.stdout.split())


STATUS_PATH_BOUND = 26  # ftrun modules behind `ftrun status` (19 when this was written; 25 with
# core.options, the enums a spec holds; 26 with core.leaving, the command's exit)


def test_import_ftrun_is_light_and_its_face_is_lazy() -> None:
    mods = _modules_after("import ftrun")
    assert not {"torch", "typer", "rich", "pynvml", "psutil"} & mods
    assert {m for m in mods if m.startswith("ftrun")} == {"ftrun"}  # no worker module yet
    mods = _modules_after("import ftrun, ftrun.worker.api as api\n"
                          "assert ftrun.init is api.init and ftrun.FaultTolerant is "
                          "api.FaultTolerant\nfrom ftrun import init")
    assert "ftrun.worker.api" in mods


def test_the_status_path_loads_no_torch_worker_or_agent_module() -> None:
    """What `ftrun status` and `ftrun inject-fault` import: the CLI's entry and its commands.
    The request types live in protocol.control_ops, not in the agent's control plane."""
    mods = _modules_after("import ftrun.cli.main, ftrun.cli.commands")
    assert not {"torch", "pynvml", "psutil"} & mods
    ours = {m for m in mods if m.startswith("ftrun")}
    below = {m for m in ours if package_of(m) in ("worker", "agent", "cluster")}
    assert not below, sorted(below)
    assert len(ours) <= STATUS_PATH_BOUND, sorted(ours)


def test_cli_module_does_not_import_torch() -> None:
    mods = _modules_after("import ftrun.cli.main, ftrun.cli.launch_args")
    assert "torch" not in mods


# fakes of a protocol: mypy checks they fit it
TYPED_TESTS = ["tests/test_recovery_core.py", "tests/fakes.py", "tests/fakestore.py",
               "tests/test_cluster_units.py", "tests/test_following_units.py",
               "tests/test_watch_units.py", "tests/test_replica_groups_recovery.py",
               "tests/test_nodeport.py"]


@pytest.mark.slow  # a cold mypy reads the whole package: ~20 s of CPU
def test_the_fakes_of_the_ports_type_check() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml",
                        *TYPED_TESTS], capture_output=True, text=True, timeout=300,
                       cwd=PKG.parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-1000:]
