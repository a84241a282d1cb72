"""One prepared check of the GPU path: kernels compiled for real, a bootstrap's steps/s, held-out τ.

    scripts/gpu_check.sh --device cuda --target tiny --steps 300 --out gpu-check   # on a GPU
    scripts/gpu_check.sh --device cpu --target tiny --steps 20 --out /tmp/gpu-check  # dry run here

Stages, each recorded even when another fails (a lease is short; one error must not lose the rest):

1. `env`: torch, Triton, the device.
2. `kernels`: the Triton verify and loss kernels against their torch references on the same
   device and inputs (compiled by Triton on CUDA; its interpreter on the CPU, at small sizes):
   greedy verify exactly equal, sampling verify exactly equal given the same uniforms, the fused
   loss's rows and gradient within 1e-4 relative; with each backend's median time.
3. `bootstrap`: `BootstrapTrainer` for `--steps` optimiser steps on the target, on `--device`
   (bf16 autocast with `--bf16`): its train steps per second and the held-out τ per domain.

Writes `results.json` and `results.md` under --out and exits non-zero when a stage failed or a
kernel disagreed with its reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda | cpu (cpu: the dry run)")
    ap.add_argument("--target", default="tiny", help="tiny | smollm2 | a target folder")
    ap.add_argument("--steps", type=int, default=300, help="bootstrap optimiser steps")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--seqs-per-step", type=int, default=8)
    ap.add_argument("--max-train-prompts", type=int, default=None)
    ap.add_argument("--eval-per-domain", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: 64 on tiny, 256 else")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast in the training steps")
    ap.add_argument(
        "--sequential-step",
        action="store_true",
        help="one forward/backward per sequence (the step before issue 34) instead of one batched",
    )
    ap.add_argument(
        "--budget-minutes", type=float, default=None, help="optional cap on the bootstrap (a lease is short)"
    )
    ap.add_argument(
        "--generate", action=argparse.BooleanOptionalAction, default=None,
        help="generate responses the committed corpus lacks, on the host (default: only for tiny)",
    )  # fmt: skip
    ap.add_argument("--skip", default="", help="comma-separated stages to skip: kernels,bootstrap")
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    return ap.parse_args(argv)


def _sync(device) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _median_ms(fn: Callable[[], object], device, repeats: int) -> float:
    sync = _sync(device)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _packed_case(lengths: list[int], V: int, device, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    n_rows, n_drafts = int(cu[-1]), int(cu[-1]) - len(lengths)
    logits = torch.randn(n_rows, V, generator=g) * 3
    top = logits.argmax(-1)
    # Draft rows copy the target's argmax for a random prefix, then diverge: every outcome occurs.
    drafts = torch.randint(0, V, (n_drafts,), generator=g)
    off = 0
    for b, n in enumerate(lengths):
        keep = int(torch.randint(0, n, (1,), generator=g))
        rows = torch.arange(int(cu[b]), int(cu[b]) + n - 1)
        drafts[off : off + keep] = top[rows[:keep]]
        off += n - 1
    t_rows = torch.cat([torch.arange(int(cu[b]), int(cu[b + 1]) - 1) for b in range(len(lengths))])
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits[t_rows] + 0.3 * torch.randn(n_drafts, V, generator=g), -1)
    ua, us = torch.rand(n_drafts, generator=g), torch.rand(len(lengths), generator=g)
    return [t.to(device) for t in (drafts, logits, cu, p, q, ua, us)]


def _compare_verify(op: str, ref_fn, tri_fn, args: tuple, device, repeats: int) -> dict:
    """Exact equality of (accepted, next) on the same inputs, and each backend's median time."""
    ref, got = ref_fn(*args), tri_fn(*args)
    equal = all(bool((a.long() == b.long()).all()) for a, b in zip(ref, got, strict=True))
    return {
        "op": op,
        "equal": equal,
        "reference_ms": _median_ms(lambda: ref_fn(*args), device, repeats),
        "triton_ms": _median_ms(lambda: tri_fn(*args), device, repeats),
    }


