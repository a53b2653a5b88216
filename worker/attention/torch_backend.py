"""Paged attention in plain torch (runs anywhere): SDPA over each step's gathered context.

Every call takes SDPA's fused kernel: 4-D inputs throughout, and grouped-query heads handled by the kernel
(``enable_gqa``) or, for decodes, by folding each KV head's query group into the query-length axis (the math
fallback is about 5x slower for a 2k-token prefill). On the CPU, decodes read the cache in place through a small C
kernel where one could be built (``cpu_kernel``): gathering each row's blocks first cost more than the products.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F

from worker.attention import cpu_kernel
from worker.attention.base import AttentionBackend, AttentionMetadata


class _Decodes(NamedTuple):
    """The step's one-token queries, batched: their rows (None: every row), the blocks to gather for each
    (row-major, padded to the longest context) and which gathered keys each query head attends to."""

    rows: torch.Tensor | None
    blocks: torch.Tensor | None  # [n * blocks_per_row] int64 (None for the CPU kernel, which reads the tables)
    num_rows: int
    # One of the two masks. SDPA's: [n, 1, 1, L] bool, L = blocks_per_row * block_size, True where the key is
    # real. The wide path's: [n, heads, L * kv_heads] bool, True where the key is NOT the head's own or lies past
    # the row's end.
    keep: torch.Tensor | None = None
    drop: torch.Tensor | None = None
    # Or neither: the CPU kernel reads the rows' block tables [n, >= blocks_per_row] and lengths [n] (int32).
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None

    @property
    def wide(self) -> bool:
        return self.drop is not None


class _Prefill(NamedTuple):
    start: int
    qlen: int
    slen: int
    blocks: torch.Tensor


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        # _band[j, c] = c <= j + _band_offset: one lower-triangular band, built once and grown on demand, shared
        # by every extend. An extend of qlen queries over slen keys (ctx = slen - qlen of them cached) sees the
        # view _band[:qlen, offset - ctx : offset - ctx + slen], so no step builds a [query x context] mask.
        self._band = torch.ones(0, 0, dtype=torch.bool)
        self._band_offset = 0
        # Where decodes gather K and V, reused by every layer and step: a fresh multi-megabyte tensor per layer
        # costs the allocator fresh pages each time (page faults), more than the copy itself. See _gather for
        # when one is given back.
        self._gathered: list[torch.Tensor] = [torch.empty(0), torch.empty(0)]
        self._lib: ctypes.CDLL | None = None  # the CPU decode kernel, once looked up (_looked_up)
        self._looked_up = False

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
    ) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, md.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, md.slot_mapping, v.to(v_cache.dtype))

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        plan = md.scratch.get("torch")
        if plan is None:
            native = q.device.type == "cpu" and cpu_kernel.supports(q, k_cache) and self.cpu_kernel() is not None
            wide = (
                not native
                and q.device.type == "cpu"
                and q.dtype == torch.bfloat16
                and k_cache.shape[2] <= self.wide_max_kv_heads
            )
            plan = self._plan(md, k_cache.shape[1], q.device, q.shape[1], k_cache.shape[2], wide, native)
            md.scratch["torch"] = plan
        decodes, prefills = plan
        if decodes is not None and not prefills:  # decode-only step: the result is the output, no scatter
            return self._decode(q, k_cache, v_cache, decodes, scale)
        out = torch.empty_like(q)
        if decodes is not None:
            out[decodes.rows] = self._decode(q[decodes.rows], k_cache, v_cache, decodes, scale)
        for p in prefills:
            k = k_cache[p.blocks].flatten(0, 1)[: p.slen].transpose(0, 1)[None]  # [1, kv_heads, slen, d]
            v = v_cache[p.blocks].flatten(0, 1)[: p.slen].transpose(0, 1)[None]
            qi = q[p.start : p.start + p.qlen].transpose(0, 1)[None]  # [1, heads, qlen, d]
            k, v = k.to(q.dtype), v.to(q.dtype)
            if p.qlen == p.slen:  # no prefix: plain causal attention
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = self._extend_mask(p.qlen, p.slen, q.device)
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[p.start : p.start + p.qlen] = o[0].transpose(0, 1)
        return out

    # bfloat16 decodes on the CPU with at most this many KV heads (per rank) take the wide path (``_decode_wide``).
    wide_max_kv_heads = 2

    def cpu_kernel(self) -> ctypes.CDLL | None:
        """The CPU decode kernel's library, or None (looked up once per backend; built on the first look-up)."""
        if not self._looked_up:
            self._lib, self._looked_up = cpu_kernel.load(), True
        return self._lib

    @staticmethod
    def _plan(
        md: AttentionMetadata,
        block_size: int,
        device: torch.device,
        heads: int,
        kv_heads: int,
        wide: bool,
        native: bool = False,
    ) -> tuple[_Decodes | None, list[_Prefill]]:
        """What every layer of the step reuses, derived once from the metadata."""
        qlens, slens = md.query_lens_cpu, md.seq_lens_cpu
        rows = [i for i, n in enumerate(qlens) if n == 1]
        decodes = None
        if rows:
            width = -(-max(slens[i] for i in rows) // block_size)
            if len(rows) == len(qlens):  # decode-only: sequence i is token i
                idx, tables, lens = None, md.block_tables[:, :width], md.seq_lens
            else:
                sel = torch.tensor(rows, device=device)
                idx, tables, lens = md.query_start_loc[sel].long(), md.block_tables[sel, :width], md.seq_lens[sel]
            if native:
                decodes = _Decodes(idx, None, len(rows), tables=tables, lens=lens.contiguous())
            else:
                keep = torch.arange(width * block_size, device=device)[None, :] < lens[:, None]
                blocks = tables.flatten().long()
                if wide:
                    # key j*kv_heads + h of a row is position j of KV head h; query head q reads KV head q // group
                    own = (torch.arange(heads, device=device) // (heads // kv_heads))[:, None] == torch.arange(
                        kv_heads, device=device
                    )
                    drop = ~(keep[:, None, :, None] & own[None, :, None, :]).flatten(2)  # [n, heads, L * kv]
                    decodes = _Decodes(idx, blocks, len(rows), drop=drop)
                else:
                    decodes = _Decodes(idx, blocks, len(rows), keep=keep[:, None, None, :])
        prefills, start = [], 0
        for i, (qlen, slen) in enumerate(zip(qlens, slens)):
            if qlen > 1:
                prefills.append(_Prefill(start, qlen, slen, md.block_tables[i, : -(-slen // block_size)]))
            start += qlen
        return decodes, prefills

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: _Decodes, scale: float
    ) -> torch.Tensor:
        """One query token per sequence [n, heads, head_dim]. Whole blocks are gathered in one index_select per
        cache (rows of block_size * kv_heads * head_dim), and each KV head's group of query heads becomes a
        query length of ``group``: plain multi-head SDPA, padding masked. Or, on the CPU where the kernel is built,
        attention straight from the blocks (``cpu_kernel.paged_decode``)."""
        if d.tables is not None:
            assert d.lens is not None
            lib = self.cpu_kernel()
            assert lib is not None
            return cpu_kernel.paged_decode(lib, q, k_cache, v_cache, d.tables, d.lens, scale)
        assert d.blocks is not None
        if d.wide:
            return self._decode_wide(q, k_cache, v_cache, d, scale)
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        n = d.num_rows
        k, v = (
            self._gather(i, cache.view(num_blocks, -1), d.blocks).view(n, -1, kv_heads, head_dim).transpose(1, 2)
            for i, cache in enumerate((k_cache, v_cache))
        )
        qg = q.view(n, kv_heads, -1, head_dim)  # query head h uses KV head h // group
        o = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=d.keep, scale=scale)
        return o.reshape(n, -1, head_dim)

    def _decode_wide(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: _Decodes, scale: float
    ) -> torch.Tensor:
        """The decodes as two batched matmuls per step and layer: every query head of a row against every key
        of the row, all KV heads together (the gathered blocks read as [n, L * kv_heads, head_dim] as they lie,
        no transpose), the other heads' keys and the padding masked out before the softmax. It computes
        kv_heads times the products a per-head attention needs, and with one or two KV heads on a rank it still
        beats SDPA's CPU kernel, whose per-head tiles cost more than the products for one-token queries. Not for
        float32: there the engine's steps get slower with it."""
        assert d.blocks is not None
        num_blocks, block_size, kv_heads, head_dim = k_cache.shape
        n = d.num_rows
        k, v = (
            self._gather(i, cache.view(num_blocks, -1), d.blocks).view(n, -1, head_dim).to(q.dtype)
            for i, cache in enumerate((k_cache, v_cache))
        )
        scores = torch.bmm(q * scale, k.transpose(1, 2))  # [n, heads, L * kv_heads]
        assert d.drop is not None
        scores.masked_fill_(d.drop, float("-inf"))  # a fill, not a bias added: a stale key can hold anything
        return torch.bmm(torch.softmax(scores, dim=-1), v)  # [n, heads, head_dim]

    # A gather buffer more than twice what a step needs is reallocated to fit, unless it is this small anyway: a
    # peak step (64 sequences of 4k tokens, 8 KV heads of 128: 1 GiB each for K and V in fp32) must not keep its
    # memory for good, while small steps keep reusing theirs as the batch shrinks and grows. At most one
    # reallocation per step: every layer of a step needs the same size.
    keep_bytes = 64 << 20

    def _gather(self, which: int, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        buf = self._gathered[which]
        need = index.numel() * rows.shape[1]
        oversized = buf.numel() > 2 * need and buf.numel() * buf.element_size() > self.keep_bytes
        if buf.numel() < need or oversized or buf.dtype != rows.dtype or buf.device != rows.device:
            self._gathered[which] = buf = torch.empty(0)  # the old buffer goes before the new one is allocated
            buf = self._gathered[which] = torch.empty(need, dtype=rows.dtype, device=rows.device)
        return torch.index_select(rows, 0, index, out=buf[:need].view(index.numel(), rows.shape[1]))

    def _extend_mask(self, qlen: int, slen: int, device: torch.device) -> torch.Tensor:
        ctx = slen - qlen
        if self._band.device != device or self._band.shape[0] < qlen or self._band_offset < ctx:
            rows = max(qlen, self._band.shape[0])
            offset = max(ctx, self._band_offset)
            rows, offset = 1 << (rows - 1).bit_length(), 1 << max(offset - 1, 0).bit_length()  # grow by doubling
            self._band = torch.ones(rows, offset + rows, dtype=torch.bool, device=device).tril(offset)
            self._band_offset = offset
        s0 = self._band_offset - ctx
        return self._band[:qlen, s0 : s0 + slen]
