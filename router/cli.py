"""The ``kvgrid`` command line. What a command answers (tables, results, benchmark figures) goes to stdout;
diagnostics (warnings, retries, restarts) go through ``logging`` to stderr."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from common.logs import configure_logging

if TYPE_CHECKING:
    from common.config import ServeConfig

DEMO_PREFIX = (
    "You are the support assistant of a company that rents out bicycles in a small harbour town. "
    "Answer briefly and politely. The shop opens at nine in the morning and closes at six in the evening, "
    "every day except on public holidays. A city bike costs twelve euros a day, an electric bike thirty, "
    "and a cargo bike forty. Helmets and locks are included; child seats cost three euros extra. "
    "Customers must show an identity document and leave a deposit of fifty euros per bike, returned in full "
    "when the bike comes back undamaged. Bikes returned more than an hour late are charged half a day extra. "
    "Flat tyres are repaired for free; other damage is charged at cost. The shop also sells maps of the "
    "coastal routes, sells water and snacks, and can recommend guided tours on weekends. "
)
DEMO_QUESTIONS = ("How much is an electric bike for two days?", "Do I need to bring my own helmet?")


def _cmd_demo_model(args: argparse.Namespace) -> int:
    from worker.models.demo_model import write_demo_model

    path = write_demo_model(args.dir, args.variant, args.seed, progress=True)
    print(f"wrote the {args.variant} demo model to {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from common.sampling import SamplingParams
    from worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=args.model, block_size=args.block_size, device=args.device))
    tok = engine.tokenizer
    prompts = args.prompt or [DEMO_PREFIX + q for q in DEMO_QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    print(f"model {engine.model_path} on {engine.device}, block size {engine.config.block_size}")
    # Warm up the kernels with a one-token prompt (no full block, so nothing enters the cache).
    engine.generate([[0]], SamplingParams(max_tokens=1))
    # One after the other, so that the second prompt can reuse the first one's shared prefix.
    for i, text in enumerate(prompts, 1):
        ids = tok.encode(text)
        start = time.perf_counter()
        out = engine.generate([ids], params, tenant=args.tenant)[0]
        total = time.perf_counter() - start
        print(f"\n[{i}] prompt: {len(ids)} tokens, {out.num_cached_tokens} from the prefix cache")
        if out.error is not None:  # the engine failed this request alone: maybe before its first token
            print(f"    failed: {out.error}")
        ttft = "none" if out.ttft is None else f"{out.ttft * 1e3:.1f} ms"
        print(f"    time to first token: {ttft}, total {total * 1e3:.1f} ms")
        print(f"    output tokens: {out.token_ids}")
        print(f"    output text:   {out.text!r}")
    return 0


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
    )
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from router.sim import loadgen

    return loadgen.run(args)


# kvgrid serve's flags (argparse dests) and the config fields they set.
SERVE_FLAGS = {
    "model": ("MODEL", ("model",)),
    "host": ("--host", ("http", "host")),
    "port": ("--port", ("http", "port")),
    "groups": ("--groups", ("groups",)),
    "tensor_parallel": ("--tensor-parallel", ("tensor_parallel",)),
    "dtype": ("--dtype", ("dtype",)),
    "served_model_name": ("--served-model-name", ("served_model_name",)),
}
DEFAULT_TENANT = "default"  # the one tenant of `kvgrid serve` without --config


def is_loopback(host: str) -> bool:
    """Whether ``host`` only takes connections from this machine (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def serve_config_from_args(args: argparse.Namespace) -> tuple[ServeConfig, str | None]:
    """``kvgrid serve``'s config: ``--config``'s (or, without it, one tenant ``default`` whose key is --api-key or
    $KVGRID_API_KEY) with the flags' values over it; and the key generated for ``default`` (on a loopback host
    without a key given), else None. Raises ConfigError naming the flag or field at fault."""
    import secrets

    from pydantic import ValidationError

    from common.config import ConfigError, HttpConfig, ServeConfig, config_error_message, load_config

    given = {dest: getattr(args, dest) for dest in SERVE_FLAGS if getattr(args, dest) is not None}
    generated = None
    raw: dict[str, Any]
    if args.config:
        if args.api_key:
            raise ConfigError(
                "--api-key is for serving without --config (the config's tenants have their api_keys); drop "
                "--api-key, or put the key in a tenant's api_keys"
            )
        cfg = load_config(args.config)
        if not given:
            return cfg, None
        raw = cfg.model_dump()  # validated again with the flags' values
    else:
        if "model" not in given:
            raise ConfigError("no model given; give a model or --config (e.g. kvgrid serve demo)")
        key, source = args.api_key, "--api-key"
        if not key:
            key, source = os.environ.get("KVGRID_API_KEY"), "KVGRID_API_KEY"
        if not key:
            host = given.get("host") or HttpConfig().host
            if not is_loopback(host):
                raise ConfigError(
                    f"--host {host} is reachable from other machines and no API key is given; give one with "
                    "--api-key or KVGRID_API_KEY (a key is generated only on a loopback host)"
                )
            key = generated = "sk-" + secrets.token_urlsafe(24)
        elif len(key) < 8:
            raise ConfigError(f"{source}: an API key must have at least 8 characters; give a longer one")
        raw = {"tenants": [{"name": DEFAULT_TENANT, "api_keys": [key]}]}
    for dest, value in given.items():
        *parents, field = SERVE_FLAGS[dest][1]
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[field] = value
    try:
        return ServeConfig.model_validate(raw), generated
    except ValidationError as exc:
        loc = tuple(str(p) for p in exc.errors()[0]["loc"])
        flag = next((SERVE_FLAGS[d][0] for d in given if loc[: len(SERVE_FLAGS[d][1])] == SERVE_FLAGS[d][1]), None)
        where = flag or args.config or "kvgrid serve"
        fix = f"give {flag} another value" if flag else None
        raise ConfigError(config_error_message(exc, where, fix)) from None


SECRET_FIELDS = ("api_keys", "admin_keys")  # config fields that `kvgrid config check` shows redacted


def redact_key(key: str) -> str:
    """A key as ``kvgrid config check`` shows it: its first characters (at most 6, at most a third of it), then …."""
    return key[: min(6, len(key) // 3)] + "…"


def _redact(node: Any) -> Any:
    """A dumped config with every key list redacted (``SECRET_FIELDS``, wherever they are)."""
    if isinstance(node, dict):
        return {
            k: [redact_key(x) for x in v] if k in SECRET_FIELDS and isinstance(v, list) else _redact(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_redact(x) for x in node]
    return node


def _cmd_config_check(args: argparse.Namespace) -> int:
    import yaml

    from common.config import load_config
    from router.control.serve import _redacted

    cfg = load_config(args.file)
    data = _redact(cfg.model_dump())
    if isinstance(data.get("tracing"), dict) and data["tracing"].get("otlp_endpoint"):  # a URL may hold a password
        data["tracing"]["otlp_endpoint"] = _redacted(data["tracing"]["otlp_endpoint"])
    print(f"# {args.file} is valid: every field with its value, defaults filled in; keys redacted")
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from router.control import serve

    cfg, generated = serve_config_from_args(args)
    if generated is not None:
        base = serve.base_url(cfg.http.host, cfg.http.port)
        print(f"no --api-key or KVGRID_API_KEY given: generated tenant {DEFAULT_TENANT}'s API key for this run:")
        print(f"  export KVGRID_API_KEY={generated}   # OpenAI base_url {base}/{DEFAULT_TENANT}/v1", flush=True)
    return serve.run(cfg, address=args.address, redis_url=args.redis)


def _cmd_model_path(args: argparse.Namespace) -> int:
    import contextlib

    from worker.models.registry import resolve_model

    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the path only: $(kvgrid model-path NAME)
        path = resolve_model(args.name)
    print(path)
    return 0


def _admin_call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One call to a running server's admin API; raises ValueError with the server's message."""
    import httpx

    key = args.admin_key or os.environ.get("KVGRID_ADMIN_KEY")
    if not key:
        raise ValueError(
            "no admin key given; pass --admin-key or set KVGRID_ADMIN_KEY (one of admin_keys in the config)"
        )
    url = args.url.rstrip("/") + "/admin/v1" + path
    try:
        r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}; check --url and that the server runs") from None
    if r.status_code == 404 and "error" not in r.text:
        raise ValueError(f"{args.url} has no admin API; set admin_keys in its config (and restart it)")
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except Exception:
            msg = r.text[:200]
        raise ValueError(f"{r.status_code}: {msg}")
    return r.json()


def _print_groups(groups: list[dict]) -> None:
    print(
        f"{'group':<8} {'state':<11} {'restarts':>8} {'running':>8} {'waiting':>8} {'requests':>9} "
        f"{'pinned':>7} {'index keys':>11}"
    )
    for g in groups:
        st, rt = g.get("stats") or {}, g.get("router") or {}
        print(
            f"{g['name']:<8} {g['state']:<11} {g['restarts']:>8} {st.get('running', '-'):>8} "
            f"{st.get('waiting', '-'):>8} {st.get('requests', '-'):>9} {st.get('blocks_pinned', '-'):>7} "
            f"{rt.get('index_keys', '-'):>11}"
        )


def _cmd_scale(args: argparse.Namespace) -> int:
    body = {"groups": args.groups, "remove": args.remove or []}
    if args.drain_timeout is not None:
        body["drain_timeout_s"] = args.drain_timeout
    _print_groups(_admin_call(args, "POST", "/scale", body)["groups"])
    return 0


def _cmd_groups(args: argparse.Namespace) -> int:
    groups = _admin_call(args, "GET", "/groups")["groups"]
    if args.json:
        print(json.dumps(groups, indent=2))
    else:
        _print_groups(groups)
    return 0


def _cmd_advise(args: argparse.Namespace) -> int:
    """The cache advisor: a running server's (GET /{tenant}/v1/cache/advice) or, with --file, offline."""
    from router.gateway import advisor

    if args.file:
        from common.config import PricesConfig
        from common.model_config import load_tokenizer
        from router.gateway.economics import Prices
        from worker.models.registry import resolve_model

        tokenizer = load_tokenizer(resolve_model(args.model))
        prices = Prices.from_config(PricesConfig(preset=args.prices) if args.prices else None)
        report = advisor.advise(
            advisor.load_jsonl(args.file, tokenizer),
            block_size=args.block_size,
            prices=prices,
            explicit=args.explicit,
            min_prefix_tokens=args.min_prefix_tokens,
        )
    else:
        import httpx

        key = args.key or os.environ.get("KVGRID_API_KEY")
        if not (args.tenant and key):
            raise ValueError("pass --file, or --tenant and --key (or KVGRID_API_KEY) to ask a running server")
        url = f"{args.url.rstrip('/')}/{args.tenant}/v1/cache/advice"
        try:
            r = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=args.timeout)
        except httpx.HTTPError as exc:
            raise ValueError(f"cannot reach {url}: {exc}; check --url and that the server runs") from None
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except Exception:
                msg = r.text[:200]
            raise ValueError(f"{r.status_code}: {msg}")
        report = r.json()
    print(json.dumps(report, indent=2) if args.json else advisor.format_report(report))
    return 0


def _add_advise(sub) -> None:
    a = sub.add_parser(
        "advise", help="cache advice: what breaks a tenant's prompt prefix (a running server, or --file offline)"
    )
    a.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    a.add_argument("--tenant", default=None, help="the tenant whose sampled prompts to analyse")
    a.add_argument("--key", default=None, help="the tenant's API key (default: $KVGRID_API_KEY)")
    a.add_argument("--timeout", type=float, default=60.0)
    a.add_argument("--file", default=None, help="offline: a JSONL of prompts (messages, prompt or token_ids)")
    a.add_argument("--model", default="demo", help="--file: the model whose tokenizer and chat template to use")
    a.add_argument("--block-size", type=int, default=16, help="--file: the server's block_size")
    a.add_argument("--prices", default=None, choices=["openai", "anthropic", "gemini", "deepseek"])
    a.add_argument("--explicit", action="store_true", help="--file: also where cache_control breakpoints pay")
    a.add_argument("--min-prefix-tokens", type=int, default=1, help="--file: implicit reuse counts from here")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=_cmd_advise)


def _admin_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--admin-key", default=None, help="an admin key (default: $KVGRID_ADMIN_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvgrid")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvgrid", description="Multi-tenant LLM serving with exact prefix caching.")
    p.add_argument("--version", action="version", version=f"kvgrid {_version()}")
    p.add_argument("--debug", action="store_true", help="on an error, print its traceback too (kvgrid --debug CMD)")
    sub = p.add_subparsers(dest="command", required=True)
    _add_demo_model(sub)
    _add_config(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_model_path(sub)
    _add_scale_and_groups(sub)
    _add_advise(sub)
    _add_bench(sub)
    _add_replay(sub)
    return p


def _add_config(sub) -> None:
    c = sub.add_parser("config", help="check a kvgrid serve config file")
    csub = c.add_subparsers(dest="config_command", required=True)
    check = csub.add_parser(
        "check",
        help="validate FILE and print it with every default filled in (keys redacted)",
        description="Validates FILE as kvgrid serve would and prints the resolved config as YAML on stdout: every "
        "field, defaults filled in, API and admin keys redacted. An invalid file: one line on stderr, exit 2.",
    )
    check.add_argument("file", metavar="FILE", help="the YAML config")
    check.set_defaults(func=_cmd_config_check)


def _add_demo_model(sub) -> None:
    d = sub.add_parser("demo-model", help="write the deterministic demo model (HF format) into DIR")
    d.add_argument("dir")
    d.add_argument("--variant", default="llama", choices=["llama", "qwen2"])
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_cmd_demo_model)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="run prompts through one engine offline and show prefix-cache reuse")
    g.add_argument("--model", default="demo", help="HF model folder, or 'demo' (built on first use)")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable); default: two sharing a long prefix")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--tenant", default="default")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--device", default="auto")
    g.set_defaults(func=_cmd_generate)


