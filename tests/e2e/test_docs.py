"""The docs site (mkdocs.yml, docs/): it builds with --strict, every page is in the nav, the generated configuration
reference is current and complete, and every runnable block of README.md and docs/ runs against a real server.

A runnable block is a fenced ``sh``/``bash``/``console``/``python`` block right after a line that is exactly
``<!-- runnable -->``. It runs against one ``kvgrid serve`` started for this module with router/demo.yaml's tenants and
admin key (the demo model, served as ``smollm2``), with ``http://127.0.0.1:8000`` in its text pointing at that server:
sh and bash blocks with ``bash -euo pipefail``, a console block's ``$ `` lines the same way (the rest is output),
python blocks with this interpreter; from the repository root, .venv/bin first on PATH. It fails if it exits non-zero.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import yaml

import harness

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS_YML = ROOT / "mkdocs.yml"
GENERATOR = DOCS / "gen_config_reference.py"
REFERENCE = DOCS / "reference" / "configuration.md"
MARKER = "<!-- runnable -->"
LANGUAGES = {"sh": "sh", "bash": "sh", "shell": "sh", "console": "console", "python": "python", "py": "python"}
BLOCK_TIMEOUT_S = 120
ADDRESS = "127.0.0.1:8000"  # what the blocks' text says; replaced by the test server's address


# -- the site -------------------------------------------------------------------------------------------------------


def test_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link or anchor, a page missing from the nav or a nav entry without its
    page fails the build (mkdocs.yml's validation settings make each a warning)."""
    site = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(MKDOCS_YML),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").exists()


