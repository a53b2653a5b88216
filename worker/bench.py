"""``kvgrid bench engine``: time to first token cold vs. over a cached prefix, and decode throughput; ``run_lora``:
decode throughput with LoRA adapters vs. without (``python -m worker.bench lora``)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common.lora import TARGETS, AdapterRef
from common.protocol import Submit
from common.sampling import SamplingParams, StructuredOutput
from worker.engine import Engine, EngineConfig


def _ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    return time.perf_counter() - start, out.num_cached_tokens


def _decode_rate(
    engine: Engine,
    batch: int,
    prompt_len: int,
    steps: int,
    rng: random.Random,
    params: SamplingParams | None = None,
    adapters: list[AdapterRef] | None = None,
) -> float:
    """Output tokens per second over steps in which every sequence of the batch decodes (request ``i`` under
    ``adapters[i % len(adapters)]`` when given)."""
    vocab = engine.model_config.vocab_size
    params = params or SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        adapter = adapters[i % len(adapters)] if adapters else None
        engine.add_request(Submit([rng.randrange(vocab) for _ in range(prompt_len)], params, adapter=adapter))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in [*engine.scheduler.waiting, *engine.scheduler.running]):
        engine.step()
    tokens, elapsed = 0, 0.0
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        elapsed += time.perf_counter() - t
        tokens += sum(len(o.new_token_ids) for o in outs)
    return tokens / elapsed


def _closed_loop(
    engine: Engine, streams: int, prompt_len: int, output_len: int, requests: int, rng: random.Random
) -> dict[str, float]:
    """``kvgrid bench serve``'s random workload in-process: ``streams`` requests at a time, each of ``prompt_len``
    new random tokens and ``output_len`` greedy tokens, the next one added as one finishes, until ``requests``
    have. Output tokens per second from the first submit to the last token, prefills included (what the HTTP
    figure of the same workload is compared to), and the mean step's wall and engine-thread CPU time."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sent = done = tokens = 0

    def send() -> None:
        nonlocal sent
        engine.add_prompt([rng.randrange(vocab) for _ in range(prompt_len)], params)
        sent += 1

    before = engine.stats()
    start = time.perf_counter()
    for _ in range(min(streams, requests)):
        send()
    while done < requests:
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                done += 1
                if sent < requests:
                    send()
    elapsed = time.perf_counter() - start
    after = engine.stats()
    steps = max(1, after.steps - before.steps)
    return {
        "tokens_per_s": tokens / elapsed,
        "step_ms": (after.step_seconds - before.step_seconds) / steps * 1e3,
        "step_cpu_ms": (after.step_cpu_seconds - before.step_cpu_seconds) / steps * 1e3,
    }


def run(
    model: str = "demo",
    prompt_len: int = 2048,
    cached: int = 1984,
    batches: tuple[int, ...] = (1, 8, 32),
    decode_steps: int = 64,
    repeats: int = 5,
    device: str = "auto",
    as_json: bool = False,
    cuda_graphs: bool = True,
    dtype: str = "auto",
    decode_threads: int | None = None,
    closed_loop: tuple[int, int] = (128, 64),
    num_blocks: int | None = None,
    timings: dict[str, float] | None = None,
) -> dict:
    """TTFT cold and over a cached prefix, decode tokens/s per batch and the closed loop per stream count (see
    ``_closed_loop``), every figure after a warm-up. ``num_blocks``: the KV cache's size (default: the engine's
    choice). ``timings``, if given, receives the seconds each phase took (engine start, warm-ups, each figure)."""
    phases = timings if timings is not None else {}
    mark = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now

    engine = Engine(
        EngineConfig(
            model=model,
            device=device,
            max_num_batched_tokens=max(2048, prompt_len),
            cuda_graphs=cuda_graphs,
            dtype=dtype,
            decode_threads=decode_threads,
            num_blocks=num_blocks,
        )
    )
    phase("engine start")
    bs = engine.config.block_size
    if cached % bs or not 0 < cached < prompt_len:
        raise ValueError(f"cached must be a multiple of the block size ({bs}) below the prompt length")
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    _ttft(engine, [rng.randrange(vocab) for _ in range(prompt_len)])  # warm-up
    # A few decode steps at every batch size, so no figure pays a kernel's first compile (Triton's JIT, in eager
    # mode, specialises on sizes: the first decode at a new one costs seconds).
    for b in batches:
        _decode_rate(engine, b, 128, 4, rng)
    engine.reset_prefix_cache()
    phase("warm-up")
    cold, hit, hit_cached = [], [], 0
    for _ in range(repeats):
        engine.reset_prefix_cache()
        base = [rng.randrange(vocab) for _ in range(prompt_len)]
        t, _ = _ttft(engine, base)
        cold.append(t)
        sibling = base[:cached] + [rng.randrange(vocab) for _ in range(prompt_len - cached)]
        t, hit_cached = _ttft(engine, sibling)
        hit.append(t)
    engine.reset_prefix_cache()
    phase("TTFT")
    decode = {b: _decode_rate(engine, b, 128, decode_steps, rng) for b in batches}
    phase("decode")
    loops = {str(b): _closed_loop(engine, b, *closed_loop, 8 * b, rng) for b in batches}
    phase("closed loop")
    result: dict[str, Any] = {
        "device": str(engine.device),
        "cuda_graphs": engine.runner.graphs is not None,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "prompt_tokens": prompt_len,
        "ttft_cold_ms": statistics.median(cold) * 1e3,
        "ttft_hit_ms": statistics.median(hit) * 1e3,
        "hit_cached_tokens": hit_cached,
        "ttft_ratio": statistics.median(hit) / statistics.median(cold),
        "decode_tokens_per_s": decode,
        "closed_loop": {"prompt_tokens": closed_loop[0], "output_tokens": closed_loop[1], **loops},
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        graphs = ", decode in CUDA graphs" if result["cuda_graphs"] else ""
        print(f"engine benchmark on {result['device']} ({model}, {result['dtype']}, median of {repeats}{graphs})")
        print(f"  TTFT cold, {prompt_len}-token prompt:          {result['ttft_cold_ms']:8.1f} ms")
        print(f"  TTFT with {hit_cached} tokens cached:          {result['ttft_hit_ms']:8.1f} ms")
        print(f"  TTFT(hit) / TTFT(cold):                  {result['ttft_ratio']:8.3f}  (target <= 0.10)")
        for b, rate in result["decode_tokens_per_s"].items():
            print(f"  decode, batch {b:3d}:                      {rate:8.1f} tokens/s")
        loop = result["closed_loop"]
        print(
            f"  closed loop ({loop['prompt_tokens']} new prompt tokens + {loop['output_tokens']} out a request, "
            "8 requests a stream, as kvgrid bench serve):"
        )
        for b in batches:
            r = loop[str(b)]
            print(
                f"    {b:3d} streams: {r['tokens_per_s']:8.1f} tokens/s, steps {r['step_ms']:.2f} ms "
                f"({r['step_cpu_ms']:.2f} ms CPU of the engine thread)"
            )
    return result


# What ``--grammar`` decodes under: records of typed fields (bounded strings and integers, booleans, an enum) in an
# array too long to finish within the benchmark, so every sequence decodes under the grammar at every step.
BENCH_SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 12},
            "active": {"type": "boolean"},
            "kind": {"enum": ["user", "group", "service"]},
        },
        "required": ["id", "name", "active", "kind"],
        "additionalProperties": False,
    },
}


