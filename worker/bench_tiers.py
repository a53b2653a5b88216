"""``kvgrid bench tiers``: a prompt evicted from a small KV pool comes back from host RAM, then from disk.

The engine's pool holds ``gpu_blocks`` blocks; after the first prompt, ``fill`` other prompts of the same length
push it out (several times the pool). Resending it is timed (time to first token) against its cold TTFT, with
the prompt tokens reported cached and the greedy output compared with an engine without tiers. Then a new
engine on the same disk directory and secret (a restart) resends it once more: the blocks come from disk. The
disk writes the fill queued are drained before the reload is timed (their time is printed apart).
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.kv_tiers import KVTiersConfig

_SECRET = b"kvgrid-bench-tiers"


_CPU: list[float] = []  # CPU seconds of the process to each request's first token (all its threads)


def _timed(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, int, list[int]]:
    """(seconds to the first token, prompt tokens reported cached, output tokens) of one greedy request; the CPU
    seconds to the first token go to ``_CPU`` (a figure other jobs on the machine change less than the wall time)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    first = None
    out = None
    for out in engine.stream(prompt, params):
        if first is None and out.new_token_ids:
            first = time.perf_counter() - start
            _CPU.append(time.process_time() - cpu)
    assert out is not None and first is not None
    return first, out.num_cached_tokens, list(out.token_ids)


