"""`adaflash export` and `adaflash sglang launch-args` (issue 7, item 1).

The exported directory must load unmodified in the reference `dflash` package (the format
oracle) and carry every config field SGLang's DFlash loader reads. SGLang itself needs a GPU and
~6 GB of CUDA wheels, so it is not run here: its field list lives in `adaflash.serving.export`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
import torch

from adaflash.errors import CheckpointError
from adaflash.models.checkpoint import load_drafter, save_drafter
from adaflash.serving.export import SGLANG_FIELDS, check_dflash_config, export_drafter, sglang_launch_argv
from tests.conftest import make_bundle


@pytest.fixture
def cli(capsys, monkeypatch):
    """Runs `adaflash ARGS` in-process through `main()` (exit codes and one-line errors included):
    a subprocess per call would spend most of this module's time importing torch."""
    from adaflash.cli import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["adaflash", *args])
        capsys.readouterr()
        try:
            main()
            rc = 0
        except SystemExit as e:
            rc = e.code or 0
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out, err)

    return run


def _perturb(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _drafter(path, target, seed=0, block_size=16):
    b = make_bundle(target, num_layers=2, block_size=block_size, seed=seed)
    _perturb(b.drafter, seed + 1)  # norms away from 1: every tensor matters
    save_drafter(path, b.drafter, b.length_head, b.meta)
    return b


def _assert_reference_matches(out, bundle, target):
    """Load `out` with dflash.model.DFlashDraftModel and compare its states with our drafter's."""
    from dflash.model import DFlashDraftModel

    ref = DFlashDraftModel.from_pretrained(str(out)).eval()
    k, S = bundle.config.block_size, 9
    assert ref.block_size == k and list(ref.target_layer_ids) == list(bundle.config.target_layer_ids)
    assert ref.mask_token_id == target.mask_token_id
    feats = torch.randn(1, S, len(bundle.config.target_layer_ids) * target.config.hidden_size) * 3
    ids = torch.full((1, k), target.mask_token_id)
    ids[0, 0] = 65
    emb = target.model.embed(ids)
    pos = torch.arange(S + k)[None]
    with torch.no_grad():
        theirs = ref(position_ids=pos, noise_embedding=emb, target_hidden=feats)
        ours = bundle.drafter(emb, pos[:, S:], bundle.drafter.context_kv(feats, pos[:, :S]),
                              torch.ones(1, k, S, dtype=torch.bool))  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_local_export_loads_unmodified_in_reference_dflash(tmp_path, tiny32, cli):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    b = _drafter(tmp_path / "src", tiny32)
    out = tmp_path / "export"
    r = cli("export", "--from", str(tmp_path / "src"), "--out", str(out), "--target", "tiny")
    assert r.returncode == 0, r.stderr
    assert "block size 16" in r.stdout
    assert {p.name for p in out.iterdir()} == {
        "config.json", "model.safetensors", "model.safetensors.index.json", "length_head.safetensors",
        "adaflash.json",
    }  # fmt: skip
    # The index names model.safetensors alone: servers that glob *.safetensors skip the length head.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}

    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert check_dflash_config(cfg, set(tensors)) == []
    # SGLang reads the config through transformers' AutoConfig and getattr: every field is there
    # (transformers 5 folds the raw `rope_theta`, kept for 4.x readers, into `rope_parameters`).
    hf = AutoConfig.from_pretrained(str(out))
    for field in (f for f in SGLANG_FIELDS if f != "rope_theta"):
        top, _, sub = field.partition(".")
        value = getattr(hf, top)
        assert value is not None, field
        if sub:
            assert value[sub] is not None, field
    assert hf.architectures == ["DFlashDraftModel"] and hf.hidden_act == "silu"
    assert hf.dflash_config == {"target_layer_ids": list(b.config.target_layer_ids),
                                "mask_token_id": tiny32.mask_token_id, "block_size": 16,
                                "num_target_layers": 4}  # fmt: skip
    assert hf.block_size == 16 and hf.num_target_layers == 4
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] == 10000.0
    # Exactly the DFlash tensors; the length head stays in its own file, byte-identical.
    assert {k for k in tensors if not k.startswith("layers.")} == {"fc.weight", "hidden_norm.weight",
                                                                  "norm.weight"}  # fmt: skip
    assert (out / "length_head.safetensors").read_bytes() == (
        tmp_path / "src" / "length_head.safetensors"
    ).read_bytes()
    assert json.loads((out / "adaflash.json").read_text())["lineage"]["export"]["format"] == "dflash"
    # The exported folder is still one of our drafters: our engine loads it as it is.
    again = load_drafter(out, target_fingerprint=tiny32.fingerprint)
    assert torch.equal(again.drafter.fc.weight.float(), tensors["fc.weight"].float())
    _assert_reference_matches(out, b, tiny32)


