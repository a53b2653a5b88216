"""Every ``KVGRID_*`` environment variable kvgrid reads, in one place: each a ``Var`` (name, type, default, what it
does) with a small function that reads and checks it. Every other module reads the environment through these;
a module that sets one for a child process (a subprocess's env, a generated file) names it with ``Var.name``.

``node.sh`` (the cluster launcher's node script) reads the ``NODE_SCRIPT_VARS`` in the shell; they are listed here
so the reference page (docs/reference/environment.md, rendered by docs/gen_env_reference.py) names them all.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Var:
    """One environment variable: ``name``, its ``type`` and ``default`` as the reference page shows them, and
    ``doc``, what it does."""

    name: str
    type: str
    default: str
    doc: str

    def raw(self) -> str | None:
        """The variable's value, None when unset or empty."""
        return os.environ.get(self.name) or None


API_KEY = Var(
    "KVGRID_API_KEY",
    "str",
    "unset",
    "Tenant `default`'s API key for `kvgrid serve` without `--config` (`--api-key` wins), and the key "
    "`kvgrid advise` asks a running server with (`--key` wins).",
)
ADMIN_KEY = Var(
    "KVGRID_ADMIN_KEY",
    "str",
    "unset",
    "The admin key of the `kvgrid` admin commands (`--admin-key` wins); one of the config's `admin_keys`.",
)
SECRET = Var(
    "KVGRID_SECRET",
    "str",
    "a random one per process",
    "The secret that salts the tenants' root keys and keys the KV tier files' MACs. Set it (the same everywhere) "
    "for cache keys that survive a restart. The config's `server_secret` wins over it.",
)
REDIS_PASSWORD = Var(
    "KVGRID_REDIS_PASSWORD",
    "str",
    "unset",
    "The Redis password for a `--redis` URL that names none (the config's `redis_password` wins over it). On a "
    "cluster the head's node script sets it (from `~/.kvgrid/redis.env`) for the head keeper.",
)
CACHE = Var(
    "KVGRID_CACHE",
    "path",
    "`~/.cache/kvgrid`",
    "The model cache: models built, converted or downloaded once, each folder renamed into place whole.",
)
KERNEL_CACHE = Var(
    "KVGRID_KERNEL_CACHE",
    "path",
    "`$XDG_CACHE_HOME/kvgrid/kernels` (`~/.cache/kvgrid/kernels`)",
    "Where the C libraries (the CPU kernels, the compact prefix index's key table) are built, keyed by their "
    "sources, compiler and CPU flags.",
)
CPU_ATTENTION = Var(
    "KVGRID_CPU_ATTENTION",
    "`auto` \\| `native` \\| `torch`",
    "`auto`",
    "CPU decode attention: `auto` uses the C kernel where it builds, `native` makes a missing kernel an error, "
    "`torch` never uses it.",
)
INDEX_NATIVE = Var(
    "KVGRID_INDEX_NATIVE",
    "`auto` \\| `native` \\| `numpy`",
    "`auto`",
    "The compact prefix index's key table: `auto` uses its C operations where they build, `native` makes a "
    "failed build an error, `numpy` never uses them.",
)
CPU_LINEAR = Var(
    "KVGRID_CPU_LINEAR",
    "`auto` \\| `packed` \\| `onednn` \\| `torch`",
    "`auto`",
    "CPU float32 linear layers: `auto` times the three ways on the model's own weights and takes the fastest; "
    "the others decide without timing.",
)
GROUP_CHANNEL = Var(
    "KVGRID_GROUP_CHANNEL",
    "`socket` \\| `ray`",
    "`socket`",
    "How a gateway talks to a worker group's leader: a TCP socket, or Ray calls and streams (where the gateways "
    "cannot open a TCP connection to the leaders' nodes).",
)
STATS_INTERVAL_S = Var(
    "KVGRID_STATS_INTERVAL_S",
    "float (seconds)",
    "`10`",
    "How often a worker group's rank 0 logs its stats line (read when the worker module is imported).",
)
KEEP_ALIVE_PERIOD_S = Var(
    "KVGRID_KEEP_ALIVE_PERIOD_S",
    "float (seconds) > 0",
    "unset: a quarter of the shortest TTL noted, at most 60 s",
    "Fixes the keep-alive service's round period (an operator's or a test's override).",
)

