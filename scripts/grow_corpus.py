"""Grow the training corpus: the target's greedy responses to the next train prompts, with the
drafter's features captured by the generator's own forward passes (no second target pass).

The bootstrap's held-out τ flattens on 214k response tokens while its training batches reach
twice the held-out position-1 acceptance (BENCHMARKS "τ against data"): the drafter has learned
what those responses hold. This adds responses in the bootstrap's own prompt order (interleaved
domains, so math and code once the 231 chat prompts are used), resumable at any point: every
finished response is in the cache at once, with its features in the train store.

Usage:
    ADAFLASH_CACHE=$PWD/.cache/adaflash ADAFLASH_THREADS=2 python scripts/grow_corpus.py \
        --prompts 2624 --minutes 30
    adaflash drafter corpus   # then write data/responses/ for git (ids only, no prompt text)
    adaflash drafter bootstrap --max-train-prompts 2624 --no-generate ...   # trains on the grown set
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from adaflash.models.targets import load_target
from adaflash.training.corpus import corpus_path, seed_cache
from adaflash.training.feature_store import StoreWriter
from adaflash.training.responses import ensure_responses, responses_path
from adaflash.workloads import interleave, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", type=int, required=True, help="the first N train prompts (interleaved)")
    ap.add_argument("--minutes", type=float, default=30.0, help="stop generating after this long")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--drafter", type=Path, default=Path("drafters/smollm2"), help="whose feature layers")
    ap.add_argument("--slots", type=int, default=64, help="decode slots of the continuous batch")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("ADAFLASH_THREADS", os.cpu_count() or 2)))

    target = load_target(args.target)
    config = json.loads((args.drafter / "config.json").read_text())
    layer_ids = tuple(config["dflash_config"]["target_layer_ids"])
    prompts = interleave(load_prompts("train"))[: args.prompts]
    cache = responses_path(target, "train", args.max_new_tokens)
    seeded = seed_cache(target, prompts, corpus_path(target, "train", args.max_new_tokens), cache)
    writer = StoreWriter(target, layer_ids, f"greedy-{args.max_new_tokens}")
    t0 = time.time()

    def progress(n: int, tokens: int) -> None:
        seconds = max(time.time() - t0, 1e-9)
        print(f"[{seconds / 60:5.1f} min] +{n} responses, {tokens} tokens ({tokens / seconds:.0f} tok/s)",
              flush=True)  # fmt: skip

    have = ensure_responses(
        target, prompts, cache, args.max_new_tokens, batch_size=args.slots,
        deadline=t0 + args.minutes * 60, on_progress=progress, features=writer,
    )  # fmt: skip
    by_domain: dict[str, int] = {}
    for r in have:
        by_domain[r.domain] = by_domain.get(r.domain, 0) + 1
    tokens = sum(len(r.response_ids) for r in have)
    print(f"{len(have)}/{len(prompts)} responses ({seeded} from the committed corpus), "
          f"{tokens} response tokens, {by_domain}; {(time.time() - t0) / 60:.1f} min")  # fmt: skip


if __name__ == "__main__":
    main()
