"""What the access log and the tenants' metrics cost: output tokens/s of `kvgrid serve` (the demo model on the CPU,
one worker group) with both on (the default) and with both off (``logging: {access_log: false}``, ``metrics:
{enabled: false}``), each driven by `kvgrid bench serve` at 32 concurrent streams.

The two configurations run interleaved (on, off, on, off, ...), each run on a freshly started server, so that a
machine that drifts (other load, thermal) moves both alike; the figure is the ratio of the medians. The target:
on within 3% of off.

    .venv/bin/python bench/observability_overhead.py            # 5 runs each, 256 requests per run
    .venv/bin/python bench/observability_overhead.py --quick    # a smoke test: 1 run each, ~1 minute

Run it on a quiet machine: a run measures the whole host."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("side_by_side", ROOT / "bench" / "side_by_side.py")
assert _spec is not None and _spec.loader is not None
side_by_side = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(side_by_side)  # its Served: a server in its own process group, stopped with all of it

API_KEY = side_by_side.API_KEY
CONFIGS = {  # name -> the config's observability sections
    "on": "",  # the defaults: access log and metrics on
    "off": "logging: {access_log: false}\nmetrics: {enabled: false}\n",
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(folder: Path, port: int, which: str) -> Path:
    path = folder / f"kvgrid-{which}.yaml"
    path.write_text(
        f"http: {{host: 127.0.0.1, port: {port}}}\nmodel: demo\ndevice: cpu\ngroups: 1\n"
        f"tenants:\n  - name: bench\n    api_keys: [{API_KEY}]\n" + CONFIGS[which]
    )
    return path


def one_run(folder: Path, which: str, i: int, args: argparse.Namespace) -> float:
    """Start a server with ``which`` configuration, drive it, stop it; its output tokens/s."""
    port = free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    base = f"http://127.0.0.1:{port}/bench/v1"
    kvgrid = str(Path(sys.executable).with_name("kvgrid"))
    cmd = [kvgrid, "serve", "--config", str(config(folder, port, which))]
    server = side_by_side.Served(f"{which} #{i + 1}", cmd, env, base, folder / f"serve-{which}-{i}.log")
    try:
        bench = [
            *(kvgrid, "bench", "serve", "--base-url", base, "--api-key", API_KEY, "--model", "demo"),
            *("--workload", "random", "--concurrency", str(args.concurrency)),
            *("--input-len", str(args.input_len), "--output-len", str(args.output_len)),
            *("--num-requests", str(args.num_requests), "--warmup", str(args.warmup), "--seed", str(i), "--json"),
        ]
        done = subprocess.run(bench, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
        if done.returncode != 0:
            raise RuntimeError(f"kvgrid bench serve failed ({done.returncode}):\n{done.stderr[-2000:]}")
        summary = json.loads(done.stdout[done.stdout.index("{") :])
        if summary.get("errors"):
            raise RuntimeError(f"run {which} #{i + 1}: {summary['errors']} failed requests")
        return float(summary["output_tokens_per_s"])
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs of each configuration (interleaved)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent streams")
    p.add_argument("--num-requests", type=int, default=256, help="requests per run")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--warmup", type=int, default=8, help="requests sent before each measured run")
    p.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    p.add_argument("--quick", action="store_true", help="a smoke test (~1 minute): 1 run each, 32 short requests")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.num_requests, args.input_len, args.output_len, args.warmup = 1, 32, 64, 8, 0
    results: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="kvgrid-overhead-") as tmp:
        for i in range(args.runs):
            for which in CONFIGS:
                tps = one_run(Path(tmp), which, i, args)
                results[which].append(tps)
                print(f"run {i + 1} {which:>3}: {tps:.1f} output tokens/s", flush=True)
    med = {name: statistics.median(v) for name, v in results.items()}
    for name, v in results.items():
        print(f"{name:>3}: median {med[name]:.1f} tokens/s over {len(v)} run(s): {', '.join(f'{x:.1f}' for x in v)}")
    ratio = med["on"] / med["off"] if med["off"] else float("nan")
    print(f"on / off: {ratio:.3f} ({100 * (ratio - 1):+.1f}%; target: within 3%)")
    # Each on run beside the off run that followed it: a machine whose speed drifts moves both of a pair alike.
    pairs = [on / off for on, off in zip(results["on"], results["off"]) if off]
    if pairs:
        paired = statistics.median(pairs)
        print(f"on / off, median of the {len(pairs)} run pairs: {paired:.3f} ({100 * (paired - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