def _add_serve(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="serve a model over HTTP, to tenant 'default' or every tenant of --config (Ctrl-C stops)",
        description="Flags override the config's values. Without --config: one tenant, 'default', at "
        "http://HOST:PORT/default/v1, with the key of --api-key or $KVGRID_API_KEY (on a loopback host without "
        "one, a key is generated and printed).",
    )
    s.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="demo, smollm2, a GGUF file, a folder, an org/name Hub id",
    )
    s.add_argument(
        "--config", default=None, help="YAML config (docs/configuration.md; check one: kvgrid config check FILE)"
    )
    s.add_argument("--host", default=None, help="http.host (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="http.port (default 8000)")
    s.add_argument("--groups", type=int, default=None, help="worker groups (default 1)")
    s.add_argument("--tensor-parallel", type=int, default=None, help="ranks per group (default 1)")
    s.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"], help="default auto")
    s.add_argument("--served-model-name", default=None, help="the model name clients send and /v1/models reports")
    s.add_argument("--api-key", default=None, help="without --config: tenant default's key (or $KVGRID_API_KEY)")
    s.add_argument("--address", default=None, help="join this Ray cluster (default: start one on 127.0.0.1)")
    s.add_argument("--redis", default=None, help="redis://... URL (default: an embedded Redis)")
    s.set_defaults(func=_cmd_serve)


def _add_model_path(sub) -> None:
    m = sub.add_parser("model-path", help="print the model folder of NAME (built or converted first)")
    m.add_argument("name", metavar="NAME", help="demo, smollm2, a GGUF file, a folder, an org/name Hub id")
    m.set_defaults(func=_cmd_model_path)


def _add_scale_and_groups(sub) -> None:
    """The admin API's commands."""
    sc = sub.add_parser("scale", help="start or drain worker groups of a running server (admin API)")
    sc.add_argument("--groups", type=int, required=True, help="how many groups to run")
    sc.add_argument(
        "--remove",
        action="append",
        metavar="GROUP",
        help="drain this group when scaling down (repeatable; default: the newest)",
    )
    sc.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="seconds a draining group's requests may still run (default 120)",
    )
    _admin_args(sc)
    sc.set_defaults(func=_cmd_scale)
    gr = sub.add_parser("groups", help="list the worker groups of a running server (admin API)")
    gr.add_argument("--json", action="store_true")
    _admin_args(gr)
    gr.set_defaults(func=_cmd_groups)


