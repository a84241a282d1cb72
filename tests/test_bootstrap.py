"""Bootstrap end to end on the tiny target: data generation, training, metrics, resume."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.errors import AdaFlashError
from adaflash.kernels.loss_reference import clipped_reverse_kl, forward_kl, hard_ce
from adaflash.models.checkpoint import load_drafter
from adaflash.models.targets import native_bf16
from adaflash.training.bootstrap import STATE, BootstrapConfig, BootstrapTrainer
from adaflash.training.losses import drafter_loss


def test_bootstrap_trains_writes_metrics_and_resumes(tmp_path, tiny32, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "drafter"
    cfg = BootstrapConfig(
        steps=100,
        num_layers=1,
        block_size=8,
        num_feature_layers=2,
        max_new_tokens=32,
        eval_per_domain=3,
        curve_per_domain=2,
        max_train_prompts=48,
        anchors_per_seq=16,
        curve_every_steps=20,
        head_steps=10,
        lr=3e-3,
    )
    events = []
    m1 = BootstrapTrainer(tiny32, out, cfg, progress=lambda k, i: events.append(k)).run()
    assert {"generate", "features_start", "train_start", "step", "head", "evaluate"} <= set(events)
    metrics = json.loads((out / "bootstrap_metrics.json").read_text())
    # bf16 by default where the CPU has it natively; the metrics say which step ran.
    assert metrics["config"]["bf16"] is native_bf16("cpu")
    assert set(metrics["heldout"]) == {"math", "code", "chat", "all"}
    for row in metrics["heldout"].values():
        assert row["dflash_tau"] >= 1.0 and 1.0 <= row["adaflash_mean_verify_len"] <= 8
        assert row["ngram_tau"] >= 1.0
    # Training helped: the curve starts at an untrained drafter and ends higher.
    assert metrics["tau_vs_budget"][0]["step"] == 0 and metrics["steps"] == 100
    assert metrics["heldout"]["all"]["dflash_tau"] > metrics["tau_vs_budget"][0]["dflash_tau"]
    bundle = load_drafter(out, target_fingerprint=tiny32.fingerprint)
    assert bundle.length_head is not None and bundle.meta.lineage["train_sequences"] == 48
    assert (out / STATE).exists()

    # Resume: more steps continue from the saved state (same data order), not from scratch.
    more = BootstrapConfig(**{**cfg.__dict__, "steps": 130})
    resumed = []
    m2 = BootstrapTrainer(tiny32, out, more, progress=lambda k, i: resumed.append((k, i))).run()
    assert resumed[0] == ("resume", {"step": 100, "head_step": 10})
    assert m2["steps"] == 130 and len(m2["tau_vs_budget"]) > len(m1["tau_vs_budget"])
    assert not any(k == "generate" for k, _ in resumed)  # responses and features were reused

    # Warm start: a new --out starts from this drafter's weights and head (fc not re-standardised).
    warm = tmp_path / "warm"
    again = BootstrapConfig(**{**cfg.__dict__, "steps": 0, "head_steps": 0, "init_from": str(out)})
    m3 = BootstrapTrainer(tiny32, warm, again).run("adaflash drafter bootstrap --init-from ...")
    before, after = (load_drafter(d, target_fingerprint=tiny32.fingerprint) for d in (out, warm))
    for (name, a), b in zip(
        before.drafter.state_dict().items(), after.drafter.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert m3["heldout"]["all"]["dflash_tau"] == pytest.approx(m2["heldout"]["all"]["dflash_tau"])
    assert after.meta.lineage["init_from"] == str(out)
    assert f"warm-started from `{out}`" in (warm / "README.md").read_text()
    with pytest.raises(AdaFlashError, match="block_size 8, this run 4"):
        BootstrapTrainer(tiny32, tmp_path / "other", BootstrapConfig(**{**again.__dict__, "block_size": 4}))


def test_bootstrap_never_generates_when_told_not_to(tmp_path, tiny32, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    cfg = BootstrapConfig(steps=1, num_layers=1, block_size=8, num_feature_layers=2, generate_missing=False)
    with pytest.raises(AdaFlashError, match="no training or held-out responses"):
        BootstrapTrainer(tiny32, tmp_path / "d", cfg).run()


def test_losses_definitions():
    torch.manual_seed(0)
    logits = torch.randn(5, 11, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(5, 11) * 2, -1)
    q = torch.softmax(logits, -1)
    terms = q * (torch.log(q) - teacher)
    # Clipping is per (position, vocab entry), not on the row sum.
    assert torch.allclose(clipped_reverse_kl(logits, teacher, 0.01), terms.clamp(max=0.01).sum(-1))
    assert torch.allclose(clipped_reverse_kl(logits, teacher, 1e9), terms.sum(-1))
    p = teacher.exp()
    assert torch.allclose(forward_kl(logits, teacher), (p * (teacher - torch.log(q))).sum(-1))
    x_star = teacher.argmax(-1)
    opd = drafter_loss("opd", logits, teacher, alpha=0.8, delta=0.01)
    assert torch.allclose(opd, 0.8 * hard_ce(logits, x_star) + 0.2 * terms.clamp(max=0.01).sum(-1))
    # Entries above δ contribute no gradient.
    clipped_reverse_kl(logits, teacher, -1e9).sum().backward()
    assert logits.grad.abs().max() == 0
