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
    # Connections and requests one gateway replica works on at once; past it the replica answers 503 at once.
    max_ongoing_requests: int = Field(1024, ge=1)
    # How long a replica keeps an idle keep-alive connection open. Longer than the clients' own idle expiry (httpx,
    # so the OpenAI and Anthropic SDKs: 5 s; aiohttp 15 s), else a client can send on a connection the server is
    # closing that moment and get a connection error (seen in CI with uvicorn's default of 5 s against httpx's 5 s).
    # Behind a load balancer: longer than its idle timeout (AWS ALB: 60 s). Idle connections count against
    # max_ongoing_requests.
    keep_alive_s: int = Field(20, ge=1)
    docs: bool = False  # serve /docs and /openapi.json (gateway) and /admin/docs, /admin/openapi.json, keyless


class KVTiersServeConfig(_Strict):
    """Host RAM and disk tiers under every group's KV cache, per rank (worker/kv_tiers.py; README "KV tiers").
    ``host_bytes`` 0 (the default) = no tiers; ``disk_path`` (each group writes under ``<disk_path>/<group>``)
    needs ``disk_bytes`` and a host tier."""

    host_bytes: int = Field(0, ge=0)
    disk_path: str | None = Field(None, min_length=1)
    disk_bytes: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _disk(self) -> KVTiersServeConfig:
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError("disk_bytes must be > 0 with a disk_path")
        if self.disk_path is not None and self.host_bytes <= 0:
            raise ValueError("host_bytes must be > 0 with a disk_path (blocks reach disk through host RAM)")
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
