"""``kvgrid bench route``: latency of ``Router.route`` (hashing, index walk, policy, bookkeeping)."""

from __future__ import annotations

import os
import random
import time

from common.events import BlockStored
from router.routing.router import Router


def route_latency(
    prompt_tokens: int = 32768, index_keys: int = 1_000_000, groups: int = 8, block_size: int = 16, calls: int = 300
) -> dict:
    names = [f"g{i}" for i in range(groups)]
    router = Router(names, os.urandom(32), block_size)
    rng = random.Random(0)
    # Fill the index with other prompts' keys, spread over the groups.
    per = max(1, index_keys // groups)
    for g in names:
        router.apply_event(g, BlockStored([rng.randbytes(16) for _ in range(per)], None))
    # A cached prompt: its every block is held by one group (the worst case: the walk never stops early).
    cached = [rng.randrange(32000) for _ in range(prompt_tokens)]
    router.apply_event(names[0], BlockStored(router.keys_for("acme", cached), None))
    results = {}
    for label, make in (
        ("cold (new prompt each call)", lambda: [rng.randrange(32000) for _ in range(prompt_tokens)]),
        ("fully cached prompt", lambda: cached),
    ):
        lat = []
        for i in range(calls):
            prompt = make()
            t = time.perf_counter()
            d = router.route("acme", prompt, f"{label}-{i}")
            lat.append(time.perf_counter() - t)
            router.on_finish(d.request_id)
        lat.sort()
        results[label] = {"p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(0.99 * len(lat))] * 1e3}
    print(
        f"route() on a {prompt_tokens}-token prompt, block size {block_size}, index of {len(router.index)} keys, "
        f"{groups} groups, {calls} calls"
    )
    for label, r in results.items():
        print(f"  {label:30s} p50 {r['p50_ms']:.3f} ms   p99 {r['p99_ms']:.3f} ms   (target p99 <= 1 ms)")
    return results
