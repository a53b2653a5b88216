"""``kvgrid bench ...`` and ``kvgrid replay``: the engine, tensor-parallel, routing, KV tier, keep-alive and HTTP
load benchmarks, and the replay of a recorded workload."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


def _cmd_bench(args: argparse.Namespace) -> int:
    from worker import bench

    common: dict[str, Any] = {  # what the decode and the grammar benchmark both take
        "model": args.model,
        "batches": tuple(args.batch),
        "decode_steps": args.decode_steps,
        "repeats": args.repeats,
        "device": args.device,
        "as_json": args.json,
        "cuda_graphs": args.cuda_graphs,
        "dtype": args.dtype,
    }
    if args.grammar:
        bench.run_grammar(**common)
    else:
        bench.run(prompt_len=args.prompt_len, cached=args.cached, decode_threads=args.decode_threads, **common)
    return 0


def _cmd_bench_lora(args: argparse.Namespace) -> int:
    from worker import bench

    bench.run_lora(
        model=args.model,
        batch=args.batch,
        num_adapters=args.adapters,
        rank=args.rank,
        decode_steps=args.decode_steps,
        repeats=args.repeats,
        device=args.device,
        as_json=args.json,
        cuda_graphs=args.cuda_graphs,
    )
    return 0


def _cmd_bench_tiers(args: argparse.Namespace) -> int:
    from worker import bench_tiers

    bench_tiers.run(
        model=args.model,
        prompt_len=args.prompt_len,
        gpu_blocks=args.gpu_blocks,
        fill=args.fill,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        host_bytes=args.host_bytes,
        disk_bytes=args.disk_bytes,
        disk_path=args.disk_path,
        device=args.device,
        as_json=args.json,
    )
    return 0


def _cmd_bench_tp(args: argparse.Namespace) -> int:
    from worker import bench

    bench.run_tp(
        model=args.model,
        tps=tuple(args.tp),
        prompt_len=args.prompt_len,
        batches=tuple(args.batch),
        decode_tokens=args.decode_tokens,
        device=args.device,
        as_json=args.json,
    )
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from router.routing.policy import POLICIES
    from router.sim.replay import format_result, load_trace, replay

    trace = load_trace(args.trace, tenants=args.tenants, limit=args.limit)
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    results = []
    for policy in policies:
        r = replay(
            trace,
            args.groups,
            args.capacity_tokens,
            args.block_size,
            policy,
            prefill_tokens_per_s=args.prefill_rate,
            decode_s_per_token=args.decode_ms / 1e3,
            seed=args.seed,
            progress=not args.json,
            host_capacity_tokens=args.host_capacity_tokens,
            disk_capacity_tokens=args.disk_capacity_tokens,
            host_load_tokens_per_s=args.host_load_rate,
            disk_load_tokens_per_s=args.disk_load_rate,
        )
        results.append(r)
        if not args.json:
            print(format_result(r))
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    return 0


def _cmd_bench_keep_alive(args: argparse.Namespace) -> int:
    from router.gateway import keep_alive

    results = keep_alive.bench(args.seeds, args.entries, args.hours, args.ttl, args.preset)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        keep_alive.print_bench(results)
    return 0 if all(r["auto_at_most_best"] for r in results) else 1


def _cmd_bench_route(args: argparse.Namespace) -> int:
    from router.sim import bench

    bench.route_latency(
        prompt_tokens=args.prompt_tokens,
        index_keys=args.index_keys,
        groups=args.groups,
        block_size=args.block_size,
        calls=args.calls,
        index=args.index,
    )
    return 0


def _cmd_bench_fleet(args: argparse.Namespace) -> int:
    from router.sim.fleet import fleet, format_fleet

    r = fleet(
        args.trace,
        args.groups,
        args.nodes,
        args.replicas,
        args.requests,
        args.rate_scale,
        args.capacity_tokens,
        args.seed,
        progress=not args.json,
        index=args.index,
        share_routes=args.share_routes,
    )
    print(json.dumps(r, indent=2) if args.json else format_fleet(r))
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from router.sim import loadgen

    return loadgen.run(args)


# kvgrid serve's flags (argparse dests) and the config fields they set.


def add_bench(sub) -> None:
    from router.sim.loadgen import add_arguments

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    _add_bench_engine(bsub)
    _add_bench_tp(bsub)
    _add_bench_lora(bsub)
    _add_bench_route(bsub)
    _add_bench_tiers(bsub)
    _add_bench_keep_alive(bsub)
    _add_bench_fleet(bsub)
    bs = bsub.add_parser("serve", help="HTTP load generator for an OpenAI-compatible server: TTFT, ITL, tokens/s")
    add_arguments(bs)
    bs.set_defaults(func=_cmd_bench_serve)


def _add_bench_engine(bsub) -> None:
    e = bsub.add_parser("engine", help="TTFT cold vs. cached prefix, decode tokens/s")
    e.add_argument("--model", default="demo")
    e.add_argument("--prompt-len", type=int, default=2048)
    e.add_argument("--cached", type=int, default=1984, help="prompt tokens shared with an earlier request")
    e.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    e.add_argument("--decode-steps", type=int, default=64)
    e.add_argument(
        "--decode-threads",
        type=int,
        default=None,
        help="CPU: decode-only steps on this many threads, the others on all of torch's (kvgrid serve's "
        "decode_cpus_per_rank; default: every step on all)",
    )
    e.add_argument("--repeats", type=int, default=5)
    e.add_argument("--device", default="auto")
    e.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the engine's dtype (auto: float32 on CPU, the model's half precision or bfloat16 on CUDA)",
    )
    e.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run decode steps eagerly on CUDA (to compare with the captured graphs)",
    )
    e.add_argument(
        "--grammar",
        action="store_true",
        help="instead: decode tokens/s without and with a JSON-schema constraint on every sequence (--batch sizes)",
    )
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_cmd_bench)


def _add_bench_lora(bsub) -> None:
    t = bsub.add_parser("lora", help="decode tokens/s of a batch over LoRA adapters vs. the same batch without")
    t.add_argument("--model", default="demo")
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--adapters", type=int, default=8, help="adapters the batch is spread over (one slot each)")
    t.add_argument("--rank", type=int, default=16, help="every adapter's rank (all seven projections)")
    t.add_argument("--decode-steps", type=int, default=64)
    t.add_argument("--repeats", type=int, default=3, help="paired runs, interleaved; the medians are compared")
    t.add_argument("--device", default="auto")
    t.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="CUDA: both batches eager")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_cmd_bench_lora)


def _add_bench_tp(bsub) -> None:
    t = bsub.add_parser("tp", help="TTFT and decode tokens/s of a worker group per tensor-parallel size (local Ray)")
    t.add_argument("--model", default="demo")
    t.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    t.add_argument("--prompt-len", type=int, default=1024)
    t.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    t.add_argument("--decode-tokens", type=int, default=64)
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_cmd_bench_tp)


def _add_bench_tiers(bsub) -> None:
    t = bsub.add_parser("tiers", help="TTFT of a prompt evicted from a small KV pool, reloaded from host RAM and disk")
    t.add_argument("--model", default="demo")
    t.add_argument("--prompt-len", type=int, default=2048)
    t.add_argument("--gpu-blocks", type=int, default=256, help="blocks in the engine's KV pool")
    t.add_argument("--fill", type=int, default=8, help="other prompts sent in between (to evict the first)")
    t.add_argument("--max-tokens", type=int, default=16, help="greedy output tokens compared with a recompute")
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--host-bytes", type=int, default=256 * 2**20)
    t.add_argument("--disk-bytes", type=int, default=512 * 2**20)
    t.add_argument("--disk-path", default=None, help="the disk tier's directory (default: a temporary one)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_cmd_bench_tiers)


def _add_bench_keep_alive(bsub) -> None:
    from common.defaults import DEFAULT_PIN_TTL_S
    from router.gateway.economics import PRESETS

    k = bsub.add_parser(
        "keep-alive", help="replay a sparse workload of explicit entries: cost of never / always / auto keep-alive"
    )
    k.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=["anthropic", "gemini"])
    k.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    k.add_argument("--entries", type=int, default=2000, help="entries per workload")
    k.add_argument("--hours", type=float, default=24.0, help="the workload's length")
    k.add_argument("--ttl", type=float, default=DEFAULT_PIN_TTL_S, help="the entries' TTL in seconds")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_bench_keep_alive)


def _add_bench_route(bsub) -> None:
    r = bsub.add_parser(
        "route",
        help="route() latency for a long prompt against a large prefix index; the index's bytes per key, event "
        "application rate and snapshot load time",
    )
    r.add_argument("--prompt-tokens", type=int, default=32768)
    r.add_argument(
        "--index-keys", type=int, default=1_000_000, help="keys to fill the index with (filled 1M keys per event)"
    )
    r.add_argument("--groups", type=int, default=8)
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--calls", type=int, default=300)
    r.add_argument("--index", choices=["dict", "compact"], default="compact", help="the prefix index to measure")
    r.set_defaults(func=_cmd_bench_route)


def _add_bench_fleet(bsub) -> None:
    f = bsub.add_parser(
        "fleet",
        help="simulated groups on simulated nodes, their KV events through a real Redis to several router replicas: "
        "routes/s, event lag, index memory, catch-up, hit ratio",
    )
    f.add_argument("--trace", default=None, help="JSONL trace (Mooncake format; default: a generated one)")
    f.add_argument("--groups", type=int, default=8)
    f.add_argument("--nodes", type=int, default=2, help="simulated nodes (the groups of a node share a Redis client)")
    f.add_argument("--replicas", type=int, default=2, help="router replicas, each with its own index")
    f.add_argument("--requests", type=int, default=2000, help="requests of the trace to run")
    f.add_argument(
        "--rate-scale",
        type=float,
        default=0.0,
        help="simulated seconds per wall second (0: what makes the requests arrive at 100/s)",
    )
    f.add_argument("--capacity-tokens", type=int, default=131072, help="KV cache tokens per group")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--index", choices=["dict", "compact"], default="compact", help="the replicas' prefix index")
    f.add_argument(
        "--no-share-routes",
        dest="share_routes",
        action="store_false",
        help="each replica hears only of the requests it routed (routing: {share_routes: false})",
    )
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=_cmd_bench_fleet)


def add_replay(sub) -> None:
    from router.routing.policy import DEFAULT_DISK_LOAD_TOKENS_PER_S, DEFAULT_HOST_LOAD_TOKENS_PER_S, POLICIES

    rp = sub.add_parser("replay", help="replay a request trace through the router and simulated worker groups")
    rp.add_argument("--trace", required=True, help="JSONL trace (timestamp, input_length, output_length, hash_ids)")
    rp.add_argument("--groups", type=int, default=8)
    rp.add_argument("--capacity-tokens", type=int, default=3_000_000, help="KV cache tokens per group")
    rp.add_argument(
        "--host-capacity-tokens", type=int, default=0, help="host-RAM tier tokens per group (0: no host tier)"
    )
    rp.add_argument("--disk-capacity-tokens", type=int, default=0, help="disk tier tokens per group (0: no disk tier)")
    rp.add_argument(
        "--host-load-rate",
        type=float,
        default=DEFAULT_HOST_LOAD_TOKENS_PER_S,
        help="tokens/s a group loads from host RAM into its GPU pool",
    )
    rp.add_argument(
        "--disk-load-rate", type=float, default=DEFAULT_DISK_LOAD_TOKENS_PER_S, help="tokens/s a group loads from disk"
    )
    rp.add_argument("--block-size", type=int, default=512, help="tokens per hash_ids entry")
    rp.add_argument("--policy", default="kvgrid", choices=[*POLICIES, "all"])
    rp.add_argument("--tenants", type=int, default=1, help="tenant of a request: hash_ids[1] %% T")
    rp.add_argument("--prefill-rate", type=float, default=16000.0, help="prefill tokens/s of one group")
    rp.add_argument("--decode-ms", type=float, default=20.0, help="ms per output token of one request")
    rp.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=_cmd_replay)
