"""Model-folder helpers: the few facts of an HF ``config.json`` the engine needs, and the tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} is not a model folder: no config.json")
        raw = json.loads(cfg_file.read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{path}: architecture {arch!r} is not supported ({', '.join(SUPPORTED_ARCHITECTURES)})")
        # transformers 5 folds rope_theta and the scaling into rope_parameters; older folders keep them apart.
        rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
        rope_theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope.pop("rope_theta", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if raw.get("sliding_window") and raw.get("use_sliding_window", arch == "MistralForCausalLM"):
            window = int(raw["sliding_window"])
        else:
            window = None
        max_pos = int(raw.get("max_position_embeddings", 2048))
        if window is not None:
            max_pos = min(max_pos, window)  # full attention is exact up to the window
        num_heads = int(raw["num_attention_heads"])
        eos = _eos_ids(path, raw)
        return cls(
            path=path,
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
        )


def max_model_len(mcfg: ModelConfig, limit: int | None = None) -> int:
    """The longest sequence (prompt and output) served: the configured ``limit`` (``max_model_len`` of the
    engine or serve config; None: no limit of its own) within the model's context. The engine enforces it and
    the gateway checks requests against the same number."""
    return min(limit or mcfg.max_position_embeddings, mcfg.max_position_embeddings)


def _eos_ids(path: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources = [json.loads(gen.read_text())] if gen.is_file() else []
    for src in [*sources, raw]:
        v = src.get("eos_token_id")
        for t in v if isinstance(v, list) else [v]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def load_tokenizer(path: str | Path):
    """The folder's tokenizer through transformers (offline: the folder must hold its files)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
