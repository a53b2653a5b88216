"""The ``kvgrid serve`` configuration file (YAML), validated with pydantic.

    model: demo            # or a path to an HF model folder
    block_size: 16
    groups: 2
    tensor_parallel: 1
    http: {host: 127.0.0.1, port: 8000}
    tenants:
      - name: acme
        api_keys: [sk-acme-1]
        cache: {mode: implicit, min_prefix_tokens: 64}
      - name: globex
        api_keys: [sk-globex-1]
        cache: {mode: explicit, default_ttl: 5m}

``load_config`` raises ``ConfigError`` with a message that names the offending field.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.checks import is_power_of_two
from common.errors import validation_message

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field."""


def parse_duration(value: str | int | float) -> float:
    """Seconds in ``value``: a number of seconds, or text like ``"90s"``, ``"5m"``, ``"1h"``."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or text like '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if m is None:
            raise ValueError(f"{value!r} is not a duration (use e.g. 30s, 5m, 1h)")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheConfig(_Strict):
    mode: Literal["implicit", "explicit"] = "implicit"
    min_prefix_tokens: int = Field(1024, ge=1)
    default_ttl: float = 300.0  # seconds; explicit pins and cached content without their own TTL
    max_pinned_tokens: int | None = Field(None, ge=0)
    # Weight of this tenant's share of every group's KV cache (eviction) and pin budget; see README, isolation.
    share: float = Field(1.0, gt=0)

    @field_validator("default_ttl", mode="before")
    @classmethod
    def _ttl(cls, v: object) -> float:
        return parse_duration(v)  # type: ignore[arg-type]


class LimitsConfig(_Strict):
    """Per-tenant limits; beyond them the tenant (only) gets 429 with Retry-After, or 413 for a long prompt."""

    requests_per_s: int | None = Field(None, ge=1)
    tokens_per_min: int | None = Field(None, ge=1)  # prompt tokens + max output tokens asked for
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_inflight_requests: int = Field(256, ge=1)  # requests running at once (counted by each gateway replica)
    # Live cached content objects (/v1/cachedContents) and their tokens together; past them a create is refused.
    max_cached_contents: int = Field(100, ge=0)
    max_cached_content_tokens: int = Field(1_000_000, ge=0)


# Price fields: dollars per million tokens (storage: per million token-hours), at most 6 decimals.
PRICE_FIELDS = ("input", "output", "cache_write_5m", "cache_write_1h", "cache_read", "storage")


class PricesConfig(_Strict):
    """A tenant's price table (router/gateway/economics.py): a vendor ``preset`` and/or any of the fields, which
    override the preset's. A field left out is the preset's, or 0 without a preset."""

    preset: Literal["openai", "anthropic", "gemini", "deepseek"] | None = None
    input: float | None = Field(None, ge=0, le=1e6)  # uncached prompt tokens
    output: float | None = Field(None, ge=0, le=1e6)
    cache_write_5m: float | None = Field(None, ge=0, le=1e6)  # tokens written to an entry with a TTL <= 5 min
    cache_write_1h: float | None = Field(None, ge=0, le=1e6)  # ... with a longer TTL
    cache_read: float | None = Field(None, ge=0, le=1e6)  # prompt tokens served from the cache
    storage: float | None = Field(None, ge=0, le=1e6)  # per million token-hours of an explicit entry's TTL

    @field_validator(*PRICE_FIELDS)
    @classmethod
    def _micro(cls, v: float | None) -> float | None:
        if v is not None and abs(v * 1e6 - round(v * 1e6)) > 1e-6:
            raise ValueError("a price has at most 6 decimals (dollars per million tokens)")
        return v


class AdviceConfig(_Strict):
    """The cache advisor's sample (GET /{tenant}/v1/cache/advice): the ``sample`` most recent prompts of the
    tenant, kept in Redis under its own key for ``ttl``; 0 = off (the default: prompts are not kept)."""

    sample: int = Field(0, ge=0, le=1000)
    ttl: float = 3600.0  # seconds the sample lives after its last prompt

    @field_validator("ttl", mode="before")
    @classmethod
    def _ttl(cls, v: object) -> float:
        return parse_duration(v)  # type: ignore[arg-type]


class MonitoringConfig(_Strict):
    """The hit-rate drop alarm of every tenant (router/gateway/monitoring.py ``DropAlarm``; README, "Prompt-cache
    economics and monitoring")."""

    drop_alerts: bool = True
    window: float = 60.0  # the share of the last window ...
    baseline: float = 300.0  # ... against the share over this long before it
    drop_ratio: float = Field(0.5, gt=0, lt=1)  # fires below this fraction of the baseline's share
    min_share: float = Field(0.2, ge=0, le=1)  # a baseline share worth watching
    streak: int = Field(10, ge=1, le=1000)  # and when the last this many requests all lost their hit

    @field_validator("window", "baseline", mode="before")
    @classmethod
    def _seconds(cls, v: object) -> float:
        return parse_duration(v)  # type: ignore[arg-type]


class TenantConfig(_Strict):
    name: str
    api_keys: list[str] = Field(min_length=1)
    cache: CacheConfig = CacheConfig()
    limits: LimitsConfig = LimitsConfig()
    prices: PricesConfig | None = None  # None: usage is counted but not priced (every cost 0)
    advice: AdviceConfig = AdviceConfig()
    # Keep explicit (cache_control) entries warm past their TTL while their reuse pays (router/gateway/keep_alive.py).
    # auto with prices that can never keep (none, or a write not dearer than a read) loads, with a warning at start.
    keep_alive: Literal["off", "auto"] = "off"

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, v: object) -> object:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", v):
            raise ValueError("must be 1-63 lowercase letters, digits, '-' or '_' (it becomes a URL path)")
        return v

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        if any(len(k) < 8 for k in v):
            raise ValueError("every API key must have at least 8 characters")
        return v


class HttpConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    replicas: int = Field(1, ge=1)  # gateway replicas (Serve spreads them over the frontend nodes)
    # Requests one gateway replica works on at once (not sockets: an idle connection holds no place, and a request
    # without a valid key is answered 401 before its body is read); past it the replica answers 503 with
    # Retry-After at once. Each tenant also has limits.max_inflight_requests per replica.
    max_ongoing_requests: int = Field(1024, ge=1)
    # How long a replica keeps an idle keep-alive connection open. Longer than the clients' own idle expiry (httpx,
    # so the OpenAI and Anthropic SDKs: 5 s; aiohttp 15 s), else a client can send on a connection the server is
    # closing that moment and get a connection error (seen in CI with uvicorn's default of 5 s against httpx's 5 s).
    # Behind a load balancer: longer than its idle timeout (AWS ALB: 60 s).
    keep_alive_s: int = Field(20, ge=1)
    docs: bool = False  # serve /docs and /openapi.json (gateway) and /admin/docs, /admin/openapi.json, keyless
    # Connection hygiene (router/gateway/ingress.py; README "HTTP connections"). A new connection that has not
    # started a request within idle_timeout_s is closed (bytes that start no request do not extend it).
    idle_timeout_s: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False)
    # A request's head (request line and headers, at most 64 KiB) must arrive within this of its first byte; else
    # 408 and the connection is closed (slowloris).
    header_timeout_s: float = Field(10.0, gt=0, le=3600, allow_inf_nan=False)
    # A request body may stall (no byte while the server reads) at most this long, and must average body_min_rate
    # bytes/s past this grace (mod_reqtimeout's rule: deadline = grace + received / body_min_rate); else the
    # connection is closed. Time the server is not reading (the app not asking yet, Expect: 100-continue) is free.
    body_timeout_s: float = Field(20.0, gt=0, le=3600, allow_inf_nan=False)
    body_min_rate: int = Field(500, ge=1)  # bytes/s
    # Connections one client address (IPv4, or IPv6 /64) may hold per replica; one more gets a 503 with Retry-After
    # and is closed unread. 0 = no cap. Behind a load balancer or proxy every connection comes from its
    # addresses: raise it (or 0) there.
    max_connections_per_client: int = Field(256, ge=0)
    # Connections one replica holds; 0 = what its open-file limit leaves room for (the soft limit, raised to the
    # hard limit at start, less the fds open and a reserve of max(256, 1/8 of it); at most 65536). At the cap the
    # oldest connection that has not sent a complete request head is closed for the newcomer; with none, the
    # newcomer gets a 503 with Retry-After. A value above the fd limit's room is lowered to it (with a warning).
    max_connections: int = Field(0, ge=0)


