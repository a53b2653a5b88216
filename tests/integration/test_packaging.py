"""Packaging: the sdist and the wheel hold every file of the packages (the non-Python ones included: the CPU
kernels' C sources, the configs, the node script, the Grafana dashboard), and the wheel, installed into a fresh
venv, runs: `kvgrid --version`, the C kernels built from its own sources (no silent torch fallback), and
`kvgrid model-path demo`.

Built from a copy of the checkout's files (tracked, and untracked but not ignored: uncommitted work counts), so the
build's build/, dist/ and egg-info never land in the repository. The fresh venv gets the heavy dependencies (torch,
Ray, ...) without downloading them: a ``.pth`` line appends this environment's site-packages to its path. A path
line only appends the folder; the ``.pth`` files inside it are not processed, so this environment's editable
install of kvgrid stays inactive there and ``router``, ``worker`` and ``common`` import from the wheel (checked).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from worker.attention import cpu_kernel

pytestmark = pytest.mark.slow  # builds the sdist and the wheel, makes a venv, imports torch in it four times

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "worker", "router")
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _checkout_files() -> list[str]:
    """The checkout's files as git sees them (tracked, or untracked and not ignored), that exist on disk."""
    if shutil.which("git") is None:
        pytest.skip("no git here: the files to package are git's")
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return sorted({f for f in out.stdout.split("\0") if f and (ROOT / f).is_file()})


def _package_files() -> tuple[list[str], list[str]]:
    """The packages' Python files and their other files (the single source of truth of what must ship). Nothing
    is left out: every file git knows under common/, worker/ and router/ is part of the installed package."""
    files = [f for f in _checkout_files() if f.split("/", 1)[0] in PACKAGES]
    return [f for f in files if f.endswith(".py")], [f for f in files if not f.endswith(".py")]