def _nav_pages(node: object) -> list[str]:
    """The page paths in a (part of) mkdocs.yml's nav, external links left out."""
    if isinstance(node, str):
        return [] if re.match(r"^[a-z]+://", node) else [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_every_page_is_in_the_nav() -> None:
    """Every docs/**/*.md is in the nav (none orphaned), once, and every nav entry is a file under docs/."""
    config = yaml.safe_load(MKDOCS_YML.read_text())
    assert config["docs_dir"] == "docs"
    nav = _nav_pages(config["nav"])
    duplicates = sorted({p for p in nav if nav.count(p) > 1})
    assert not duplicates, f"pages in mkdocs.yml's nav more than once: {duplicates}"
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    orphaned = sorted(set(pages) - set(nav))
    assert not orphaned, f"pages under docs/ missing from mkdocs.yml's nav: {orphaned}"
    missing = sorted(set(nav) - set(pages))
    assert not missing, f"mkdocs.yml's nav names pages that do not exist under docs/: {missing}"


# -- the configuration reference -------------------------------------------------------------------------------------


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_config_reference_is_current() -> None:
    """docs/reference/configuration.md is what the generator renders from common/config.py now."""
    want = _generator().render()
    have = REFERENCE.read_text() if REFERENCE.exists() else ""
    assert have == want, (
        "docs/reference/configuration.md is out of date with common/config.py: "
        "run .venv/bin/python docs/gen_config_reference.py"
    )


ENV_GENERATOR = DOCS / "gen_env_reference.py"
ENV_REFERENCE = DOCS / "reference" / "environment.md"
ENV_VAR = re.compile(r"\bKVGRID_[A-Z_]+\b")


def _env_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_env_reference", ENV_GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_env_reference_is_current() -> None:
    """docs/reference/environment.md is what the generator renders from common/env.py now."""
    want = _env_generator().render()
    have = ENV_REFERENCE.read_text() if ENV_REFERENCE.exists() else ""
    assert have == want, (
        "docs/reference/environment.md is out of date with common/env.py: "
        "run .venv/bin/python docs/gen_env_reference.py"
    )


def test_env_reference_lists_every_variable_in_the_code() -> None:
    """Every ``KVGRID_*`` name in common/, worker/ and router/ (Python, shell, YAML) is on the page, and the Python
    code outside common/env.py reads no ``KVGRID_*`` variable from ``os.environ`` itself."""
    page = ENV_REFERENCE.read_text()
    seen: dict[str, str] = {}
    for folder in ("common", "worker", "router"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".sh", ".yaml", ".yml") or "__pycache__" in path.parts:
                continue
            text = path.read_text()
            for name in ENV_VAR.findall(text):
                seen.setdefault(name, str(path.relative_to(ROOT)))
            if path.suffix == ".py" and path.name != "env.py":
                reads = re.findall(r"environ(?:\.get\(|\[)\s*[\"']KVGRID_", text)
                assert not reads, f"{path.relative_to(ROOT)} reads a KVGRID_ variable itself: use common/env.py"
    seen.pop("KVGRID_LOGGERS", None)  # common/logs.py's tuple of logger names, not a variable
    missing = {name: where for name, where in seen.items() if f"### `{name}`" not in page}
    assert not missing, (
        f"KVGRID_* variables missing from docs/reference/environment.md (add them to common/env.py): {missing}"
    )


def test_config_reference_covers_every_field() -> None:
    """Every field of every model reachable from ServeConfig has a description and its own entry on the page."""
    gen = _generator()
    entries = list(gen.entries())
    models = {e.section.model.__name__ for e in entries}
    for name in ("ServeConfig", "HttpConfig", "TenantConfig", "CacheConfig", "LimitsConfig", "PricesConfig"):
        assert name in models, f"the generator did not reach {name}"
    for name in ("AdviceConfig", "MonitoringConfig", "KVTiersServeConfig", "RoutingConfig"):
        assert name in models, f"the generator did not reach {name}"
    page = gen.render()
    absent = [e.path for e in entries if f"\n### `{e.path}`\n" not in page]
    assert not absent, f"fields missing from the rendered reference: {absent}"
    undescribed = [
        f"{e.path} ({e.section.model.__name__}.{e.name})" for e in entries if not (e.info.description or "").strip()
    ]
    assert not undescribed, (
        f"{len(undescribed)} config fields have no Field(description=...) in common/config.py: "
        + ", ".join(undescribed)
    )


# -- runnable blocks ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    line: int  # the opening fence's, 1-based
    language: str  # sh, console or python
    text: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _scan(path: Path) -> tuple[list[Block], list[str]]:
    """The runnable blocks of one file, and what is wrong with its markers (a marker not exactly on its own line,
    or not followed by a fenced block of a language this test runs)."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks, problems = [], []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        where = f"{rel}:{i + 1}"
        if line != MARKER:
            problems.append(f"{where}: the marker must be a line of its own, unindented: {MARKER}")
            continue
        fence = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if fence is None or fence.group(2).lower() not in LANGUAGES:
            problems.append(f"{where}: {MARKER} must be followed by a ```sh, ```bash, ```console or ```python block")
            continue
        close = re.compile(rf"^{re.escape(fence.group(1)[0])}{{{len(fence.group(1))},}}\s*$")
        end = next((j for j in range(i + 2, len(lines)) if close.match(lines[j])), None)
        if end is None:
            problems.append(f"{where}: the block after {MARKER} is never closed")
            continue
        body = "\n".join(lines[i + 2 : end]) + "\n"
        blocks.append(Block(rel, i + 2, LANGUAGES[fence.group(2).lower()], body))
    return blocks, problems


def _collect() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    problems: list[str] = []
    for path in _markdown_files():
        if path.exists():
            found, wrong = _scan(path)
            blocks += found
            problems += wrong
    return blocks, problems


BLOCKS, MARKER_PROBLEMS = _collect()


def test_runnable_markers_are_well_formed() -> None:
    assert not MARKER_PROBLEMS, "\n".join(MARKER_PROBLEMS)


def test_enough_runnable_blocks() -> None:
    """The docs' examples are tested: at least 5 runnable blocks in README.md and docs/ together."""
    assert len(BLOCKS) >= 5, f"only {len(BLOCKS)} runnable blocks ({MARKER} before a fenced block): {BLOCKS}"


def _console_commands(text: str) -> str:
    """A console block's commands: its ``$ `` lines, with their ``\\``-continued lines; the rest is output."""
    out: list[str] = []
    continued = False
    for line in text.splitlines():
        if continued or line.startswith("$ "):
            out.append(line if continued else line[2:])
            continued = line.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


# The server: router/demo.yaml's tenants and admin key, on the demo model named as the docs' model (smollm2), one
# CPU group, a short context: it starts in seconds, without downloading anything.
DEMO = yaml.safe_load((ROOT / "router" / "demo.yaml").read_text())
SERVED = {**DEMO, "model": "demo", "served_model_name": "smollm2", "device": "cpu", "groups": 1, "max_model_len": 1024}
SERVED.pop("http")
READY = [(t["name"], t["api_keys"][0]) for t in DEMO["tenants"]]


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory):
    with harness.serving(tmp_path_factory, "", READY, defaults=yaml.safe_dump(SERVED, sort_keys=False)) as srv:
        yield srv


def _run(block: Block, server: harness.Server, folder: Path) -> subprocess.CompletedProcess[str]:
    text = block.text.replace(f"http://{ADDRESS}", server.base).replace(ADDRESS, f"127.0.0.1:{server.port}")
    if block.language == "python":
        script = folder / "block.py"
        script.write_text(text)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", _console_commands(text) if block.language == "console" else text]
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(ROOT / ".venv" / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the block's own process group: bash and whatever it started
        out, _ = proc.communicate()
        pytest.fail(f"{block.id}: did not finish within {BLOCK_TIMEOUT_S} s; its output:\n{out}\n--- block:\n{text}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_runnable_block(block: Block, docs_server: harness.Server, tmp_path: Path) -> None:
    done = _run(block, docs_server, tmp_path)
    assert done.returncode == 0, (
        f"{block.id} ({block.language}) exited {done.returncode}; its output:\n{done.stdout}\n--- block:\n{block.text}"
    )
