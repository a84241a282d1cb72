"""GPU benchmark: Triton kernels vs PyTorch references (needs CUDA and the `kernels` extra).

128 requests x 16 verified positions at V = 49,152 (SmolLM2) and 151,936 (Qwen); for each op:
median time (CUDA events) of kernel and reference, their ratio, and peak extra memory.
Writes benchmarks/kernels.json and benchmarks/kernels.md.

    python scripts/bench_kernels.py [--out benchmarks]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _time(fn, reps: int = 20) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], (torch.cuda.max_memory_allocated() - base) / 2**20


def bench_vocab(V: int, B: int = 128, k: int = 16) -> list[dict]:
    from adaflash.kernels import loss_reference, triton_loss, triton_verify, verify

    dev = "cuda"
    cu = torch.arange(0, B * k + 1, k, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(B * k, V, device=dev, generator=g) * 3
    p = torch.softmax(logits, -1)
    t_rows = torch.cat([torch.arange(b * k, b * k + k - 1, device=dev) for b in range(B)])
    q = torch.softmax(logits[t_rows] + 0.5 * torch.randn(t_rows.numel(), V, device=dev, generator=g), -1)
    drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
    ua = torch.rand(drafts.numel(), device=dev, generator=g)
    us = torch.rand(B, device=dev, generator=g)
    z = (torch.randn(B * (k - 1), V, device=dev, generator=g) * 3).requires_grad_(True)
    teacher = torch.log_softmax(torch.randn(B * (k - 1), V, device=dev, generator=g) * 3, -1)

    def loss_step(mod):
        def run():
            z.grad = None
            mod.drafter_loss_rows("opd", z, teacher, 0.8, 0.01).sum().backward()

        return run

    ops = {
        "greedy_verify": (
            lambda: triton_verify.greedy_verify(drafts, logits, cu),
            lambda: verify.greedy_verify(drafts, logits, cu),
        ),
        "sampling_verify": (
            lambda: triton_verify.sampling_verify(drafts, q, p, cu, ua, us),
            lambda: verify.sampling_verify(drafts, q, p, cu, ua, us),
        ),
        "opd_loss_fwd_bwd": (loss_step(triton_loss), loss_step(loss_reference)),
    }
    rows = []
    for name, (kern, ref) in ops.items():
        tk, mk = _time(kern)
        tr, mr = _time(ref)
        rows.append(
            {"op": name, "V": V, "kernel_ms": tk, "reference_ms": tr, "speedup": tr / tk,
             "kernel_extra_mib": mk, "reference_extra_mib": mr}
        )  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [row for V in (49_152, 151_936) for row in bench_vocab(V)]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": "128 requests x 16"}
    (args.out / "kernels.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"Kernels vs PyTorch reference on {meta['gpu']} ({meta['shape']}), median of 20.", "",
             "| op | V | kernel ms | reference ms | speedup | kernel extra MiB | reference extra MiB |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['V']} | {r['kernel_ms']:.3f} | {r['reference_ms']:.3f} | {r['speedup']:.2f}x"
            f" | {r['kernel_extra_mib']:.0f} | {r['reference_extra_mib']:.0f} |"
        )
    (args.out / "kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
