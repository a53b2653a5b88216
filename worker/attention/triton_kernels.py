"""Paged attention kernels in Triton: KV write, a unified extend/decode kernel, and the split-KV merge.

The cache layout is ``[num_blocks, block_size, kv_heads, head_dim]`` per layer for K and for V. The attention
kernel handles any ragged mix of sequences: sequence ``s`` has ``q_len`` new query tokens that are the last of
its ``seq_len`` context tokens, so query ``j`` sits at position ``seq_len - q_len + j`` and attends causally
to keys ``0 ..`` that position, read page by page through the block table. One program handles one KV head
and a tile of query tokens together with all the query heads that share that KV head (GQA), so each K/V tile
is loaded once per group. For long contexts and few sequences, ``num_splits > 1`` cuts the keys into
independent ranges whose partial results are merged by log-sum-exp (flash-decoding).

Under ``TRITON_INTERPRET=1`` (CPU) bf16 dots are computed wrongly, so ``FP32_DOT`` casts operands first; fp32
inputs use IEEE dots (Triton's default for fp32 on GPUs is TF32, too coarse for an fp32 model).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_db,
    stride_ds,
    stride_dh,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # a padding token of a CUDA-graph batch: it has no place in the cache
        return
    block, off = slot // PAGE, slot % PAGE
    h = tl.arange(0, KV_HEADS_P2)[:, None]
    d = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + block * stride_cb + off * stride_cs + h * stride_ch + d, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_db + off * stride_ds + h * stride_dh + d, v, mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    # Row r of the tile is query token q_tile * BLOCK_Q + r // GROUP of query head kvh * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_Q * GROUP)
    tok = q_tile * BLOCK_Q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    qpos = ctx + tok
    d = tl.arange(0, HEAD_DIM_P2)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    # Keys past the tile's last query are never seen; split the rest into NUM_SPLITS ranges of whole tiles.
    kv_end = ctx + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(kv_end, lo + per_split)

    m_i = tl.full([BLOCK_Q * GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP, HEAD_DIM_P2], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        # int64: block * stride overflows int32 once a layer's cache passes 2**31 elements.
        page = tl.load(block_tables_ptr + seq * stride_bt + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(
            k_cache_ptr + (page * stride_kb + (n % PAGE) * stride_ks + kvh * stride_kh)[None, :] + d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + (page * stride_vb + (n % PAGE) * stride_vs + kvh * stride_vh)[:, None] + d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        s = tl.where((n[None, :] <= qpos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key here yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.maximum(l_i, 1e-30)))
        tl.store(lse_ptr + (q_start + tok) * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM_P2)
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + s)
    w = tl.exp(lse - tl.max(lse, 0))
    part = tl.load(
        part_ptr + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=d[None, :] < HEAD_DIM,
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
