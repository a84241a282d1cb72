"""The drafter that ships in git (`drafters/smollm2/`): complete, small, fp16, and the same model
in the reference `dflash` package as in ours."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.models.checkpoint import load_drafter
from tests.conftest import REPO

SHIPPED = REPO / "drafters" / "smollm2"


def test_shipped_drafter_is_complete_small_and_fp16():
    names = {p.name for p in SHIPPED.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "length_head.safetensors",
        "adaflash.json",
        "README.md",
    } <= names
    assert sum(p.stat().st_size for p in SHIPPED.iterdir()) <= 30e6
    assert not any(n.startswith(".bootstrap_state") for n in names)  # no training state in git
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(SHIPPED / "model.safetensors")).values()} == {torch.float16}
    bundle = load_drafter(SHIPPED)
    assert bundle.length_head is not None
    meta = json.loads((SHIPPED / "adaflash.json").read_text())
    assert meta["target_name"] == "smollm2" and meta["lineage"]["steps"] > 0


def test_shipped_drafter_loads_in_reference_dflash_with_the_same_outputs():
    dflash_model = pytest.importorskip("dflash.model")
    ref = dflash_model.DFlashDraftModel.from_pretrained(str(SHIPPED)).float().eval()
    ours = load_drafter(SHIPPED).drafter
    c = ours.config
    assert ref.block_size == c.block_size and list(ref.target_layer_ids) == list(c.target_layer_ids)
    assert ref.mask_token_id == c.mask_token_id
    g = torch.Generator().manual_seed(0)
    S, k = 11, c.block_size
    feats = torch.randn(1, S, len(c.target_layer_ids) * c.hidden_size, generator=g) * 3
    emb = torch.randn(1, k, c.hidden_size, generator=g) * 0.05
    pos = torch.arange(S + k)[None]
    with torch.no_grad():
        theirs = ref(position_ids=pos, noise_embedding=emb, target_hidden=feats)
        mine = ours(
            emb, pos[:, S:], ours.context_kv(feats, pos[:, :S]), torch.ones(1, k, S, dtype=torch.bool)
        )
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4)
