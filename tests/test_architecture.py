"""The intended import directions (ARCHITECTURE.md, DESIGN §3) hold, by parsing every import in
the package, lazy ones inside functions included; and every room and module ARCHITECTURE.md names
exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "adaflash"
# Modules at the package's first level that are not rooms: importable by every room, and they
# import no room themselves. ("adaflash" itself is the package root: its __version__.)
FLOOR = {"adaflash", "errors", "procs", "workloads", "reporting"}
ROOMS = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}

# room -> the rooms it may import (the floor always allowed). None: anything.
ALLOWED: dict[str, set[str] | None] = {
    "models": set(),
    "kernels": set(),
    "feedback": set(),
    "registry": {"feedback"},
    "governance": {"feedback", "models"},
    "training": {"models", "kernels", "feedback"},
    "serving": {"models", "kernels", "feedback", "registry"},
    "components": {"training", "registry", "governance", "serving", "models", "feedback"},
    "pipelines": {"components", "governance"},
    "bench": {"serving", "governance", "training", "models", "feedback"},
    "ops": {"feedback", "governance", "models", "pipelines", "registry"},
    "cli": None,
}


def _room(module: str) -> str:
    """adaflash.serving.engine -> serving; adaflash.errors -> errors; adaflash -> adaflash."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path) -> set[str]:
    """Every adaflash module `path` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "adaflash"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "adaflash":  # from adaflash import kernels / __version__
                out |= {f"adaflash.{a.name}" for a in node.names}
            elif node.module.startswith("adaflash."):
                out.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; the rules read absolute ones")
    return out


def _graph() -> dict[str, set[str]]:
    """room (or floor module) -> the other rooms and floor modules it imports."""
    graph: dict[str, set[str]] = {}
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG)
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if src == "__init__":
            src = "adaflash"
        if src == "__main__":
            src = "cli"  # `python -m adaflash` is the command line
        deps = {_room(m) for m in _imports(f)} - {src}
        deps = {"adaflash" if d == "__version__" else d for d in deps}
        graph.setdefault(src, set()).update(deps)
    return graph


def test_every_first_level_module_is_a_room_or_the_floor():
    assert set(_graph()) <= ROOMS | FLOOR, set(_graph()) - ROOMS - FLOOR
    assert set(ALLOWED) == ROOMS, "a new room needs its import rule here and a paragraph in ARCHITECTURE.md"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_rooms_import_only_what_they_may(room):
    allowed = ALLOWED[room]
    if allowed is None:
        return
    deps = _graph().get(room, set()) - FLOOR
    assert deps <= allowed, f"{room} imports {sorted(deps - allowed)}; it may import {sorted(allowed)}"


def test_the_floor_imports_no_room():
    graph = _graph()
    for mod in FLOOR:
        assert graph.get(mod, set()) <= FLOOR, (mod, graph.get(mod))


def test_the_named_directions():
    """The rules the issue spells out, stated on their own so a change to ALLOWED cannot drop them."""
    graph = _graph()
    for leaf in ("models", "kernels", "feedback"):
        assert graph.get(leaf, set()) <= FLOOR, (leaf, graph[leaf])
    assert not graph["serving"] & {"training", "governance", "components", "pipelines"}
    assert "serving" not in graph["training"]
    top = {"cli", "bench", "ops"}
    for room, deps in graph.items():
        if room != "cli":
            assert not deps & {"cli"}, room
        if room not in top:
            assert not deps & top, (room, deps & top)


def test_no_import_cycles_between_rooms():
    graph = {k: v - FLOOR for k, v in _graph().items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join([*path, node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        visit(node, [])


def test_architecture_md_names_only_what_exists():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    rooms = set(re.findall(r"`adaflash/(\w+)/`", text))
    assert rooms == ROOMS, f"rooms described {sorted(rooms)} vs present {sorted(ROOMS)}"
    for room in rooms:
        # "`adaflash/serving/`: ... `engine.py`, `protocol.py` ...": each file named in its paragraph
        para = text.split(f"**`adaflash/{room}/`**", 1)[1].split("\n\n", 1)[0]
        for name in re.findall(r"`(\w+\.py)`", para):
            assert (PKG / room / name).exists(), f"ARCHITECTURE.md names {room}/{name}, which does not exist"
    for path in re.findall(r"`((?:cli|components|governance|pipelines|registry|serving)/\w+\.py)", text):
        assert (PKG / path).exists(), path
    for name in ("errors.py", "procs.py", "workloads.py", "reporting.py"):
        assert name in text and (PKG / name).exists(), name
