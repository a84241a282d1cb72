"""Frozen linear layers for inference: fused and prepacked once for the CPU's fastest kernel.

Why: a decode step of a small model is ~200 matmuls of a few rows each, and the plain
`F.linear` reads each weight in the layout PyTorch stores it, through a kernel picked per call.
Per SmolLM2-135M decode step (its linear layers + LM head, 2 threads; AVX2 EPYC, best of 5):

| rows | fp32 oneDNN prepacked | fp32 row-wise (`rowwise.py`) |
|---|---|---|
| 1  | 50 ms | 29 ms |
| 8  | 59 ms | 44 ms |
| 32 | 115 ms | 104–118 ms |

fp32 runs the row-wise kernel when this machine can build it: each output is one sequential fma
chain, so a row's bits never depend on the rows beside it, and verifying k̂ rows gives the same
logits as decoding one (oneDNN's fp32 down-projections differed between one row and more).
Calls past `LARGE_ROWS` rows (prefills) run oneDNN's GEMM, ~1.3× faster there, in the layers
where a probe on the first such call finds it bit-identical to the row-wise kernel (`large`).
Without a C compiler fp32 falls back to oneDNN's prepacked matmul, and bf16 always uses it.
(Speculation on a bf16 target is still not token-identical to its AR on SmolLM2, cause not yet
localized, so nothing serves bf16: docs/serving.md.) `ADAFLASH_PACKED_LINEAR=0` turns packing
off and `ADAFLASH_ROWWISE=0` the row-wise kernel (to compare).

Only without autograd: training runs the modules as they are. A packed copy remembers the
storage and version counter of the weights it was built from and is rebuilt if either changes
(an optimizer step between two evaluations, a `.to(dtype)`), so it never serves stale weights.
"""

from __future__ import annotations

import os
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from adaflash.models import rowwise

# Rows the oneDNN weight layout is tuned for: a decode/verify step's order of magnitude.
_PACK_ROWS = 32
# Past this many rows a call may run oneDNN's GEMM instead, where that gives the same bits.
LARGE_ROWS = 64
_PACKED = os.environ.get("ADAFLASH_PACKED_LINEAR", "1") != "0"
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """`w` prepacked for oneDNN's matmul, or None where this CPU's oneDNN cannot run it."""
    if not _ONEDNN:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
    except RuntimeError:
        # oneDNN's bf16 kernels need AVX-512 (bw/vl/dq) or AVX-NE-CONVERT; a CPU without
        # them (seen: an EPYC with AVX2 only) runs the plain matmul instead.
        return None


class FrozenLinear:
    """`linears` fused on the output dimension into one matmul, prepacked for the fastest
    batch-invariant kernel this CPU has: the row-wise one in fp32 (`rowwise.py`), oneDNN in bf16."""

    def __init__(self, linears: tuple[nn.Linear, ...]) -> None:
        self.sources = linears
        self.versions = self._versions()
        w = torch.cat([lin.weight.detach() for lin in linears]).contiguous()
        biases = [
            lin.bias.detach() if lin.bias is not None else w.new_zeros(lin.out_features) for lin in linears
        ]
        self.bias = torch.cat(biases) if any(lin.bias is not None for lin in linears) else None
        self.sizes = [lin.out_features for lin in linears]
        self.out_features = w.shape[0]
        self.dtype = w.dtype
        on_cpu = _PACKED and w.device.type == "cpu"
        self.kernel = "plain"
        self.weight = w
        if on_cpu and w.dtype == torch.float32 and rowwise.available():
            self.kernel, self.weight = "rowwise", rowwise.pack(w)
        elif (
            on_cpu and w.dtype in (torch.float32, torch.bfloat16) and (packed := _onednn_pack(w)) is not None
        ):
            self.kernel, self.weight = "onednn", packed

    def _rowwise(self, rows: torch.Tensor) -> torch.Tensor:
        y = rowwise.matmul(rows, self.weight, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y

    @cached_property
    def large(self) -> torch.Tensor | None:
        """oneDNN's packing, for row-wise calls past LARGE_ROWS rows, if its matmul gives the
        row-wise kernel's bits here; else None. Probed on the first such call, not at packing:
        most packed copies (a drafter rebuilt after each optimizer step) never see one.

        Why: from ~100 rows up (a prefill) oneDNN's GEMM is ~1.3× faster than the row-wise
        kernel, and on this machine it reduces each output over K in the same sequential order
        for SmolLM2's 576-wide inputs (bit-identical from 1 to 700 rows), but not for the
        1536-wide down projection. Which shapes agree depends on the CPU and oneDNN's kernel
        choice, so it is probed per layer on random rows at two sizes past the cut: a different
        reduction order differs somewhere in those outputs, so agreement means the same order.
        """
        w = torch.cat([lin.weight.detach() for lin in self.sources])
        packed = _onednn_pack(w)
        if packed is None:
            return None
        g = torch.Generator().manual_seed(0)
        for m in (LARGE_ROWS + 1, 3 * LARGE_ROWS + 5):
            x = torch.randn(m, w.shape[1], generator=g, device=w.device)  # CPU even under a meta default
            theirs = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            if not torch.equal(self._rowwise(x), theirs):
                return None
        return packed

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
        if self.kernel == "rowwise" and x.dtype == self.dtype and x.dim() == 2 and x.shape[0] <= LARGE_ROWS:
            return self._rowwise(x)  # a decode step's call, ~120 per step: the shortest path
        if self.kernel == "plain":
            return F.linear(x, self.weight, self.bias)
        if x.dtype != self.dtype:  # what the modules themselves do (or how they fail)
            return torch.cat([lin(x) for lin in self.sources], dim=-1)
        rows = x.reshape(-1, x.shape[-1])
        if self.kernel == "rowwise" and (rows.shape[0] <= LARGE_ROWS or self.large is None):
            y = self._rowwise(rows)
        else:
            packed = self.large if self.kernel == "rowwise" else self.weight
            y = torch.ops.mkldnn._linear_pointwise(rows, packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])


def frozen_linear(owner: object, key: str, *linears: nn.Linear) -> FrozenLinear:
    """The fused, prepacked inference copy of `linears`, cached on `owner` under `key` and rebuilt
    when their weights change. Its output is [..., Σ out_features], the linears' outputs side by side."""
    slot = "_frozen_" + key
    frozen = owner.__dict__.get(slot)
    if frozen is None or frozen.stale:
        frozen = FrozenLinear(linears)
        owner.__dict__[slot] = frozen  # a plain attribute: not a submodule, not in state_dict
    return frozen


def fused_linear(owner: object, key: str, x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """`x` through each of `linears` (outputs in order). Without autograd: one fused, prepacked
    matmul (`frozen_linear`); with autograd: the modules themselves."""
    if torch.is_grad_enabled():
        return tuple(lin(x) for lin in linears)
    frozen = frozen_linear(owner, key, *linears)
    y = frozen(x)
    return y.split(frozen.sizes, dim=-1) if len(linears) > 1 else (y,)