def stage_kernels(device, small: bool) -> dict:
    import torch

    from adaflash.kernels import loss_reference, triton_loss, triton_verify, verify

    repeats = 3 if small else 20
    sizes = [(4, 1024)] if small else [(1, 49152), (8, 49152), (32, 49152)]
    rows: list[dict] = []
    for B, V in sizes:
        lengths = [1 + (7 * b + 3) % 16 for b in range(B)]  # ragged k̂ in 1..16
        drafts, logits, cu, p, q, ua, us = _packed_case(lengths, V, device, seed=B * 31 + V)
        for op, args in (
            ("greedy_verify", (drafts, logits, cu)),
            ("sampling_verify", (drafts, q, p, cu, ua, us)),
        ):
            rows.append(
                _compare_verify(op, getattr(verify, op), getattr(triton_verify, op), args, device, repeats)
            )
            rows[-1].update(batch=B, vocab=V)
    R, V = (16, 1024) if small else (8 * 16 * 7, 49152)  # one training step's supervised rows
    g = torch.Generator().manual_seed(7)
    base = (torch.randn(R, V, generator=g) * 2).to(device)
    teacher = torch.log_softmax(torch.randn(R, V, generator=g) * 2, -1).to(device)
    for kind in ("ce", "opd", "fkl"):
        a = base.clone().requires_grad_(True)
        b = base.clone().requires_grad_(True)
        ref = loss_reference.drafter_loss_rows(kind, a, teacher, 0.8, 0.01)
        got = triton_loss.drafter_loss_rows(kind, b, teacher, 0.8, 0.01)
        ref.sum().backward()
        got.sum().backward()
        ref, got = ref.detach(), got.detach()
        rel = float((ref - got).abs().max() / ref.abs().max().clamp_min(1e-9))
        grel = float((a.grad - b.grad).abs().max() / a.grad.abs().max().clamp_min(1e-9))

        def ref_fb(kind=kind):
            x = base.clone().requires_grad_(True)
            loss_reference.drafter_loss_rows(kind, x, teacher, 0.8, 0.01).sum().backward()

        def tri_fb(kind=kind):
            x = base.clone().requires_grad_(True)
            triton_loss.drafter_loss_rows(kind, x, teacher, 0.8, 0.01).sum().backward()

        rows.append(
            {
                "op": f"drafter_loss_rows[{kind}] fwd+bwd",
                "batch": R,
                "vocab": V,
                "equal": rel < 1e-4 and grel < 1e-4,
                "max_rel_err": max(rel, grel),
                "reference_ms": _median_ms(ref_fb, device, repeats),
                "triton_ms": _median_ms(tri_fb, device, repeats),
            }
        )
    return {"ok": all(r["equal"] for r in rows), "rows": rows}