def test_export_champion_from_the_registry(tmp_path, tiny32, mlflow_server, cli):
    from adaflash.registry.client import RegistryClient

    bundles = [_drafter(tmp_path / f"d{i}", tiny32, seed=10 * i) for i in range(2)]
    with RegistryClient(mlflow_server.tracking_uri, tiny32.fingerprint, "tiny",
                        download_dir=tmp_path / "downloads") as reg:  # fmt: skip
        v1 = reg.register(tmp_path / "d0", {"kind": "test"})
        reg.promote(v1, who="test", reason="first")
        v2 = reg.register(tmp_path / "d1", {"kind": "test"})
        reg.promote(v2, who="test", reason="better")

    out = tmp_path / "drafter"
    args = ["--tracking-uri", mlflow_server.tracking_uri, "--target", "tiny", "--out", str(out)]
    r = cli("export", "--version", "champion", *args, "--require-block-size", "16")
    assert r.returncode == 0, r.stderr
    assert f"exported v{v2}" in r.stdout
    meta = json.loads((out / "adaflash.json").read_text())
    assert meta["lineage"]["export"]["version"] == v2 and meta["lineage"]["registry"]["version"] == v2
    _assert_reference_matches(out, bundles[1], tiny32)

    # Rollback target: an explicit version replaces the directory in place.
    r = cli("export", "--version", v1, *args)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "adaflash.json").read_text())["lineage"]["export"]["version"] == v1
    _assert_reference_matches(out, bundles[0], tiny32)
    assert not list(tmp_path.glob(".drafter*"))  # no scratch left beside the volume's directory


def test_export_refuses_what_a_server_would_reject(tmp_path, tiny32, cli):
    _drafter(tmp_path / "src", tiny32, block_size=8)
    with pytest.raises(CheckpointError, match="block size 8.*--speculative-num-draft-tokens 16"):
        export_drafter(tmp_path / "src", tmp_path / "out", require_block_size=16)
    with pytest.raises(CheckpointError, match="trained for target"):
        export_drafter(tmp_path / "src", tmp_path / "out", target_fingerprint="0" * 16)
    assert not (tmp_path / "out").exists()

    good = export_drafter(tmp_path / "src", tmp_path / "out", dtype="bfloat16")
    cfg = json.loads((good.path / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and check_dflash_config(cfg) == []
    for broken, reason in [
        ({"dflash_config": {**cfg["dflash_config"], "mask_token_id": 10**6}}, "mask_token_id"),
        ({"dflash_config": {**cfg["dflash_config"], "target_layer_ids": [1, 9]}}, "target_layer_ids"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"block_size": 4}, "disagree"),
        ({"rope_theta": None} | {k: v for k, v in cfg.items() if k != "rope_theta"}, None),
    ]:
        problems = check_dflash_config(cfg | broken)
        assert (reason is None and problems == []) or any(reason in p for p in problems), (broken, problems)
    no_layer_types = {k: v for k, v in cfg.items() if k != "layer_types"}
    assert check_dflash_config(no_layer_types) == ["missing layer_types"]
    tensors = {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.x", "layers.1.x", "head.w"}
    assert any("silently drop" in p for p in check_dflash_config(cfg, tensors))

    for args in ([], ["--version", "champion", "--from", str(tmp_path / "src")]):
        r = cli("export", "--out", str(tmp_path / "x"), *args)
        assert r.returncode == 2 and r.stderr.strip().startswith("error: give exactly one of"), r.stderr


def test_sglang_launch_args_prints_the_exact_line(tmp_path, tiny32, cli):
    _drafter(tmp_path / "src", tiny32)
    out = export_drafter(tmp_path / "src", tmp_path / "exp").path
    base = ["sglang", "launch-args", "--target", "tiny", "--drafter", str(out)]
    r = cli(*base, "--model-path", "/models/target", "--port", "30001")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip()
    assert line == (
        "python -m sglang.launch_server --model-path /models/target --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {out} --speculative-num-draft-tokens 16 "
        "--host 0.0.0.0 --port 30001"
    )
    r = cli(*base, "--model-path", "/models/t", "--drafter-path", "/drafter/current", "--json")
    argv = json.loads(r.stdout)
    assert argv == sglang_launch_argv("/models/t", "/drafter/current", 16)
    assert shlex.split(line)[:3] == ["python", "-m", "sglang.launch_server"]

    r = cli(*base)  # the tiny target has no HF checkpoint directory to serve
    assert r.returncode == 2 and "pass --model-path" in r.stderr
    meta = json.loads((out / "adaflash.json").read_text())
    (out / "adaflash.json").write_text(json.dumps(meta | {"target_fingerprint": "f" * 16}))
    r = cli(*base, "--model-path", "/m")
    assert r.returncode == 2 and "trained for target ffff" in r.stderr
