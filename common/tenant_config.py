"""A tenant's section of the serve config: its cache, limits, prices, advice, the hit-rate alarm (``monitoring``,
also a top-level default) and ``TenantConfig`` itself. common/config.py re-exports them."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.config_base import Strict as _Strict, parse_duration
from common.defaults import DEFAULT_PIN_TTL_S
from common.lora import AdapterError, read_adapter

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a request's model field names one


class CacheConfig(_Strict):
    """A tenant's prompt caching."""

    mode: Literal["implicit", "explicit"] = Field(
        "implicit",
        description="implicit: every prompt's prefix is cached and reused automatically (OpenAI's way); explicit: "
        "the client marks what to keep (Anthropic's cache_control, Gemini's cached contents) and sees all reuse",
    )
    min_prefix_tokens: int = Field(
        1024,
        ge=1,
        description="implicit mode: cached tokens are reported (and billed as cache reads) only from this many up",
    )
    default_ttl: float = Field(
        DEFAULT_PIN_TTL_S,
        description="Seconds (or 30s, 5m, 1h) an explicit pin or cached content lives when it names no TTL",
    )
    max_pinned_tokens: int | None = Field(
        None,
        ge=0,
        description="The most tokens this tenant may hold pinned on a group at once (default: its weighted part of "
        "the pin budget, see share)",
    )
    share: float = Field(
        1.0,
        gt=0,
        description="Weight of this tenant's share of every group's KV cache (eviction takes from the tenant "
        "holding the most for its weight) and of the pin budget",
    )

    @field_validator("default_ttl", mode="before")
    @classmethod
    def _ttl(cls, v: object) -> float:
        return parse_duration(v)  # type: ignore[arg-type]


class LimitsConfig(_Strict):
    """Per-tenant limits; beyond them the tenant (only) gets 429 with Retry-After, or 413 for a long prompt."""

    requests_per_s: int | None = Field(
        None, ge=1, description="Requests per second, counted in Redis over every gateway replica (none: no limit)"
    )
    tokens_per_min: int | None = Field(
        None,
        ge=1,
        description="Prompt tokens plus the max output tokens asked for, per minute, over every replica (none: no "
        "limit)",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="The longest prompt in tokens; a longer one gets 413 (none: the model's context)"
    )
    max_inflight_requests: int = Field(
        256, ge=1, description="Requests running at once, counted by each gateway replica"
    )
    max_cached_contents: int = Field(
        100, ge=0, description="Live cached content objects (/v1/cachedContents); past it a create is refused"
    )
    max_cached_content_tokens: int = Field(
        1_000_000, ge=0, description="The tokens of all live cached contents together; past it a create is refused"
    )
    max_adapters: int = Field(
        8, ge=0, description="LoRA adapters the tenant may have (``adapters``), in the config or added at run time"
    )


# Price fields: dollars per million tokens (storage: per million token-hours), at most 6 decimals.
PRICE_FIELDS = ("input", "output", "cache_write_5m", "cache_write_1h", "cache_read", "storage")


class PricesConfig(_Strict):
    """A tenant's price table (router/gateway/economics.py): a vendor ``preset`` and/or any of the fields, which
    override the preset's. A field left out is the preset's, or 0 without a preset."""

    preset: Literal["openai", "anthropic", "gemini", "deepseek"] | None = Field(
        None, description="A vendor's price table to start from (the fields given override its prices)"
    )
    input: float | None = Field(None, ge=0, le=1e6, description="Dollars per million uncached prompt tokens")
    output: float | None = Field(None, ge=0, le=1e6, description="Dollars per million output tokens")
    cache_write_5m: float | None = Field(
        None, ge=0, le=1e6, description="Dollars per million tokens written to a cache entry with a TTL <= 5 min"
    )
    cache_write_1h: float | None = Field(
        None, ge=0, le=1e6, description="Dollars per million tokens written to a cache entry with a longer TTL"
    )
    cache_read: float | None = Field(
        None, ge=0, le=1e6, description="Dollars per million prompt tokens served from the cache"
    )
    storage: float | None = Field(
        None, ge=0, le=1e6, description="Dollars per million token-hours of an explicit entry's TTL (storage)"
    )

    @field_validator(*PRICE_FIELDS)
    @classmethod
    def _micro(cls, v: float | None) -> float | None:
        if v is not None and abs(v * 1e6 - round(v * 1e6)) > 1e-6:
            raise ValueError("a price has at most 6 decimals (dollars per million tokens)")
        return v


class AdviceConfig(_Strict):
    """The cache advisor's sample (GET /{tenant}/v1/cache/advice): the ``sample`` most recent prompts of the
    tenant, kept in Redis under its own key for ``ttl``; 0 = off (the default: prompts are not kept)."""

    sample: int = Field(
        0, ge=0, le=1000, description="How many of the tenant's most recent prompts are kept for the advisor (0: off)"
    )
    ttl: float = Field(3600.0, description="Seconds (or 30m, 1h) the sample lives after its last prompt")

    @field_validator("ttl", mode="before")
    @classmethod
    def _ttl(cls, v: object) -> float:
        return parse_duration(v)  # type: ignore[arg-type]


