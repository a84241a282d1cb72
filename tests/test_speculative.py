"""Speculative decoding is lossless: token-identical at temperature 0, distribution-identical
when sampling (chi-square against the target's exact distribution)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from adaflash import kernels
from adaflash.errors import InputError
from adaflash.models.generate import greedy_generate
from adaflash.models.targets import Target
from adaflash.models.transformer import TargetConfig, TargetModel
from adaflash.serving.offline import DecodeConfig, OfflineDecoder
from adaflash.training.blocks import block_hidden, sequence_pass
from tests.conftest import make_bundle


def quick_train(bundle, target, steps: int, seed: int = 0):
    """A few CE steps on the target's greedy continuations: enough for a tiny target's short
    cycles to become predictable, so that full-block acceptance happens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[256, *torch.randint(0, 256, (6,), generator=g).tolist()] for _ in range(16)]
    outs = greedy_generate(target.model, prompts, 48)
    seqs = [p + o for p, o in zip(prompts, outs, strict=True)]
    passes = sequence_pass(target.model, seqs, bundle.drafter.config.target_layer_ids)
    d = bundle.drafter.train().requires_grad_(True)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for step in range(steps):
        sp, P = passes[step % len(passes)], len(prompts[step % len(passes)])
        pool = torch.arange(P, len(sp.tokens) - 1)
        anchors = pool[torch.randperm(pool.numel(), generator=g)[:24]].sort().values
        hidden, labels, _ = block_hidden(d, target.model, sp, anchors)
        valid = labels >= 0
        loss = torch.nn.functional.cross_entropy(target.model.logits(hidden[:, 1:][valid]), labels[valid])
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.eval().requires_grad_(False)
    return bundle


PROMPTS = [[256, *b"hello there"], [256, *b"what is 2+2?"], [256, *b"abcabcabc"], [256, *b"x"]]


def test_greedy_is_token_identical_to_ar_with_zero_partial_and_full_acceptance(tiny64):
    ar = OfflineDecoder(tiny64).generate(PROMPTS, DecodeConfig("ar", 40))
    # Our AR is the target itself: same as plain greedy generation.
    assert [r.token_ids for r in ar] == greedy_generate(tiny64.model, PROMPTS, 40)
    seen = {"zero": 0, "partial": 0, "full": 0}
    for block, layers, seed, steps in [
        (2, 1, 0, 0),
        (8, 2, 2, 0),
        (4, 1, 3, 30),
        (8, 2, 4, 40),
        (16, 2, 5, 50),
    ]:
        bundle = make_bundle(tiny64, num_layers=layers, block_size=block, seed=seed)
        if steps:
            quick_train(bundle, tiny64, steps, seed)
        dec = OfflineDecoder(tiny64, bundle)
        for method in ("dflash", "adaflash"):
            out = dec.generate(PROMPTS, DecodeConfig(method, 40))
            for a, s in zip(ar, out, strict=True):
                assert s.token_ids == a.token_ids, (block, seed, method)
                for r in s.rounds:
                    assert 1 <= r.verify_len <= block and 0 <= r.accepted <= r.verify_len - 1
                    if r.verify_len > 1:
                        kind = (
                            "zero"
                            if r.accepted == 0
                            else "full"
                            if r.accepted == r.verify_len - 1
                            else "partial"
                        )
                        seen[kind] += 1
    assert all(v > 0 for v in seen.values()), seen


def test_batched_equals_one_by_one(tiny64):
    bundle = quick_train(make_bundle(tiny64, block_size=8, seed=7), tiny64, 40)
    dec = OfflineDecoder(tiny64, bundle)
    batched = dec.generate(PROMPTS, DecodeConfig("adaflash", 30))
    for p, b in zip(PROMPTS, batched, strict=True):
        single = dec.generate([p], DecodeConfig("adaflash", 30))[0]
        assert single.token_ids == b.token_ids
        assert [(r.verify_len, r.accepted) for r in single.rounds] == [
            (r.verify_len, r.accepted) for r in b.rounds
        ]


def test_eos_and_max_new_tokens(tiny64):
    dec = OfflineDecoder(tiny64, make_bundle(tiny64))
    ar = dec.generate(PROMPTS[:1], DecodeConfig("ar", 25))[0]
    stop = ar.token_ids[10]
    eos_target = Target(
        "tiny", tiny64.model, SimpleNamespace(eos_token_ids=(stop,)), tiny64.fingerprint, tiny64.mask_token_id
    )
    for method in ("ar", "dflash", "adaflash"):
        r = OfflineDecoder(eos_target, make_bundle(tiny64)).generate(PROMPTS[:1], DecodeConfig(method, 25))[0]
        first = ar.token_ids.index(stop)
        assert r.token_ids == ar.token_ids[: first + 1] and r.finish_reason == "stop"
        r = dec.generate(PROMPTS[:1], DecodeConfig(method, 7))[0]
        assert len(r.token_ids) == 7 and r.finish_reason == "length"


