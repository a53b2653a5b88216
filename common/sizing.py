"""Capacity planning arithmetic (``kvgrid plan``): a model's shape from its ``config.json``, the KV bytes one token
takes, the parameter count, and what a worker group of ``tp`` GPUs holds of KV cache after the weights and a
reserve. Pure functions of their inputs: the CLI (router/cli/plan.py) reads files, runs replays and prints.

``common.model_config.ModelConfig`` reads only the architectures the engine runs; a plan is also asked for
models kvgrid does not serve (GPT-3, DeepSeek-V3), so ``shape_from_config`` reads any decoder's config.json,
under the key names of the common Hugging Face families (Llama's, GPT-2's, DeepSeek's, Mixtral's, Qwen-MoE's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

GIB = 1 << 30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}
DEFAULT_RESERVE_GIB = 2.0  # per GPU: CUDA context, cuBLAS/NCCL workspaces, CUDA graphs and one step's activations
DEFAULT_UTILIZATION = 0.9


@dataclass(frozen=True)
class Gpu:
    memory_gib: float
    source: str  # where the figure comes from: the vendor's spec


# GPU memory as the vendor specifies it. NVIDIA's "GB" of GPU memory are binary (an A100 80GB has 80 GiB of HBM),
# so the figures are taken as GiB; the few hundred MiB the driver keeps are within what the utilization leaves.
GPUS: dict[str, Gpu] = {
    "b200": Gpu(180, "NVIDIA DGX B200 datasheet: 1,440 GB of GPU memory over 8 B200 GPUs"),
    "h200": Gpu(141, "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e"),
    "h100": Gpu(80, "NVIDIA H100 Tensor Core GPU datasheet: 80 GB (SXM and PCIe)"),
    "h100-nvl": Gpu(94, "NVIDIA H100 Tensor Core GPU datasheet: 94 GB (H100 NVL)"),
    "a100-80g": Gpu(80, "NVIDIA A100 Tensor Core GPU datasheet: 80 GB HBM2e"),
    "a100-40g": Gpu(40, "NVIDIA A100 Tensor Core GPU datasheet: 40 GB HBM2"),
    "l40s": Gpu(48, "NVIDIA L40S datasheet: 48 GB GDDR6"),
    "l4": Gpu(24, "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6"),
    "a10": Gpu(24, "NVIDIA A10 Tensor Core GPU datasheet: 24 GB GDDR6"),
    "rtx-4090": Gpu(24, "NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X"),
}

# Key names of the same figure across Hugging Face families, first found wins.
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
_VOCAB = ("vocab_size", "padded_vocab_size")
_EXPERTS = ("n_routed_experts", "num_local_experts", "num_experts")
# Families whose MLP is two matrices (up, down) rather than gated (gate, up, down), with biases and learned
# position embeddings (GPT-2's layout, which GPT-3 shares).
_UNGATED = {"gpt2", "gpt_bigcode", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi"}
_LEARNED_POSITIONS = {"gpt2", "gpt_bigcode", "opt"}


class PlanError(ValueError):
    """Input a plan cannot be made from; the message is ``cause; fix``."""


@dataclass(frozen=True)
class ModelShape:
    """What a plan needs of a model. ``kv_lora_rank`` set: multi-head latent attention (DeepSeek-V2/V3)."""

    name: str
    architecture: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    torch_dtype: str | None = None  # of the checkpoint, as config.json says
    quantized_fp8: bool = False  # config.json's quantization_config is fp8 (DeepSeek-V3's published weights)
    params: int | None = None  # computed from config.json; None when it lacks the fields (then from the files)
    params_missing: tuple[str, ...] = ()  # the fields the parameter count lacked

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "MLA"
        return "MHA" if self.kv_heads == self.heads else "GQA"


def _get(raw: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((raw[k] for k in keys if raw.get(k) is not None), None)


def shape_from_config(raw: dict[str, Any], name: str) -> ModelShape:
    """The shape of a Hugging Face ``config.json`` (``raw``); PlanError names every field the KV figures lack."""
    if _get(raw, _LAYERS) is None and isinstance(raw.get("text_config"), dict):
        raw = {**raw, **raw["text_config"]}  # a multimodal model: its language model's config
    layers, heads, hidden = _get(raw, _LAYERS), _get(raw, _HEADS), _get(raw, _HIDDEN)
    mla = bool(raw.get("kv_lora_rank"))
    missing = [keys[0] for keys, v in ((_LAYERS, layers), (_HEADS, heads)) if v is None]
    if mla and not raw.get("qk_rope_head_dim"):
        missing.append("qk_rope_head_dim")
    if not mla and raw.get("head_dim") is None and hidden is None:
        missing.append("head_dim (or hidden_size)")
    if missing:
        raise PlanError(
            f"{name} lacks {', '.join(missing)}, needed for the KV cache size; give a complete config.json "
            "(a Hugging Face model folder's)"
        )
    heads = int(heads)
    kv_heads = int(_get(raw, _KV_HEADS) or heads)
    head_dim = int(raw.get("head_dim") or int(hidden) // heads) if not mla else int(raw.get("v_head_dim") or 0)
    quant = raw.get("quantization_config") or {}
    shape = ModelShape(
        name=name,
        architecture=str((raw.get("architectures") or [raw.get("model_type") or "?"])[0]),
        layers=int(layers),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_lora_rank=int(raw["kv_lora_rank"]) if mla else None,
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]) if mla else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        quantized_fp8=isinstance(quant, dict) and quant.get("quant_method") == "fp8",
    )
    params_missing = [k[0] for k in (_HIDDEN, _VOCAB) if _get(raw, k) is None]
    # GPT-2's MLP width defaults to 4 x hidden; a gated MLP's must be given (an MoE model's experts' suffice).
    ungated, moe_only = raw.get("model_type") in _UNGATED, _get(raw, _EXPERTS) and raw.get("moe_intermediate_size")
    if _get(raw, _INTERMEDIATE) is None and not ungated and not moe_only:
        params_missing.append(_INTERMEDIATE[0])
    params = None if params_missing else config_params(raw, shape)
    return replace(shape, params=params, params_missing=tuple(params_missing))


def config_params(raw: dict[str, Any], shape: ModelShape) -> int:
    """Parameters of a decoder from its config: embeddings (and an untied LM head), attention, MLP (every expert
    of a mixture-of-experts layer, shared experts and the router), norms. Within a few % of the checkpoint's."""
    hidden, vocab = int(_get(raw, _HIDDEN)), int(_get(raw, _VOCAB))
    family = str(raw.get("model_type") or "")
    layers, heads, kvh, hd = shape.layers, shape.heads, shape.kv_heads, shape.head_dim
    biased = family in _UNGATED or bool(raw.get("attention_bias"))
    tied = bool(raw.get("tie_word_embeddings", family in _UNGATED))
    total = vocab * hidden * (1 if tied else 2) + hidden  # embeddings, LM head, final norm
    if family in _LEARNED_POSITIONS:
        total += int(raw.get("n_positions") or raw.get("max_position_embeddings") or 0) * hidden

    if shape.kv_lora_rank:  # MLA: low-rank query (when q_lora_rank) and a shared K/V latent, up-projected per head
        rope, lora = int(raw["qk_rope_head_dim"]), shape.kv_lora_rank
        nope, v = int(raw.get("qk_nope_head_dim") or 0), int(raw.get("v_head_dim") or 0)
        q_rank = raw.get("q_lora_rank")
        q = hidden * heads * (nope + rope) if not q_rank else hidden * q_rank + q_rank + q_rank * heads * (nope + rope)
        attention = q + hidden * (lora + rope) + lora + lora * heads * (nope + v) + heads * v * hidden
    else:
        attention = 2 * hidden * heads * hd + 2 * hidden * kvh * hd  # Q and O, K and V
        if biased:
            attention += heads * hd + 2 * kvh * hd + (hidden if family in _UNGATED else 0)

    mats = 2 if family in _UNGATED else 3
    inter = int(_get(raw, _INTERMEDIATE) or 4 * hidden)
    dense = mats * hidden * inter + ((inter + hidden) if family in _UNGATED else 0)
    experts = int(_get(raw, _EXPERTS) or 0)
    moe = 0
    if experts:
        expert = int(raw.get("moe_intermediate_size") or inter)
        shared = int(raw.get("n_shared_experts") or 0) * expert + int(raw.get("shared_expert_intermediate_size") or 0)
        moe = experts * mats * hidden * expert + mats * hidden * shared + experts * hidden  # experts, shared, router
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    freq, step = int(raw.get("moe_layer_freq") or 1), int(raw.get("decoder_sparse_step") or 1)
    dense_only = set(raw.get("mlp_only_layers") or [])
    norms = 2 * hidden * (2 if family in _UNGATED else 1)  # two per layer (LayerNorm: weight and bias)
    for i in range(layers):
        is_moe = experts and i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in dense_only
        total += attention + (moe if is_moe else dense) + norms
    return total


