"""Adaptive length head: k̂ formula and gradient isolation from the drafter."""

from __future__ import annotations

import torch

from adaflash.models.length_head import LengthHead, acceptance_label, verify_lengths
from tests.conftest import make_bundle


def test_verify_length_formula_and_bounds():
    a = torch.tensor([0.0, 0.01, 0.2, 0.5, 0.99, 1.0])
    assert verify_lengths(a, 16).tolist() == [1, 1, 3, 8, 15, 16]
    assert verify_lengths(a, 16, gamma=0.5).tolist() == [1, 1, 1, 4, 7, 8]
    assert verify_lengths(a, 16, gamma=3.0).tolist() == [1, 1, 9, 16, 16, 16]
    rnd = torch.rand(10_000)
    for k in (1, 4, 8, 16):
        for g in (0.3, 1.0, 2.5):
            kh = verify_lengths(rnd, k, g)
            assert kh.min() >= 1 and kh.max() <= k
            assert torch.equal(kh, torch.clamp(torch.floor(g * rnd * k), 1, k).long())


def test_head_output_in_unit_interval_and_labels():
    head = LengthHead(32, 16)
    a = head(torch.randn(5, 8, 32) * 100)
    assert a.shape == (5,) and (a >= 0).all() and (a <= 1).all()
    assert acceptance_label(torch.tensor([0, 7, 15]), 16).tolist() == [1 / 16, 0.5, 1.0]


def test_length_head_loss_never_reaches_the_drafter(tiny32):
    b = make_bundle(tiny32)
    drafter, head = b.drafter.train().requires_grad_(True), b.length_head.train().requires_grad_(True)
    ctx = torch.randn(1, 12, 128)
    kv = drafter.context_kv(ctx, torch.arange(12)[None])
    emb = tiny32.model.embed(torch.tensor([[65] + [tiny32.mask_token_id] * 7]))
    hidden = drafter(emb, torch.arange(12, 20)[None], kv, torch.ones(1, 8, 12, dtype=torch.bool))
    loss = (head(hidden) - 0.7).pow(2).mean()
    loss.backward()
    assert all(p.grad is None for p in drafter.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