def run_grammar(
    model: str = "demo",
    batches: tuple[int, ...] = (8,),
    decode_steps: int = 64,
    repeats: int = 5,
    device: str = "auto",
    as_json: bool = False,
    cuda_graphs: bool = True,
    dtype: str = "auto",
) -> dict:
    """Decode tokens/s at each batch size without and with a JSON-schema constraint (``BENCH_SCHEMA``) on every
    sequence, sampled at temperature 1 either way; the median of ``repeats`` paired runs, and the share of the
    throughput the grammar costs (target: under 20% at batch 8)."""
    engine = Engine(EngineConfig(model=model, device=device, cuda_graphs=cuda_graphs, dtype=dtype))
    so = StructuredOutput("json_schema", json.dumps(BENCH_SCHEMA))
    rng = random.Random(0)
    plain = SamplingParams(max_tokens=decode_steps + 1, temperature=1.0, seed=0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=decode_steps + 1, temperature=1.0, seed=0, ignore_eos=True, structured_output=so
    )
    _decode_rate(engine, max(batches), 128, 8, rng, constrained)  # warm-up: compiles the grammar, the tokenizer
    result: dict[str, Any] = {
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "decode_tokens_per_s": {},
    }
    for b in batches:
        free, masked = [], []
        for _ in range(repeats):  # interleaved, so drifting machine load hits both alike
            free.append(_decode_rate(engine, b, 128, decode_steps, rng, plain))
            masked.append(_decode_rate(engine, b, 128, decode_steps, rng, constrained))
        f, m = statistics.median(free), statistics.median(masked)
        result["decode_tokens_per_s"][b] = {"without_grammar": f, "with_grammar": m, "cost": 1.0 - m / f}
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"grammar benchmark on {result['device']} ({model}, {result['dtype']}, "
            f"JSON schema on every sequence, median of {repeats})"
        )
        for b, r in result["decode_tokens_per_s"].items():
            print(
                f"  decode, batch {b:3d}: {r['without_grammar']:8.1f} tokens/s without grammar, "
                f"{r['with_grammar']:8.1f} with: costs {r['cost'] * 100:5.1f}%  (target < 20% at batch 8)"
            )
    return result


