"""The target runner: equal to HF's Llama/Qwen3, KV cache and padded batches exact."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.errors import AdaFlashError
from adaflash.models.generate import greedy_generate
from adaflash.models.layers import apply_rope, rope_tables
from adaflash.models.targets import fingerprint_of, load_target, tiny_target


def _hf_model(target, arch="llama"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    c = target.config
    kw = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
    )
    cls, cfg = (LlamaForCausalLM, LlamaConfig) if arch == "llama" else (Qwen3ForCausalLM, Qwen3Config)
    hf = cls(cfg(**kw)).double().eval()
    state = {f"model.{k}": v for k, v in target.model.state_dict().items() if k != "lm_head.weight"}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected
    assert all(k == "lm_head.weight" or k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing)
    with torch.no_grad():  # Qwen3's q/k norms: random, so the test exercises them
        for k in missing:
            if k.endswith("norm.weight"):
                hf.get_parameter(k).uniform_(0.5, 1.5)
    return hf


# HF computes RMSNorm and RoPE tables in fp32 even in a float64 model: compare at fp32 precision.
HF_ATOL = 1e-4


def test_matches_hf_llama_logits_and_hidden_states(tiny64):
    hf = _hf_model(tiny64)
    x = torch.randint(0, 256, (2, 23))
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True)
    cache = tiny64.model.new_cache(2, 32)
    out = tiny64.model(x, cache, capture_layers=(0, 2))
    torch.testing.assert_close(tiny64.model.logits(out.hidden), ref.logits, rtol=0, atol=HF_ATOL)
    H = tiny64.config.hidden_size
    torch.testing.assert_close(out.features[..., :H], ref.hidden_states[1], rtol=0, atol=HF_ATOL)
    torch.testing.assert_close(out.features[..., H:], ref.hidden_states[3], rtol=0, atol=HF_ATOL)


def test_incremental_and_padded_batches_equal_full_forward(tiny64):
    m = tiny64.model
    seqs = [torch.randint(0, 256, (n,)) for n in (17, 9, 30)]
    full = []
    for s in seqs:
        c = m.new_cache(1, 64)
        full.append(m.logits(m(s[None], c).hidden)[0])
    # Padded prefill of different lengths, then token-by-token decode of the rest.
    prefix = [s[:5] for s in seqs]
    pad = torch.stack([torch.nn.functional.pad(p, (0, 0)) for p in prefix])
    cache = m.new_cache(3, 64)
    out = m(pad, cache)
    cache.commit(torch.tensor([5, 5, 5]))
    for i in range(3):
        torch.testing.assert_close(m.logits(out.hidden[i]), full[i][:5], rtol=0, atol=1e-9)
    # Ragged step: 3 / 1 / 4 tokens, padded to 4; the padding must not disturb anything.
    steps = [3, 1, 4]
    toks = torch.zeros(3, 4, dtype=torch.long)
    for i, n in enumerate(steps):
        toks[i, :n] = seqs[i][5 : 5 + n]
    out = m(toks, cache)
    for i, n in enumerate(steps):
        torch.testing.assert_close(m.logits(out.hidden[i, :n]), full[i][5 : 5 + n], rtol=0, atol=1e-9)
    cache.commit(torch.tensor(steps))
    # Rejection: roll request 2 back by 2 tokens and continue from there.
    cache.lengths[2] -= 2
    nxt = torch.stack([seqs[0][8], seqs[1][6], seqs[2][7]])[:, None]
    out = m(nxt, cache)
    torch.testing.assert_close(m.logits(out.hidden[2, 0]), full[2][7], rtol=0, atol=1e-9)
    torch.testing.assert_close(m.logits(out.hidden[0, 0]), full[0][8], rtol=0, atol=1e-9)


def test_greedy_generate_matches_hf_generate(tiny64):
    hf = _hf_model(tiny64)
    prompts = [[256, *b"hello"], [256, *b"a longer prompt here"]]
    ours = greedy_generate(tiny64.model, prompts, 20)
    for p, o in zip(prompts, ours, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None)
        assert o == ref[0, len(p) :].tolist()


@pytest.mark.parametrize("max_new", [1, 9, 24])
def test_continuous_batching_refill_equals_one_by_one(tiny64, max_new):
    g = torch.Generator().manual_seed(0)
    prompts = [
        [256, *torch.randint(0, 256, (int(n),), generator=g).tolist()] for n in (3, 40, 7, 19, 1, 25, 11)
    ]
    alone = [greedy_generate(tiny64.model, [p], max_new)[0] for p in prompts]
    # An eos that some continuations hit early makes slots free up at different times.
    eos = alone[1][min(4, max_new - 1)]
    alone_eos = [greedy_generate(tiny64.model, [p], max_new, (eos,))[0] for p in prompts]
    assert greedy_generate(tiny64.model, prompts, max_new, slots=2, refill_fraction=0.5) == alone
    assert greedy_generate(tiny64.model, prompts, max_new, (eos,), slots=3, refill_fraction=0.3) == alone_eos
    assert all(len(r) == max_new for r in alone)


def test_fingerprint_tracks_weights(tiny32):
    state = {k: v.clone() for k, v in tiny32.model.state_dict().items()}
    fp = fingerprint_of(tiny32.config, state)
    assert fp == tiny_target().fingerprint
    state["norm.weight"][0] += 1e-3
    assert fingerprint_of(tiny32.config, state) != fp


def test_loads_hf_qwen3_checkpoint_directory(tmp_path, tiny64):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf = _hf_model(tiny64, arch="qwen3").float()
    hf.save_pretrained(tmp_path)
    vocab = {chr(i + 33): i for i in range(200)} | {"[UNK]": 200, "[MASK]": 201, "</s>": 202}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", mask_token="[MASK]", eos_token="</s>"
    ).save_pretrained(tmp_path)
    target = load_target(str(tmp_path), torch.float64)
    assert target.config.arch == "qwen3" and target.mask_token_id == 201
    x = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        ref = hf.double()(x).logits
    out = target.model(x, target.model.new_cache(1, 16))
    torch.testing.assert_close(target.model.logits(out.hidden), ref, rtol=0, atol=HF_ATOL)


def test_unknown_target_and_bad_dirs(tmp_path):
    with pytest.raises(AdaFlashError, match="unknown target"):
        load_target("gpt-17")
    with pytest.raises(AdaFlashError, match="config.json"):
        load_target(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(AdaFlashError, match="unsupported target architecture"):
        load_target(str(tmp_path))


def test_generation_streams_results_and_stops_at_deadline(tiny64):
    import time

    prompts = [[256, 65 + i] for i in range(6)]
    seen: dict[int, list[int]] = {}
    out = greedy_generate(tiny64.model, prompts, 8, slots=2, on_done=lambda i, t: seen.setdefault(i, list(t)))
    assert seen == dict(enumerate(out)) and all(len(t) == 8 for t in out)
    late = greedy_generate(tiny64.model, prompts, 8, slots=2, deadline=time.time() - 1)
    assert late == [None] * 6
    # Cut mid-way: started prompts come back as greedy prefixes, the rest as None.
    clock = iter([0.0] * 4 + [1e12] * 1000)
    import adaflash.models.generate as gen

    real = gen.time.time
    gen.time.time = lambda: next(clock)
    try:
        cut = greedy_generate(tiny64.model, prompts, 8, slots=2, deadline=1.0)
    finally:
        gen.time.time = real
    assert cut[:2] == [out[0][: len(cut[0])], out[1][: len(cut[1])]] and 0 < len(cut[0]) < 8
    assert cut[2:] == [None] * 4


def test_frozen_linears_match_the_modules_and_follow_weight_changes():
    """The prepacked inference path (`models.packed`) computes what the modules compute, and a
    packed copy never outlives the weights it was built from (optimizer steps, new parameters,
    dtype casts, load_state_dict)."""
    from adaflash.models.packed import fused_linear

    torch.manual_seed(0)
    q, k = torch.nn.Linear(16, 8, bias=True), torch.nn.Linear(16, 4, bias=False)
    owner = torch.nn.Module()
    x = torch.randn(5, 3, 16)
    with torch.no_grad():
        for _ in range(2):  # built, then reused
            fq, fk = fused_linear(owner, "qk", x, q, k)
            torch.testing.assert_close(fq, q(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fk, k(x), rtol=1e-5, atol=1e-5)
        q.weight.mul_(2)  # an in-place update (what an optimizer step does)
        torch.testing.assert_close(fused_linear(owner, "qk", x, q, k)[0], q(x), rtol=1e-5, atol=1e-5)
        k.weight = torch.nn.Parameter(torch.zeros(4, 16))
        assert torch.equal(fused_linear(owner, "qk", x, q, k)[1], torch.zeros(5, 3, 4))
        q.to(torch.bfloat16), k.to(torch.bfloat16)
        xb = x.bfloat16()
        torch.testing.assert_close(fused_linear(owner, "qk", xb, q, k)[0], q(xb))
        q.load_state_dict({"weight": torch.ones(8, 16), "bias": torch.zeros(8)})
        torch.testing.assert_close(fused_linear(owner, "qk", xb, q, k)[0], q(xb))
    x.requires_grad_(True)  # with autograd: the modules themselves, gradients flow
    fused_linear(owner, "qk", x.bfloat16(), q.requires_grad_(True), k)[0].sum().backward()
    assert q.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_the_sign_in_the_table_is_rotate_half_bit_for_bit(dtype):
    """`apply_rope` rolls instead of slicing and negating; its products must be HF's exactly."""
    positions = torch.randint(0, 4096, (2, 5))
    x = (torch.randn(2, 3, 5, 64) * 40).to(dtype)
    cos, signed_sin = rope_tables(positions, 64, 10000.0, dtype)
    sin = signed_sin.clone()
    sin[..., :32] = -sin[..., :32]  # the plain sin table
    assert torch.all(sin[..., :32] == sin[..., 32:])
    rotated = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
    assert torch.equal(apply_rope(x, cos, signed_sin), x * cos[:, None] + rotated * sin[:, None])