def _env(tmp: Path) -> dict[str, str]:
    """The environment of the fresh venv's commands: nothing of this one's paths, private caches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "KVGRID_"))}
    env |= {
        "PYTHONNOUSERSITE": "1",
        "HF_HUB_OFFLINE": "1",
        "KVGRID_CACHE": str(tmp / "kvgrid-cache"),
        "KVGRID_KERNEL_CACHE": str(tmp / "kernel-cache"),
    }
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel (built from the sdist, as `python -m build` does), from a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("packaging")
    src, dist = tmp / "src", tmp / "dist"
    for f in _checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    # --no-isolation: the build backend (setuptools) from this environment, nothing downloaded
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel, "tmp": tmp}


@pytest.fixture(scope="module")
def fresh(built: dict[str, Path]) -> Path:
    """A new venv with only the wheel installed in it, this environment's site-packages appended to its path."""
    venv = built["tmp"] / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # this environment's pip, installing into the fresh venv (its own would cost an ensurepip)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet"]
        + ["--disable-pip-version-check", str(built["wheel"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "kvgrid-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def _run(fresh: Path, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A command of the fresh venv, run outside the checkout (a cwd inside it would import from it)."""
    cwd = fresh.parent / "elsewhere"
    cwd.mkdir(exist_ok=True)
    return subprocess.run(cmd, cwd=cwd, env=_env(fresh.parent), capture_output=True, text=True, timeout=timeout)


def test_the_sdist_and_the_wheel_hold_every_file_of_the_packages(built):
    code, data = _package_files()
    # what the code opens relative to its own files: in the list above, so in the checks below
    opened = {str(p.resolve().relative_to(ROOT)) for p in cpu_kernel.SOURCES}
    assert opened <= set(data), opened - set(data)
    assert data, "no non-Python files found under the packages: the scan is broken"
    with zipfile.ZipFile(built["wheel"]) as whl:
        in_wheel = set(whl.namelist())
    with tarfile.open(built["sdist"]) as sdist:
        # the sdist's members sit under kvgrid-<version>/
        in_sdist = {m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile() and "/" in m.name}
    assert not [f for f in data if f not in in_sdist], "missing from the sdist (package-data in pyproject.toml)"
    assert not [f for f in data if f not in in_wheel], "missing from the wheel (package-data in pyproject.toml)"
    assert not [f for f in code if f not in in_wheel], "Python files missing from the wheel (packages.find)"


def test_the_wheel_imports_from_the_fresh_venv_not_the_checkout(fresh):
    proc = _run(
        fresh,
        str(fresh / "bin" / "python"),
        "-c",
        "import common, router, worker; print('\\n'.join(m.__file__ for m in (common, router, worker)))",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = [Path(p).resolve() for p in proc.stdout.split()]
    assert len(paths) == 3 and all(p.is_relative_to(fresh.resolve()) for p in paths), paths


def test_kvgrid_version_from_the_installed_wheel(fresh):
    proc = _run(fresh, str(fresh / "bin" / "kvgrid"), "--version")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"kvgrid {PROJECT['version']}"


# Run inside the fresh venv: the C kernels built from the wheel's sources, and the same results as torch.
KERNELS = textwrap.dedent(
    """
    import logging, sysconfig
    from pathlib import Path

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    import torch
    import torch.nn.functional as F

    from worker.attention import cpu_kernel
    from worker.attention.torch_backend import TorchBackend
    from worker.layers.norm import RMSNorm

    site = Path(sysconfig.get_path("purelib")).resolve()
    assert all(s.resolve().is_relative_to(site) for s in cpu_kernel.SOURCES), cpu_kernel.SOURCES
    lib = cpu_kernel.load()
    assert lib is not None, "the C kernels did not load"
    assert TorchBackend().cpu_kernel() is not None, "the attention backend is on its torch fallback"
    g = torch.Generator().manual_seed(0)

    # decode attention: 3 rows of 1, 5 and 9 keys in blocks of 4, 2 query heads per KV head
    heads, kv_heads, dim, block = 4, 2, 32, 4
    lens = torch.tensor([1, 5, 9], dtype=torch.int32)
    k = torch.randn(12, block, kv_heads, dim, generator=g)
    v = torch.randn(12, block, kv_heads, dim, generator=g)
    tables = torch.randperm(12, generator=g)[:9].view(3, 3).to(torch.int32)
    q = torch.randn(3, heads, dim, generator=g)
    out = cpu_kernel.paged_decode(lib, q, k, v, tables, lens, dim**-0.5)
    for i, n in enumerate(lens.tolist()):
        kk, vv = (c[tables[i].long()].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, 1) for c in (k, v))
        ref = F.scaled_dot_product_attention(q[i, :, None], kk.transpose(0, 1), vv.transpose(0, 1), scale=dim**-0.5)
        torch.testing.assert_close(out[i], ref[:, 0], atol=1e-5, rtol=1e-5)

    # the residual add fused with RMSNorm, through the layer the model uses
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64, generator=g)
    x, residual = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    y, h = norm(x, residual)
    assert norm._lib, "RMSNorm is on its torch fallback"
    torch.testing.assert_close(h, x + residual)
    torch.testing.assert_close(y, F.rms_norm(x + residual, (64,), norm.weight, 1e-5), atol=1e-5, rtol=1e-5)
    print("kernels ok")
    """
)


@pytest.mark.skipif(cpu_kernel.find_compiler() is None, reason="no C compiler here: the kernels cannot be built")
def test_the_c_kernels_build_and_load_from_the_installed_wheel(fresh):
    proc = _run(fresh, str(fresh / "bin" / "python"), "-c", KERNELS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "kernels ok" in proc.stdout
    # the fallback's one warning (cpu_kernel.load) is not there, nor any other of kvgrid's
    assert "unavailable" not in proc.stderr and "WARNING kvgrid" not in proc.stderr, proc.stderr[-3000:]
    assert list((fresh.parent / "kernel-cache").glob("cpu_decode-*.so")), "built nowhere: not from the wheel"


def test_kvgrid_model_path_demo_from_the_installed_wheel(fresh):
    proc = _run(fresh, str(fresh / "bin" / "kvgrid"), "model-path", "demo")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = Path(proc.stdout.strip())
    assert path.is_relative_to(fresh.parent / "kvgrid-cache"), path
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
