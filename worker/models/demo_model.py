"""A tiny, deterministic, randomly initialised Hugging Face model for tests, demos and benchmarks.

``write_demo_model`` writes a complete model folder (config, generation config, safetensors weights, a byte-level BPE
tokenizer with a ChatML chat template) in the classic layout that transformers 4.x/5.x and vLLM read unchanged.
``cached_demo_model`` keeps a copy in kvgrid's model cache, which ``registry.resolve_model`` maps the names
``demo`` / ``demo:<variant>`` to. ``write_shaped_model`` writes a folder with the same tokenizer and vocabulary but a
real model's layer shapes and noise weights, for speed benchmarks.

The weights are random but "peaky": greedy next-token logits usually have a clear winner (median top-1/top-2 gap about
1.5), so two correct implementations that differ only in float rounding pick the same tokens. Being random, the model
can emit any token, EOS and the chat markers included (EOS is the greedy choice at roughly 1 step in 8000 for llama
and 1 in 700 for qwen2), so tests that need an exact output length should ignore EOS.

The tokenizer never adds special tokens on its own: ``tokenizer("hi")`` is just the BPE pieces of ``"hi"``, and
``<|begin_of_text|>`` appears only where a caller puts it. The chat template does not add it either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from worker.models.cache import build_atomically, cache_root
from worker.models.demo_corpus import demo_corpus

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Trained first, so these get ids 0..4 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

DEMO_VARIANTS = ("llama", "qwen2")

# Part of the cache folder name: bump it whenever the files written here change, so stale caches are not reused.
_FORMAT_VERSION = 2
_TARGET_VOCAB_SIZE = 4096
# Qwen2's split (the one transformers' Qwen2Tokenizer hard-codes): words, single digits, punctuation runs, whitespace.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML. String content is written as is; a list of OpenAI-style content parts contributes its text parts.
# With ``tools`` (transformers' ``apply_chat_template(..., tools=...)``) it is Qwen2.5's (Hermes-style) tool format:
# the functions' JSON in the system turn, the assistant's calls as <tool_call>{"name": ..., "arguments": ...}
# </tool_call> after its text, tool results in a user turn inside <tool_response>. Without tools (and tool
# messages) it renders exactly what it always did.
_CONTENT = (
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set message = messages[0] -%}" + _CONTENT + "{{- '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}"
    "{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    ' + \'<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": \''
    " + '<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' -}}" + _CONTENT + "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + "{%- if message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}"
    "{%- if call['arguments'] is string -%}{{- call['arguments'] -}}{%- else -%}{{- call['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Spread of the random next-token logits; sets how peaky the output distribution is.
_LOGIT_STD = 8.0
_BIAS_STD = 0.5


@dataclass(frozen=True)
class _Spec:
    architecture: str
    model_type: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    tie_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_positions: int
    rms_norm_eps: float
    extra_config: dict[str, Any]
    # Init scales, relative to 1/sqrt(fan_in). Sharper attention (qk_gain) makes the output depend more on the
    # context but also on float rounding, so it stays low. The MLP output gain lets each token's own features,
    # rather than its raw embedding or a blurred average of the context, drive the next prediction: with tied
    # embeddings a residual stream dominated by the input embedding makes greedy decoding repeat tokens.
    qk_gain: float
    attn_out_gain: float
    mlp_out_gain: float


_SPECS = {
    "llama": _Spec(
        architecture="LlamaForCausalLM",
        model_type="llama",
        num_layers=4,
        hidden=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate=768,
        tie_embeddings=False,
        qkv_bias=False,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        max_positions=4096,
        rms_norm_eps=1e-5,
        extra_config={"attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0},
        qk_gain=1.0,
        attn_out_gain=2.0,
        mlp_out_gain=4.0,
    ),
    "qwen2": _Spec(
        architecture="Qwen2ForCausalLM",
        model_type="qwen2",
        num_layers=2,
        hidden=128,
        num_heads=4,
        num_kv_heads=4,
        head_dim=32,
        intermediate=384,
        tie_embeddings=True,
        qkv_bias=True,
        rope_theta=1000000.0,
        rope_scaling=None,
        max_positions=2048,
        rms_norm_eps=1e-6,
        # sliding_window null and max_window_layers == num_layers: every layer is full attention, in any reader.
        extra_config={
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
            "attention_dropout": 0.0,
        },
        qk_gain=1.5,
        attn_out_gain=2.0,
        mlp_out_gain=24.0,
    ),
}


def _spec(variant: str) -> _Spec:
    if variant not in _SPECS:
        raise ValueError(f"unknown demo model variant {variant!r}; expected one of: {', '.join(DEMO_VARIANTS)}")
    return _SPECS[variant]


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    # Cached as a string, not a Tokenizer, so no caller can mutate the shared copy.
    tokenizer = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix=""))
    # transformers 5 ignores tokenizer_class for model_type qwen2 and rebuilds the pipeline as Qwen2Tokenizer does
    # (this split, then byte-level without its own regex), so use exactly that for both variants: every loader
    # then tokenizes alike. There is no normalizer, so any string round-trips; Qwen2Tokenizer adds NFC, which
    # only matters for text that is not already NFC.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # An explicit no-op template, so readers that honour tokenizer.json's post-processor add no BOS either.
    tokenizer.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    # The BPE trainer breaks count ties by pair order, so training is deterministic (the tests retrain in a fresh
    # process and compare bytes). min_frequency=2: every merge is of a pair the corpus really repeats.
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(demo_corpus(), trainer=trainer)
    return tokenizer.to_str(pretty=True)


def _tokenizer_facts() -> tuple[dict[str, int], int]:
    """Special token ids and the full vocabulary size (added tokens included) of the demo tokenizer."""
    tokenizer = Tokenizer.from_str(_tokenizer_json())
    ids = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise RuntimeError(f"the demo tokenizer lacks the special token {token!r}")
        ids[token] = token_id
    return ids, tokenizer.get_vocab_size(with_added_tokens=True)


def _uniform(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    # Integers from the generator, then exactly rounded float64 arithmetic. torch.randn's CPU kernel has SIMD
    # specific paths whose last bits can differ between machines; this gives the same bits everywhere.
    k = torch.randint(0, 1 << 24, shape, generator=gen, dtype=torch.int64)
    u = (k.to(torch.float64) + 0.5) * 2.0**-23 - 1.0
    return (u * (std * math.sqrt(3.0))).to(torch.float32)


def _state_dict(spec: _Spec, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    h, q_dim, kv_dim = spec.hidden, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    ones = functools.partial(torch.ones, dtype=torch.float32)

    tensors = {"model.embed_tokens.weight": _uniform(gen, (vocab_size, h), 1.0)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(h)
        tensors[p + "self_attn.q_proj.weight"] = _uniform(gen, (q_dim, h), spec.qk_gain / math.sqrt(h))
        tensors[p + "self_attn.k_proj.weight"] = _uniform(gen, (kv_dim, h), spec.qk_gain / math.sqrt(h))
        tensors[p + "self_attn.v_proj.weight"] = _uniform(gen, (kv_dim, h), 1.0 / math.sqrt(h))
        if spec.qkv_bias:
            tensors[p + "self_attn.q_proj.bias"] = _uniform(gen, (q_dim,), _BIAS_STD)
            tensors[p + "self_attn.k_proj.bias"] = _uniform(gen, (kv_dim,), _BIAS_STD)
            tensors[p + "self_attn.v_proj.bias"] = _uniform(gen, (kv_dim,), _BIAS_STD)
        tensors[p + "self_attn.o_proj.weight"] = _uniform(gen, (h, q_dim), spec.attn_out_gain / math.sqrt(q_dim))
        tensors[p + "post_attention_layernorm.weight"] = ones(h)
        tensors[p + "mlp.gate_proj.weight"] = _uniform(gen, (spec.intermediate, h), 1.0 / math.sqrt(h))
        tensors[p + "mlp.up_proj.weight"] = _uniform(gen, (spec.intermediate, h), 1.0 / math.sqrt(h))
        tensors[p + "mlp.down_proj.weight"] = _uniform(
            gen, (h, spec.intermediate), spec.mlp_out_gain / math.sqrt(spec.intermediate)
        )
    tensors["model.norm.weight"] = ones(h)
    if spec.tie_embeddings:
        # The tied head is the embedding itself, so the logit spread fixes the embedding scale (mlp_out_gain is
        # tuned against it). The layers see RMS-normalised inputs, so only the residual mix depends on it.
        tensors["model.embed_tokens.weight"] *= _LOGIT_STD / math.sqrt(h)
    else:
        tensors["lm_head.weight"] = _uniform(gen, (vocab_size, h), _LOGIT_STD / math.sqrt(h))
    return tensors


def _config(spec: _Spec, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    # Classic (transformers 4.x) layout with rope_theta / rope_scaling, which every reader understands;
    # transformers 5 converts it to rope_parameters on load.
    return {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_embeddings,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "use_cache": True,
        **spec.extra_config,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def _told(variant: str, seed: int, progress: bool) -> Iterator[None]:
    """With ``progress``, say on stderr what is built: a line before, one after with the time it took (the build
    takes about a second: no progress bar)."""
    if not progress:
        yield
        return
    spec = _spec(variant)
    start = time.perf_counter()
    print(
        f"building the {variant} demo model (seed {seed}: a {spec.num_layers}-layer, {spec.hidden}-wide random "
        f"model and its {_TARGET_VOCAB_SIZE}-token BPE tokenizer) ...",
        file=sys.stderr,
        flush=True,
    )
    yield
    print(f"built the {variant} demo model in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def write_demo_model(
    out_dir: str | os.PathLike[str], variant: str = "llama", seed: int = 0, progress: bool = False
) -> Path:
    """Write a complete demo model folder for ``variant`` (see ``DEMO_VARIANTS``) into ``out_dir`` and return it.

    The folder holds config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    and special_tokens_map.json. The same ``variant`` and ``seed`` always give byte-identical files. Raises
    ValueError for an unknown variant. ``progress``: say on stderr what is built, and how long it took.
    """
    with _told(variant, seed, progress):
        return _write_demo_model(Path(out_dir), variant, seed)


def _write_demo_model(out: Path, variant: str, seed: int) -> Path:
    spec = _spec(variant)
    out.mkdir(parents=True, exist_ok=True)
    ids, vocab_size = _tokenizer_facts()
    _write_folder_files(out, spec, _config(spec, vocab_size, ids), ids)
    save_file(_state_dict(spec, vocab_size, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _write_folder_files(out: Path, spec: _Spec, config: dict[str, Any], ids: dict[str, int]) -> None:
    """Everything of a model folder but its weights: config, generation config and the tokenizer's files."""
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[BOS_TOKEN],
            "eos_token_id": ids[EOS_TOKEN],
            "pad_token_id": ids[PAD_TOKEN],
            "do_sample": False,
        },
    )
    (out / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    special = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            **special,
            "tokenizer_class": "PreTrainedTokenizerFast",
            # Without this, Qwen2Tokenizer (see above) would add its own <|endoftext|> unk token past the vocab.
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_positions,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(out / "special_tokens_map.json", special)


def write_shaped_model(
    out_dir: str | os.PathLike[str],
    *,
    variant: str = "llama",
    dtype: str = "bfloat16",
    std: float = 0.02,
    device: str = "cpu",
    seed: int = 0,
    **shape: Any,
) -> Path:
    """Write a model folder with the demo tokenizer and vocabulary but another shape: ``shape`` overrides the
    ``variant``'s layout fields (num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, rope_theta,
    rope_scaling, max_positions, ...). For benchmarks of a real model's size: the weights are plain normal noise
    of ``std`` in ``dtype``, drawn on ``device`` and saved one shard per layer (with an index), so host memory
    holds one layer at a time whatever the model's size. TypeError for a field the spec lacks."""
    spec = dataclasses.replace(_spec(variant), **shape)
    torch_dtype = getattr(torch, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids, vocab_size = _tokenizer_facts()
    _write_folder_files(out, spec, {**_config(spec, vocab_size, ids), "torch_dtype": dtype}, ids)

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def noise(*size: int) -> torch.Tensor:
        t = torch.randn(size, generator=gen, device=device, dtype=torch_dtype).mul_(std)
        return t.cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch_dtype)

    def layer(i: int) -> dict[str, torch.Tensor]:
        h, q_dim, kv_dim = spec.hidden, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        p = f"model.layers.{i}."
        tensors = {
            p + "input_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": noise(q_dim, h),
            p + "self_attn.k_proj.weight": noise(kv_dim, h),
            p + "self_attn.v_proj.weight": noise(kv_dim, h),
            p + "self_attn.o_proj.weight": noise(h, q_dim),
            p + "post_attention_layernorm.weight": ones(h),
            p + "mlp.gate_proj.weight": noise(spec.intermediate, h),
            p + "mlp.up_proj.weight": noise(spec.intermediate, h),
            p + "mlp.down_proj.weight": noise(h, spec.intermediate),
        }
        if spec.qkv_bias:
            for name, n in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                tensors[f"{p}self_attn.{name}_proj.bias"] = noise(n)
        return tensors

    def head() -> dict[str, torch.Tensor]:
        tensors = {"model.norm.weight": ones(spec.hidden)}
        if not spec.tie_embeddings:
            tensors["lm_head.weight"] = noise(vocab_size, spec.hidden)
        return tensors

    # Shards built lazily, one at a time: the embedding, each layer, the final norm and head.
    shards: list[Callable[[], dict[str, torch.Tensor]]] = [
        lambda: {"model.embed_tokens.weight": noise(vocab_size, spec.hidden)},
        *(functools.partial(layer, i) for i in range(spec.num_layers)),
        head,
    ]
    weight_map: dict[str, str] = {}
    total = 0
    for n, build in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = build()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return out


def demo_variant(model: str) -> str:
    """The variant a demo model name (``demo``, ``demo:<variant>``) names; ValueError for an unknown one."""
    variant = "llama" if model == "demo" else model.removeprefix("demo:")
    _spec(variant)
    return variant


def demo_model_folder(variant: str) -> Path:
    """Where ``cached_demo_model`` keeps the demo model of ``variant`` (built or not)."""
    return cache_root() / f"demo-{variant}-v{_FORMAT_VERSION}"


def cached_demo_model(variant: str, progress: bool = False) -> Path:
    """The demo model folder of ``variant`` in kvgrid's model cache, built on first use (said on stderr with
    ``progress``); concurrent callers are safe (``registry.resolve_model`` maps the names to it)."""

    def build(tmp: Path) -> Path:
        with _told(variant, 0, progress):
            return write_demo_model(tmp, variant)

    return build_atomically(demo_model_folder(variant), build)
