"""The registry validates what it stores and the CLI never answers misuse with a traceback
(issue 14): `registry register` refuses a checkpoint the servers would reject, `approve` refuses a
version that is no longer the pending challenger, every subcommand missing a required option
prints one `error:` line and exits 2, and `broker status` finds the broker on the port it was
started on. Real MLflow and Tansu processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from adaflash.feedback.broker import free_port
from adaflash.models.checkpoint import save_drafter
from adaflash.registry import RegistryClient, RegistryError
from tests.conftest import make_bundle


def _cli(*args: str, home) -> subprocess.CompletedProcess:
    env = {**os.environ, "ADAFLASH_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "adaflash.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def _one_error_line(out: subprocess.CompletedProcess, needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert needle in lines[0], lines[0]


def test_register_refuses_a_checkpoint_the_servers_would_reject(mlflow_server, drafters, tiny, tmp_path):
    uri = mlflow_server.tracking_uri
    truncated = tmp_path / "truncated"
    shutil.copytree(drafters[0], truncated)
    w = truncated / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    reg_args = ("--target", "tiny", "--tracking-uri", uri, "--bootstrap-servers", "")
    out = _cli("registry", "register", str(truncated), "--reason", "try", *reg_args, home=tmp_path)
    _one_error_line(out, "refusing to register")
    assert "corrupt" in out.stderr
    wrong_shape = tmp_path / "wrong-shape"  # a 1-layer config holding a 2-layer drafter's weights
    b = make_bundle(tiny, num_layers=1, seed=3)
    save_drafter(wrong_shape, b.drafter, b.length_head, b.meta)
    shutil.copy(drafters[1] / "model.safetensors", wrong_shape / "model.safetensors")
    _one_error_line(
        _cli("registry", "register", str(wrong_shape), "--reason", "try", *reg_args, home=tmp_path),
        "refusing to register",
    )
    with RegistryClient(uri, tiny.fingerprint, "tiny") as reg:
        assert reg.versions() == []  # nothing that every server would reject was stored
    ok = _cli("registry", "register", str(drafters[0]), "--reason", "bootstrap", *reg_args, home=tmp_path)
    assert ok.returncode == 0 and "v1 registered" in ok.stdout, ok.stderr
    # Without --reason: one error line and exit 2 (it used to be a traceback and exit 1).
    _one_error_line(_cli("registry", "register", str(drafters[0]), *reg_args, home=tmp_path), "--reason")


def test_approve_refuses_a_version_that_is_no_longer_the_pending_challenger(mlflow_server, drafters, tiny):
    with RegistryClient(
        mlflow_server.tracking_uri, tiny.fingerprint, "tiny", model_name="approve-rules"
    ) as reg:
        v1 = reg.register(drafters[0], pending_approval=True)
        v2 = reg.register(drafters[1], pending_approval=True)
        with pytest.raises(RegistryError, match="superseded") as err:
            reg.approve(v1, "alice", "the older one")
        assert "not the pending challenger" in str(err.value) and f"challenger is v{v2}" in str(err.value)
        assert reg.champion() is None
        assert reg.approve(v2, "alice", "looks good") == v2 and reg.champion() == v2
        with pytest.raises(RegistryError, match="already the champion"):
            reg.approve(v2, "alice", "again")
        v3 = reg.register(drafters[2], pending_approval=True)
        reg.approve(v3, "bob", "better")
        # v2 is now the previous champion: approving it again must not silently re-promote it.
        with pytest.raises(RegistryError, match="previous champion"):
            reg.approve(v2, "alice", "the old one was fine")
        assert reg.champion() == v3
        reg.rollback("carol", "regression")
        with pytest.raises(RegistryError, match="rolled back"):
            reg.approve(v3, "bob", "try again")
        assert reg.champion() == v2


def _required_misuse() -> list[tuple[list[str], str]]:
    """(argv, what is missing) for every subcommand that has a required parameter."""
    import typer

    from adaflash.cli import app

    out = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            for name, sub in sorted(subs.items()):
                walk(sub, [*path, name])
            return
        required = [p for p in cmd.params if p.required]
        if required:
            out.append((path, required[0].name))

    walk(typer.main.get_command(app), [])
    return out


def test_every_subcommand_missing_a_required_option_is_one_error_line(monkeypatch, capsys):
    from adaflash.cli import main

    cases = _required_misuse()
    assert len(cases) >= 10
    for argv, missing in cases:
        monkeypatch.setattr(sys, "argv", ["adaflash", *argv])
        with pytest.raises(SystemExit) as ex:
            main()
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert ex.value.code == 2, (argv, ex.value.code, err)
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        assert missing.replace("_", "-") in lines[0] or missing in lines[0], (argv, lines[0])


def test_broker_status_and_stop_find_the_port_it_was_started_on(tmp_path):
    port = str(free_port())
    start = _cli("broker", "start", "--port", port, home=tmp_path)
    assert start.returncode == 0, start.stderr
    try:
        st = _cli("broker", "status", home=tmp_path)  # no --port: the one it was started on
        assert (
            st.returncode == 0 and f"127.0.0.1:{port}" in st.stdout and "adaflash.feedback.raw" in st.stdout
        )
    finally:
        stop = _cli("broker", "stop", home=tmp_path)
    assert "broker stopped" in stop.stdout
    assert _cli("broker", "status", home=tmp_path).returncode == 1
