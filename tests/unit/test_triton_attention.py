"""Triton paged attention against a float64 reference (under TRITON_INTERPRET=1 on CPU).

Inputs are random (never zeros), block tables shuffled, outputs poisoned with NaN so an unwritten element
fails, and cache slots not written must keep their poison.
"""

from __future__ import annotations

import pytest
import torch

from worker.attention.base import AttentionMetadata
from worker.attention.triton_backend import paged_attention, write_kv

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_batch(seqs, page, kv_heads, group, head_dim, dtype, seed=0):
    """``seqs``: list of (context_before, new_tokens). Returns q, caches, metadata and the per-sequence K/V."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    blocks_per_seq = [-(-(c + n) // page) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()  # shuffled physical blocks
    k_cache = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, ks, vs, slots, qsl, seq_lens = [], [], [], [], [0], []
    for (ctx, new), nb in zip(seqs, blocks_per_seq):
        table = [order.pop() for _ in range(nb)]
        tables.append(table)
        total = ctx + new
        k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
        ks.append(k)
        vs.append(v)
        for p in range(total):  # the cached prefix is already in the cache
            if p < ctx:
                k_cache[table[p // page], p % page] = k[p]
                v_cache[table[p // page], p % page] = v[p]
            else:
                slots.append(table[p // page] * page + p % page)
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(qsl[-1], heads, head_dim, generator=g).to(dtype)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(seq_lens),
        query_lens_cpu=[n for _, n in seqs],
        seq_lens_cpu=seq_lens,
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(ks, seqs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(vs, seqs)])
    return q, k_cache, v_cache, md, ks, vs, new_k, new_v


def reference(q, ks, vs, seqs, scale):
    outs, start = [], 0
    for k, v, (ctx, new) in zip(ks, vs, seqs):
        qi = q[start : start + new].double()
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, kk) * scale
        pos = torch.arange(ctx, ctx + new)[:, None]
        s = s.masked_fill(torch.arange(ctx + new)[None, :] > pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vv))
        start += new
    return torch.cat(outs)


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def run_case(seqs, page, kv_heads, group, head_dim, dtype, num_splits=None, seed=0):
    q, kc, vc, md, ks, vs, nk, nv = make_batch(seqs, page, kv_heads, group, head_dim, dtype, seed)
    write_kv(nk, nv, kc, vc, md.slot_mapping)
    used = set(md.block_tables.flatten().tolist())
    for b in range(kc.shape[0]):  # unused blocks keep their poison
        if b not in used:
            assert torch.isnan(kc[b]).all() and torch.isnan(vc[b]).all()
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    paged_attention(q, kc, vc, md, scale, out=out, num_splits=num_splits)
    assert not torch.isnan(out).any(), "unwritten output elements"
    err = rel_err(out, reference(q, ks, vs, seqs, scale))
    assert err <= TOL[dtype], f"relative error {err:.2e}"


def test_write_kv_fills_exactly_the_slots():
    q, kc, vc, md, ks, vs, nk, nv = make_batch([(5, 7), (0, 20)], 16, 2, 1, 64, torch.float32)
    write_kv(nk, nv, kc, vc, md.slot_mapping)
    flat_k, flat_v = kc.view(-1, 2, 64), vc.view(-1, 2, 64)
    assert torch.equal(flat_k[md.slot_mapping], nk) and torch.equal(flat_v[md.slot_mapping], nv)
    assert torch.isnan(flat_k).all(-1).all(-1).sum() == flat_k.shape[0] - 5 - 27


# (prefix, new) per sequence: ragged, prefix 0 / 1 / unaligned, partial last blocks.
RAGGED = [(0, 19), (1, 6), (37, 9), (16, 1)]


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_ragged_extend_each_gqa_ratio_fp32(group):
    run_case(RAGGED, 16, 2 if group < 8 else 1, group, 64, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ragged_extend_half_precisions(dtype):
    run_case(RAGGED, 16, 2, 2, 64, dtype)


@pytest.mark.parametrize("page, head_dim", [(32, 128), (64, 64), (128, 64)])
def test_block_sizes_and_head_dims(page, head_dim):
    run_case([(70, 5), (3, 40), (0, 1)], page, 1, 4, head_dim, torch.float32)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_over_a_long_paged_context_with_and_without_split_kv(splits):
    run_case([(300, 1), (129, 1), (5, 1)], 16, 2, 2, 64, torch.float32, num_splits=splits)


def test_split_kv_decode_fp16():
    run_case([(200, 1), (64, 1)], 32, 1, 8, 64, torch.float16, num_splits=8)


def test_engine_with_triton_backend_matches_torch_backend_with_a_prefix_hit(demo_path):
    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    shared = list(range(600, 640))
    prompts = [shared + [1, 2, 3], list(range(700, 711))]
    runs = {}
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model=str(demo_path), device="cpu", attention_backend=backend))
        first = engine.generate(prompts, params)
        second = engine.generate([shared + [9, 8]], params)[0]
        assert second.num_cached_tokens == 32
        runs[backend] = [o.token_ids for o in first] + [second.token_ids]
    assert runs["triton"] == runs["torch"]


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    from worker.attention import get_backend

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        get_backend("triton", "cpu")
