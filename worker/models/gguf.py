"""GGUF files to Hugging Face model folders: ``convert_gguf`` reads a Llama-family GGUF (llama.cpp's format) with
the format's own Python reader (``gguf``) and writes what the engine loads: ``config.json``, the weights
dequantized to float32 ``*.safetensors``, ``tokenizer.json`` built from the file's vocabulary and merges,
``tokenizer_config.json`` with the chat template of its metadata, and ``generation_config.json``.

llama.cpp stores Q and K projections with the rows of each head interleaved for its rotary layout; they are put
back in Hugging Face's order here (the reverse of its converter's permutation), so the folder is an ordinary
Llama checkpoint. Anything this module cannot convert exactly (another architecture, tensor type, tokenizer or
pre-tokenizer, Llama 3's rope frequency table) is a ``GGUFError`` naming it, raised before anything is written.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SUPPORTED_ARCHITECTURES = ("llama",)
SHARD_BYTES = 2 << 30  # float32 weights go in files of at most ~2 GiB, with an index when there are several

# Pre-tokenizers by the ``tokenizer.ggml.pre`` names llama.cpp gives them: a regex split before byte-level BPE
# (None: GPT-2's own regex inside the byte-level step), and whether digits are split one by one first.
_GPT2_SPLIT = None
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (_GPT2_SPLIT, False),
    "gpt-2": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, True),
    "starcoder": (_GPT2_SPLIT, True),
    "refact": (_GPT2_SPLIT, True),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token types that are added tokens


class GGUFError(ValueError):
    """A GGUF file that cannot be converted: not GGUF, truncated, or of an architecture or type not supported."""


@dataclass(frozen=True)
class _Hparams:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_theta: float
    rms_eps: float
    vocab: int
    rope_scaling: dict[str, Any] | None


def is_gguf(path: Path) -> bool:
    """Whether the file starts with GGUF's magic."""
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def open_gguf(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... on a bad or cut file
        what = "truncated or corrupt" if is_gguf(path) else "not GGUF"
        raise GGUFError(f"{path.name} is not a readable GGUF file ({what}: {type(exc).__name__}: {exc})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{path.name} is truncated: tensor {t.name!r} ends past the end of the file")
    return reader


def gguf_field(reader, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _hparams(reader, arch: str) -> _Hparams:
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(gguf_field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens is not None else 0))
    scaling = None
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    elif kind not in ("none", ""):
        raise GGUFError(f"rope scaling {kind!r} is not supported (only linear)")
    return _Hparams(
        layers=int(gguf_field(reader, f"{arch}.block_count")),
        hidden=hidden,
        intermediate=int(gguf_field(reader, f"{arch}.feed_forward_length")),
        heads=heads,
        kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(gguf_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        context=int(gguf_field(reader, f"{arch}.context_length")),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab=vocab,
        rope_scaling=scaling,
    )


def _hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor; None for one this module does not know."""
    fixed = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    local = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }.get(parts[2])
    return None if local is None else f"model.layers.{parts[1]}.{local}.{parts[3]}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order: within each head it stores row ``half * (head_dim / 2) + i`` of Hugging
    Face's layout at ``2 * i + half`` (the two rotated halves interleaved)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check(reader, path: Path) -> tuple[str, _Hparams]:
    """Architecture, hyperparameters and tensor names and types, all checked before anything is written."""
    arch = str(gguf_field(reader, "general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path.name}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hp = _hparams(reader, arch)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise GGUFError(f"{path.name}: Llama 3.1-style rope frequency scaling (rope_freqs) is not supported")
        if _hf_name(t.name) is None:
            raise GGUFError(f"{path.name}: tensor {t.name!r} is not part of a Llama model")
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFError(
                f"{path.name}: tensor {t.name!r} has type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
            )
    return arch, hp


def _tensors(reader, hp: _Hparams, progress: bool):
    """(HF name, float32 array) of every tensor, dequantized, Q and K in Hugging Face's row order."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    for t in tqdm(reader.tensors, desc="converting GGUF tensors", unit="tensor", disable=not progress):
        name = _hf_name(t.name)
        assert name is not None  # _check saw every name
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, hp.heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, hp.kv_heads)
        yield name, np.ascontiguousarray(w)


def _write_weights(out: Path, tensors) -> bool:
    """Write the tensors as safetensors shards of at most ``SHARD_BYTES``; True when the model has an LM head
    of its own (no ``output.weight``: tied to the embedding)."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size, has_head = 0, False
    for name, w in tensors:
        has_head |= name == "lm_head.weight"
        if size and size + w.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return has_head
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(w.nbytes for shard in shards for w in shard.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return has_head


def _tokenizer(reader, path: Path) -> tuple[Any, dict[str, Any]]:
    """The ``tokenizers`` object of the file's BPE vocabulary, and the special-token facts for the configs."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{path.name}: tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = str(gguf_field(reader, "tokenizer.ggml.pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(
            f"{path.name}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})"
        )
    tokens = [str(t) for t in gguf_field(reader, "tokenizer.ggml.tokens")]
    types = list(gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges: list[tuple[str, str]] = []
    for m in gguf_field(reader, "tokenizer.ggml.merges"):
        left, _, right = str(m).partition(" ")
        merges.append((left, right))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"), byte_fallback=False)
    )
    split, digits = _PRE_TOKENIZERS[pre]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(tokens[i], special=types[i] == _TOKEN_CONTROL, normalized=False)
        for i in range(len(tokens))
        if types[i] in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tok.add_tokens(added)

    def name(key: str) -> str | None:
        i = gguf_field(reader, f"tokenizer.ggml.{key}", None)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, add_bos = name("bos_token_id"), bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos} $B:1", special_tokens=[(bos, vocab[bos])]
        )
    else:  # explicitly none, so every reader adds no BOS
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    eos_ids = [
        int(i)
        for key in ("eos_token_id", "eot_token_id")
        if (i := gguf_field(reader, f"tokenizer.ggml.{key}", None)) is not None
    ]
    facts = {
        "bos_token": bos,
        "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"),
        "unk_token": name("unknown_token_id"),
        "add_bos_token": add_bos,
        "bos_token_id": vocab.get(bos) if bos else None,
        "eos_token_ids": list(dict.fromkeys(eos_ids)),
    }
    return tok, facts


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(path: str | Path, out: str | Path, progress: bool = True) -> Path:
    """Write the Hugging Face folder of the GGUF file ``path`` into the existing, empty folder ``out``.

    Raises FileNotFoundError for a missing file and ``GGUFError`` for one that cannot be converted; the checks
    that need no tensor data run first. The caller owns ``out`` and removes it on failure
    (``registry.resolve_model`` builds into a temporary folder and renames it into the cache)."""
    path, out = Path(path), Path(out)
    reader = open_gguf(path)
    arch, hp = _check(reader, path)
    tokenizer, facts = _tokenizer(reader, path)
    if tokenizer.get_vocab_size(with_added_tokens=True) != hp.vocab:
        raise GGUFError(f"{path.name}: {tokenizer.get_vocab_size()} tokens for a vocabulary of {hp.vocab}")
    if progress:
        print(f"converting {path.name} ({len(reader.tensors)} tensors) once, into kvgrid's cache", file=sys.stderr)
    try:
        has_head = _write_weights(out, _tensors(reader, hp, progress))
    except GGUFError:
        raise
    except (ValueError, IndexError, TypeError) as exc:  # data the reader could map but not decode
        raise GGUFError(f"{path.name}: a tensor could not be read ({exc})") from None
    eos = facts["eos_token_ids"]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": hp.vocab,
        "hidden_size": hp.hidden,
        "intermediate_size": hp.intermediate,
        "num_hidden_layers": hp.layers,
        "num_attention_heads": hp.heads,
        "num_key_value_heads": hp.kv_heads,
        "head_dim": hp.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": hp.context,
        "rms_norm_eps": hp.rms_eps,
        "rope_theta": hp.rope_theta,
        "rope_scaling": hp.rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_head,
        "torch_dtype": "float32",
        "bos_token_id": facts["bos_token_id"],
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "kvgrid_source": {"gguf": path.name, "architecture": arch},
    }
    _write_json(out / "config.json", config)
    gen = {"bos_token_id": facts["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    _write_json(out / "generation_config.json", gen)
    tokenizer.save(str(out / "tokenizer.json"))
    special = {k: facts[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if facts[k] is not None}
    tok_config: dict[str, Any] = {
        **special,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": facts["add_bos_token"],
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hp.context,
    }
    template = gguf_field(reader, "tokenizer.chat_template", None)
    if template:
        tok_config["chat_template"] = str(template)
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "special_tokens_map.json", special)
    return out
