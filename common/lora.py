"""LoRA adapters in PEFT's folder format: what a request names (``AdapterRef``) and the checks on the folder.

A PEFT adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors``. ``read_adapter`` checks
the config (rank, targets, the features the engine does not implement) without reading any tensor, and names the
adapter by a digest of both files, so the same bytes give the same id wherever they are read (the id also salts
the KV cache's root key: blocks computed under one adapter never match another's or the base model's).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

# The projections of a Llama-family layer an adapter may target (PEFT's module names).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter folder the engine cannot serve; the message names the folder and what is wrong."""


@dataclass(frozen=True)
class AdapterRef:
    """The adapter a request runs under: its id (``adapter_id`` of the folder) and the folder."""

    id: str
    path: str

    @classmethod
    def of(cls, path: str | Path) -> AdapterRef:
        """A reference to the folder at ``path``, with the id of what it holds now."""
        return cls(adapter_id(path), str(path))


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter config: rank, alpha, rsLoRA, the targeted modules; ``id`` digests config and weights."""

    id: str
    path: str
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        """What PEFT multiplies ``B A x`` by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)


def _files(path: str | Path) -> tuple[Path, Path]:
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {str(path)!r} does not exist")
    config, weights = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config.is_file():
        raise AdapterError(f"adapter folder {str(path)!r} has no {CONFIG_FILE}")
    if not weights.is_file():
        raise AdapterError(f"adapter folder {str(path)!r} has no {WEIGHTS_FILE} (only safetensors weights are read)")
    return config, weights


def _digest(config: bytes, weights: Path) -> str:
    h = hashlib.sha256(config)
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:32]


def adapter_id(path: str | Path) -> str:
    """The id of the adapter in folder ``path``: the first 32 hex digits of SHA-256(config bytes + weights bytes)."""
    config, weights = _files(path)
    return _digest(config.read_bytes(), weights)


def read_adapter(path: str | Path, max_rank: int) -> AdapterSpec:
    """Check the PEFT adapter folder at ``path`` (rank within ``max_rank``, supported targets and options) and
    return its spec; ``AdapterError`` naming the folder and the field or file otherwise."""
    config_file, weights = _files(path)
    where = f"adapter {str(path)!r}"
    raw = config_file.read_bytes()
    try:
        cfg = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= max_rank:
        raise AdapterError(f"{where}: rank r={r!r} must be an integer in [1, {max_rank}] (max_lora_rank)")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha={alpha!r} must be a number")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise AdapterError(
            f"{where}: target_modules is a regular expression ({targets!r}); give a list of module names"
        )
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{where}: target_modules must be a non-empty list of module names, got {targets!r}")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise AdapterError(f"{where}: target_modules {unknown} unknown; supported: {', '.join(TARGETS)}")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias={cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save is not supported")
    if cfg.get("use_dora"):
        raise AdapterError(f"{where}: use_dora (DoRA) is not supported")
    for field in ("rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            raise AdapterError(f"{where}: {field} (per-module ranks or alphas) is not supported")
    for field in ("layers_to_transform", "layer_replication"):
        if cfg.get(field) is not None:
            raise AdapterError(f"{where}: {field} is not supported (every layer must be adapted)")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{where}: use_rslora={rslora!r} must be true or false")
    ordered = tuple(t for t in TARGETS if t in targets)
    return AdapterSpec(_digest(raw, weights), str(path), r, float(alpha), rslora, ordered)
