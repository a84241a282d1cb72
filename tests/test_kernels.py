"""Triton kernels (run by the Triton interpreter on CPU) against their PyTorch references, and
the dispatcher on the engine's and the trainer's path."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition

import pytest  # noqa: E402
import torch  # noqa: E402

from adaflash import kernels  # noqa: E402
from adaflash.kernels import loss_reference, verify  # noqa: E402

triton_verify = pytest.importorskip("adaflash.kernels.triton_verify")
triton_loss = pytest.importorskip("adaflash.kernels.triton_loss")


def _packed(lengths, V, seed, temperature=1.0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    n_rows, n_drafts = int(cu[-1]), int(cu[-1]) - len(lengths)
    logits = torch.randn(n_rows, V, generator=g) * 3
    q_logits = torch.randn(n_drafts, V, generator=g) * 3
    return g, cu, logits / temperature, q_logits / temperature


@pytest.mark.parametrize("V", [37, 1024, 3001])
def test_greedy_kernel_equals_reference(V):
    lengths = [1, 16, 5, 2, 16, 9, 1, 3]
    g, cu, logits, _ = _packed(lengths, V, seed=V)
    top = logits.argmax(-1)
    doff = verify.draft_offsets(cu)
    # Per request: all accepted, none accepted, or a random prefix.
    drafts = torch.randint(0, V, (int(cu[-1]) - len(lengths),), generator=g)
    modes = ["all", "all", "none", "all", "partial", "partial", "none", "none"]
    for b, (n, mode) in enumerate(zip(lengths, modes, strict=True)):
        rows, ds = slice(int(cu[b]), int(cu[b]) + n - 1), slice(int(doff[b]), int(doff[b]) + n - 1)
        if mode == "all":
            drafts[ds] = top[rows]
        elif mode == "none":
            drafts[ds] = (top[rows] + 1) % V
        else:
            cut = n // 2
            drafts[ds] = top[rows]
            if n - 1 > cut:
                drafts[int(doff[b]) + cut] = (top[int(cu[b]) + cut] + 1) % V
    ref = verify.greedy_verify(drafts, logits, cu)
    got = triton_verify.greedy_verify(drafts, logits, cu)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert {0, max(lengths) - 1} <= set(ref[0].tolist())


@pytest.mark.parametrize("V,temperature", [(37, 1.0), (1500, 1.0), (3001, 0.7), (1500, 0.02)])
def test_sampling_kernel_equals_reference_given_uniforms(V, temperature):
    lengths = [1, 16, 5, 2, 16, 9, 1, 3, 12, 4]
    g, cu, logits, q_logits = _packed(lengths, V, seed=V + 1, temperature=temperature)
    # Draft j's q: its target row plus noise, so acceptance is neither ~0 nor ~1.
    doff = verify.draft_offsets(cu)
    t_rows = torch.cat([torch.arange(int(cu[b]), int(cu[b + 1]) - 1) for b in range(len(lengths))])
    assert t_rows.numel() == int(doff[-1])
    p, q = torch.softmax(logits, -1), torch.softmax(logits[t_rows] + 0.3 * q_logits, -1)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
    seen = set()
    for trial in range(6):
        ua = torch.rand(drafts.numel(), generator=g)
        if trial == 0:
            ua = torch.zeros_like(ua)  # accept every draft with p(x) > 0
        us = torch.rand(len(lengths), generator=g)
        ref = verify.sampling_verify(drafts, q, p, cu, ua, us)
        got = triton_verify.sampling_verify(drafts, q, p, cu, ua, us)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
        seen |= {
            "all" if a == n - 1 else "none" if a == 0 else "partial"
            for a, n in zip(ref[0].tolist(), lengths, strict=True)
        }
    assert seen == {"all", "none", "partial"}


def test_sampling_kernel_when_p_equals_q_falls_back_to_p():
    lengths = [4, 3]
    g, cu, logits, _ = _packed(lengths, 50, seed=3)
    p = torch.softmax(logits, -1)
    doff = verify.draft_offsets(cu)
    q = torch.cat([p[int(cu[b]) : int(cu[b + 1]) - 1] for b in range(2)])
    drafts = q.argmax(-1)
    ua, us = torch.ones(drafts.numel()), torch.rand(2, generator=g)  # u·q < p fails when p == q
    ref = verify.sampling_verify(drafts, q, p, cu, ua, us)
    got = triton_verify.sampling_verify(drafts, q, p, cu, ua, us)
    assert ref[0].tolist() == [0, 0] == got[0].tolist() and torch.equal(ref[1], got[1])
    assert doff.tolist() == [0, 3, 5]


@pytest.mark.parametrize("kind", ["opd", "fkl", "ce"])
@pytest.mark.parametrize("V", [37, 2500])
def test_fused_loss_and_gradients_match_reference(kind, V):
    g = torch.Generator().manual_seed(V)
    z = (torch.randn(9, V, generator=g) * 4).requires_grad_(True)
    teacher = torch.log_softmax(torch.randn(9, V, generator=g) * 4, -1)
    w = torch.rand(9, generator=g)
    for delta in (0.01, 1e-4):
        z.grad = None
        ref = loss_reference.drafter_loss_rows(kind, z, teacher, 0.8, delta)
        (ref * w).sum().backward()
        g_ref = z.grad.clone()
        z.grad = None
        got = triton_loss.drafter_loss_rows(kind, z, teacher, 0.8, delta)
        (got * w).sum().backward()
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(z.grad, g_ref, rtol=0, atol=1e-5)
    if kind == "opd":  # δ = 1e-4 really clips some entries and keeps others
        q = torch.softmax(z.detach(), -1)
        t = q * (torch.log(q) - teacher)
        assert (t > 1e-4).any() and (t <= 1e-4).any()


def test_dispatcher_is_on_the_engine_and_trainer_paths(tiny32, monkeypatch):
    from adaflash.serving.offline import DecodeConfig, OfflineDecoder
    from adaflash.training.losses import drafter_loss
    from tests.conftest import make_bundle

    prompts = [[256, *b"hello"], [256, *b"kernels"]]
    dec = OfflineDecoder(tiny32, make_bundle(tiny32))
    kernels.calls.clear()
    ref_greedy = dec.generate(prompts, DecodeConfig("dflash", 12))
    dec.generate(prompts, DecodeConfig("dflash", 12, temperature=0.8))
    drafter_loss("opd", torch.randn(3, 320), torch.log_softmax(torch.randn(3, 320), -1))
    assert kernels.calls[("greedy_verify", "reference")] > 0
    assert kernels.calls[("sampling_verify", "reference")] > 0
    assert kernels.calls[("drafter_loss_rows", "reference")] == 1

    monkeypatch.setenv("ADAFLASH_KERNELS", "triton")
    kernels.calls.clear()
    via_triton = dec.generate(prompts, DecodeConfig("dflash", 12))
    assert (
        kernels.calls[("greedy_verify", "triton")] > 0 and not kernels.calls[("greedy_verify", "reference")]
    )
    assert [r.token_ids for r in via_triton] == [r.token_ids for r in ref_greedy]
    logits = torch.randn(3, 320, requires_grad=True)
    drafter_loss("opd", logits, torch.log_softmax(torch.randn(3, 320), -1)).sum().backward()
    assert kernels.calls[("drafter_loss_rows", "triton")] == 1 and logits.grad is not None
