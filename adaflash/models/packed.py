"""Frozen linear layers for inference: fused and prepacked once for the CPU's oneDNN kernels.

Why: a decode step of a small model is ~200 matmuls of a few rows each, and the plain
`F.linear` reads each weight in the layout PyTorch stores it, through a kernel picked per call.
Measured on this machine (SmolLM2-135M's per-layer shapes, 30 layers, 2 threads; DESIGN §4):

| rows | fp32 `F.linear` | fp32 prepacked | bf16 `F.linear` | bf16 prepacked |
|---|---|---|---|---|
| 1  | 44.5 ms | 30.0 ms | 19.9 ms | 15.3 ms |
| 8  | 83.0 ms | 33.4 ms | 26.3 ms | 19.1 ms |
| 32 | 79.3 ms | 53.4 ms | 43.1 ms | 28.7 ms |

The prepacked kernel is also *batch-invariant* here: a row's output does not depend on how many
other rows share the call (checked for 1–400 rows; fp32 down-projections differ only between
one row and more): verifying k̂ rows and decoding one give the same bits in every linear layer.
(Speculation on a bf16 target is still not token-identical to its AR on SmolLM2, cause not yet
localized, so nothing serves bf16: docs/serving.md.)

Only without autograd: training runs the modules as they are. A packed copy remembers the
storage and version counter of the weights it was built from and is rebuilt if either changes
(an optimizer step between two evaluations, a `.to(dtype)`), so it never serves stale weights.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

# Rows the oneDNN weight layout is tuned for: a decode/verify step's order of magnitude.
_PACK_ROWS = 32
_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and os.environ.get("ADAFLASH_PACKED_LINEAR", "1") != "0"
)


class FrozenLinear:
    """`linears` fused on the output dimension into one matmul, prepacked where oneDNN can."""

    def __init__(self, linears: tuple[nn.Linear, ...]) -> None:
        self.sources = linears
        self.versions = self._versions()
        w = torch.cat([lin.weight.detach() for lin in linears]).contiguous()
        biases = [
            lin.bias.detach() if lin.bias is not None else w.new_zeros(lin.out_features) for lin in linears
        ]
        self.bias = torch.cat(biases) if any(lin.bias is not None for lin in linears) else None
        self.sizes = [lin.out_features for lin in linears]
        self.onednn = _ONEDNN and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
        self.weight = w
        if self.onednn:
            try:
                self.weight = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
            except RuntimeError:
                # oneDNN's bf16 kernels need AVX-512 (bw/vl/dq) or AVX-NE-CONVERT; a CPU without
                # them (seen: an EPYC with AVX2 only) runs the plain matmul instead.
                self.onednn = False

    def _versions(self) -> list[tuple[nn.Linear, int, int]]:
        # In-place updates bump `_version`; `.to()` / `load_state_dict` may swap the storage
        # (or the Parameter: `lin.weight` is read afresh on every check).
        return [(lin, lin.weight.data_ptr(), lin.weight._version) for lin in self.sources]

    @property
    def stale(self) -> bool:
        # Checked on every call (~120 per decode step): a plain loop, no tuples built.
        for lin, ptr, version in self.versions:
            w = lin.weight
            if w._version != version or w.data_ptr() != ptr:
                return True
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.onednn:
            return F.linear(x, self.weight, self.bias)
        if x.dtype != self.weight.dtype:  # what the modules themselves do (or how they fail)
            return torch.cat([lin(x) for lin in self.sources], dim=-1)
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])


def fused_linear(owner: object, key: str, x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """`x` through each of `linears` (outputs in order). Without autograd: one fused, prepacked
    matmul cached on `owner` under `key`; with autograd: the modules themselves."""
    if torch.is_grad_enabled():
        return tuple(lin(x) for lin in linears)
    slot = "_frozen_" + key
    frozen = owner.__dict__.get(slot)
    if frozen is None or frozen.stale:
        frozen = FrozenLinear(linears)
        owner.__dict__[slot] = frozen  # a plain attribute: not a submodule, not in state_dict
    y = frozen(x)
    return y.split(frozen.sizes, dim=-1) if len(linears) > 1 else (y,)