def kv_bytes_per_token(shape: ModelShape, value_bytes: int) -> int:
    """K and V of one token over all layers (MLA: the one latent and the rotary key, no separate K and V)."""
    if shape.kv_lora_rank:
        return shape.layers * (shape.kv_lora_rank + (shape.qk_rope_head_dim or 0)) * value_bytes
    return shape.layers * shape.kv_heads * shape.head_dim * 2 * value_bytes


def kv_formula(shape: ModelShape, dtype: str) -> str:
    b = DTYPE_BYTES[dtype]
    total = f"{kv_bytes_per_token(shape, b):,} bytes/token"
    if shape.kv_lora_rank:
        return (
            f"{shape.layers} layers x ({shape.kv_lora_rank} kv_lora_rank + {shape.qk_rope_head_dim} "
            f"qk_rope_head_dim) x {b} bytes ({dtype}) = {total} (one latent per token, no x2 for K and V)"
        )
    return (
        f"{shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} head dim x 2 (K and V) x {b} bytes "
        f"({dtype}) = {total}"
    )


def attention_note(shape: ModelShape) -> str:
    if shape.kv_lora_rank:
        return f"MLA (config has kv_lora_rank {shape.kv_lora_rank}: a compressed K/V latent per token)"
    if shape.kv_heads == shape.heads:
        return f"MHA ({shape.kv_heads} KV heads = {shape.heads} heads)"
    return f"GQA ({shape.kv_heads} KV heads < {shape.heads} heads)"


