"""``kvgrid bench route``: latency of ``Router.route`` (hashing, index walk, policy, bookkeeping), and the prefix
index's memory per key, event application rate and snapshot load time at that size."""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

from common.events import BlockRemoved, BlockStored, KVEvent
from common.hashing import token_array
from router.routing.index import CompactPrefixIndex
from router.routing.router import Router

FILL_BATCH = 1_000_000  # keys per event while filling the index: bounded memory for the keys' bytes objects


def _rss() -> int:
    """This process's resident memory in bytes (0 where /proc is missing)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _keys(rng: random.Random, n: int) -> list[bytes]:
    buf = rng.randbytes(16 * n)
    return [buf[i : i + 16] for i in range(0, 16 * n, 16)]


def route_latency(
    prompt_tokens: int = 32768,
    index_keys: int = 1_000_000,
    groups: int = 8,
    block_size: int = 16,
    calls: int = 300,
    index: str = "compact",
) -> dict:
    names = [f"g{i}" for i in range(groups)]
    rss0 = _rss()
    router = Router(names, os.urandom(32), block_size, index=index)
    rng = random.Random(0)
    # Fill the index with other prompts' keys, spread over the groups, a bounded batch per event.
    fill_s, done = 0.0, 0
    while done < index_keys:
        n = min(FILL_BATCH, index_keys - done)
        keys = _keys(rng, n)
        t = time.perf_counter()
        router.apply_event(names[(done // FILL_BATCH) % groups], BlockStored(keys, None))
        fill_s += time.perf_counter() - t
        done += n
    del keys
    # A cached prompt: its every block is held by one group (the worst case: the walk never stops early).
    cached = [rng.randrange(32000) for _ in range(prompt_tokens)]
    router.apply_event(names[0], BlockStored(router.keys_for("acme", cached), None))
    table = router.index
    results: dict = {
        "index": index,
        "index_keys": len(table),
        "rss_bytes_per_key": (_rss() - rss0) / max(1, len(table)),
        "fill_keys_per_s": index_keys / fill_s if fill_s else 0.0,
    }
    if isinstance(table, CompactPrefixIndex):  # its arrays' own size
        results["index_bytes"] = table.nbytes()
        results["index_bytes_per_key"] = table.nbytes() / max(1, len(table))
    results.update(_event_rates(router, rng, names))
    # Prompts as the gateways send them to a replica: one array('I') (hashing reads it as one buffer). The cold ones
    # are made before the timed calls: making 32k Python ints between two calls tripled a call's time (the
    # allocator's churn), which a replica, whose prompts arrive as one buffer, does not see.
    cold = [token_array([rng.randrange(32000) for _ in range(prompt_tokens)]) for _ in range(calls)]
    for label, prompts in (
        ("cold (new prompt each call)", cold),
        ("fully cached prompt", [token_array(cached)] * calls),
    ):
        lat, cpu = [], []
        for i, prompt in enumerate(prompts):
            t, c = time.perf_counter(), time.thread_time()
            d = router.route("acme", prompt, f"{label}-{i}")
            lat.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
            router.on_finish(d.request_id)
        lat.sort()
        cpu.sort()
        results[label] = {
            "p50_ms": lat[len(lat) // 2] * 1e3,
            "p99_ms": lat[int(0.99 * len(lat))] * 1e3,
            # The call's own CPU time: what it costs without the waits for a core on a shared machine.
            "cpu_p50_ms": cpu[len(cpu) // 2] * 1e3,
            "cpu_p99_ms": cpu[int(0.99 * len(cpu))] * 1e3,
        }
    if isinstance(table, CompactPrefixIndex):  # last: a fresh copy's 704 MiB (at 25M keys) disturbed what came after
        results.update(_snapshot(table))
    _print(results, prompt_tokens, block_size, groups, calls)
    return results


def _event_rates(router: Router, rng: random.Random, names: list[str]) -> dict:
    """Keys/s of events applied to the full index: 100k-key events (stored, then removed), and 64-key events
    applied 1000 at a time (``Router.apply_events``, what a poll of the event streams does)."""
    out = {}
    keys = _keys(rng, 100_000)
    for label, event in (("store", BlockStored(keys, None)), ("remove", BlockRemoved(keys))):
        t, c = time.perf_counter(), time.thread_time()
        router.apply_event(names[1 % len(names)], event)
        out[f"{label}_keys_per_s"] = len(keys) / (time.perf_counter() - t)
        out[f"{label}_keys_per_cpu_s"] = len(keys) / max(1e-9, time.thread_time() - c)
    keys = _keys(rng, 64_000)
    for label in ("store", "remove"):
        batch: list[tuple[str, KVEvent]] = [
            (
                names[i // 64 % len(names)],
                BlockStored(keys[i : i + 64], None) if label == "store" else BlockRemoved(keys[i : i + 64]),
            )
            for i in range(0, len(keys), 64)
        ]
        t, c = time.perf_counter(), time.thread_time()
        router.apply_events(batch)
        out[f"small_{label}_keys_per_s"] = len(keys) / (time.perf_counter() - t)
        out[f"small_{label}_keys_per_cpu_s"] = len(keys) / max(1e-9, time.thread_time() - c)
    return out


def _snapshot(index: CompactPrefixIndex) -> dict:
    """Seconds to save the index to a file and to load it back, and the file's size."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "index.snap"
        t = time.perf_counter()
        index.save(path)
        saved = time.perf_counter() - t
        size = path.stat().st_size
        t = time.perf_counter()
        copy = CompactPrefixIndex.load(path)
        loaded = time.perf_counter() - t
        assert len(copy) == len(index)
        del copy
    return {"snapshot_save_s": saved, "snapshot_load_s": loaded, "snapshot_bytes": size}