# Folders a disk tier may not be in: the system's own (``/usr/...``, ``/dev/null``, ``/proc/...``).
_SYSTEM_DIRS = "/bin /boot /dev /etc /lib /lib32 /lib64 /libx32 /proc /run /sbin /sys /usr".split()
# Folders a disk tier may be under but not be: shared by everything else on the machine.
_SHARED_DIRS = frozenset("/ /home /media /mnt /opt /root /srv /tmp /var /var/tmp /var/cache /var/lib /var/log".split())


def disk_tier_path(value: str) -> str:
    """A disk tier's folder: ``value`` with ``~`` expanded, normalised. ``ValueError`` for a relative path, a
    ``..`` component, a system folder or a path in one (also where a symlink leads), a shared top folder itself
    (``/``, ``/tmp``, ``/var``, ``/home``, ...), or something that exists and is not a folder (``/dev/null``)."""
    expanded = os.path.expanduser(value)
    if not os.path.isabs(expanded):
        raise ValueError(f"must be an absolute path (or start with ~/), got {value!r}")
    if ".." in Path(expanded).parts:
        raise ValueError(f"must not hold '..' components, got {value!r}")
    path = os.path.normpath(expanded)
    for where in dict.fromkeys((path, os.path.realpath(path))):
        if where in _SHARED_DIRS:
            example = "/var/cache/kvgrid" if where == "/" else f"{where}/kvgrid"
            raise ValueError(f"must be a folder of its own (e.g. {example}), not {where}")
        system = next((d for d in _SYSTEM_DIRS if where == d or where.startswith(d + "/")), None)
        if system is not None:
            raise ValueError(f"must not be in the system folder {system}, got {value!r}")
        if os.path.exists(where) and not os.path.isdir(where):
            raise ValueError(f"{where} exists and is not a folder")
    return path


