"""A batch-invariant fp32 matmul for decode-sized batches, compiled once for this CPU.

Why: a decode step at C = 1 reads every weight once, and oneDNN's prepacked 1-row matmul does so
at about half the machine's streaming bandwidth. Its faster small-M kernels would reduce in a
different order for 1 row than for k rows, and verification needs a row's logits to be the same
bits whatever else shares the call. `csrc/rowwise_matmul.c` computes each output as one
sequential fma chain over K, so it is batch-invariant by construction, and streams the prepacked
weights at close to the machine's bandwidth. Measured on SmolLM2-135M's linear layers (30 layers
+ LM head, 2 threads, AVX2 EPYC; `scripts/profile_step.py`, BENCHMARKS "Where a C = 1 step
goes"): 1 row 29 ms against oneDNN's 50 ms, 8 rows 44 against 59, 32 rows level; from ~100 rows
up (prefill) oneDNN is ~1.3× faster, which costs first-token latency only.

It lives in the library `kernels.py` builds. Without a compiler (or with `ADAFLASH_ROWWISE=0`)
`available()` is False and the caller keeps oneDNN.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import torch.nn.functional as F

from adaflash.models.kernels import library


@cache  # read once per process: matmul runs ~120 times per decode step
def _library():
    return library() if os.environ.get("ADAFLASH_ROWWISE", "1") != "0" else None


def available() -> bool:
    return _library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (fp32) in the kernel's layout: [ceil(N / w)][K][w] column blocks, zero-padded."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the row-wise matmul is not available on this machine")
    width = lib.rowwise_block_width()
    n, k = weight.shape
    blocks = -(-n // width)
    padded = F.pad(weight.detach().float(), (0, 0, 0, blocks * width - n))
    return padded.view(blocks, width, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """`x` [M, K] (fp32) times the packed weight's transpose: [M, n], the same bits per row for any M."""
    lib = _library()
    assert lib is not None and x.dtype == torch.float32 and packed.dtype == torch.float32
    if not (x.is_cpu and packed.is_cpu):
        raise ValueError(f"the row-wise matmul runs on the CPU (rows: {x.device}, weight: {packed.device})")
    x = x.contiguous()
    m, k = x.shape
    if k != packed.shape[1]:
        raise ValueError(f"rows have {k} features, the weight expects {packed.shape[1]}")
    # on the rows' device: under `torch.device("meta")` (tests/test_device.py) a bare empty() is
    # a meta tensor, and its data_ptr would be handed to C
    y = x.new_empty((m, n))
    if m:
        lib.rowwise_matmul(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, n, k, torch.get_num_threads())
    return y
