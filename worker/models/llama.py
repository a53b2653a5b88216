"""The Llama family (Llama 2/3, Mistral, Qwen2): pre-norm decoder, RoPE, grouped-query attention, SwiGLU.

Layers are tensor-parallel: Q/K/V and gate/up are column-parallel, o_proj and down_proj row-parallel (one
all-reduce each), the embedding and LM head vocab-parallel.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from common.model_config import ModelConfig
from worker.attention import ForwardContext, PagedAttention
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding, rotate
from worker.lora import LoraBatch


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=cfg.attention_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.attn = PagedAttention(layer_idx, cfg.head_dim)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        qkv = self.qkv_proj(x, ctx.lora)
        # Q and K sit side by side in the fused projection: rotate them as one [T, heads + kv_heads, D] tensor.
        qk = rotate(qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim), rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, ctx).flatten(1), ctx.lora)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, ctx.lora), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Every layer rotates by the same positions: one table, looked up once per step.
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.lookup(positions)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, ctx)
        return self.norm(x, residual)[0]


# HF tensor name fragment -> (our fused parameter, shard id)
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final hidden states of every token in the step; ``compute_logits`` scores the ones sampled."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, each through its parameter's loader (which takes this rank's slice)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            shard: object = None
            for hf, (ours, sid) in _PACKED.items():
                if f".{hf}." in name:
                    name, shard = name.replace(f".{hf}.", f".{ours}."), sid
                    break
            if name not in params:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor.to(param.dtype), shard)
            loaded.add(name)
        missing = {n for n in params if n not in loaded}
        if self.cfg.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:5]}")