def memory_bytes() -> int | None:
    """This machine's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def filesystem_bytes(path: str) -> int | None:
    """The size of the filesystem ``path`` is on (or would be, by its nearest existing folder)."""
    p = Path(path)
    try:
        while not p.exists() and p != p.parent:
            p = p.parent
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


class KVTiersServeConfig(_Strict):
    """Host RAM and disk tiers under every group's KV cache, per rank (worker/kv_tiers.py; README "KV tiers").
    ``host_bytes`` 0 (the default) = no tiers; ``disk_path`` (each group writes under ``<disk_path>/<group>``)
    needs ``disk_bytes`` and a host tier. ``host_bytes`` is at most this machine's memory; ``disk_path`` is an
    absolute folder of its own (``~`` expanded; ``disk_tier_path``); ``disk_bytes`` at most the size of its
    filesystem."""

    host_bytes: int = Field(0, ge=0)
    disk_path: str | None = Field(None, min_length=1)
    disk_bytes: int = Field(0, ge=0)

    @field_validator("host_bytes")
    @classmethod
    def _memory(cls, value: int) -> int:
        memory = memory_bytes()
        if memory is not None and value > memory:
            raise ValueError(f"{value} bytes is more than this machine's memory ({memory} bytes)")
        return value

    @field_validator("disk_path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        return None if value is None else disk_tier_path(value)

    @model_validator(mode="after")
    def _disk(self) -> KVTiersServeConfig:
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError("disk_bytes must be > 0 with a disk_path")
        if self.disk_path is not None and self.host_bytes <= 0:
            raise ValueError("host_bytes must be > 0 with a disk_path (blocks reach disk through host RAM)")
        size = filesystem_bytes(self.disk_path) if self.disk_path is not None else None
        if size is not None and self.disk_bytes > size:
            raise ValueError(
                f"disk_bytes ({self.disk_bytes}) is more than the size of disk_path's filesystem ({size} bytes)"
            )
        return self


class RoutingConfig(_Strict):
    """The router's cost policy (router/routing/policy.py; README "Tiers in the router"): what a hit a group holds in
    host RAM or on disk costs, in prefill-token equivalents per token (a load's time counted in prefill time;
    0.04 and 0.4 by default: 16k prefill tokens/s against loads of 400k and 40k tokens/s)."""

    host_load_weight: float = Field(0.04, ge=0, allow_inf_nan=False)
    disk_load_weight: float = Field(0.4, ge=0, allow_inf_nan=False)


class ServeConfig(_Strict):
    model: str = "demo"
    # The model name clients send and GET /v1/models reports (default: ``model_id``'s, from ``model``).
    served_model_name: str | None = Field(None, max_length=256)
    block_size: int = Field(16, ge=1)
    groups: int = Field(1, ge=1)
    tensor_parallel: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    kv_cache_bytes: int = Field(512 * 2**20, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    max_queued_prefill_tokens: int = Field(1_000_000, ge=1)  # per group; beyond it requests get 429
    router_replicas: int = Field(1, ge=1)  # RouterService actors, each with its own index copy (from Redis)
    max_groups: int | None = Field(None, ge=1)  # the most groups `kvgrid scale` may ask for (default 2 x groups)
    http: HttpConfig = HttpConfig()
    admin_keys: list[str] = []  # keys of the admin API (/admin: scaling); none = no admin API
    redis_timeout_s: float = Field(1.0, gt=0, le=60)  # past it a Redis call fails (503) instead of waiting
    step_timeout_s: float = Field(60.0, gt=0)  # a group whose step runs longer has failed (a hung rank)
    # Threads each rank computes its steps with (default: this machine's cores over the groups' ranks, >= 1).
    cpus_per_rank: int | None = Field(None, ge=1)
    # CPU threads of a rank's decode-only steps (default: one fewer than cpus_per_rank, at least 1, so that the
    # HTTP path streaming the tokens keeps a core); every other step uses cpus_per_rank.
    decode_cpus_per_rank: int | None = Field(None, ge=1)
    # Each group's engine steps in a process of its own beside its rank 0 actor (default false: on a thread of the
    # actor; see the README's A/B of the two on 2 cores).
    engine_process: bool = False
    cuda_graphs: bool = True  # on CUDA, decode replays captured graphs (eager otherwise, and always on CPU)
    # Weights, activations and KV cache: auto = float32 on CPU; on CUDA the model's float16/bfloat16, else bfloat16.
    # bfloat16 on a CPU with AVX512-BF16 or AMX runs about 1.5-2x faster than float32 (what vLLM's CPU build
    # downcasts float32 models to by default), at bfloat16's precision.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_tiers: KVTiersServeConfig = KVTiersServeConfig()  # host RAM and disk under every group's KV cache (off)
    routing: RoutingConfig = RoutingConfig()  # the router's tier load weights
    monitoring: MonitoringConfig = MonitoringConfig()
    tenants: list[TenantConfig] = Field(min_length=1)

    @field_validator("admin_keys")
    @classmethod
    def _admin_keys(cls, v: list[str]) -> list[str]:
        if any(len(k) < 16 for k in v):
            raise ValueError("every admin key must have at least 16 characters")
        return v

    @field_validator("served_model_name")
    @classmethod
    def _served_name(cls, v: str | None) -> str | None:
        if v is not None and (not v or any(c.isspace() for c in v)):
            raise ValueError("must be a name without spaces")
        return v

    @field_validator("block_size")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if not is_power_of_two(v):
            raise ValueError("must be a power of two")
        return v

    @property
    def model_id(self) -> str:
        """The model name clients send: ``served_model_name``, else ``demo`` or what follows the last ``/`` of
        ``model`` (a folder's name, a Hub id's name: the Gemini API's paths hold the name, and a ``/`` cannot be
        part of it there)."""
        if self.served_model_name is not None:
            return self.served_model_name
        return self.model if self.model == "demo" else self.model.rstrip("/").split("/")[-1]

    @model_validator(mode="after")
    def _unique(self) -> ServeConfig:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        if "admin" in names:
            raise ValueError("the tenant name 'admin' is reserved (the admin API lives under /admin)")
        keys = [k for t in self.tenants for k in t.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key may belong to one tenant only")
        if set(keys) & set(self.admin_keys):
            raise ValueError("an admin key cannot also be a tenant's API key")
        if self.max_groups is not None and self.max_groups < self.groups:
            raise ValueError("max_groups must be >= groups")
        return self

    @property
    def group_limit(self) -> int:
        return self.max_groups or 2 * self.groups

    @property
    def rank_threads(self) -> int:
        if self.cpus_per_rank is not None:
            return self.cpus_per_rank
        return max(1, (os.cpu_count() or 1) // (self.groups * self.tensor_parallel))

    @property
    def decode_threads(self) -> int:
        if self.decode_cpus_per_rank is not None:
            return min(self.decode_cpus_per_rank, self.rank_threads)
        return max(1, self.rank_threads - 1)


def load_config(path: str | Path) -> ServeConfig:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of fields")
    try:
        return ServeConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {validation_message(exc, 'config', plain=True, count=True)}") from exc
