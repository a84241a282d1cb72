"""The intended import directions (ARCHITECTURE.md, DESIGN §3) hold, by parsing every import in
the package, lazy ones inside functions included; no two modules of a room import each other, even
through others; and every room and module ARCHITECTURE.md names exists.

Every import counts: at the top of a module, inside a function (a lazy import still ties the two
modules; it only hides the tie until that line runs) and under `if TYPE_CHECKING:` (the module's
annotations still speak of the other's types). A circle is opened by moving the shared name to the
floor or to a module both import, or by a Protocol, never by making an import lazy."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "adaflash"
# Modules at the package's first level that are not rooms: importable by every room, and they
# import no room themselves. ("adaflash" itself is the package root: its __version__.)
FLOOR = {"adaflash", "errors", "paths", "procs", "workloads", "reporting"}
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


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (node -> what it imports) as a path that ends where it starts,
    or None when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        if state.get(node) == 1:
            return [*path[path.index(node) :], node]
        if state.get(node) == 2:
            return None
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if found := visit(dep, [*path, node]):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if found := visit(node, []):
            return found
    return None


def test_no_import_cycles_between_rooms():
    cycle = _cycle({k: v - FLOOR for k, v in _graph().items()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _module_name(path: Path, pkg: Path) -> str:
    """adaflash/serving/engine.py -> adaflash.serving.engine; models/__init__.py -> adaflash.models."""
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """module -> the modules of the same room it imports, wherever the import stands (top level,
    a function, `if TYPE_CHECKING:`). `from adaflash.models import rowwise` imports the module
    `rowwise`; `from adaflash.models import X` of a name the package defines imports its `__init__`."""
    files = {_module_name(f, pkg): f for f in pkg.rglob("*.py")}
    root = pkg.name
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in files else node.module)
        room = name.split(".")[:2]
        graph[name] = {d for d in deps if d in files and d != name and d.split(".")[:2] == room}
    return graph


def test_no_import_circles_inside_a_room():
    cycle = _cycle(_module_graph())
    assert cycle is None, (
        "import circle inside a room: " + " -> ".join(cycle or []) + " (move the shared name to a "
        "module both may import, or to the floor; a lazy or TYPE_CHECKING import still counts)"
    )


def test_the_circle_check_sees_lazy_and_annotation_only_imports(tmp_path):
    """The rule has teeth: a circle held only by a function-level import and an import under
    TYPE_CHECKING is found, and so is one through a package's `__init__`."""
    pkg = tmp_path / "adaflash"
    (pkg / "room").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "room" / "__init__.py").write_text("from adaflash.room.a import f\n")
    (pkg / "room" / "a.py").write_text("def f():\n    from adaflash.room.b import g\n    return g\n")
    (pkg / "room" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adaflash.room import a\ng = 1\n"
    )
    (pkg / "room" / "c.py").write_text("from adaflash.room import f\n")
    graph = _module_graph(pkg)
    assert graph["adaflash.room.a"] == {"adaflash.room.b"}
    assert graph["adaflash.room.b"] == {"adaflash.room.a"}
    assert graph["adaflash.room.c"] == {"adaflash.room"}
    assert _cycle(graph) == ["adaflash.room.a", "adaflash.room.b", "adaflash.room.a"]
    (pkg / "room" / "b.py").write_text("g = 1\n")
    assert _cycle(_module_graph(pkg)) is None


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
    for name in ("errors.py", "paths.py", "procs.py", "workloads.py", "reporting.py"):
        assert name in text and (PKG / name).exists(), name


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80


def _long_functions() -> dict[str, int]:
    """`<path under adaflash/>: <name>` -> lines, for every function longer than MAX_FUNCTION_LINES
    (counted from its first decorator to its last line)."""
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - first + 1) > MAX_FUNCTION_LINES:
                    out[f"{f.relative_to(PKG).as_posix()}: {node.name}"] = n
    return out


def test_modules_and_functions_stay_small():
    """No module over 500 lines; no function over 80 unless ARCHITECTURE.md lists it (generated or
    table-like code only) with its reason, and nothing is listed that is no longer long."""
    big = {f.relative_to(PKG).as_posix(): n for f in PKG.rglob("*.py")
           if (n := len(f.read_text().splitlines())) > MAX_MODULE_LINES}  # fmt: skip
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"
    size = (ROOT / "ARCHITECTURE.md").read_text().split("\n## Size\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^- `([\w/]+\.py: \w+)`: \S", size, re.M))
    long = _long_functions()
    unlisted = {k: v for k, v in long.items() if k not in listed}
    assert not unlisted, f"functions over {MAX_FUNCTION_LINES} lines, not in ARCHITECTURE.md: {unlisted}"
    assert listed <= set(long), f"ARCHITECTURE.md lists functions within the limit: {listed - set(long)}"
