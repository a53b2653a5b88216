"""GPU benchmark of the Triton paged attention kernels against torch's SDPA.

    python bench/attention.py            # on a CUDA machine: correctness check, then the decode and extend tables
    python bench/attention.py --quick    # tiny shapes; runs on CPU too (set TRITON_INTERPRET=1), to check the script

Decode: batch 1/16/128 x context 1k/8k/32k, one query token per sequence; achieved bandwidth counts the K/V bytes
read. Extend: batch 8, 1k new tokens over 0 or 8k cached tokens; TFLOP/s counts the causal QK^T and PV work.
Reference: torch's scaled_dot_product_attention on the same tokens in contiguous tensors. Copy bandwidth is a
device-to-device copy of 4 GiB, the ceiling for a memory-bound kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from worker.attention.base import AttentionMetadata  # noqa: E402
from worker.attention.triton_backend import paged_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16  # a Llama-3-8B layer


def timed(fn, device: torch.device, reps: int = 20) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=5, rep=reps * 5, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(max(2, reps // 10)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def build(batch: int, ctx: int, new: int, dtype: torch.dtype, device: torch.device, page: int = PAGE):
    """Paged caches with shuffled blocks holding ``ctx + new`` tokens per sequence, and the same K/V contiguous."""
    total = ctx + new
    per_seq = -(-total // page)
    num_blocks = batch * per_seq
    g = torch.Generator(device=device).manual_seed(0)
    k_cache = torch.randn(num_blocks, page, KV_HEADS, HEAD_DIM, dtype=dtype, device=device, generator=g)
    v_cache = torch.randn(num_blocks, page, KV_HEADS, HEAD_DIM, dtype=dtype, device=device, generator=g)
    tables = torch.randperm(num_blocks, device=device, generator=g).view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch * new, HEADS, HEAD_DIM, dtype=dtype, device=device, generator=g)
    md = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), total, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=new,
        max_seq_len=total,
        query_lens_cpu=[new] * batch,
        seq_lens_cpu=[total] * batch,
    )
    # Contiguous [B, kv_heads, total, D] copies for the SDPA reference.
    k = torch.stack([k_cache[t.long()].flatten(0, 1)[:total].transpose(0, 1) for t in tables])
    v = torch.stack([v_cache[t.long()].flatten(0, 1)[:total].transpose(0, 1) for t in tables])
    qc = q.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return q, k_cache, v_cache, md, qc, k, v


def sdpa(qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """Reference attention: queries are the last tokens, so causality is aligned to the lower right."""
    from torch.nn.attention.bias import causal_lower_right

    new, total = qc.shape[2], k.shape[2]
    if new == 1:
        return F.scaled_dot_product_attention(qc, k, v, enable_gqa=True)
    if ctx == 0:
        return F.scaled_dot_product_attention(qc, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(qc, k, v, attn_mask=causal_lower_right(new, total), enable_gqa=True)


def check(device: torch.device, dtype: torch.dtype) -> float:
    """Largest relative error against float64 over a few shapes; raises if above tolerance."""
    worst = 0.0
    for batch, ctx, new, splits in ((3, 100, 37, 1), (4, 700, 1, 1), (2, 3000, 1, 4)):
        q, kc, vc, md, qc, k, v = build(batch, ctx, new, dtype, device)
        out = torch.full_like(q, float("nan"))
        paged_attention(q, kc, vc, md, HEAD_DIM**-0.5, out=out, num_splits=splits)
        ref = sdpa(qc.double(), k.double(), v.double(), ctx).transpose(1, 2).reshape_as(q)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, err)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    if not worst <= tol:
        raise SystemExit(f"correctness check failed: relative error {worst:.2e} > {tol:.0e}")
    return worst


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run, also on CPU)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no CUDA device: run with TRITON_INTERPRET=1 and --quick to check the script on CPU")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(
        f"device: {name}; layer: {HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, page {PAGE}, "
        f"{args.dtype}"
    )
    print(f"correctness vs float64: max relative error {check(device, dtype):.2e}")
    scale = HEAD_DIM**-0.5
    elem = torch.empty((), dtype=dtype).element_size()

    copy_bw = copy_bandwidth(device, 2**22 if args.quick else 2**32)
    print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s\n")

    batches, ctxs = ((1, 2), (256, 512)) if args.quick else ((1, 16, 128), (1024, 8192, 32768))
    print("decode   batch  context   triton ms   GB/s   % copy bw   sdpa ms   sdpa/triton")
    for b in batches:
        for c in ctxs:
            q, kc, vc, md, qc, k, v = build(b, c - 1, 1, dtype, device)
            t = timed(partial(paged_attention, q, kc, vc, md, scale), device)
            ts = timed(partial(sdpa, qc, k, v, c - 1), device)
            bw = 2 * b * c * KV_HEADS * HEAD_DIM * elem / t
            print(
                f"         {b:5d}  {c:7d}   {t * 1e3:9.3f}  {bw / 1e9:6.0f}   {100 * bw / copy_bw:8.1f}%  "
                f"{ts * 1e3:8.3f}   {ts / t:6.2f}"
            )
            del q, kc, vc, md, qc, k, v

    new, b = (32, 2) if args.quick else (1024, 8)
    print("\nextend   batch  new  cached   triton ms   TFLOP/s   sdpa ms   sdpa TFLOP/s   triton/sdpa")
    for cached in (0, 64) if args.quick else (0, 8192):
        q, kc, vc, md, qc, k, v = build(b, cached, new, dtype, device)
        t = timed(partial(paged_attention, q, kc, vc, md, scale), device)
        ts = timed(partial(sdpa, qc, k, v, cached), device)
        pairs = b * (new * cached + new * (new + 1) // 2)  # (query, key) pairs attended
        flops = 4 * pairs * HEADS * HEAD_DIM
        print(
            f"         {b:5d}  {new:4d}  {cached:6d}   {t * 1e3:9.3f}  {flops / t / 1e12:8.1f}  {ts * 1e3:8.3f}  "
            f"{flops / ts / 1e12:12.1f}   {t / ts:10.2f}"
        )
        del q, kc, vc, md, qc, k, v


if __name__ == "__main__":
    main()
