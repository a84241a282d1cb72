"""The CLI: JSON output, and one-line errors (no traceback) for expected bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from adaflash.models.checkpoint import save_drafter
from tests.conftest import make_bundle


def run(*args, env_cache=None):
    return subprocess.run(
        [sys.executable, "-m", "adaflash.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory):
    from adaflash.models.targets import tiny_target

    d = tmp_path_factory.mktemp("cli") / "drafter"
    b = make_bundle(tiny_target())
    save_drafter(d, b.drafter, b.length_head, b.meta)
    return d


def test_generate_json_for_each_method(tiny_drafter):
    outs = {}
    for method in ("ar", "dflash", "adaflash"):
        r = run(
            "generate",
            "--target",
            "tiny",
            "--drafter",
            str(tiny_drafter),
            "--method",
            method,
            "--prompt",
            "hello",
            "--max-new-tokens",
            "12",
            "--json",
        )
        assert r.returncode == 0, r.stderr
        obj = json.loads(r.stdout)
        assert {"text", "token_ids", "tau", "mean_verify_len", "rounds"} <= set(obj)
        assert len(obj["token_ids"]) == 12 and obj["tau"] >= 1
        outs[method] = obj["token_ids"]
    assert outs["ar"] == outs["dflash"] == outs["adaflash"]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target", "nonsense-model", "--method", "ar"], "unknown target"),
        (["--target", "tiny", "--drafter", "/nonexistent/dir", "--method", "dflash"], "does not exist"),
        (["--target", "tiny", "--method", "ar", "--temperature", "-0.5"], "invalid temperature"),
        (["--target", "tiny", "--method", "ar", "--max-new-tokens", "2000"], "per-request limit"),
        (["--target", "tiny", "--method", "dflash"], "needs --drafter"),
    ],
)
def test_bad_input_is_one_line_error(args, needle):
    r = run("generate", "--prompt", "hi", *args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_serve_refuses_an_unknown_step_loop_in_one_line_from_the_flag_or_the_env():
    for args, env in ((["--step-loop", "bogus"], {}), ([], {"ADAFLASH_STEP_LOOP": "bogus"})):
        argv = [sys.executable, "-m", "adaflash.cli", "serve", "--target", "tiny", *args]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        assert r.returncode == 2 and r.stderr.strip() == "error: --step-loop 'bogus': choose thread or main"


def test_serve_stepping_on_main_fails_when_its_port_is_taken():
    """uvicorn runs on a thread there: its failure to bind must still end `serve` non-zero."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        serve = ["serve", "--target", "tiny", "--method", "ar", "--port", port, "--step-loop", "main"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-m", "adaflash.cli", *serve], capture_output=True, text=True,
                           timeout=120, env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert (
        r.stderr.strip().splitlines()[-1]
        == f"error: the HTTP server could not start on 127.0.0.1:{port} (see the log above)"
    )


def test_corrupt_and_mismatched_checkpoints_are_one_line_errors(tmp_path, tiny_drafter):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_drafter, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    r = run("generate", "--target", "tiny", "--drafter", str(bad), "--method", "dflash", "--prompt", "x")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "corrupt" in r.stderr
    other = tmp_path / "other"
    shutil.copytree(tiny_drafter, other)
    meta = json.loads((other / "adaflash.json").read_text())
    meta["target_fingerprint"] = "ffffffffffffffff"
    (other / "adaflash.json").write_text(json.dumps(meta))
    r = run("generate", "--target", "tiny", "--drafter", str(other), "--method", "dflash", "--prompt", "x")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "trained for target" in r.stderr


# -- issue 32: every command of the README's "The CLI" section that runs on `tiny`, once on a
# terminal-like console and once piped. `drafter bootstrap` died in its progress bar on both (the
# "generate" bar has no total) and nothing ran the CLI's progress path. `demo` needs the whole
# stack (broker, MLflow, governance): `tests/test_stack.py` and `make demo` run it.
TERMINAL = {"COLUMNS": "100", "FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
CONSOLES = {"terminal": TERMINAL, "piped": {}}


def _run_console(args: list[str], console: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (*TERMINAL, "NO_COLOR", "TERM")}
    env.update(CONSOLES[console])
    r = subprocess.run(
        [sys.executable, "-m", "adaflash.cli", *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=cwd,
    )  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr[-3000:])
    return r


@pytest.fixture(scope="module", params=list(CONSOLES))
def bootstrapped(request, tmp_path_factory):
    """`drafter bootstrap --target tiny` with a few prompts and steps: generation, features,
    training and the held-out evaluation all run, so every progress bar is drawn."""
    work = tmp_path_factory.mktemp(f"cli-{request.param}")
    args = ["drafter", "bootstrap", "--target", "tiny", "--out", str(work / "drafter"), "--steps", "2",
            "--max-train-prompts", "3", "--eval-per-domain", "1", "--max-new-tokens", "8"]  # fmt: skip
    r = _run_console(args, request.param, work)
    if request.param == "terminal":
        assert "\x1b[" in r.stderr and "length head" in r.stderr  # rich drew its bars
    else:
        assert "\x1b[" not in r.stderr and "trained 2 steps" in r.stdout
    return request.param, work


def test_cli_commands_run_on_tiny_on_a_terminal_and_piped(bootstrapped):
    console, work = bootstrapped
    drafter = str(work / "drafter")
    r = _run_console(["drafter", "info", drafter], console, work)
    assert "block_size" in r.stdout
    gen = ["generate", "--target", "tiny", "--drafter", drafter, "--method", "adaflash",
           "--prompt", "hello", "--max-new-tokens", "8"]  # fmt: skip
    _run_console(gen, console, work)
    cmp = ["compare", "--target", "tiny", "--drafter", drafter, "--prompts-per-domain", "1",
           "--max-new-tokens", "8"]  # fmt: skip
    _run_console(cmp, console, work)
    adapt = ["adapt", "--target", "tiny", "--drafter", drafter, "--rounds", "1", "--per-round", "4",
             "--max-new-tokens", "8", "--epochs", "1", "--c1-prompts", "1", "--learners", "osd",
             "--no-frozen-cost", "--concurrency", "2", "--out", str(work / "adapt"),
             "--work", str(work / "adapt-work")]  # fmt: skip
    _run_console(adapt, console, work)
    assert (work / "adapt" / "results.json").exists()
