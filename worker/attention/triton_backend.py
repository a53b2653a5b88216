"""The Triton attention backend: launches the kernels of ``triton_kernels`` (CUDA, or CPU under the interpreter)."""

from __future__ import annotations

import os

import torch
import triton

from common.checks import is_power_of_two
from worker.attention.base import AttentionBackend, AttentionMetadata
from worker.attention.triton_kernels import _merge_splits_kernel, _paged_attention_kernel, _write_kv_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _p2(n: int) -> int:
    return triton.next_power_of_2(n)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter ``k``/``v`` [T, kv_heads, head_dim] into the caches at ``slots`` (block * block_size + offset);
    a token whose slot is -1 is not written."""
    t, kv_heads, head_dim = k.shape
    if t == 0:
        return
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    _write_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_P2=_p2(kv_heads),
        HEAD_DIM_P2=_p2(head_dim),
        PAGE=k_cache.shape[1],
    )


def pick_num_splits(md: AttentionMetadata, kv_heads: int) -> int:
    """Split the keys only for decode-only batches too small to fill the GPU on their own."""
    if md.max_query_len > 1 or md.max_seq_len < 2048:
        return 1
    programs = md.num_seqs * kv_heads
    if programs >= 256:
        return 1
    return min(16, _p2(max(1, 512 // programs)), _p2(md.max_seq_len // 1024))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` [T, heads, head_dim] over each sequence's paged context (see the module doc)."""
    num_tokens, heads, head_dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    splits = pick_num_splits(md, kv_heads) if num_splits is None else num_splits
    assert is_power_of_two(splits), "num_splits must be a power of two"
    # Enough query tokens per program that the dot's row count (tokens x group) is at least 16.
    block_q = max(16 // group, 1) if md.max_query_len <= 16 // max(group, 1) else max(64 // group, 1)
    block_n = block_n or (64 if INTERPRET else (64 if head_dim > 64 else 128))
    fp32_dot = q.dtype == torch.float32 or (INTERPRET and q.dtype == torch.bfloat16)
    grid = (md.num_seqs, kv_heads, triton.cdiv(md.max_query_len, block_q) * splits)
    if splits == 1:
        part, lse, so = out, out, 0
    else:
        part = torch.empty(num_tokens, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, heads, splits, dtype=torch.float32, device=q.device)
        so = part.stride(2)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        part,
        lse,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        part.stride(0),
        part.stride(1),
        so,
        lse.stride(0) if splits > 1 else 0,
        lse.stride(1) if splits > 1 else 0,
        md.block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=_p2(head_dim),
        PAGE=page,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        FP32_DOT=fp32_dot,
        DOT_PRECISION="ieee" if fp32_dot else "tf32",
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, heads)](
            part,
            lse,
            out,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=_p2(head_dim),
        )
    return out


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
    ) -> None:
        write_kv(k, v, k_cache, v_cache, md.slot_mapping)

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, md, scale)
