"""Does a bigger online-training budget lift τ on shifted traffic? (BENCHMARKS.md, issue 16 item 1.)

Takes the clean records an `adaflash adapt` learner already served and governed (its resumable
`state.json`), trains a copy of the bootstrap drafter on the first --train of them once per
config, and scores each copy's full-block τ and |â − a*| on the prompts of later rounds, which none
of the copies trained on, replayed on AR's continuation:

    ADAFLASH_THREADS=2 python scripts/online_budget.py --state .adaflash/adapt-replay32/state.json \\
        --train 40 --eval-rounds 6-9 '{}' '{"lr": 0.001}' '{"lr": 0.001, "epochs": 3}'

Each positional argument is one config: `OnlineConfig` fields as JSON. AR's continuations are
cached in --out, so reruns with other configs skip the generation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from adaflash.bench.adaptation import (
    AdaptationSpec,
    continuation_passes,
    full_block_tau,
    serve_records,
    shifted_prompts,
)
from adaflash.feedback.schema import CleanRecord
from adaflash.models.checkpoint import load_drafter_for
from adaflash.models.targets import load_target
from adaflash.training.online import OnlineConfig, OnlineTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", default=["{}"], help="OnlineConfig fields as JSON, one per run")
    ap.add_argument("--state", type=Path, required=True, help="an `adaflash adapt` run's state.json")
    ap.add_argument("--learner", default="adaflash", help="whose served records to train on")
    ap.add_argument("--train", type=int, default=40, help="the first N clean records")
    ap.add_argument("--eval-rounds", default="6-9", help="rounds whose prompts score the copies")
    ap.add_argument("--drafter", type=Path, default=Path("drafters/smollm2"))
    ap.add_argument("--out", type=Path, default=Path(".cache/online_budget"))
    a = ap.parse_args()

    state = json.loads(a.state.read_text())
    spec = AdaptationSpec(**{k: v for k, v in state["spec"].items() if k != "data_dir"})
    records = [CleanRecord.model_validate(h) for h in state["loops"][a.learner]["history"]][: a.train]
    first, last = (int(x) for x in a.eval_rounds.split("-"))
    trained_rounds = -(-len(records) // spec.per_round)
    if first < trained_rounds:
        raise SystemExit(
            f"--eval-rounds starts at {first}, but the {len(records)} records reach round "
            f"{trained_rounds - 1}: the copies would be scored on prompts they trained on"
        )

    target = load_target("smollm2")
    prompts = shifted_prompts(spec)[first * spec.per_round : (last + 1) * spec.per_round]
    ids = [target.tokenizer.chat_prompt(p.text) for p in prompts]
    a.out.mkdir(parents=True, exist_ok=True)
    cache = a.out / f"ar-{spec.source}-{first}-{last}.json"
    if cache.exists():
        ref = json.loads(cache.read_text())
    else:
        serve = (ids, spec.concurrency, spec.max_new_tokens, ["t"], "code")
        _, ref, _ = serve_records(target, None, "ar", *serve)
        cache.write_text(json.dumps(ref))
    fixed = load_drafter_for(a.drafter, target)
    passes, starts = continuation_passes(target, ids, ref, fixed.drafter.config.target_layer_ids)

    base = full_block_tau(target, fixed, passes, starts)
    rows = [{"config": "bootstrap", "tau_full": base["tau_full"], "head_mae": base["head_mae"]}]
    print(f"bootstrap: τ_full {base['tau_full']:.4f}  |â − a*| {base['head_mae']:.4f}", flush=True)
    for i, raw in enumerate(a.configs):
        cfg = OnlineConfig(**json.loads(raw))
        out = a.out / f"drafter-{i}"
        shutil.rmtree(out, ignore_errors=True)  # the trainer would resume a finished run
        t = time.perf_counter()
        m = OnlineTrainer(target, load_drafter_for(a.drafter, target), out, cfg).train(
            records, lineage={"version": f"budget-{i}"}
        )
        r = full_block_tau(target, load_drafter_for(out, target), passes, starts)
        gain = r["tau_full"] / base["tau_full"] - 1
        row = {
            "config": json.loads(raw),
            "tau_full": r["tau_full"],
            "gain": gain,
            "head_mae": r["head_mae"],
            "train_tau": [e["train_tau"] for e in m["epochs"]],
            "train_s": time.perf_counter() - t,
        }
        rows.append(row)
        print(f"{raw}: τ_full {r['tau_full']:.4f} ({gain:+.1%})  |â − a*| {r['head_mae']:.4f}", flush=True)
    summary = {"state": str(a.state), "train_records": len(records), "eval_prompts": len(ids), "rows": rows}
    (a.out / "results.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
