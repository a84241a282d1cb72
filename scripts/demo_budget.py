"""How `make demo`'s training budget and serving γ were chosen (BENCHMARKS.md, the issue 16 run).

Serves held-out prompts of one domain with the shipped drafter on the engine (the demo's traffic),
fine-tunes a copy on some of the records with the pipeline's trainer, and after every epoch
reports the paired per-record τ gain on the rest (full block, and served at each γ):

    ADAFLASH_THREADS=1 python scripts/demo_budget.py --domain code --train 112 --heldout 48 \\
        --epochs 1 --gammas 1,2,3 --out .cache/demo_budget

Served records are cached in --out, so reruns with another budget skip the serving.
"""

from __future__ import annotations

import argparse
import json
import random
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from adaflash.components.gate import paired_bootstrap
from adaflash.components.steps import serve_greedy
from adaflash.feedback.schema import CleanRecord, FeedbackRecord, Provenance, RoundRecord
from adaflash.models.checkpoint import load_drafter_for
from adaflash.models.targets import load_target
from adaflash.training.blocks import sequence_pass
from adaflash.training.evaluate import acceptance_per_sequence
from adaflash.training.online import OnlineConfig, OnlineTrainer
from adaflash.workloads import load_prompts


def served_records(target, bundle, domain: str, n: int, max_tokens: int, cache: Path) -> list[CleanRecord]:
    """The newest n held-out prompts of `domain` (as the demo picks them), served at T=0."""
    tok = target.tokenizer
    texts = [p.text for p in reversed(load_prompts("heldout")[domain]) if len(p.text) <= 1000][:n]
    prompts = [(str(i), domain, tok.chat_prompt(t)) for i, t in enumerate(texts)]
    if cache.exists():
        served = json.loads(cache.read_text())
    else:
        reqs = serve_greedy(target, bundle, "adaflash", prompts, 8, max_tokens).requests
        served = [{"out": r.output_ids, "rounds": [(x.start, x.verify_len, x.accepted) for x in r.rounds]}
                  for r in reqs]  # fmt: skip
        cache.write_text(json.dumps(served))
    rng = random.Random(0)
    out = []
    for i, ((_, _, p), s) in enumerate(zip(prompts, served, strict=True)):
        rec = FeedbackRecord(
            record_id=uuid.UUID(int=rng.getrandbits(128)).hex, request_id=str(i), tenant_id=f"t{i % 4}",
            domain=domain, created_at=datetime.now(UTC), target_fingerprint=target.fingerprint,
            method="adaflash", block_size=bundle.drafter.block_size, prompt_text=tok.decode(p),
            output_text=tok.decode(s["out"]), prompt_token_ids=p, output_token_ids=s["out"],
            rounds=[RoundRecord(start=a, verify_len=b, accepted=c) for a, b, c in s["rounds"]],
        )  # fmt: skip
        prov = Provenance(topic="served", partition=0, offset=i, governed_at=datetime.now(UTC))
        out.append(CleanRecord(record=rec, provenance=prov))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domain", default="code")
    ap.add_argument("--train", type=int, default=112)
    ap.add_argument("--heldout", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--head-lr", type=float, default=2e-4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gammas", default="1,2,3")
    ap.add_argument("--out", type=Path, default=Path(".cache/demo_budget"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    target = load_target("smollm2")
    v1 = load_drafter_for("drafters/smollm2", target)
    n = a.train + a.heldout
    recs = served_records(
        target, v1, a.domain, n, a.max_tokens, a.out / f"served-{a.domain}-{n}-{a.max_tokens}.json"
    )
    order = list(range(len(recs)))
    random.Random(1).shuffle(order)
    held, train = [recs[i] for i in order[: a.heldout]], [recs[i] for i in order[a.heldout :]]
    gammas = [float(g) for g in a.gammas.split(",")]
    # Served outputs are the greedy ones (lossless), so the replay runs on them: one target pass.
    seqs = [r.record.prompt_token_ids + r.record.output_token_ids for r in held]
    ids = v1.drafter.config.target_layer_ids
    passes = [p for i in range(0, len(seqs), 8) for p in sequence_pass(target.model, seqs[i : i + 8], ids)]
    starts = [len(r.record.prompt_token_ids) for r in held]

    def replay(bundle) -> dict[str, np.ndarray]:
        """Per held-out record: full-block τ, and served τ (the k̂ walk) at each γ."""
        out = {}
        for g in gammas:
            rows = acceptance_per_sequence(
                bundle.drafter, target.model, passes, starts, bundle.length_head, g
            )
            out["tau_full"] = np.array([r.tau_full for r in rows])
            out[f"served γ={g:g}"] = np.array([r.head_tokens / max(r.head_rounds, 1) for r in rows])
        return out

    base = replay(v1)
    print({k: round(float(v.mean()), 3) for k, v in base.items()}, flush=True)
    v2 = load_drafter_for("drafters/smollm2", target)
    cfg = OnlineConfig(epochs=a.epochs, lr=a.lr, head_lr=a.head_lr)
    trainer = OnlineTrainer(target, v2, a.out / "v2", cfg)

    def progress(kind: str, info: dict) -> None:
        if kind != "step" or info["record"] != info["of"]:
            return
        now = replay(v2)
        for k, v in now.items():
            gain, low, high = paired_bootstrap(v - base[k], 2000, 0.95, seed=0)
            print(f"epoch {info['epoch'] + 1}: {k} {base[k].mean():.3f} → {v.mean():.3f}, "
                  f"Δ {gain:+.3f} [{low:+.3f}, {high:+.3f}]", flush=True)  # fmt: skip

    trainer.progress = progress
    print(f"{trainer.train(train)['steps']} optimiser steps", flush=True)


if __name__ == "__main__":
    main()
