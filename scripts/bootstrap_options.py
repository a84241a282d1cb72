"""The options table (issue 34): each training option at the same CPU-minutes budget, held-out τ.

Every option is the batched fp32 recipe (`BootstrapConfig(**BASE)`) with a few fields changed (`OPTIONS`).
Equal CPU minutes are set by work, not by a clock inside the run: the option's steps per
CPU-minute are first measured over `--calibrate` steps of a throw-away trainer (this process's CPU
time, `time.process_time`), its run then gets `budget x rate` steps — a step count, so the run is
deterministic, its learning-rate schedule completes and it resumes like any bootstrap — and the
table reports the CPU minutes it really spent beside the budget. Each option trains a fresh
drafter (same seed, same data order) with `adaflash drafter bootstrap`'s trainer into
`<out>/<option>/`, which then holds its drafter, metrics and model card; an option whose metrics
exist is not run again, so the table resumes, and two processes with different `--options` and
the same `--out` split the work over the cores. The report (results.json, results.md) is rebuilt
from every option folder under `--out` after each option.

    ADAFLASH_CACHE=.cache/adaflash nice -n 10 python scripts/bootstrap_options.py \\
        --options today,batched,batched+bf16,anchors32 --cpu-minutes 20 --out benchmarks/options

`--steps N` trains every option exactly N steps instead (the calibrated rate is still reported):
quality at equal steps, the other half of "faster at unchanged quality".

Held-out τ is `evaluate_acceptance` over `--eval-per-domain` held-out prompts per domain (the
bootstrap's own evaluation, after its length-head phase). The first run on a machine builds the
train feature store (one target pass over the train corpus) before any option trains.
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
from adaflash.training.bootstrap import METRICS, BootstrapConfig, BootstrapTrainer

# Each option: the fields it changes in the recipe the table was measured against, the batched
# fp32 step (`BASE`; bf16 became the default on CPUs with native bf16 after this table).
BASE: dict = {"bf16": False, "vocab_negatives": 4096}  # 4,096: the recipe's default until 2026-12-06
OPTIONS: dict[str, dict] = {
    "today": {"batch_step": False},  # one forward/backward per sequence (the step before issue 34)
    "batched": {},  # one padded forward/backward per step
    "batched+bf16": {"bf16": True},
    "anchors32": {"anchors_per_seq": 32},
    "anchors32+bf16": {"anchors_per_seq": 32, "bf16": True},
    "seqs16": {"seqs_per_step": 16},
    "kd": {"kl_weight": 0.5, "teacher_topk": 32},  # hard CE + top-32 forward KL on target logits
    "uniform-positions": {"position_decay": None},
    "block16": {"block_size": 16, "position_decay": 7.0},
    "layers1": {"num_layers": 1},
    "layers3": {"num_layers": 3},
    "layers1+bf16": {"num_layers": 1, "bf16": True},
    "seqlen192": {"max_train_len": 192},  # prompt + response cut at 192 tokens (full: up to ~prompt + 256)
    # Target layer ids: fewer of the shipped 5 (1, 8, 14, 20, 27 on SmolLM2's 30 layers), read as
    # column subsets of the stored features (no second target pass): EAGLE-3's low / mid / high
    # (1, 14, 27), and the two ends (1, 27).
    "features3": {"num_feature_layers": 3},
    "features2": {"num_feature_layers": 2},
    # Fewer sampled negatives in the training head's softmax (4,096 by default beside the ~9,250 cut
    # ids): the head's matmuls are ~25% of the fp32 step, so 1,024 cuts the step by ~6%, if τ holds.
    "negatives1024": {"vocab_negatives": 1024},
    "negatives1024+bf16": {"vocab_negatives": 1024, "bf16": True},
}


def steps_per_cpu_minute(target, cfg: BootstrapConfig, steps: int, warm: int = 2) -> float:
    """The option's training speed, measured on a throw-away trainer (same data, same seed)."""
    trainer = BootstrapTrainer(target, Path(tempfile.mkdtemp()), replace(cfg, head_steps=0))
    _, store, _ = trainer._data(None)
    vocab = trainer._vocab(store)
    cpu = 0.0
    for i in range(warm + steps):
        t = time.process_time()
        trainer._train_step(store, vocab)
        trainer.state.step += 1
        if i >= warm:
            cpu += time.process_time() - t
    return 60 * steps / cpu


