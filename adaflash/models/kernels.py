"""Our C kernels (`csrc/*.c`), compiled once for this CPU into one shared library.

Why C: a decode step's hot loops need an order of arithmetic that is the same for a row however
many rows share the call (what token-identical speculation rests on), at the machine's
bandwidth; PyTorch's CPU kernels pick their blocking per shape. The kernels are the row-wise
matmul (`rowwise.py`), the slot attention (`slot_attention.py`) and a layer's row-wise
element ops (`row_ops.py`).

The library is built with the system's C compiler (`cc -O3 -march=native -fopenmp`) into
`$ADAFLASH_CACHE/kernels/`, keyed by the sources, the compiler and the CPU, so a second process or
a copy of the cache on another CPU never loads a mismatched build. It links the `libgomp.so.1`
that torch has already loaded, so its threads are torch's. Without a compiler `library()` is
None (logged once) and the callers keep PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from adaflash.paths import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.c"))
_PTR, _LONG, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
# name -> (argument types, return type) of every exported function
SIGNATURES = {
    "rowwise_block_width": ([], _INT),
    "rowwise_matmul": ([_PTR] * 3 + [_LONG] * 3 + [_INT], None),
    "slot_attention": ([_PTR] * 5 + [_FLOAT] + [_PTR] * 5 + [_LONG] * 6 + [_FLOAT, _INT], _INT),
    "add_rms_norm": ([_PTR] * 3 + [_FLOAT] + [_PTR] * 2 + [_LONG] * 2 + [_INT], None),
    "silu_mul": ([_PTR] * 2 + [_LONG] * 2 + [_INT], None),
}


def _cpu_signature() -> str:
    # -march=native bakes in the ISA: the build key must change with the CPU (a cache directory
    # can be shared between hosts, e.g. an AVX-512 one and an AVX2-only one).
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = ("model name", "flags")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted}))


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(built)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, out)  # atomic: a concurrent process sees the old file or the whole new one


@cache
def library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: our batch-invariant kernels are off, PyTorch's serve")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        sources = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]")))
        identity = sources + version.encode() + _cpu_signature().encode()
        key = hashlib.sha256(identity).hexdigest()[:16]
        path = cache_root() / "kernels" / f"adaflash-{key}.so"
        if not path.exists():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("our C kernels did not build (%s): PyTorch's serve", str(detail).strip()[:500])
        return None
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib
