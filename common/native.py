"""Small C libraries built on the machine that runs them, with the system's C compiler, and loaded through ctypes:
the CPU kernels (worker/attention/cpu_kernel.py) and the prefix index's key table (router/routing/keytable_native.py).

A build is cached under ``$KVGRID_KERNEL_CACHE`` (default ``~/.cache/kvgrid/kernels``), keyed by the sources, the
flags, the compiler's version and the CPU's feature flags (``-march=native`` builds for the CPU it runs on).
Callers fall back to their Python path, after one warning, when there is no compiler or a build fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from common import env

BUILD_TIMEOUT_S = 120


def find_compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc`` or ``gcc`` on the PATH (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cpu_flags() -> str:
    """The CPU's feature flags line of /proc/cpuinfo ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(name: str, sources: Sequence[Path], flags: Sequence[str], compiler: str | None = None) -> Path:
    """The shared library ``name-<key>.so`` built from ``sources`` with ``flags`` (built once per machine and
    cached). Raises FileNotFoundError (no compiler, a source missing from the install) or
    subprocess.CalledProcessError (the build failed: its stderr says why)."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    missing = [str(source) for source in sources if not Path(source).is_file()]
    if missing:  # an install without the package data (pyproject.toml's [tool.setuptools.package-data])
        raise FileNotFoundError(f"{name}: C source missing from the install: {', '.join(missing)}")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [*(Path(source).read_text() for source in sources), *flags, version, cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    out = env.kernel_cache() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place: processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-shared", "-fPIC", "-o", tmp, *map(str, sources), "-lm"],
            capture_output=True,
            text=True,
            check=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
