"""``kvgrid scale``, ``kvgrid groups`` and ``kvgrid advise``: the admin commands, calls to a running server's admin
API (``advise`` also reads a sample file offline)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from common import env


def _call(method: str, url: str, key: str, timeout: float, body: dict | None = None, no_route: str = "") -> Any:
    """One authenticated call to a running server, its JSON answer; raises ValueError naming an unreachable server,
    ``no_route`` for a 404 of no API error (the path is not served there), else the server's own message."""
    import httpx

    try:
        r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}; check --url and that the server runs") from None
    if no_route and r.status_code == 404 and "error" not in r.text:
        raise ValueError(no_route)
    if r.status_code not in (200, 201):
        try:
            msg = r.json()["error"]["message"]
        except Exception:
            msg = r.text[:200]
        raise ValueError(f"{r.status_code}: {msg}")
    return r.json()


def _admin_call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One call to a running server's admin API; raises ValueError with the server's message."""
    key = args.admin_key or env.admin_key()
    if not key:
        raise ValueError(
            "no admin key given; pass --admin-key or set KVGRID_ADMIN_KEY (one of admin_keys in the config)"
        )
    url = args.url.rstrip("/") + "/admin/v1" + path
    no_route = f"{args.url} has no admin API; set admin_keys in its config (and restart it)"
    return _call(method, url, key, args.timeout, body, no_route)


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
        key = args.key or env.api_key()
        if not (args.tenant and key):
            raise ValueError("pass --file, or --tenant and --key (or KVGRID_API_KEY) to ask a running server")
        report = _call("GET", f"{args.url.rstrip('/')}/{args.tenant}/v1/cache/advice", key, args.timeout)
    print(json.dumps(report, indent=2) if args.json else advisor.format_report(report))
    return 0


def add_advise(sub) -> None:
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


def add_scale_and_groups(sub) -> None:
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
