"""Where a bootstrap training step's CPU time goes, and steps per CPU-minute of each step variant.

Each variant (`sequential`: one forward/backward per sequence, today's step before issue 34;
`batched`: one padded forward/backward per step; `+bf16`: under bf16 autocast) trains a fresh
drafter from the same seed on the same data order (the shipped recipe unless overridden), in
alternating rounds so a busy machine shifts every variant alike. Time is this process's CPU time
(`time.process_time`), not wall time, at `--threads` torch threads. Reported per variant: ms of
CPU per step, steps per CPU-minute, the ratio to the first variant, and the loss of every step
(same seed and data: `batched` must track `sequential` up to float rounding; bf16 shows its
drift). `--profile N` adds torch.profiler's top ops over N steps of each variant.

    ADAFLASH_CACHE=.cache/adaflash nice -n 10 python scripts/profile_bootstrap.py \\
        --target smollm2 --steps 20 --rounds 2 --out benchmarks/bootstrap-step

`--stored-only` trains on the sequences whose features are already stored (no target pass; the
store's first shards hold the shortest sequences, so steps are cheaper than on the full set);
the training vocabulary is always the full train set's. `--tau N` scores each variant's drafter
on N held-out prompts per domain after its steps. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from adaflash.models.targets import load_target
from adaflash.training.blocks import SequencePass
from adaflash.training.bootstrap import BootstrapConfig, BootstrapTrainer
from adaflash.training.evaluate import evaluate_acceptance
from adaflash.training.feature_store import build_store
from adaflash.training.offline import VocabCut
from adaflash.workloads import interleave, load_prompts

VARIANTS = {
    "default": {},  # the checkout's own recipe: compares commits (today's step before issue 34)
    "sequential": {"batch_step": False, "bf16": False},
    "batched": {"batch_step": True, "bf16": False},
    "batched+bf16": {"batch_step": True, "bf16": True},
    "sequential+bf16": {"batch_step": False, "bf16": True},
}


def _data(target, cfg: BootstrapConfig, stored_only: bool):
    """The train feature store and the training vocabulary (cut from every train response)."""
    probe = BootstrapTrainer(target, Path(tempfile.mkdtemp()), cfg)
    train = probe._responses("train", interleave(load_prompts("train")), None)
    layers = probe.drafter.config.target_layer_ids
    store = build_store(
        target, train, layers, response_set=f"greedy-{cfg.max_new_tokens}", compute_missing=not stored_only
    )
    vocab = VocabCut.from_tokens(
        target.config.vocab_size,
        (torch.tensor(r.response_ids, dtype=torch.long) for r in train),
        extra=target.tokenizer.eos_token_ids,
    )
    return store, vocab


class Run:
    """One variant's trainer, advanced a few steps at a time."""

    def __init__(self, target, cfg: BootstrapConfig, store, vocab) -> None:
        self.trainer = BootstrapTrainer(target, Path(tempfile.mkdtemp()), cfg)
        self.trainer._standardize_fc([store[i] for i in range(min(16, len(store)))])
        self.store, self.vocab = store, vocab
        self.cpu_s, self.steps, self.losses = 0.0, 0, []

    def advance(self, n: int, timed: bool = True) -> None:
        t = time.process_time()
        for _ in range(n):
            info = self.trainer._train_step(self.store, self.vocab)
            self.trainer.state.step += 1
            self.losses.append(info["loss"])
        if timed:
            self.cpu_s += time.process_time() - t
            self.steps += n


def _heldout(target, cfg: BootstrapConfig, per_domain: int) -> tuple[list, list, list]:
    """The first `per_domain` held-out sequences of each domain (passes, starts, domains)."""
    probe = BootstrapTrainer(target, Path(tempfile.mkdtemp()), cfg)
    prompts = interleave(load_prompts("heldout"), cfg.eval_per_domain)
    held = probe._responses("heldout", prompts, None)
    store = build_store(
        target, held, probe.drafter.config.target_layer_ids, response_set=f"greedy-{cfg.max_new_tokens}"
    )
    seqs = [store[i] for i in range(len(store))]
    seqs = [
        s for d in sorted({s.domain for s in seqs}) for s in [x for x in seqs if x.domain == d][:per_domain]
    ]
    passes = [SequencePass(s.tokens, s.features, None) for s in seqs]
    return passes, [s.prompt_len for s in seqs], [s.domain for s in seqs]


