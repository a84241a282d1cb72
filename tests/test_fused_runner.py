"""Our C slot attention and row ops (models/slot_attention.py, models/row_ops.py) and the runner's
fused path built on them: right against PyTorch, each row's bits independent of the rows beside
it, bad inputs refused, and fp32 serving through it token-identical to AR under continuous
batching."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from adaflash.models import row_ops, slot_attention
from adaflash.models.layers import apply_rope, rope_tables
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.runner import PackedBatch, PackedRunner, Segment
from tests.conftest import make_bundle
from tests.test_speculative import quick_train

H, KVH, D = 6, 2, 32


def _case(seed: int, slots: int = 4, cap: int = 96):
    g = torch.Generator().manual_seed(seed)
    # rows of several requests: a prefill, a 3-row verify, 1-row decodes, in mixed slot order
    rows = [(2, p) for p in range(40)] + [(0, 17), (0, 18), (0, 19), (3, 95), (1, 0)]
    slot_rows = torch.tensor([s for s, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    qkv = torch.randn(len(rows), (H + 2 * KVH) * D, generator=g)
    ck = torch.randn(slots, KVH, cap, D, generator=g)  # stale entries everywhere else
    cv = torch.randn(slots, KVH, cap, D, generator=g)
    return qkv, slot_rows, positions, ck, cv


def _reference(qkv, slot_rows, positions, ck, cv, q_norm=None, k_norm=None, eps=1e-6):
    """RoPE, the cache write and causal attention in float64 with PyTorch, row by row."""
    cos, sin = rope_tables(positions[None], D, 10000.0, torch.float64)
    q, k, v = qkv.double().split([H * D, KVH * D, KVH * D], dim=-1)
    q, k, v = q.view(-1, H, D), k.view(-1, KVH, D), v.view(-1, KVH, D)
    if q_norm is not None:
        q = F.rms_norm(q, (D,), q_norm.double(), eps)
        k = F.rms_norm(k, (D,), k_norm.double(), eps)
    q = apply_rope(q.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    k = apply_rope(k.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
    ck, cv = ck.double().clone(), cv.double().clone()
    ck[slot_rows, :, positions], cv[slot_rows, :, positions] = k, v
    out = []
    for n in range(len(positions)):
        keys, values = ck[slot_rows[n], :, : positions[n] + 1], cv[slot_rows[n], :, : positions[n] + 1]
        out.append(F.scaled_dot_product_attention(q[n][:, None], keys, values, enable_gqa=True)[:, 0])
    return torch.stack(out), ck, cv


def _attend(qkv, slot_rows, positions, ck, cv, **norms):
    cos, sin = rope_tables(positions, D, 10000.0, torch.float32)
    return slot_attention.attend(qkv, cos, sin, ck, cv, slot_rows, positions, H, **norms)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_slot_attention_matches_pytorch_and_writes_the_cache(qk_norm: bool) -> None:
    qkv, slot_rows, positions, ck, cv = _case(0)
    g = torch.Generator().manual_seed(1)
    norms = {}
    if qk_norm:  # Qwen3's per-head norms
        norms = {"q_norm": torch.rand(D, generator=g) + 0.5, "k_norm": torch.rand(D, generator=g) + 0.5}
    ref, ref_k, ref_v = _reference(qkv, slot_rows, positions, ck, cv, **norms)
    out = _attend(qkv, slot_rows, positions, ck, cv, **({**norms, "eps": 1e-6} if norms else {}))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ck.double(), ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(cv.double(), ref_v)


def test_a_row_gets_the_same_bits_alone_as_among_others() -> None:
    qkv, slot_rows, positions, ck, cv = _case(2)
    together = _attend(qkv, slot_rows, positions, ck, cv)
    for n in range(len(positions)):  # its slot's earlier rows were written by the packed call
        alone = _attend(qkv[n : n + 1], slot_rows[n : n + 1], positions[n : n + 1], ck, cv)
        assert torch.equal(alone[0], together[n]), n


def test_out_of_range_rows_are_refused_before_anything_is_written() -> None:
    qkv, slot_rows, positions, ck, cv = _case(3)
    before = ck.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        _attend(qkv[:2], torch.tensor([0, 4]), positions[:2], ck, cv)
    with pytest.raises(ValueError, match="outside the cache"):
        _attend(qkv[:1], slot_rows[:1], torch.tensor([96]), ck, cv)
    with pytest.raises(ValueError, match="fp32"):
        _attend(qkv.double(), slot_rows, positions, ck, cv)
    assert torch.equal(ck, before)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 20), h=st.sampled_from([8, 64, 576]), seed=st.integers(0, 99))
def test_row_ops_match_pytorch_row_by_row(n: int, h: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, a = torch.randn(n, h, generator=g) * 30, torch.randn(n, h, generator=g)
    w = torch.rand(h, generator=g) + 0.5
    s, y = row_ops.add_rms_norm(x, a, w, 1e-5)
    assert torch.equal(s, x + a)
    torch.testing.assert_close(y, F.rms_norm(x + a, (h,), w, 1e-5), rtol=1e-5, atol=1e-5)
    gu = torch.randn(n, 2 * h, generator=g) * 4
    z = row_ops.silu_mul(gu)
    torch.testing.assert_close(z, F.silu(gu[:, :h]) * gu[:, h:], rtol=1e-5, atol=1e-5)
    i = n // 2
    assert torch.equal(row_ops.add_rms_norm(x[i : i + 1], a[i : i + 1], w, 1e-5)[1][0], y[i])
    assert torch.equal(row_ops.silu_mul(gu[i : i + 1])[0], z[i])


def test_the_fused_runner_matches_the_pytorch_layers(tiny32) -> None:
    prompts = [list(b"the fused runner, request %d" % i) for i in range(3)]
    results = []
    for fused in (True, False):
        runner = PackedRunner(tiny32.model, 3, 64)
        assert runner.fused  # fp32 on the CPU with a compiler: the fused path is the default
        runner.fused = fused
        prefill, _ = runner.forward(PackedBatch.build([Segment(i, 0, p) for i, p in enumerate(prompts)]))
        step = [Segment(0, len(prompts[0]), [7, 8, 9]), Segment(2, len(prompts[2]), [10])]
        verify, features = runner.forward(PackedBatch.build(step), capture_layers=(1, 3))
        results.append((prefill, verify, features))
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_fp32_speculation_through_the_fused_runner_is_token_identical_to_ar(tiny32) -> None:
    bundle = quick_train(make_bundle(tiny32, block_size=8, seed=4), tiny32, 40, seed=4)
    prompts = [[256, *f"q{i}: {'ab' * (i % 5)} {i * 7}?".encode()] for i in range(12)]
    outputs = {}
    for method in ("ar", "adaflash", "ngram"):
        engine = Engine(tiny32, bundle, EngineConfig(method=method, max_running=6), "v1")
        assert engine.runner.fused
        reqs = [Request(p, GenParams(max_tokens=40, temperature=0.0)) for p in prompts]
        for r in reqs[:6]:
            engine.submit(r)
        rest = reqs[6:]
        while engine.step() is not None or rest:  # continuous arrivals: mixed prefills and verifies
            if rest:
                engine.submit(rest.pop(0))
        outputs[method] = [r.output_ids for r in reqs]
        if method != "ar":
            assert any(rd.verify_len > 1 for r in reqs for rd in r.rounds), method
    assert outputs["adaflash"] == outputs["ar"]
    assert outputs["ngram"] == outputs["ar"]