def auto_dtype(shape: ModelShape, weights: bool) -> str:
    """What ``auto`` means: the checkpoint's float16/bfloat16 (bfloat16 for anything else, as the engine picks on
    a GPU); for weights, fp8 when config.json's quantization_config says the checkpoint is fp8."""
    if weights and shape.quantized_fp8:
        return "fp8"
    return shape.torch_dtype if shape.torch_dtype in ("float16", "bfloat16") else "bfloat16"


def check_tp(shape: ModelShape, tp: int) -> None:
    if tp < 1:
        raise PlanError(f"--tp {tp} is not a GPU count; give --tp 1 or more")
    # Each GPU takes whole heads: K/V heads (MHA, GQA) and query heads (all; under MLA the only split ones).
    for n, what in ((0 if shape.kv_lora_rank else shape.kv_heads, "KV heads"), (shape.heads, "attention heads")):
        if n and n % tp:
            divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
            raise PlanError(f"--tp {tp} does not divide the {n} {what}; use one of {divisors}")


def gpu_memory(name: str | None, memory_gib: float | None) -> tuple[str, float]:
    """(label, GiB) of ``--gpu NAME`` or ``--gpu-memory GIB`` (which wins)."""
    if memory_gib is not None:
        if not memory_gib > 0:
            raise PlanError(f"--gpu-memory {memory_gib} is not a memory size; give the GPU's GiB, e.g. 80")
        return f"{memory_gib:g} GiB GPU", float(memory_gib)
    if name is None:
        raise PlanError("no GPU given; give --gpu NAME (e.g. h100) or --gpu-memory GIB")
    gpu = GPUS.get(name.lower())
    if gpu is None:
        raise PlanError(f"unknown GPU {name!r}; use one of {', '.join(GPUS)}, or give --gpu-memory GIB")
    return name.lower(), gpu.memory_gib


