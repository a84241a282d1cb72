"""The real target: SmolLM2-135M-Instruct. Run with `make test-smollm2` (marker `smollm2`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaflash.models.checkpoint import load_drafter_for
from adaflash.models.targets import load_target, smollm2_dir
from adaflash.serving.offline import DecodeConfig, OfflineDecoder
from adaflash.workloads import DOMAINS, load_prompts
from tests.conftest import REPO

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2_64():
    return load_target("smollm2", torch.float64)


@pytest.fixture(scope="module")
def bootstrap_drafter(tmp_path_factory) -> Path:
    """The measured bootstrap drafter when present (make bootstrap), else a quick one."""
    d = REPO / "drafters" / "smollm2"
    if (d / "config.json").exists():
        return d
    from adaflash.training.bootstrap import BootstrapConfig, BootstrapTrainer

    out = tmp_path_factory.mktemp("smollm2") / "drafter"
    target = load_target("smollm2")
    cfg = BootstrapConfig(
        steps=100, eval_per_domain=2, curve_per_domain=1, max_new_tokens=96, max_train_prompts=96
    )
    BootstrapTrainer(target, out, cfg).run()
    return out


def test_runner_matches_hf_llama(smollm2_64):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir()), dtype=torch.float64).eval()
    ids = smollm2_64.tokenizer.chat_prompt("Write a haiku about the sea.")
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    out = smollm2_64.model(torch.tensor([ids]), smollm2_64.model.new_cache(1, 128), capture_layers=(14,))
    torch.testing.assert_close(smollm2_64.model.logits(out.hidden), ref.logits, rtol=0, atol=2e-3)
    torch.testing.assert_close(out.features, ref.hidden_states[15], rtol=1e-4, atol=1e-2)
    assert smollm2_64.config.num_layers == 30 and smollm2_64.config.vocab_size == 49152
    assert smollm2_64.mask_token_id == 16


def test_lossless_greedy_on_heldout_prompts(smollm2_64, bootstrap_drafter):
    held = load_prompts("heldout")
    prompts = [smollm2_64.tokenizer.chat_prompt(p.text) for d in DOMAINS for p in held[d][-8:]]
    assert len(prompts) >= 20
    bundle = load_drafter_for(bootstrap_drafter, smollm2_64)
    dec = OfflineDecoder(smollm2_64, bundle)
    ar = dec.generate(prompts, DecodeConfig("ar", 64))
    # γ = 8 makes AdaFlash verify drafts even when its head predicts little acceptance, so the
    # adaptive path is exercised on real drafts, not only on k̂ = 1 steps.
    for method, gamma in (("dflash", 1.0), ("adaflash", 1.0), ("adaflash", 8.0)):
        spec = dec.generate(prompts, DecodeConfig(method, 64, gamma=gamma))
        for i, (a, s) in enumerate(zip(ar, spec, strict=True)):
            assert s.token_ids == a.token_ids, (method, gamma, i)
        rounds = [r for s in spec for r in s.rounds]
        if method == "dflash" or gamma > 1:
            assert sum(r.verify_len - 1 for r in rounds) > 0  # drafts were verified
            assert sum(r.accepted for r in rounds) > 0  # and some were accepted


def test_shipped_drafter_reproduces_its_model_card_on_heldout_responses():
    """Re-measures the model card's held-out table on the committed held-out greedy responses: the
    released fp16 drafter's τ per domain within 0.02 of the card's (measured in training precision),
    prompt lookup's exactly, and every domain above 1. (It asserted "beats prompt lookup on every
    domain" until 2026-12-06: issue 34's stretch bar, which no shipped drafter has met - math 1.72
    against lookup's 2.06 - so `make test-smollm2` failed on a claim no card made.)"""
    import json

    from adaflash.training.blocks import SequencePass
    from adaflash.training.corpus import corpus_path, seed_cache
    from adaflash.training.evaluate import evaluate_acceptance
    from adaflash.training.feature_store import build_store
    from adaflash.workloads import interleave

    target = load_target("smollm2")
    bundle = load_drafter_for(REPO / "drafters" / "smollm2", target)
    prompts = interleave(load_prompts("heldout"), 40)
    cache = Path(__import__("tempfile").mkdtemp()) / "heldout.jsonl"
    assert seed_cache(target, prompts, corpus_path(target, "heldout", 256), cache) > 50
    from adaflash.training.responses import read_responses

    responses = read_responses(cache)
    store = build_store(target, responses, bundle.config.target_layer_ids, root=cache.parent / "fs")
    seqs = [store[i] for i in range(len(store))]
    rep = evaluate_acceptance(
        bundle.drafter, target.model, [SequencePass(s.tokens, s.features, None) for s in seqs],
        [s.prompt_len for s in seqs], [s.domain for s in seqs], ngram=True,
    )  # fmt: skip
    card = json.loads((REPO / "drafters" / "smollm2" / "bootstrap_metrics.json").read_text())["heldout"]
    for domain in (*DOMAINS, "all"):
        got, want = rep[domain], card[domain]
        assert got["n_sequences"] == want["n_sequences"], domain
        assert abs(got["dflash_tau"] - want["dflash_tau"]) <= 0.02 and got["dflash_tau"] > 1.0, (domain, got)
        assert abs(got["ngram_tau"] - want["ngram_tau"]) <= 1e-3, (domain, got)
