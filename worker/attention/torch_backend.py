"""Paged attention in plain torch: gathers each sequence's blocks, then masked attention. Runs anywhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.attention.base import AttentionBackend, AttentionMetadata


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
    ) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, md.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, md.slot_mapping, v.to(v_cache.dtype))

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        decode = [i for i, n in enumerate(md.query_lens_cpu) if n == 1]
        if decode:
            self._decode(q, k_cache, v_cache, md, scale, decode, out)
        block_size = k_cache.shape[1]
        for i, (qlen, slen) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
            if qlen == 1:
                continue
            start = int(md.query_start_loc[i])
            blocks = md.block_tables[i, : -(-slen // block_size)]
            k = k_cache[blocks].flatten(0, 1)[:slen].transpose(0, 1)  # [kv_heads, slen, d]
            v = v_cache[blocks].flatten(0, 1)[:slen].transpose(0, 1)
            # 4-D inputs (a batch of one): on CPU, SDPA's fused kernels take them, while 3-D inputs fall back to
            # the math path (about 5x slower for a 2k-token prefill).
            qi = q[start : start + qlen].transpose(0, 1)[None]  # [1, heads, qlen, d]
            k, v = k.to(q.dtype)[None], v.to(q.dtype)[None]
            if qlen == slen:  # no prefix: plain causal attention
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(
                    qi, k, v, attn_mask=self._mask(md, qlen, slen, q.device), scale=scale, enable_gqa=True
                )
            out[start : start + qlen] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _mask(md: AttentionMetadata, qlen: int, slen: int, device: torch.device) -> torch.Tensor:
        """Query j sits at position slen - qlen + j and sees keys 0 .. that position (built once per step)."""
        key = f"mask{qlen}x{slen}"
        if key not in md.scratch:
            md.scratch[key] = torch.ones(qlen, slen, dtype=torch.bool, device=device).tril(slen - qlen)
        return md.scratch[key]

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        rows: list[int],
        out: torch.Tensor,
    ) -> None:
        """One query token per sequence, batched: pad every context to the longest and mask the rest."""
        block_size, kv_heads, d = k_cache.shape[1:]
        if "decode" not in md.scratch:
            idx = torch.tensor(rows, device=q.device)
            max_len = max(md.seq_lens_cpu[i] for i in rows)
            tables = md.block_tables[idx, : -(-max_len // block_size)]
            pad = torch.arange(tables.shape[1] * block_size, device=q.device)[None, :] >= md.seq_lens[idx][:, None]
            md.scratch["decode"] = (tables, md.query_start_loc[idx].long(), pad[:, None, None, :])
        tables, tok, pad = md.scratch["decode"]
        k = k_cache[tables].flatten(1, 2)  # [B, L, kv_heads, d]
        v = v_cache[tables].flatten(1, 2)
        qb = q[tok].view(len(rows), kv_heads, -1, d)  # [B, kv_heads, group, d]
        scores = torch.einsum("bkgd,blkd->bkgl", qb.float(), k.float()) * scale
        scores.masked_fill_(pad, float("-inf"))
        o = torch.einsum("bkgl,blkd->bkgd", scores.softmax(-1), v.float())
        out[tok] = o.reshape(len(rows), -1, d).to(out.dtype)
