"""The rooms' import rules (docs/ARCHITECTURE.md "Rooms"), drawn from the code's own imports,
lazy ones inside functions included: rooms import downward only, no module imports itself back
through others, trainer/ and tasks/ know nothing of collab_app, the machine room (collab_app/cpu)
is a leaf, and only the entry points start the CPU split, the lending and the process settings.
No exception is written into a rule."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("collab_app", "trainer", "tasks")
# top to bottom: a module may import its own room and the rooms below it
ROOMS = ("entry", "collab_app.commands", "collab_app.web", "collab_app.online", "collab_app.engines", "trainer", "tasks",
         "base", "collab_app.cpu")
ENTRY = {"collab_app.cli", "app"}
BASE = {"collab_app", "collab_app.paths", "collab_app.secret_env"}
# what starts the split, the lending and the process-wide settings: entry points only
STARTERS = {"apply_to_serving", "lend_trainer_cores", "pinned_command", "pin_and_exec", "prepare",
            "huge_pages_for_serving", "set_cpu_budget", "prepare_process", "prepare_serving_process", "training_load"}
ENTRY_FILES = ("collab_app/cli.py", "app.py", "collab_app/web/serve.py", "collab_app/commands/", "collab_app/cpu/")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    found["app"] = ROOT / "app.py"
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules `path` imports (`from P import m` names module P.m where that is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def room(mod: str) -> str:
    if mod in ENTRY:
        return "entry"
    if mod in BASE:
        return "base"
    return next(r for r in ROOMS if mod == r or mod.startswith(r + "."))


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(p, known) - {m} for m, p in known.items()}


def test_every_module_has_a_room():
    assert [m for m in modules() if not any(m == r or m.startswith(r + ".") for r in ROOMS) and m not in ENTRY | BASE] == []


def test_rooms_import_downward_only():
    g = graph()
    up = [f"{a} ({room(a)}) imports {b} ({room(b)})" for a, targets in g.items() for b in targets
          if ROOMS.index(room(b)) < ROOMS.index(room(a))]
    assert up == [], up


def test_trainer_and_tasks_know_nothing_of_collab_app():
    g = graph()
    bad = [f"{a} imports {b}" for a, targets in g.items() if room(a) in ("trainer", "tasks")
           for b in targets if b.startswith("collab_app")]
    assert bad == [], bad


def test_the_machine_room_is_a_leaf():
    g = graph()
    bad = [f"{a} imports {b}" for a, targets in g.items() if room(a) == "collab_app.cpu"
           for b in targets if room(b) != "collab_app.cpu"]
    assert bad == [], bad


def test_no_import_circle():
    """Tarjan's strongly connected components over the module graph: none larger than one module."""
    g = graph()
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in list(g):
        if v not in index:
            visit(v)
    assert circles == [], circles


def test_only_the_entry_points_start_the_split_the_lending_and_the_process_settings():
    bad = []
    for mod, path in modules().items():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(ENTRY_FILES) or rel == "app.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name in STARTERS:
                    bad.append(f"{rel}:{node.lineno} calls {name}")
    assert bad == [], bad


def test_importing_the_package_runs_nothing():
    """The package face and the engines' face hold no statements beyond imports and constants."""
    for face in ("collab_app/__init__.py", "collab_app/engines/__init__.py", "collab_app/cpu/__init__.py"):
        body = ast.parse((ROOT / face).read_text()).body
        calls = [n.lineno for n in body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign))
                 and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert calls == [], f"{face}: statements at lines {calls}"