def run_tp(
    model: str = "demo",
    tps: tuple[int, ...] = (1, 2),
    prompt_len: int = 1024,
    batches: tuple[int, ...] = (1, 8),
    decode_tokens: int = 64,
    device: str = "cpu",
    as_json: bool = False,
) -> dict:
    """TTFT and decode tokens/s of one worker group per tensor-parallel size, on a local Ray."""
    from worker.group import GroupConfig, WorkerGroup, init_local_ray

    use_gpu = device == "cuda"
    init_local_ray(num_cpus=max(tps) + 1 if not use_gpu else None)
    rng = random.Random(0)
    results: dict = {}
    for tp in tps:
        group = WorkerGroup(GroupConfig(f"bench-tp{tp}", EngineConfig(model=model, device=device), tp, use_gpu))
        try:
            vocab = 4000
            group.generate([1, 2, 3], SamplingParams(max_tokens=2))  # warm-up
            ttfts = []
            for _ in range(3):
                prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
                start = time.perf_counter()
                next(group.stream(prompt, SamplingParams(max_tokens=1, temperature=0.0)))
                ttfts.append(time.perf_counter() - start)
            rates = {}
            for b in batches:
                rates[b] = asyncio.run(_group_decode_rate(group, b, decode_tokens, rng))
            results[tp] = {"ttft_ms": statistics.median(ttfts) * 1e3, "decode_tokens_per_s": rates}
        finally:
            group.shutdown()
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        print(f"tensor-parallel benchmark on {device} ({model}); TTFT of a {prompt_len}-token prompt, median of 3")
        for tp, r in results.items():
            rates_text = ", ".join(f"batch {b}: {v:.1f}" for b, v in r["decode_tokens_per_s"].items())
            print(f"  tp={tp}: TTFT {r['ttft_ms']:8.1f} ms   decode tokens/s {rates_text}")
    return results


async def _group_decode_rate(group, batch: int, tokens: int, rng: random.Random) -> float:
    """Output tokens per second of ``batch`` concurrent requests, counted after each one's first token."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    firsts: list[float] = []

    async def one() -> int:
        n = 0
        async for out in group.astream([rng.randrange(4000) for _ in range(32)], params):
            if n == 0:
                firsts.append(time.perf_counter())
            n += len(out.new_token_ids)
        return n - 1

    counts = await asyncio.gather(*(one() for _ in range(batch)))
    return sum(counts) / (time.perf_counter() - max(firsts))


def write_random_adapter(engine: Engine, folder: Path, rank: int, targets: tuple[str, ...], seed: int) -> AdapterRef:
    """A PEFT-format LoRA adapter with random A and B for ``engine``'s model (what ``run_lora`` serves)."""
    from safetensors.torch import save_file

    from worker.lora import target_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes = target_shapes(engine.model_config)
    tensors = {}
    for layer in range(engine.model_config.num_layers):
        for t in targets:
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{t}"
            out, inp = shapes[t]
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp**0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) / rank**0.5
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return AdapterRef.of(folder)


def run_lora(
    model: str = "demo",
    batch: int = 32,
    num_adapters: int = 8,
    rank: int = 16,
    decode_steps: int = 64,
    repeats: int = 3,
    device: str = "auto",
    as_json: bool = False,
    cuda_graphs: bool = True,
    num_blocks: int | None = None,
) -> dict:
    """Decode tokens/s of ``batch`` requests spread over ``num_adapters`` LoRA adapters (rank ``rank``, all seven
    targets; requests of one adapter not neighbours in the batch) vs. the same batch without adapters: the
    median of ``repeats`` paired runs and their ratio (target >= 0.7)."""
    engine = Engine(
        EngineConfig(
            model=model,
            device=device,
            max_loras=num_adapters,
            cuda_graphs=cuda_graphs,
            lora_graphs=cuda_graphs,
            num_blocks=num_blocks,
        )
    )
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvgrid-bench-lora-") as tmp:
        adapters = [write_random_adapter(engine, Path(tmp) / f"a{i}", rank, TARGETS, i) for i in range(num_adapters)]
        _decode_rate(engine, batch, 128, 4, rng)  # warm-up (and every adapter loaded once)
        _decode_rate(engine, batch, 128, 4, rng, adapters=adapters)
        base, lora = [], []
        for _ in range(repeats):  # interleaved, so drifting machine load hits both alike
            base.append(_decode_rate(engine, batch, 128, decode_steps, rng))
            lora.append(_decode_rate(engine, batch, 128, decode_steps, rng, adapters=adapters))
    b, m = statistics.median(base), statistics.median(lora)
    result = {
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "batch": batch,
        "adapters": num_adapters,
        "rank": rank,
        "cuda_graphs": bool(cuda_graphs and engine.device.type == "cuda"),
        "base_tokens_per_s": b,
        "lora_tokens_per_s": m,
        "ratio": m / b,
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"LoRA benchmark on {result['device']} ({model}, {result['dtype']}, median of {repeats}): decode, "
            f"batch {batch} over {num_adapters} adapters of rank {rank} on all seven projections"
        )
        print(f"  without adapters: {b:8.1f} tokens/s")
        print(f"  with adapters:    {m:8.1f} tokens/s   ratio {m / b:.2f}  (target >= 0.70)")
    return result


if __name__ == "__main__":  # python -m worker.bench lora [model]
    import sys

    if sys.argv[1:2] != ["lora"]:
        sys.exit("usage: python -m worker.bench lora [model] [device]")
    run_lora(model=sys.argv[2] if len(sys.argv) > 2 else "demo", device=sys.argv[3] if len(sys.argv) > 3 else "auto")
