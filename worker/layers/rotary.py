"""Rotary position embedding (the half-split "neox" layout HF Llama uses) with the config's scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv
    assert scaling is not None
    if rope_type == "linear":
        return inv / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, out)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")


class RotaryEmbedding(nn.Module):
    """One table for every layer: a step looks its positions up once (``lookup``) and each layer rotates with it."""

    cos: torch.Tensor  # buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv = inverse_frequencies(head_dim, base, scaling).float()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        cos, sin = freqs.cos(), freqs.sin()
        # Laid out for x * cos + swap_halves(x) * sin: the rotation in two multiplies and an add, with the same
        # products and sums as (x1 cos - x2 sin, x2 cos + x1 sin) (negating sin is exact).
        self.register_buffer("cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's ``positions`` [T], shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x`` [T, heads, D] (queries and keys together, as one tensor) by ``RotaryEmbedding.lookup``,
    in float32 whatever ``x``'s dtype (a no-op cast for fp32)."""
    cos, sin = rope
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((x2, x1), dim=-1) * sin).to(x.dtype)