def plan(
    shape: ModelShape,
    params: int,
    gpu: str,
    gpu_memory_gib: float,
    tp: int = 1,
    kv_dtype: str = "bfloat16",
    weights_dtype: str = "bfloat16",
    utilization: float = DEFAULT_UTILIZATION,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    block_size: int = 16,
    working_set_tokens: int | None = None,
) -> dict[str, Any]:
    """The figures of one plan, by name (what ``kvgrid plan --json`` prints). Per GPU: ``utilization`` of its
    memory, less its share of the weights (split evenly over the ``tp`` GPUs) and ``reserve_gib``, holds KV blocks;
    a group (``tp`` GPUs) holds that many blocks, each GPU its share of every token's KV (under MLA every GPU
    keeps the whole latent: it is not split by heads)."""
    check_tp(shape, tp)
    if not 0 < utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization {utilization} is not in (0, 1]; give e.g. 0.9")
    if reserve_gib < 0 or block_size < 1:
        raise PlanError("--reserve-gib must be >= 0 and --block-size >= 1; fix the flag")
    per_token = kv_bytes_per_token(shape, DTYPE_BYTES[kv_dtype])
    if per_token < 1 or shape.heads < 1:
        raise PlanError(f"{shape.name} has no attention layers or heads (0 KV bytes per token); check its config")
    per_token_gpu = per_token if shape.kv_lora_rank else per_token // tp
    weights = params * DTYPE_BYTES[weights_dtype]
    weights_gpu = math.ceil(weights / tp)
    usable = int(utilization * gpu_memory_gib * GIB)
    reserve = int(reserve_gib * GIB)
    budget = usable - weights_gpu - reserve
    if budget < per_token_gpu * block_size:
        room = ", leaving no room for one KV block" if budget >= 0 else ""
        raise PlanError(
            f"the weights need {weights_gpu / GIB:.1f} GiB per GPU ({weights / GIB:.1f} GiB in {weights_dtype} over "
            f"--tp {tp}) plus the {reserve_gib:g} GiB reserve, but a GPU has {usable / GIB:.1f} GiB "
            f"({gpu_memory_gib:g} GiB x {utilization:g}){room}; use a larger --tp, a GPU with more memory or a "
            "smaller --weights-dtype"
        )
    blocks = budget // (per_token_gpu * block_size)
    out: dict[str, Any] = {
        "model": shape.name,
        "architecture": shape.architecture,
        "attention": shape.attention,
        "layers": shape.layers,
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "kv_dtype": kv_dtype,
        "kv_bytes_per_token": per_token,
        "kv_formula": kv_formula(shape, kv_dtype),
        "kv_bytes_per_token_per_gpu": per_token_gpu,
        "params": params,
        "weights_dtype": weights_dtype,
        "weights_bytes": weights,
        "weights_bytes_per_gpu": weights_gpu,
        "gpu": gpu,
        "gpu_memory_gib": gpu_memory_gib,
        "gpu_memory_utilization": utilization,
        "tp": tp,
        "reserve_bytes_per_gpu": reserve,
        "kv_budget_bytes_per_gpu": budget,
        "block_size": block_size,
        "blocks_per_group": blocks,
        "kv_tokens_per_group": blocks * block_size,
    }
    if working_set_tokens is not None:
        out.update(groups_for(working_set_tokens, blocks * block_size, tp))
    return out


def groups_for(working_set_tokens: int, tokens_per_group: int, tp: int) -> dict[str, int]:
    """Groups (and GPUs) whose KV caches together hold ``working_set_tokens``."""
    if working_set_tokens < 0:
        raise PlanError(f"--working-set-tokens {working_set_tokens} is negative; give a token count")
    groups = max(1, math.ceil(working_set_tokens / tokens_per_group))
    return {"working_set_tokens": working_set_tokens, "groups_needed": groups, "gpus_needed": groups * tp}
