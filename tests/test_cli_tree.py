"""The command line users type does not change by accident: every command, argument and option
(names, flags, defaults, types, env vars, help) is compared with the committed tree in
tests/cli_tree.json. After an intended change, rewrite it with

    python -m tests.test_cli_tree

and review the JSON diff like any other interface change.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

FIXTURE = Path(__file__).with_name("cli_tree.json")


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)  # Path defaults and the like: what --help shows


def _param(p) -> dict:
    ann = p.type_descriptor.annotation
    return {
        "name": p.name,
        "kind": "option" if p.param_type_name == "option" else "argument",
        "opts": list(p.opts),
        "secondary_opts": list(p.secondary_opts),
        "type": getattr(ann, "__name__", None) or str(ann),
        "required": p.required,
        "default": _jsonable(p.default),
        "is_flag": bool(getattr(p, "is_flag", False)),
        "multiple": p.multiple,
        "envvar": _jsonable(p.envvar),
        "help": getattr(p, "help", None),
        "hidden": bool(getattr(p, "hidden", False)),
    }


def command_tree() -> dict:
    """{"adaflash registry list": {...}, ...}: one entry per group and command, by its full path."""
    import typer

    from adaflash.cli import app

    tree: dict[str, dict] = {}

    def walk(cmd, path: str) -> None:
        subs = getattr(cmd, "commands", None)
        entry = {"help": cmd.help, "no_args_is_help": cmd.no_args_is_help}
        if subs:
            tree[path] = {**entry, "commands": sorted(subs)}
            for name, sub in sorted(subs.items()):
                walk(sub, f"{path} {name}")
        else:
            tree[path] = {**entry, "params": [_param(p) for p in cmd.params]}

    walk(typer.main.get_command(app), "adaflash")
    return tree


def test_command_tree_matches_the_committed_one():
    want = json.loads(FIXTURE.read_text())
    got = command_tree()
    assert sorted(got) == sorted(want), "commands added or removed"
    for path in want:
        assert got[path] == want[path], path


def test_every_help_works(monkeypatch, capsys):
    # In-process through main() (a subprocess each would spend a minute importing); the entry
    # points themselves are checked once below.
    from adaflash.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    for path in json.loads(FIXTURE.read_text()):
        monkeypatch.setattr(sys, "argv", [*path.split(), "--help"])
        code = 0
        try:
            main()  # --help returns normally in non-standalone mode
        except SystemExit as e:
            code = e.code or 0
        out = capsys.readouterr()
        assert code == 0, (path, out.err)
        assert "Usage:" in out.out, path


@pytest.mark.parametrize("module", ["adaflash", "adaflash.cli"])
def test_python_dash_m_runs_the_cli(module):
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "registry" in r.stdout and "Usage:" in r.stdout


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(command_tree(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {FIXTURE}")
