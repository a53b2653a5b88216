"""``kvgrid serve``, ``kvgrid config check`` and ``kvgrid model-path``: a serve config from a file or the flags, and
the server started from it."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from common import env
from common.config_secrets import is_loopback

if TYPE_CHECKING:
    from common.config import ServeConfig


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
            key, source = env.api_key(), env.API_KEY.name
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


# Config fields that `kvgrid config check` shows redacted (lists of keys, or one secret).
SECRET_FIELDS = ("api_keys", "admin_keys", "redis_password", "server_secret")


def redact_key(key: str) -> str:
    """A key as ``kvgrid config check`` shows it: its first characters (at most 6, at most a third of it), then …."""
    return key[: min(6, len(key) // 3)] + "…"


def _redact_secret(value: Any) -> Any:
    if isinstance(value, list):
        return [redact_key(x) for x in value]
    return "…" if isinstance(value, str) else value  # a password or secret: not even its first characters


def _redact(node: Any) -> Any:
    """A dumped config with every key list redacted (``SECRET_FIELDS``, wherever they are)."""
    if isinstance(node, dict):
        return {k: _redact_secret(v) if k in SECRET_FIELDS else _redact(v) for k, v in node.items()}
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


def add_config(sub) -> None:
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


def add_serve(sub) -> None:
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


def add_model_path(sub) -> None:
    m = sub.add_parser("model-path", help="print the model folder of NAME (built or converted first)")
    m.add_argument("name", metavar="NAME", help="demo, smollm2, a GGUF file, a folder, an org/name Hub id")
    m.set_defaults(func=_cmd_model_path)