def run_option(target, name: str, args: argparse.Namespace) -> dict:
    out = args.out / name
    if (out / METRICS).exists():
        return json.loads((out / METRICS).read_text())
    base = replace(
        BootstrapConfig(**{**BASE, **OPTIONS[name]}),
        generate_missing=args.generate,
        max_train_prompts=args.max_train_prompts,
        eval_per_domain=args.eval_per_domain,
        seed=args.seed,
    )
    rate = steps_per_cpu_minute(target, base, args.calibrate)
    steps = args.steps or max(1, int(rate * args.cpu_minutes))
    cfg = replace(base, steps=steps)
    print(f"{name}: {rate:.1f} steps per CPU-minute -> {cfg.steps} steps", flush=True)
    budget = f"--steps {args.steps}" if args.steps else f"--cpu-minutes {args.cpu_minutes}"
    command = f"scripts/bootstrap_options.py --options {name} {budget}"
    metrics = BootstrapTrainer(target, out, cfg).run(command)
    metrics["option"] = {"name": name, "changes": OPTIONS[name], "calibrated_steps_per_cpu_minute": rate}
    (out / METRICS).write_text(json.dumps(metrics, indent=2))
    return metrics


def report(out: Path, budget: float, steps: int = 0) -> dict:
    rows = {}
    for path in sorted(out.glob(f"*/{METRICS}")):
        m = json.loads(path.read_text())
        if "option" not in m:
            continue
        rows[m["option"]["name"]] = {
            "changes": m["option"]["changes"],
            "steps": m["steps"],
            "train_cpu_minutes": m.get("train_cpu_minutes"),
            "steps_per_cpu_minute": round(m["option"]["calibrated_steps_per_cpu_minute"], 1),
            "tau": {d: r["dflash_tau"] for d, r in m["heldout"].items()},
            "acc1": m["heldout"]["all"]["accept_rate_by_position"][0],
            "ngram_tau": m["heldout"]["all"].get("ngram_tau"),
        }
    result = {
        "cpu_minutes_budget": None if steps else budget,
        "steps_budget": steps or None,
        "threads": torch.get_num_threads(),
        "recipe": asdict(BootstrapConfig(**BASE)),  # what every option changes a few fields of
        "options": rows,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(markdown(result))
    return result


def markdown(r: dict) -> str:
    domains = sorted({d for row in r["options"].values() for d in row["tau"]} - {"all"}) + ["all"]
    steps = r.get("steps_budget")
    budget = f"{steps} steps" if steps else f"{r['cpu_minutes_budget']} CPU-minutes"
    lines = [
        f"# Options at {budget} of training each ({r['threads']} thread(s))",
        "",
        "| option | changes | steps/CPU-min | steps | CPU-min | "
        + " | ".join(f"τ {d}" for d in domains)
        + " | acc@1 |",
        "|---|---|---:|---:|---:|" + "---:|" * (len(domains) + 1),
    ]
    for name, row in r["options"].items():
        changes = ", ".join(f"{k}={v}" for k, v in row["changes"].items()) or "batched fp32 step"
        taus = " | ".join(f"{row['tau'].get(d, float('nan')):.3f}" for d in domains)
        lines.append(
            f"| {name} | {changes} | {row['steps_per_cpu_minute']} | {row['steps']} | "
            f"{row['train_cpu_minutes']} | {taus} | {row['acc1']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--options", default="today,batched,batched+bf16,anchors32")
    ap.add_argument("--cpu-minutes", type=float, default=20.0, help="training CPU minutes per option")
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="train every option exactly this many steps instead (quality at equal steps)",
    )
    ap.add_argument("--calibrate", type=int, default=8, help="timed steps that set an option's step count")
    ap.add_argument("--eval-per-domain", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--generate", action="store_true", help="generate responses the corpus lacks")
    ap.add_argument("--max-train-prompts", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/options"))
    args = ap.parse_args()
    unknown = set(args.options.split(",")) - set(OPTIONS)
    if unknown:
        ap.error(f"unknown options {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.options.split(","):
        run_option(target, name, args)
        print(markdown(report(args.out, args.cpu_minutes, args.steps)), flush=True)


if __name__ == "__main__":
    main()
