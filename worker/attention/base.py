"""The attention backend interface: write a step's new K/V into the paged cache, then attend through it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from worker.lora import LoraBatch


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit. The batch is ragged: sequence ``i`` contributes the query tokens
    ``query_start_loc[i]:query_start_loc[i+1]``, which are the last ones of its ``seq_lens[i]`` tokens of
    context (cached prefix + earlier steps + these)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, for backends that loop or split on the CPU.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Per-step values a backend derives once and reuses in every layer (masks, index tensors).
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """One implementation of paged attention; the model calls it once per layer."""

    name: str
    # Whether a decode step through this backend can be captured in a CUDA graph: no host synchronisation, launch
    # shapes fixed by the batch size, and ``write_kv`` skipping slot -1 (where padding tokens go).
    supports_cuda_graphs = False

    @abstractmethod
    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
    ) -> None:
        """Scatter ``k``/``v`` [num_tokens, kv_heads, head_dim] into the caches
        [num_blocks, block_size, kv_heads, head_dim] at ``md.slot_mapping``."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of ``q`` [num_tokens, heads, head_dim] over each sequence's paged context."""


@dataclass
class ForwardContext:
    """What every attention layer needs for one step: the backend, the cache and where the tokens go."""

    backend: AttentionBackend
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    metadata: AttentionMetadata
    lora: LoraBatch | None = None  # the step's tokens by LoRA adapter slot; None: no adapter in the step


class PagedAttention(torch.nn.Module):
    """One layer's attention through the paged cache (its slice ``kv_cache[layer_idx]``)."""

    def __init__(self, layer_idx: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        k_cache, v_cache = ctx.kv_cache[self.layer_idx]
        ctx.backend.write_kv(k, v, k_cache, v_cache, ctx.metadata)
        return ctx.backend.forward(q, k_cache, v_cache, ctx.metadata, self.scale)