class MonitoringConfig(_Strict):
    """The hit-rate drop alarm of every tenant (router/gateway/monitoring.py ``DropAlarm``; docs/economics.md)."""

    drop_alerts: bool = Field(True, description="Watch every tenant's cache hit rate and alert when it drops")
    window: float = Field(60.0, description="Seconds (or 1m): the hit share of this last window is compared ...")
    baseline: float = Field(300.0, description="... with the share over this long before it (seconds, or 5m)")
    drop_ratio: float = Field(
        0.5, gt=0, lt=1, description="The alarm fires below this fraction of the baseline's share"
    )
    min_share: float = Field(0.2, ge=0, le=1, description="The smallest baseline share worth watching")
    streak: int = Field(
        10, ge=1, le=1000, description="... and only when the last this many requests all lost their hit"
    )

    @field_validator("window", "baseline", mode="before")
    @classmethod
    def _seconds(cls, v: object) -> float:
        return parse_duration(v)  # type: ignore[arg-type]


class BudgetConfig(_Strict):
    """A tenant's spending budget in dollars at its prices, over a period (router/gateway/budgets.py)."""

    period: Literal["daily", "monthly", "total"] = Field(
        description="daily and monthly restart at UTC midnight / the first of the month; total never restarts"
    )
    soft_usd: float | None = Field(
        None, ge=0, description="Past this many dollars an alert metric is raised and logged once a period"
    )
    hard_usd: float | None = Field(
        None, ge=0, description="Past this many dollars (spent plus in flight) requests get 429 until the reset"
    )

    @model_validator(mode="after")
    def _order(self) -> BudgetConfig:
        if self.soft_usd is not None and self.hard_usd is not None and self.soft_usd > self.hard_usd:
            raise ValueError("soft_usd: the soft budget must not exceed hard_usd")
        return self


class KeyLimitsConfig(_Strict):
    """One API key's own limits, within its tenant's (both must take a request)."""

    requests_per_s: int | None = Field(None, ge=1, description="Requests per second with this key (none: no limit)")
    tokens_per_min: int | None = Field(
        None, ge=1, description="Prompt plus max output tokens per minute with this key (none: no limit)"
    )


class KeyConfig(_Strict):
    """What an API key made by the admin API may carry besides its tenant's settings."""

    limits: KeyLimitsConfig | None = Field(None, description="Its own rate limits, over every gateway replica")
    budget: BudgetConfig | None = Field(None, description="Its own spending budget, within the tenant's")


class TenantConfig(_Strict):
    """One tenant: its own URLs (``/{name}/...``), API keys, cache, limits and prices."""

    name: str = Field(
        description="The tenant's name: 1-63 lowercase letters, digits, '-' or '_'; its URLs start with /{name}"
    )
    api_keys: list[str] = Field(
        min_length=1,
        description="The keys its clients send (Authorization: Bearer, x-api-key or ?key=); at least 8 characters "
        "each, each key of one tenant only; each may be ${NAME}, an environment variable's value",
    )
    cache: CacheConfig = Field(CacheConfig(), description="Its prompt caching: implicit or explicit, TTL, share")
    limits: LimitsConfig = Field(LimitsConfig(), description="Its rate, size and concurrency limits")
    prices: PricesConfig | None = Field(
        None, description="Its price table; none: usage is counted but not priced (every cost 0)"
    )
    advice: AdviceConfig = Field(AdviceConfig(), description="The cache advisor's sample of its prompts (off)")
    budget: BudgetConfig | None = Field(
        None, description="Its spending budget (period, soft_usd, hard_usd); none: unlimited"
    )
    adapters: dict[str, str] = Field(
        {},
        description="Its LoRA adapters: name -> a PEFT folder (adapter_config.json, adapter_model.safetensors) on "
        "every worker node; a request picks one by its model field",
    )
    # auto with prices that can never keep (none, or a write not dearer than a read) loads, with a warning at start.
    keep_alive: Literal["off", "auto"] = Field(
        "off",
        description="auto: keep explicit (cache_control) entries warm past their TTL while their reuse pays "
        "(router/gateway/keep_alive.py); off: never",
    )

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

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not ADAPTER_NAME.fullmatch(name):
                raise ValueError(
                    f"adapter name {name!r}: 1-64 letters, digits, '.', '_' or '-', from a letter or digit"
                )
            if not isinstance(path, str) or not path:
                raise ValueError(f"adapters.{name}: the path of a PEFT adapter folder")
        return v

    @model_validator(mode="after")
    def _adapter_count(self) -> TenantConfig:
        if len(self.adapters) > self.limits.max_adapters:
            raise ValueError(
                f"adapters: {len(self.adapters)} adapters, more than limits.max_adapters ({self.limits.max_adapters})"
            )
        return self

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        if any(len(k) < 8 for k in v):
            raise ValueError("every API key must have at least 8 characters")
        return v


def adapter_problem(tenant: TenantConfig, base_model: str, max_rank: int) -> str | None:
    """What is wrong with ``tenant``'s adapters, as ``adapters.<name>: <why>`` (None: nothing): a name that is the
    base model's, or a folder ``read_adapter`` refuses (missing, malformed, rank above ``max_rank``, unknown
    targets). The serve config and the admin API both check with it."""
    for name, path in tenant.adapters.items():
        if name == base_model:
            return f"adapters.{name}: an adapter cannot take the base model's name"
        try:
            read_adapter(path, max_rank)
        except AdapterError as exc:
            return f"adapters.{name}: {exc}"
    return None