def _add_bench(sub) -> None:
    from router.sim.loadgen import add_arguments

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    _add_bench_engine(bsub)
    _add_bench_tp(bsub)
    _add_bench_route(bsub)
    _add_bench_tiers(bsub)
    _add_bench_keep_alive(bsub)
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
    from router.gateway.economics import PRESETS

    k = bsub.add_parser(
        "keep-alive", help="replay a sparse workload of explicit entries: cost of never / always / auto keep-alive"
    )
    k.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=["anthropic", "gemini"])
    k.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    k.add_argument("--entries", type=int, default=2000, help="entries per workload")
    k.add_argument("--hours", type=float, default=24.0, help="the workload's length")
    k.add_argument("--ttl", type=float, default=300.0, help="the entries' TTL in seconds")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=_cmd_bench_keep_alive)


def _add_bench_route(bsub) -> None:
    r = bsub.add_parser("route", help="route() latency for a long prompt against a large prefix index")
    r.add_argument("--prompt-tokens", type=int, default=32768)
    r.add_argument("--index-keys", type=int, default=1_000_000)
    r.add_argument("--groups", type=int, default=8)
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--calls", type=int, default=300)
    r.set_defaults(func=_cmd_bench_route)


def _add_replay(sub) -> None:
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


def error_line(exc: BaseException, command: str = "") -> str:
    """What ``main`` prints after ``kvgrid: error:`` for an error a command raised: one line, its cause, then after
    ``; `` the fix: the message's own (kvgrid's errors say it), else one for the kind of error."""
    cause, fix = _cause_and_fix(exc, command)
    text = " ".join(cause.split()) or type(exc).__name__
    if len(text) > 1000:
        text = text[:997] + "..."
    return text if "; " in text else f"{text}; {fix}"