def run(
    model: str = "demo",
    prompt_len: int = 2048,
    gpu_blocks: int = 256,
    fill: int = 8,
    max_tokens: int = 16,
    repeats: int = 5,
    host_bytes: int = 256 * 2**20,
    disk_bytes: int = 512 * 2**20,
    disk_path: str | None = None,
    device: str = "cpu",
    as_json: bool = False,
) -> dict:
    tmp = None
    if disk_path is None:
        disk_path = tmp = tempfile.mkdtemp(prefix="kvgrid-bench-tiers-")
    try:
        return _run(
            model, prompt_len, gpu_blocks, fill, max_tokens, repeats, host_bytes, disk_bytes, disk_path, device, as_json
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(
    model: str,
    prompt_len: int,
    gpu_blocks: int,
    fill: int,
    max_tokens: int,
    repeats: int,
    host_bytes: int,
    disk_bytes: int,
    disk_path: str,
    device: str,
    as_json: bool,
) -> dict:
    tiers = KVTiersConfig(host_bytes=host_bytes, disk_path=disk_path, disk_bytes=disk_bytes)

    def engine(with_tiers: bool) -> Engine:
        return Engine(
            EngineConfig(
                model=model,
                device=device,
                num_blocks=gpu_blocks,
                max_num_batched_tokens=max(2048, prompt_len),
                secret=_SECRET,
                kv_tiers=tiers if with_tiers else KVTiersConfig(),
                cuda_graphs=False,
            )
        )

    rng = random.Random(0)
    plain = engine(False)
    vocab = plain.model_config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(prompt_len)]

    _timed(plain, prompt(), 1)  # warm-up
    eng = engine(True)
    _timed(eng, prompt(), 1)
    cold, host, disk = [], [], []
    host_cached = disk_cached = 0
    host_cached_all: list[int] = []
    cpu_cold: list[float] = []
    drain: list[float] = []
    cpu_host: list[float] = []
    cpu_disk: list[float] = []
    disk_cached_all: list[int] = []
    same_host = same_disk = True
    for _ in range(repeats):
        first = prompt()
        _, _, reference = _timed(plain, first, max_tokens)
        plain.reset_prefix_cache()
        t, _, _ = _timed(eng, first, max_tokens)
        cold.append(t)
        cpu_cold.append(_CPU[-1])
        for _ in range(fill):  # push it out of the pool, several times over
            _timed(eng, prompt(), 1)
        # The fill's evictions leave a backlog of disk writes; the writer thread would compete for the cores with
        # the reload timed next (a cost of the fill, shown apart: drain_ms).
        t0 = time.perf_counter()
        if eng.runner.tiers is not None:
            eng.runner.tiers.flush()
        drain.append(time.perf_counter() - t0)
        t, host_cached, out = _timed(eng, first, max_tokens)
        host.append(t)
        cpu_host.append(_CPU[-1])
        host_cached_all.append(host_cached)
        same_host &= out == reference
        # A restart: a new engine on the same disk directory and secret.
        eng.close()
        eng = engine(True)
        t, disk_cached, out = _timed(eng, first, max_tokens)
        disk.append(t)
        cpu_disk.append(_CPU[-1])
        disk_cached_all.append(disk_cached)
        same_disk &= out == reference
    stats = eng.stats()
    eng.close()
    result: dict[str, Any] = {
        "device": str(eng.device),
        "prompt_tokens": prompt_len,
        "gpu_pool_tokens": gpu_blocks * eng.config.block_size,
        "fill_tokens": fill * prompt_len,
        # Medians, and the best of the repeats (less of the noise of a shared machine).
        "ttft_cold_ms": statistics.median(cold) * 1e3,
        "ttft_host_ms": statistics.median(host) * 1e3,
        "ttft_disk_ms": statistics.median(disk) * 1e3,
        "host_over_cold": statistics.median(host) / statistics.median(cold),
        "disk_over_cold": statistics.median(disk) / statistics.median(cold),
        "ttft_cold_ms_min": min(cold) * 1e3,
        "ttft_host_ms_min": min(host) * 1e3,
        "ttft_disk_ms_min": min(disk) * 1e3,
        "host_over_cold_min": min(host) / min(cold),
        "disk_over_cold_min": min(disk) / min(cold),
        "cached_fraction_host": host_cached / prompt_len,
        "cached_fraction_disk": disk_cached / prompt_len,
        "greedy_identical_host": same_host,
        "greedy_identical_disk": same_disk,
        "disk_bytes_used": eng.runner.tiers.disk_usage() if eng.runner.tiers is not None else 0,
        "disk_bytes_limit": disk_bytes,
        "cpu_ms": {"cold": _ms(cpu_cold), "host": _ms(cpu_host), "disk": _ms(cpu_disk)},
        "cpu_host_over_cold": statistics.median(cpu_host) / statistics.median(cpu_cold),
        "cpu_disk_over_cold": statistics.median(cpu_disk) / statistics.median(cpu_cold),
        "drain_ms": _ms(drain),
        "runs_ms": {"cold": _ms(cold), "host": _ms(host), "disk": _ms(disk)},
        "cached_tokens": {"host": host_cached_all, "disk": disk_cached_all},
        "tiers": {t: vars(s) for t, s in stats.kv_tiers.items()},
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return result


def _ms(xs: list[float]) -> list[float]:
    return [round(x * 1e3, 1) for x in xs]


def _print(r: dict) -> None:
    print(
        f"device {r['device']}: a {r['prompt_tokens']}-token prompt, a pool of {r['gpu_pool_tokens']} tokens, "
        f"{r['fill_tokens']} tokens of other prompts in between"
    )
    print("  TTFT (median / best of the repeats)")
    print(f"  cold                {r['ttft_cold_ms']:8.1f} / {r['ttft_cold_ms_min']:7.1f} ms")
    print(
        f"  from host RAM       {r['ttft_host_ms']:8.1f} / {r['ttft_host_ms_min']:7.1f} ms  "
        f"({r['host_over_cold']:.3f}x / {r['host_over_cold_min']:.3f}x cold)  "
        f"cached {r['cached_fraction_host']:.1%}  greedy identical: {r['greedy_identical_host']}"
    )
    print(
        f"  from disk           {r['ttft_disk_ms']:8.1f} / {r['ttft_disk_ms_min']:7.1f} ms  "
        f"({r['disk_over_cold']:.3f}x / {r['disk_over_cold_min']:.3f}x cold)  "
        f"cached {r['cached_fraction_disk']:.1%}  greedy identical: {r['greedy_identical_disk']}  (a new engine)"
    )
    print(
        f"  CPU time to the first token (median, all threads): host {r['cpu_host_over_cold']:.3f}x cold, "
        f"disk {r['cpu_disk_over_cold']:.3f}x cold"
    )
    print(f"  runs (ms): {r['runs_ms']}")
    print(f"  CPU (ms):  {r['cpu_ms']}")
    print(f"  disk writes the fill left, drained before each reload (ms): {r['drain_ms']}")
    print(f"  disk used {r['disk_bytes_used'] / 2**20:.1f} MiB of {r['disk_bytes_limit'] / 2**20:.1f} MiB")
