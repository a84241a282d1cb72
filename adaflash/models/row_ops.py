"""A decoder layer's row-wise element ops in C: RMSNorm with the residual add fused in, and
SiLU(gate) · up (`csrc/row_ops.c`).

Why: at one row a decode step is ~30 layers x a dozen small ops, and PyTorch spends more on
dispatching each (a few µs) than on the arithmetic. One C call per op pair, computing each row
alone in a fixed order, so a row's bits do not depend on the rows beside it (what lossless
verification needs). The serving runner uses them (`serving/runner.py`) where `available()`;
training keeps the modules.
"""

from __future__ import annotations

import torch

from adaflash.models.kernels import library


def available() -> bool:
    return library() is not None


def _fp32_rows(*tensors: torch.Tensor) -> None:
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("row ops take contiguous fp32 CPU tensors")


def add_rms_norm(
    x: torch.Tensor, added: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, RMSNorm(s)) with s = x + added (or x itself when `added` is None); x, added [N, H]."""
    N, H = x.shape
    _fp32_rows(x, weight, *(() if added is None else (added,)))
    if H % 8 or weight.shape != (H,) or (added is not None and added.shape != x.shape):
        raise ValueError(f"rows {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    s = x if added is None else torch.empty_like(x)
    y = torch.empty_like(x)
    library().add_rms_norm(
        x.data_ptr(),
        None if added is None else added.data_ptr(),
        weight.data_ptr(),
        eps,
        s.data_ptr(),
        y.data_ptr(),
        N,
        H,
        torch.get_num_threads(),
    )
    return s, y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] = [gate | up] -> SiLU(gate) · up [N, I]."""
    N, width = gate_up.shape
    _fp32_rows(gate_up)
    if width % 16:
        raise ValueError(f"gate_up width {width} must be a multiple of 16")
    y = torch.empty(N, width // 2, dtype=torch.float32, device=gate_up.device)
    library().silu_mul(gate_up.data_ptr(), y.data_ptr(), N, width // 2, torch.get_num_threads())
    return y