def _cause_and_fix(exc: BaseException, command: str) -> tuple[str, str]:
    debug = "rerun with kvgrid --debug for the traceback"
    library = type(exc).__module__.split(".")[0]
    if library == "ray":
        cause = getattr(exc, "cause", None)  # a RayTaskError: what the remote call raised
        if isinstance(cause, Exception):
            return _cause_and_fix(cause, command)
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        return f"Ray: {type(exc).__name__}: {first}", f"check the Ray cluster (ray status); {debug}"
    if library == "redis":
        return f"Redis: {type(exc).__name__}: {exc}", "check that Redis runs and that --redis names it"
    if isinstance(exc, (ValueError, FileNotFoundError)):  # ConfigError, ModelError and kvgrid's other bad input
        return str(exc), f"see kvgrid {command} --help".replace("  ", " ")
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc) or type(exc).__name__
        return (f"{what}: {exc.filename}" if exc.filename else what), "check the path, the address and permissions"
    if isinstance(exc, RuntimeError):
        return str(exc), debug
    return f"unexpected {type(exc).__name__}: {exc}", f"{debug}, and report it"


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr, ``kvgrid: error: <cause>; <fix>``, and exit code 2
    (Ctrl-C: 130, quietly). ``kvgrid --debug ...`` prints the traceback first."""
    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        return 130
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        sys.stdout.flush()
        command = " ".join(str(getattr(args, a)) for a in ("command", "bench") if getattr(args, a, None))
        print(f"kvgrid: error: {error_line(exc, command)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