def stage_bootstrap(args: argparse.Namespace, device) -> dict:
    import torch

    from adaflash.models.targets import load_target
    from adaflash.training.bootstrap import BootstrapConfig, BootstrapTrainer

    tiny = args.target == "tiny"
    host = load_target(args.target)
    max_new = args.max_new_tokens or (64 if tiny else 256)
    cfg = BootstrapConfig(
        steps=args.steps,
        num_layers=args.layers,
        block_size=args.block_size,
        num_feature_layers=2 if tiny else 5,
        seqs_per_step=args.seqs_per_step,
        max_new_tokens=max_new,
        max_train_prompts=args.max_train_prompts or (96 if tiny else None),
        eval_per_domain=args.eval_per_domain,
        curve_per_domain=4,
        curve_every_steps=max(args.steps // 4, 1),
        head_steps=min(150, max(args.steps // 2, 5)),
        bf16=args.bf16,
        batch_step=not args.sequential_step,
        budget_minutes=args.budget_minutes,
    )
    # Responses come from the committed corpus or are generated on the host first: generation
    # is the serving path's job (measured elsewhere); this stage times the trainer on the device.
    _responses_on_host(host, cfg, generate=tiny if args.generate is None else args.generate)
    target = host if device.type == "cpu" else load_target(args.target, device=device)
    cfg.generate_missing = False
    stages: dict[str, float] = {}
    last = {"t": time.time()}

    def progress(kind: str, info: dict) -> None:
        now = time.time()
        stages[kind] = stages.get(kind, 0.0) + now - last["t"]
        last["t"] = now
        if kind in ("train_start", "evaluate", "resume"):
            print(f"  bootstrap {kind}: {info}", flush=True)

    out = args.out / "drafter"
    metrics = BootstrapTrainer(target, out, cfg, progress=progress).run("scripts/gpu_check.sh")
    train_s = metrics["train_minutes"] * 60
    held = metrics["heldout"]
    return {
        "ok": True,
        "target": target.name,
        "target_fingerprint": target.fingerprint,
        "stopped_by_budget": metrics["stopped_by_budget"],
        "device": str(next(target.model.parameters()).device),
        "bf16": args.bf16,
        "batch_step": not args.sequential_step,
        "steps": metrics["steps"],
        "train_seconds": round(train_s, 2),
        "steps_per_second": round(metrics["steps"] / max(train_s, 1e-9), 2),
        "steps_per_minute": round(60 * metrics["steps"] / max(train_s, 1e-9), 1),
        "wall_minutes": metrics["wall_minutes"],
        "train_sequences": metrics["train_sequences"],
        "seconds_by_stage": {k: round(v, 1) for k, v in stages.items()},
        "heldout_tau": {d: row["dflash_tau"] for d, row in held.items()},
        "heldout_ngram_tau": {d: row["ngram_tau"] for d, row in held.items()},
        "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device.type == "cuda"
        else None,
    }


def _responses_on_host(target, cfg, generate: bool) -> None:
    from adaflash.training.corpus import corpus_path, seed_cache
    from adaflash.training.responses import ensure_responses, responses_path
    from adaflash.workloads import interleave, load_prompts

    splits = {
        "heldout": interleave(load_prompts("heldout"), cfg.eval_per_domain),
        "train": interleave(load_prompts("train"))[: cfg.max_train_prompts],
    }
    for split, prompts in splits.items():
        path = responses_path(target, split, cfg.max_new_tokens)
        seed_cache(target, prompts, corpus_path(target, split, cfg.max_new_tokens), path)
        # deadline 0: only what the corpus and the cache hold (SmolLM2 on a GPU machine's CPU
        # would take far longer than a lease to generate thousands of responses).
        done = ensure_responses(target, prompts, path, cfg.max_new_tokens, deadline=None if generate else 0.0)
        print(f"  responses {split}: {len(done)} of {len(prompts)} prompts", flush=True)


def _env(device) -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return info


def _markdown(res: dict) -> str:
    lines = [f"# GPU check — {res['env'].get('gpu', res['env']['device'])}", ""]
    lines.append(f"`{res['command']}`  ")
    lines.append(f"torch {res['env']['torch']}, Triton {res['env']['triton']}, {res['when']}")
    k = res.get("kernels", {})
    if k.get("rows"):
        lines += ["", "## Kernels: Triton vs the torch reference (same device, same inputs)", ""]
        lines += ["| op | rows/batch | vocab | equal | reference ms | Triton ms |", "|---" * 6 + "|"]
        for r in k["rows"]:
            lines.append(
                f"| {r['op']} | {r['batch']} | {r['vocab']} | {'yes' if r['equal'] else '**NO**'} | "
                f"{r['reference_ms']:.3f} | {r['triton_ms']:.3f} |"
            )
    b = res.get("bootstrap", {})
    if b.get("ok"):
        lines += [
            "",
            f"## Bootstrap ({b['target']} on {b['device']}, bf16 {b['bf16']}, "
            f"batched step {b.get('batch_step', False)})",
            "",
        ]
        lines.append(
            f"{b['steps']} steps in {b['train_seconds']} s of training: **{b['steps_per_second']} steps/s** "
            f"({b['steps_per_minute']} per minute); whole run {b['wall_minutes']} min; "
            f"{b['train_sequences']} training sequences."
        )
        lines += ["", "| domain | held-out τ (drafter) | τ (prompt lookup) |", "|---|---|---|"]
        for d, tau in b["heldout_tau"].items():
            lines.append(f"| {d} | {tau:.3f} | {b['heldout_ngram_tau'][d]:.3f} |")
    for name in ("kernels", "bootstrap"):
        if res.get(name, {}).get("error"):
            lines += ["", f"## {name} FAILED", "", "```", res[name]["error"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.device == "cpu":
        # Triton runs on CPU tensors only through its interpreter, which must be chosen before
        # the kernels are defined (import time).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("ADAFLASH_CACHE", str(Path(tempfile.gettempdir()) / "adaflash-gpu-check"))
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no GPU (use --device cpu for the dry run)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    res: dict = {
        "command": "scripts/gpu_check.sh " + " ".join(sys.argv[1:] if argv is None else argv),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "env": _env(device),
    }
    print(json.dumps(res["env"]), flush=True)
    stages = [("kernels", lambda: stage_kernels(device, small=device.type != "cuda"))]
    stages.append(("bootstrap", lambda: stage_bootstrap(args, device)))
    for name, fn in stages:
        if name in skip:
            continue
        t = time.time()
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001 — record the failure, run the other stages
            res[name] = {"ok": False, "error": traceback.format_exc()}
        res[name]["seconds"] = round(time.time() - t, 1)
        print(f"{name}: ok={res[name]['ok']} in {res[name]['seconds']} s", flush=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=2))
    (args.out / "results.md").write_text(_markdown(res))
    print(_markdown(res))
    return 0 if all(res[n]["ok"] for n, _ in stages if n in res) else 1


if __name__ == "__main__":
    sys.exit(main())
