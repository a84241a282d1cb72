"""Where AdaFlash keeps what it builds or downloads: one root, `$ADAFLASH_CACHE` (default
`~/.cache/adaflash`). Rooms keep their own folders below it (`targets/`, `kernels/`, `data/`,
`features/`); nothing under it is committed."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ADAFLASH_CACHE", Path.home() / ".cache" / "adaflash"))


def governance_dir(home: Path) -> Path:
    """Governance's state under a runtime home (`$ADAFLASH_HOME`, a stack's or the demo's): buffer,
    lineage, quarantine. Its inner layout belongs to `GovernanceConfig`."""
    return home / "governance"
