"""The rooms' import rule (docs/ARCHITECTURE.md "Rooms"): nothing below commands/ imports it, and
trainer/ and tasks/ never import collab_app. Lazy imports inside functions count too."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_no_arrow_from_a_lower_room_to_commands():
    bad = []
    for room in ("collab_app/engines", "collab_app/online", "collab_app/web", "trainer", "tasks"):
        for f in (ROOT / room).rglob("*.py"):
            for m in imports_of(f):
                if m.startswith("collab_app.commands"):
                    bad.append(f"{f.relative_to(ROOT)} imports {m}")
    assert bad == [], bad


def test_trainer_and_tasks_know_nothing_of_collab_app():
    bad = [f"{f.relative_to(ROOT)} imports {m}" for room in ("trainer", "tasks") for f in (ROOT / room).rglob("*.py")
           for m in imports_of(f) if m.startswith("collab_app")
           and not (f.name == "sandbox.py" and m == "collab_app.online.cpushare")]   # its one documented lazy import
    assert bad == [], bad
