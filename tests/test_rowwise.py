"""The row-wise fp32 matmul (models/rowwise.py): right, batch-invariant bit for bit, and what
FrozenLinear serves fp32 with; without a compiler oneDNN serves instead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from adaflash.models import rowwise
from adaflash.models.packed import LARGE_ROWS, FrozenLinear


def test_it_builds_here() -> None:
    # No skip when it does not: the Makefile's machines have a C compiler, and a kernel that stops
    # compiling would otherwise turn every test below into a silent fallback.
    assert rowwise.available()


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.integers(1, 140),
    k=st.integers(1, 450),
    seed=st.integers(0, 2**16),
)
def test_every_row_is_the_same_bits_whatever_shares_the_call(m: int, n: int, k: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    packed = rowwise.pack(w)
    y = rowwise.matmul(x, packed, n)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4 * k**0.5)
    for i in range(m):  # alone, and inside a slice that puts it at another place in a tile
        assert torch.equal(rowwise.matmul(x[i : i + 1], packed, n)[0], y[i])
        assert torch.equal(rowwise.matmul(x[max(0, i - 1) :], packed, n)[min(i, 1)], y[i])


def test_decode_sized_shapes_and_a_long_prefill_agree_row_for_row() -> None:
    # SmolLM2's down projection (K = 1536 crosses the kernel's K chunks) over 1 .. 300 rows
    w = torch.randn(576, 1536)
    x = torch.randn(300, 1536)
    packed = rowwise.pack(w)
    full = rowwise.matmul(x, packed, 576)
    for rows in (1, 2, 3, 7, 16, 33):
        assert torch.equal(rowwise.matmul(x[-rows:], packed, 576), full[-rows:])
    assert rowwise.matmul(x[:0], packed, 576).shape == (0, 576)
    with pytest.raises(ValueError, match="features"):
        rowwise.matmul(x[:, :100], packed, 576)


def test_its_threads_are_torchs_own_openmp_runtime() -> None:
    # Two libgomp copies would be two thread pools fighting over 2 cores.
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomps) == 1, gomps


def test_frozen_linear_serves_fp32_with_it_and_bf16_without() -> None:
    torch.manual_seed(0)
    q, k = nn.Linear(48, 40, bias=True), nn.Linear(48, 8, bias=False)
    frozen = FrozenLinear((q, k))
    assert frozen.kernel == "rowwise"
    x = torch.randn(5, 3, 48)
    with torch.no_grad():
        torch.testing.assert_close(frozen(x), torch.cat([q(x), k(x)], dim=-1), rtol=1e-5, atol=1e-5)
        assert torch.equal(frozen(x[1:2, 2:3]), frozen(x)[1:2, 2:3])
    assert FrozenLinear((q.bfloat16(),)).kernel != "rowwise"


def test_without_a_compiler_it_falls_back_to_onednn(tmp_path) -> None:
    code = (
        "import torch; from torch import nn; from adaflash.models import rowwise; "
        "from adaflash.models.packed import FrozenLinear; "
        "print(rowwise.available(), FrozenLinear((nn.Linear(8, 8),)).kernel)"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "ADAFLASH_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "onednn"]
    assert "did not build" in out.stderr


@pytest.mark.parametrize("k", [576, 1536])  # SmolLM2's widths: oneDNN agrees at 576 on some CPUs, not at 1536
def test_a_call_past_the_cut_gives_each_row_the_bits_it_gets_alone(k: int) -> None:
    torch.manual_seed(k)
    lin = nn.Linear(k, 70, bias=False)
    frozen = FrozenLinear((lin,))
    x = torch.randn(LARGE_ROWS * 3, k)
    with torch.no_grad():
        big = frozen(x)  # oneDNN's GEMM where it was probed identical, the row-wise kernel elsewhere
        for i in (0, 1, LARGE_ROWS, 3 * LARGE_ROWS - 1):
            assert torch.equal(frozen(x[i : i + 1]), big[i : i + 1])
        assert torch.equal(frozen(x[:LARGE_ROWS]), big[:LARGE_ROWS])


def test_a_meta_default_device_never_reaches_the_kernel() -> None:
    w, x = torch.randn(40, 24), torch.randn(3, 24)
    packed = rowwise.pack(w)
    with torch.device("meta"):  # what tests/test_device.py sets around a training step
        y = rowwise.matmul(x, packed, 40)
    assert y.device.type == "cpu"
    torch.testing.assert_close(y, x @ w.T)
    with pytest.raises(ValueError, match="CPU"):
        rowwise.matmul(x.to("meta"), packed, 40)