def _tau(run: Run, target, held: tuple[list, list, list]) -> dict[str, float]:
    run.trainer.drafter.eval()
    rep = evaluate_acceptance(run.trainer.drafter, target.model, *held)
    run.trainer.drafter.train()
    return {d: round(r["dflash_tau"], 4) for d, r in rep.items()}


def _top_ops(run: Run, steps: int, rows: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run.advance(steps, timed=False)
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [
        {"op": e.key, "shapes": str(e.input_shapes)[:80], "share": round(e.self_cpu_time_total / total, 3)}
        for e in events[:rows]
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--variants", default="sequential,batched,batched+bf16")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", type=int, default=2, help="untimed steps per variant first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", type=int, default=0, help="torch.profiler over N steps per variant")
    ap.add_argument("--stored-only", action="store_true")
    ap.add_argument("--tau", type=int, default=0, help="after training: held-out τ on N prompts per domain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/bootstrap-step"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    base = BootstrapConfig(generate_missing=False, seed=args.seed)
    store, vocab = _data(target, base, args.stored_only)
    names = args.variants.split(",")
    runs = {n: Run(target, replace(base, **VARIANTS[n]), store, vocab) for n in names}
    for run in runs.values():
        run.advance(args.warm, timed=False)
    for _ in range(args.rounds):
        for run in runs.values():
            run.advance(args.steps)
    first = runs[names[0]]
    result = {
        "target": target.name,
        "threads": args.threads,
        "train_sequences": len(store),
        "stored_only": args.stored_only,
        "vocab": vocab.size,
        "config": asdict(base),
        "variants": {},
    }
    for n, run in runs.items():
        per_min = 60 * run.steps / run.cpu_s
        row = {
            **VARIANTS[n],
            "steps": run.steps,
            "cpu_ms_per_step": round(1e3 * run.cpu_s / run.steps, 1),
            "steps_per_cpu_minute": round(per_min, 1),
            "speedup": round(per_min / (60 * first.steps / first.cpu_s), 2),
            "losses": [round(x, 4) for x in run.losses],
            "max_abs_loss_diff_vs_first": round(
                max(abs(a - b) for a, b in zip(run.losses, first.losses, strict=True)), 5
            ),
        }
        result["variants"][n] = row
    if args.tau:
        held = _heldout(target, base, args.tau)
        for n, run in runs.items():
            result["variants"][n]["heldout_tau"] = _tau(run, target, held)
    for n, run in runs.items():
        if args.profile:
            result["variants"][n]["top_ops"] = _top_ops(run, args.profile)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    (args.out / "results.md").write_text(_markdown(result))
    print(_markdown(result))


def _markdown(r: dict) -> str:
    lines = [
        f"# Bootstrap step, {r['target']}: {r['threads']} thread(s), process CPU time",
        "",
        f"{r['train_sequences']} train sequences{' (stored only)' if r['stored_only'] else ''}, "
        f"training vocabulary {r['vocab']} (+{r['config']['vocab_negatives']} negatives a step), "
        f"{r['config']['seqs_per_step']} sequences x {r['config']['anchors_per_seq']} anchors a step.",
        "",
        "| variant | steps timed | CPU ms/step | steps per CPU-minute | speed-up | max |Δ loss| vs first |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n, v in r["variants"].items():
        lines.append(
            f"| {n} | {v['steps']} | {v['cpu_ms_per_step']} | {v['steps_per_cpu_minute']} | "
            f"{v['speedup']}x | {v['max_abs_loss_diff_vs_first']} |"
        )
    if any("heldout_tau" in v for v in r["variants"].values()):
        lines += ["", "Held-out τ after the timed steps (same seed, same data order):", ""]
        lines += [f"- {n}: {v['heldout_tau']}" for n, v in r["variants"].items() if "heldout_tau" in v]
    for n, v in r["variants"].items():
        if "top_ops" in v:
            lines += [
                "",
                f"## {n}: top ops by self CPU time",
                "",
                "| op | shapes | share |",
                "|---|---|---:|",
            ]
            lines += [f"| {o['op']} | `{o['shapes']}` | {o['share']:.1%} |" for o in v["top_ops"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
