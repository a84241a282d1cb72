"""`adaflash export --format vllm` without vLLM (issue 36): the directory carries what vLLM 0.32's
DFlash loader reads (adaflash/serving/export_vllm.py lists it, with the vLLM files it comes from).
tests/test_vllm.py loads the same export in a real vLLM where `make vllm` has built one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaflash.errors import InputError
from adaflash.models.checkpoint import save_drafter
from adaflash.serving.export import check_dflash_config, export_drafter
from adaflash.serving.export_vllm import check_vllm_export, speculative_config, vllm_launch_argv
from tests.conftest import make_bundle


def _drafter_with_vocab(tmp_path, target):
    b = make_bundle(target, num_layers=2, block_size=8, seed=3)
    vocab = torch.tensor(
        sorted({2, 5, 7, 9, 40, 41, 100, target.mask_token_id, target.config.vocab_size - 1})
    )
    save_drafter(tmp_path / "src", b.drafter, b.length_head, b.meta, draft_vocab=vocab)
    head = target.model.lm_head.weight.detach().clone()
    save_file({"lm_head.weight": head.contiguous()}, str(tmp_path / "target" / "model.safetensors"))
    return b, vocab, head


def test_vllm_export_has_the_draft_vocabulary_head(tmp_path, tiny32):
    (tmp_path / "target").mkdir()
    b, vocab, head = _drafter_with_vocab(tmp_path, tiny32)
    out = export_drafter(tmp_path / "src", tmp_path / "out", fmt="vllm", target_dir=tmp_path / "target").path
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    drafter_tensors = {k for k in tensors if k not in ("lm_head.weight", "d2t", "t2d")}
    assert check_dflash_config(cfg, drafter_tensors) == [] and check_vllm_export(cfg, tensors) == []
    assert cfg["draft_vocab_size"] == len(vocab) and cfg["dflash_config"]["causal"] is False
    assert cfg["vocab_size"] == tiny32.config.vocab_size  # vLLM scatters back into the target's vocabulary
    # vLLM's DFlashQwen3ForCausalLM.compute_logits: draft logits over its own head, placed at
    # arange(V') + d2t in a -inf row of the target vocabulary. It must equal our engine's draft
    # head (Proposer: the target LM head's rows of the draft vocabulary, -inf elsewhere).
    h = torch.randn(3, tiny32.config.hidden_size)
    theirs = torch.full((3, cfg["vocab_size"]), float("-inf"))
    theirs[:, torch.arange(cfg["draft_vocab_size"]) + tensors["d2t"]] = h @ tensors["lm_head.weight"].T
    ours = torch.full((3, tiny32.config.vocab_size), float("-inf"))
    ours[:, vocab] = h @ head[vocab].T
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    assert tensors["t2d"].nonzero().flatten().tolist() == vocab.tolist()
    # The loader reads only what the index names; the length head and vocabulary stay for our engine.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == {
        "model.safetensors"
    }
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert json.loads((out / "draft_vocab.json").read_text())["token_ids"] == vocab.tolist()
    torch.testing.assert_close({k: tensors[k] for k in drafter_tensors}, b.drafter.state_dict())
    assert json.loads((out / "adaflash.json").read_text())["lineage"]["export"]["format"] == "vllm"


def test_vllm_export_needs_the_target_for_a_draft_vocabulary(tmp_path, tiny32):
    (tmp_path / "target").mkdir()
    _drafter_with_vocab(tmp_path, tiny32)
    with pytest.raises(InputError, match="needs --target"):
        export_drafter(tmp_path / "src", tmp_path / "out", fmt="vllm")
    # A drafter over the whole vocabulary shares the target's head in vLLM: nothing to add.
    b = make_bundle(tiny32, block_size=8)
    save_drafter(tmp_path / "full", b.drafter, b.length_head, b.meta)
    out = export_drafter(tmp_path / "full", tmp_path / "out2", fmt="vllm").path
    tensors = load_file(str(out / "model.safetensors"))
    assert not {"lm_head.weight", "d2t", "t2d"} & set(tensors)
    assert "draft_vocab_size" not in json.loads((out / "config.json").read_text())
    with pytest.raises(InputError, match="--format"):
        export_drafter(tmp_path / "full", tmp_path / "out3", fmt="onnx")


def test_vllm_launch_line_from_the_speculative_config():
    spec = speculative_config("dflash", "/drafters/v2", block_size=8)
    assert spec == {"method": "dflash", "model": "/drafters/v2", "num_speculative_tokens": 7}
    argv = vllm_launch_argv(
        "/models/target", spec, python="/venv/bin/python", port=8100, served_model_name="m"
    )
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == spec
    assert argv[argv.index("--port") + 1] == "8100" and argv[argv.index("--model") + 1] == "/models/target"
    assert "--speculative-config" not in vllm_launch_argv("/m", speculative_config("ar", None, 8))
    assert speculative_config("ngram", None, 8)["num_speculative_tokens"] == 7