NODE_SCRIPT_VARS = (
    Var("KVGRID_RAY_PORT", "int", "`6379`", "node.sh: the head's Ray GCS port, the same on every node."),
    Var("KVGRID_REDIS_PORT", "int", "`6380`", "node.sh: kvgrid's Redis on the head."),
    Var(
        "KVGRID_SERVE_CONFIG",
        "path",
        "`router/cluster-serve.yaml` of the checkout",
        "node.sh: the serve config the head keeper runs.",
    ),
    Var(
        "KVGRID_NODE_IP",
        "str",
        "the address the launcher reached the node on (`SSH_CONNECTION`), else Ray's choice",
        "node.sh: the address Ray announces for this node.",
    ),
    Var("KVGRID_RAY_START_ARGS", "str", "empty", "node.sh: more `ray start` options for this node."),
    Var(
        "KVGRID_HEAD_LOST_S",
        "float (seconds)",
        "`60`",
        "node.sh: a worker's Ray stops this long after it lost the head (e.g. after `ray down`).",
    ),
    Var(
        "KVGRID_INSTALLED", "flag", "unset", "node.sh: kvgrid is already on this node's PATH; `setup` installs nothing."
    ),
)

ALL: tuple[Var, ...] = (
    API_KEY,
    ADMIN_KEY,
    SECRET,
    REDIS_PASSWORD,
    CACHE,
    KERNEL_CACHE,
    CPU_ATTENTION,
    INDEX_NATIVE,
    CPU_LINEAR,
    GROUP_CHANNEL,
    STATS_INTERVAL_S,
    KEEP_ALIVE_PERIOD_S,
    *NODE_SCRIPT_VARS,
)


def _choice(var: Var, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(var.name, default) or default
    if value not in choices:
        raise ValueError(f"{var.name} must be {', '.join(choices[:-1])} or {choices[-1]}, not {value!r}")
    return value


def api_key() -> str | None:
    return API_KEY.raw()


def admin_key() -> str | None:
    return ADMIN_KEY.raw()


def secret() -> str | None:
    return SECRET.raw()


def redis_password() -> str | None:
    return REDIS_PASSWORD.raw()


def cache_root() -> Path:
    """``$KVGRID_CACHE``, default ``~/.cache/kvgrid``."""
    return Path(CACHE.raw() or Path.home() / ".cache" / "kvgrid").expanduser()


def kernel_cache() -> Path:
    """``$KVGRID_KERNEL_CACHE``, default ``$XDG_CACHE_HOME/kvgrid/kernels`` (``~/.cache/kvgrid/kernels``)."""
    root = KERNEL_CACHE.raw()
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgrid" / "kernels"


def cpu_attention() -> str:
    """``$KVGRID_CPU_ATTENTION``: ``auto`` (default), ``native`` or ``torch``."""
    return _choice(CPU_ATTENTION, "auto", ("auto", "native", "torch"))


def index_native() -> str:
    """``$KVGRID_INDEX_NATIVE``: ``auto`` (default), ``native`` or ``numpy``."""
    return _choice(INDEX_NATIVE, "auto", ("auto", "native", "numpy"))


def cpu_linear() -> str:
    """``$KVGRID_CPU_LINEAR``: ``auto`` (default), ``packed``, ``onednn`` or ``torch``."""
    return _choice(CPU_LINEAR, "auto", ("auto", "packed", "onednn", "torch"))


def group_channel() -> str:
    """``$KVGRID_GROUP_CHANNEL``: ``socket`` (default) or ``ray``."""
    kind = os.environ.get(GROUP_CHANNEL.name, "socket") or "socket"
    if kind not in ("socket", "ray"):
        raise ValueError(f"{GROUP_CHANNEL.name}={kind!r}: expected 'socket' or 'ray'")
    return kind


def stats_interval_s() -> float:
    """``$KVGRID_STATS_INTERVAL_S``, default 10."""
    return float(os.environ.get(STATS_INTERVAL_S.name, "10"))


def keep_alive_period_s() -> float | None:
    """``$KVGRID_KEEP_ALIVE_PERIOD_S``: a finite number of seconds > 0, or None when unset (or empty)."""
    raw = os.environ.get(KEEP_ALIVE_PERIOD_S.name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{KEEP_ALIVE_PERIOD_S.name}={raw!r}: must be a finite number of seconds > 0")
    return value
