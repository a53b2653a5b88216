"""``kvgrid tenants list|create|update|delete`` and ``kvgrid keys create|list|revoke|rotate``: tenants and their API
keys at run time, calls to a running server's admin API (router/gateway/tenant_admin.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from router.cli.admin import _admin_args, _admin_call


def _section(pairs: list[str] | None) -> dict[str, Any]:
    """``--set limits.requests_per_s=5 --set prices.preset=openai`` as a nested body; values are JSON when they
    parse as JSON (numbers, true, null), else strings."""
    body: dict[str, Any] = {}
    for pair in pairs or []:
        path, sep, raw = pair.partition("=")
        if not sep or not path:
            raise ValueError(f"--set {pair!r}: expected FIELD=VALUE (e.g. limits.requests_per_s=5)")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        *parents, leaf = path.split(".")
        node = body
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {pair!r}: {p} is set to a value already")
        node[leaf] = value
    return body


def _body(args: argparse.Namespace) -> dict[str, Any]:
    body = json.loads(args.json_body) if args.json_body else {}
    if not isinstance(body, dict):
        raise ValueError('--json: a JSON object, e.g. \'{"limits": {"requests_per_s": 5}}\'')
    for k, v in _section(args.set).items():
        body[k] = {**body[k], **v} if isinstance(v, dict) and isinstance(body.get(k), dict) else v
    return body


def _print(data: Any) -> None:
    print(json.dumps(data, indent=2))


def _cmd_tenants(args: argparse.Namespace) -> int:
    if args.action == "list":
        tenants = _admin_call(args, "GET", "/tenants")["tenants"]
        if args.json:
            _print(tenants)
        else:
            print(f"{'tenant':<24} {'origin':<7} {'cache':<9} {'keys':>4}")
            for t in tenants:
                print(f"{t['name']:<24} {t['origin']:<7} {t['config']['cache']['mode']:<9} {len(t['keys']):>4}")
        return 0
    if not args.name:
        raise ValueError(f"kvgrid tenants {args.action} needs the tenant's name")
    if args.action == "create":
        _print(_admin_call(args, "POST", "/tenants", {"name": args.name, **_body(args)}))
    elif args.action == "update":
        _print(_admin_call(args, "PATCH", f"/tenants/{args.name}", _body(args)))
    elif args.action == "get":
        _print(_admin_call(args, "GET", f"/tenants/{args.name}"))
    else:
        _print(_admin_call(args, "DELETE", f"/tenants/{args.name}"))
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    base = f"/tenants/{args.tenant}/keys"
    if args.action == "list":
        keys = _admin_call(args, "GET", base)["keys"]
        if args.json:
            _print(keys)
        else:
            print(f"{'id':<18} {'prefix':<12} {'origin':<7} {'created':>14} {'expires':>14}")
            for k in keys:
                print(
                    f"{k['id']:<18} {k['prefix']:<12} {k['origin']:<7} {k['created']:>14.0f} "
                    f"{'-' if k['expires'] is None else format(k['expires'], '.0f'):>14}"
                )
        return 0
    if args.action == "create":
        out = _admin_call(args, "POST", base)
    elif not args.id:
        raise ValueError(f"kvgrid keys {args.action} needs the key's id (kvgrid keys list --tenant T)")
    elif args.action == "revoke":
        out = _admin_call(args, "DELETE", f"{base}/{args.id}")
    else:
        out = _admin_call(args, "POST", f"{base}/{args.id}/rotate", {"overlap_s": args.overlap})
    if "key" in out:  # shown this once: the server keeps only its hash
        print(f"key {out['id']} of {args.tenant}: {out['key']}\n(store it now; it is not shown again)")
    else:
        _print(out)
    return 0


def add_tenants_and_keys(sub) -> None:
    t = sub.add_parser("tenants", help="list, create, update or delete tenants of a running server (admin API)")
    t.add_argument("action", choices=["list", "get", "create", "update", "delete"])
    t.add_argument("name", nargs="?", default=None, help="the tenant (all but list)")
    t.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="a config field (repeatable): limits.requests_per_s=5, cache.mode=explicit, prices.preset=openai",
    )
    t.add_argument("--json-body", "--body", dest="json_body", default=None, help="the fields as one JSON object")
    t.add_argument("--json", action="store_true", help="list: print JSON")
    _admin_args(t)
    t.set_defaults(func=_cmd_tenants)
    k = sub.add_parser("keys", help="create, list, revoke or rotate a tenant's API keys (admin API)")
    k.add_argument("action", choices=["create", "list", "revoke", "rotate"])
    k.add_argument("id", nargs="?", default=None, help="the key's id (revoke, rotate)")
    k.add_argument("--tenant", required=True)
    k.add_argument("--overlap", type=float, default=300.0, help="rotate: seconds the old key still works (default 300)")
    k.add_argument("--json", action="store_true", help="list: print JSON")
    _admin_args(k)
    k.set_defaults(func=_cmd_keys)
