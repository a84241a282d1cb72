"""The CLI: JSON output, and one-line errors (no traceback) for expected bad input."""

from __future__ import annotations

import json
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
