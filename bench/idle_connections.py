"""A tenant's latency beside thousands of idle and trickling connections (a hostile client's idle sockets), against a
running `kvgrid serve` such as `make run`'s:

    .venv/bin/python bench/idle_connections.py [--url http://127.0.0.1:8000] [--tenant globex --key sk-globex-1]
        [--connections 2000] [--per-address 200] [--model smollm2]

Sends `--probes` 1-token completions (one every 0.1 s) alone, then again while `--connections` sockets are open
(half send nothing, half one partial request head), each group of `--per-address` from its own loopback source
address (127.0.0.2, .3, ...: the ingress caps connections per client address), and prints success and p50 / p99
latency of both rounds. Loopback only."""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import time
from urllib.parse import urlsplit

import httpx


def probe(args: argparse.Namespace) -> tuple[int, float, float]:
    lat, ok = [], 0
    with httpx.Client(timeout=30) as client:
        for i in range(args.probes):
            start = time.perf_counter()
            r = client.post(
                f"{args.url}/{args.tenant}/v1/completions",
                headers={"Authorization": f"Bearer {args.key}"},
                json={"model": args.model, "prompt": f"Hello {i}", "max_tokens": 1},
            )
            lat.append(time.perf_counter() - start)
            ok += r.status_code == 200
            time.sleep(0.1)
    lat.sort()
    return ok, statistics.median(lat) * 1e3, lat[int(0.99 * (len(lat) - 1))] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--tenant", default="globex")
    p.add_argument("--key", default="sk-globex-1")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--connections", type=int, default=2000)
    p.add_argument("--per-address", type=int, default=200)
    p.add_argument("--probes", type=int, default=40)
    args = p.parse_args()
    host, port = urlsplit(args.url).hostname or "127.0.0.1", urlsplit(args.url).port or 80
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.connections + 256)), hard))
    alone = probe(args)
    socks = []
    for i in range(args.connections):
        s = socket.socket()
        s.bind((f"127.0.0.{2 + i // args.per_address}", 0))
        s.connect((host, port))
        if i % 2:
            s.send(b"GET /" + args.tenant.encode() + b"/v1/models HTTP/1.1\r\nX-a: 1\r\n")  # a head never finished
        socks.append(s)
    beside = probe(args)
    for s in socks:
        s.close()
    print("| round | success | p50 (ms) | p99 (ms) |\n| --- | --- | --- | --- |")
    for name, (ok, p50, p99) in (("alone", alone), (f"beside {args.connections} connections", beside)):
        print(f"| {name} | {ok}/{args.probes} | {p50:.1f} | {p99:.1f} |")
    print(f"p99 ratio: {beside[2] / alone[2]:.2f}")


if __name__ == "__main__":
    main()
