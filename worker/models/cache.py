"""kvgrid's model cache (``$KVGRID_CACHE``, default ``~/.cache/kvgrid``): folders built once and renamed into
place whole, so a folder found there is always complete and a failed build leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from common import env


def cache_root() -> Path:
    return env.cache_root()


def build_atomically(target: Path, build: Callable[[Path], object]) -> Path:
    """``target`` as ``build`` writes it into a temporary sibling folder, renamed into place once complete; a
    folder already at ``target`` is returned as it is. Concurrent builders are safe: the loser's copy is dropped
    (builds are deterministic, so both copies are the same)."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        # mkdtemp (and some writers) make files private; the cache is shared by the user's processes.
        os.chmod(tmp, 0o755)
        for f in tmp.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; a failed or losing build's files otherwise
    return target
