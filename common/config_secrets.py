"""Secrets in the serve config: environment references (a whole value ``${NAME}`` in a secret field is the
variable's value, resolved when the file is loaded) and the serve-time refusal of an example admin key on an address
other machines reach. Only the secret fields take references: ``tenants[].api_keys``, ``admin_keys``,
``redis_password`` and ``server_secret``; ``$${NAME}`` there is the text ``${NAME}``; a ``$`` anywhere else is
kept."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Any

from common.config_base import ConfigError

_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
SECRET_LISTS = ("admin_keys",)  # top-level lists of secrets
SECRET_VALUES = ("redis_password", "server_secret")  # top-level secret strings

# The admin keys the project itself publishes as examples: router/demo.yaml, README.md and docs/ (configuration.md,
# getting-started.md, operations.md, tenants.md) show sk-admin-change-me-0001, router/cluster-serve.yaml the
# placeholder. Anybody can read them, so they never guard a server other machines reach.
EXAMPLE_ADMIN_KEYS = frozenset({"sk-admin-change-me-0001", "replace-with-a-long-random-admin-key"})
# Parts of a key that say it was never replaced (the placeholders' own words).
_PLACEHOLDER_WORDS = ("change-me", "changeme", "replace-with", "replace-me")


def _resolve(value: Any, where: str, environ: Mapping[str, str]) -> Any:
    if not isinstance(value, str):
        return value  # the model says what is wrong with it
    if value.startswith("$${") and _REF.fullmatch(value[1:]):
        return value[1:]  # escaped: the text ${NAME} itself
    m = _REF.fullmatch(value)
    if m is None:
        return value
    name = m.group(1)
    if name not in environ:
        raise ConfigError(f"{where}: environment variable {name} is not set")
    if not environ[name]:
        raise ConfigError(f"{where}: environment variable {name} is empty")
    return environ[name]


def resolve_env_refs(raw: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``raw`` (a parsed config file) with every ``${NAME}`` of a secret field replaced by ``environ[NAME]`` (default:
    this process's environment); ConfigError ``"<field path>: environment variable NAME is not set"`` (or empty)
    otherwise. ``raw`` itself is not changed; a malformed field is left for the model's validation."""
    env = os.environ if environ is None else environ
    out = dict(raw)
    for field in SECRET_LISTS:
        if isinstance(out.get(field), list):
            out[field] = [_resolve(v, f"{field}[{i}]", env) for i, v in enumerate(out[field])]
    for field in SECRET_VALUES:
        if field in out:
            out[field] = _resolve(out[field], field, env)
    if isinstance(out.get("tenants"), list):
        tenants = []
        for i, t in enumerate(out["tenants"]):
            if isinstance(t, dict) and isinstance(t.get("api_keys"), list):
                keys = [_resolve(v, f"tenants[{i}].api_keys[{j}]", env) for j, v in enumerate(t["api_keys"])]
                t = {**t, "api_keys": keys}
            tenants.append(t)
        out["tenants"] = tenants
    return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` only takes connections from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def is_example_admin_key(key: str) -> bool:
    """Whether ``key`` is one of the published example keys, or a placeholder never replaced."""
    low = key.lower()
    return key in EXAMPLE_ADMIN_KEYS or any(w in low for w in _PLACEHOLDER_WORDS)


def check_admin_keys(admin_keys: list[str], host: str) -> None:
    """ValueError (one line: the cause, then the fix) when an admin key is an example one and ``host`` is not a
    loopback address: anybody who read the docs could scale or reconfigure the server."""
    if is_loopback(host):
        return
    for i, key in enumerate(admin_keys):
        if is_example_admin_key(key):
            raise ValueError(
                f"admin_keys[{i}] is an example key from kvgrid's docs and http.host {host} is reachable from other "
                'machines; give a long random admin key (e.g. admin_keys: ["${KVGRID_ADMIN_KEY}"] with '
                "KVGRID_ADMIN_KEY=$(openssl rand -hex 32)), or listen on 127.0.0.1"
            )
