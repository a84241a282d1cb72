"""The serving benchmark committed in BENCHMARKS.md: `adaflash bench` with that run's grid.

    ADAFLASH_THREADS=1 python scripts/bench_serving.py --drafter DIR --out benchmarks/serving

Extra arguments are passed through to `adaflash bench` (and override the defaults below).
"""

from __future__ import annotations

import sys

from adaflash.cli import main

DEFAULTS = [
    "--target", "smollm2",
    "--methods", "ar,ngram,dflash,adaflash,adaflash-cost",
    "--concurrency", "1,8,32",
    "--domains", "math,code,chat,blend",
    "--max-new-tokens", "64",
    "--serve-rss", "32",
]  # fmt: skip

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "bench", *DEFAULTS, *sys.argv[1:]]
    main()