def _print(r: dict, prompt_tokens: int, block_size: int, groups: int, calls: int) -> None:
    mib = 2**20
    print(
        f"route() on a {prompt_tokens}-token prompt, block size {block_size}, index of {r['index_keys']} keys, "
        f"{groups} groups, {calls} calls"
    )
    for label in ("cold (new prompt each call)", "fully cached prompt"):
        p = r[label]
        print(
            f"  {label:30s} p50 {p['p50_ms']:.3f} ms   p99 {p['p99_ms']:.3f} ms   (target p99 <= 1 ms); its CPU time: "
            f"p50 {p['cpu_p50_ms']:.3f} ms   p99 {p['cpu_p99_ms']:.3f} ms"
        )
    arrays = (
        f"{r['index_bytes'] / mib:.0f} MiB of arrays, {r['index_bytes_per_key']:.1f} bytes/key (numpy nbytes); "
        if "index_bytes" in r
        else ""
    )
    print(
        f"{r['index']} index memory: {arrays}process RSS grew {r['rss_bytes_per_key']:.1f} bytes/key   "
        "(target <= 40 bytes/key)"
    )
    print(
        f"event application: fill {r['fill_keys_per_s'] / 1e6:.2f} M keys/s (1M-key events, growth included); "
        f"100k-key events: store {r['store_keys_per_s'] / 1e6:.2f}, remove {r['remove_keys_per_s'] / 1e6:.2f} "
        f"M keys/s; 64-key events in batches of 1000: store {r['small_store_keys_per_s'] / 1e6:.2f}, remove "
        f"{r['small_remove_keys_per_s'] / 1e6:.2f} M keys/s   (target >= 5M keys/s); per second of CPU time: "
        f"{r['store_keys_per_cpu_s'] / 1e6:.2f}, {r['remove_keys_per_cpu_s'] / 1e6:.2f}; "
        f"{r['small_store_keys_per_cpu_s'] / 1e6:.2f}, {r['small_remove_keys_per_cpu_s'] / 1e6:.2f}"
    )
    if "snapshot_bytes" in r:
        print(
            f"snapshot: {r['snapshot_bytes'] / mib:.0f} MiB, saved in {r['snapshot_save_s']:.2f} s, loaded in "
            f"{r['snapshot_load_s']:.2f} s   (target load <= 10 s at 25M keys)"
        )