def test_bad_requests_are_input_errors(tiny64):
    dec = OfflineDecoder(tiny64, make_bundle(tiny64, with_head=False))
    with pytest.raises(InputError, match="temperature"):
        dec.generate(PROMPTS, DecodeConfig("dflash", 5, temperature=-1))
    with pytest.raises(InputError, match="temperature"):
        dec.generate(PROMPTS, DecodeConfig("dflash", 5, temperature=float("nan")))
    with pytest.raises(InputError, match="exceeds the server.s per-request limit"):
        dec.generate([[1] * 1020], DecodeConfig("ar", 10))
    with pytest.raises(InputError, match="length head"):
        dec.generate(PROMPTS, DecodeConfig("adaflash", 5))
    with pytest.raises(InputError, match="needs a drafter"):
        OfflineDecoder(tiny64).generate(PROMPTS, DecodeConfig("dflash", 5))


# --- sampling ---------------------------------------------------------------------------------

V = 4  # tiny vocabulary: the joint law of 4 generated tokens has 256 cells


def _tiny_vocab_target() -> Target:
    cfg = TargetConfig(
        arch="llama",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
    )
    g = torch.Generator().manual_seed(3)
    m = TargetModel(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if not n.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (0.15 if "embed" in n else 0.2))
    m.double().eval().requires_grad_(False)
    return Target("vocab4", m, SimpleNamespace(eos_token_ids=()), "vocab4", mask_token_id=V - 1)


def _exact_law(target: Target, prompt: list[int], n: int, temperature: float) -> torch.Tensor:
    law = torch.zeros((V,) * n, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=n):
        toks = torch.tensor([prompt + list(seq)])
        out = target.model(toks, target.model.new_cache(1, 16))
        logp = torch.log_softmax(target.model.logits(out.hidden[0]) / temperature, -1)
        law[seq] = sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(seq))
    return law.exp()


def _flat_drafter(target):
    """A random drafter with a shrunken output norm: q is near-uniform, so drafts are often
    accepted and often rejected — both branches of the verifier get exercised."""
    bundle = make_bundle(target, num_layers=1, block_size=4, seed=5)
    with torch.no_grad():
        bundle.drafter.norm.weight.mul_(0.2)
    return bundle


def _sample_counts(target, bundle, prompt, n, temperature, samples=20_000):
    dec = OfflineDecoder(target, bundle, max_running=1024)  # a wide batch: one step serves many
    res = dec.generate([prompt] * samples, DecodeConfig("dflash", n, temperature=temperature, seed=11))
    counts = torch.zeros((V,) * n, dtype=torch.float64)
    for r in res:
        counts[tuple(r.token_ids)] += 1
    return counts, res


def engine_sample_counts(target, bundle, method: str, prompt, n: int, temperature: float, samples: int):
    """Counts of the n-token outputs of `samples` seeded requests on the serving engine, and the
    rounds they ran (the engine's sampling-law scaffold, shared by every method's test)."""
    from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request

    cfg = EngineConfig(method=method, max_running=64, max_queue=samples, max_model_len=16)
    engine = Engine(target, bundle, cfg)
    reqs = [
        engine.submit(Request(prompt, GenParams(max_tokens=n, temperature=temperature, seed=i)))
        for i in range(samples)
    ]
    engine.run_until_idle()
    counts = torch.zeros((target.config.vocab_size,) * n, dtype=torch.float64)
    for r in reqs:
        counts[tuple(r.output_ids)] += 1
    return counts, [rd for r in reqs for rd in r.rounds], reqs


def _chi2_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    expected = law.flatten() * counts.sum()
    observed = counts.flatten()
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_matches_target_distribution(temperature):
    target = _tiny_vocab_target()
    bundle = _flat_drafter(target)
    prompt = [0, 1, 2]
    counts, res = _sample_counts(target, bundle, prompt, 4, temperature)
    assert sum(r.accepted for x in res for r in x.rounds) > 1000  # drafts were really accepted
    assert sum(r.verify_len - 1 - r.accepted for x in res for r in x.rounds) > 1000  # and rejected
    assert _chi2_pvalue(counts, _exact_law(target, prompt, 4, temperature)) > 0.01


def test_chi_square_catches_a_biased_verifier(monkeypatch):
    """The classic bug — on rejection, resample from p instead of norm(max(0, p - q)) — must be
    detected by the same check, or the check above proves nothing."""
    real = kernels.sampling_verify

    def biased(draft_tokens, draft_probs, target_probs, cu, u_accept, u_sample):
        accepted, nxt = real(draft_tokens, draft_probs, target_probs, cu, u_accept, u_sample)
        rejected = accepted < (cu[1:] - cu[:-1] - 1)
        rows = target_probs[cu[:-1] + accepted]
        cdf = rows.cumsum(-1)
        from_p = torch.searchsorted(cdf, u_sample[:, None] * cdf[:, -1:], right=True).squeeze(1)
        return accepted, torch.where(rejected, from_p.clamp_max(V - 1), nxt)

    monkeypatch.setattr(kernels, "sampling_verify", biased)
    target = _tiny_vocab_target()
    bundle = _flat_drafter(target)
    counts, _ = _sample_counts(target, bundle, [0, 1, 2], 4, 1.0)
    assert _chi2_pvalue(counts, _exact_law(target, [0, 1, 2], 4, 1.0)) < 0.01
