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
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from common.checks import is_power_of_two
from common.config_base import ConfigError, Strict as _Strict, parse_duration
from common.config_secrets import resolve_env_refs
from common.errors import field_path
from common.machine import disk_tier_path, filesystem_bytes, memory_bytes
from common.tenant_config import (
    PRICE_FIELDS,
    AdviceConfig,
    BudgetConfig,
    CacheConfig,
    LimitsConfig,
    MonitoringConfig,
    PricesConfig,
    TenantConfig,
    adapter_problem,
)

__all__ = [
    "PRICE_FIELDS",
    "AdviceConfig",
    "BudgetConfig",
    "CacheConfig",
    "ConfigError",
    "HttpConfig",
    "KVTiersServeConfig",
    "LimitsConfig",
    "LoraConfig",
    "LoggingConfig",
    "MetricsConfig",
    "MonitoringConfig",
    "PricesConfig",
    "RoutingConfig",
    "ServeConfig",
    "TenantConfig",
    "TracingConfig",
    "config_error_message",
    "disk_tier_path",
    "load_config",
    "parse_duration",
]


class LoggingConfig(_Strict):
    """What `kvgrid serve` logs to its console (common/logs.py): every gateway replica's access log (stdout) and the
    supervisor's control events (stderr), relayed from the Ray actors to the process that runs `kvgrid serve`."""

    format: Literal["text", "json"] = Field(
        "text",
        description="text: one readable line per record; json: one JSON object per line (for a log shipper)",
    )
    access_log: bool = Field(
        True,
        description="One line per HTTP request on stdout (logger kvgrid.access): request id, method, path, tenant, "
        "model, status, prompt / cached / output tokens, time to first token and total time; never a key, a prompt "
        "or a completion. Successful health probes (/health, /ready, /-/healthz) are not logged",
    )


class MetricsConfig(_Strict):
    """The tenants' Prometheus metrics (``GET /{tenant}/metrics``; router/gateway/tenant_metrics.py)."""

    enabled: bool = Field(
        True,
        description="Count every request in its tenant's metrics and publish them across the gateway replicas; "
        "false: no per-request metric updates, no hit-rate drop alarm, no publishing, and /{tenant}/metrics answers "
        "404 (the admin API's /admin/v1/metrics is unaffected)",
    )


class HttpConfig(_Strict):
    """The HTTP gateway: where it listens, its replicas, and its connection hygiene (router/gateway/ingress.py)."""

    host: str = Field("127.0.0.1", description="The address the gateway listens on (0.0.0.0 or :: for every interface)")
    port: int = Field(8000, ge=1, le=65535, description="The TCP port the gateway listens on")
    replicas: int = Field(
        1,
        ge=1,
        description="Gateway replicas, each serving the port itself (Serve spreads them over the frontend nodes)",
    )
    # Not sockets: an idle connection holds no place, and a request without a valid key is answered 401 before its
    # body is read. Each tenant also has limits.max_inflight_requests per replica.
    max_ongoing_requests: int = Field(
        1024,
        ge=1,
        description="Requests one gateway replica works on at once; past it the replica answers 503 with "
        "Retry-After at once",
    )
    # How long a replica keeps an idle keep-alive connection open. Longer than the clients' own idle expiry (httpx,
    # so the OpenAI and Anthropic SDKs: 5 s; aiohttp 15 s), else a client can send on a connection the server is
    # closing that moment and get a connection error (seen in CI with uvicorn's default of 5 s against httpx's 5 s).
    # Behind a load balancer: longer than its idle timeout (AWS ALB: 60 s).
    keep_alive_s: int = Field(
        20,
        ge=1,
        description="Seconds a replica keeps an idle keep-alive connection open: longer than the clients' idle "
        "expiry (httpx 5 s, aiohttp 15 s) and, behind a load balancer, than its idle timeout (AWS ALB: 60 s)",
    )
    docs: bool = Field(
        False,
        description="Serve /docs and /openapi.json (gateway) and /admin/docs, /admin/openapi.json, without a key",
    )
    idle_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="A new connection that has not started a request within this many seconds is closed (bytes "
        "that start no request do not extend it)",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="A request's head (request line and headers, at most 64 KiB) must arrive within this many "
        "seconds of its first byte; else 408 and the connection is closed (slowloris)",
    )
    # mod_reqtimeout's rule: deadline = grace + received / body_min_rate. Time the server is not reading (the app not
    # asking yet, Expect: 100-continue) is free.
    body_timeout_s: float = Field(
        20.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="Seconds a request body may stall while the server reads, and the grace past which it must "
        "average body_min_rate; else the connection is closed",
    )
    body_min_rate: int = Field(500, ge=1, description="Bytes/s a request body must average past body_timeout_s's grace")
    max_connections_per_client: int = Field(
        256,
        ge=0,
        description="Connections one client address (IPv4, or IPv6 /64) may hold per replica; one more gets a 503 "
        "with Retry-After. 0 = no cap. Behind a load balancer or proxy, raise it (or 0): every connection comes "
        "from its addresses",
    )
    # 0: the soft open-file limit (raised to the hard limit at start) less the fds open and a reserve of max(256, 1/8
    # of it), at most 65536. A value above that room is lowered to it (with a warning).
    max_connections: int = Field(
        0,
        ge=0,
        description="Connections one replica holds (0: what its open-file limit leaves room for). At the cap the "
        "oldest connection without a complete request head is closed for the newcomer; with none, the newcomer "
        "gets a 503 with Retry-After",
    )


class KVTiersServeConfig(_Strict):
    """Host RAM and disk tiers under every group's KV cache, per rank (worker/kv_tiers.py; docs/caching.md).
    ``host_bytes`` 0 (the default) = no tiers; ``disk_path`` (each group writes under ``<disk_path>/<group>``)
    needs ``disk_bytes`` and a host tier. ``host_bytes`` is at most this machine's memory; ``disk_path`` is an
    absolute folder of its own (``~`` expanded; ``disk_tier_path``); ``disk_bytes`` at most the size of its
    filesystem."""

    host_bytes: int = Field(
        0, ge=0, description="Bytes of host RAM per rank under its KV cache (0: no tiers); at most this machine's"
    )
    disk_path: str | None = Field(
        None,
        min_length=1,
        description="The disk tier's folder (absolute or ~/..., a folder of its own); each group writes under "
        "<disk_path>/<group>. Needs host_bytes and disk_bytes",
    )
    disk_bytes: int = Field(
        0, ge=0, description="Bytes of the disk tier per rank; at most the size of disk_path's filesystem"
    )

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
    """The router's prefix index (router/routing/index.py), whether its replicas share routes, and its cost policy
    (router/routing/policy.py; docs/routing.md): what a hit a group holds in host RAM or on disk costs, in
    prefill-token equivalents per token (a load's time counted in prefill time; 0.04 and 0.4 by default: 16k
    prefill tokens/s against loads of 400k and 40k tokens/s)."""

    host_load_weight: float = Field(
        0.04,
        ge=0,
        allow_inf_nan=False,
        description="What a cached token held in host RAM costs to use, in prefill-token equivalents",
    )
    disk_load_weight: float = Field(
        0.4,
        ge=0,
        allow_inf_nan=False,
        description="What a cached token held on disk costs to use, in prefill-token equivalents",
    )
    index: Literal["dict", "compact"] = Field(
        "compact",
        description="Each router replica's prefix index: compact (an open-addressing table in numpy arrays, its "
        "operations in C where a compiler is found: about 15-40 bytes per block key, the fastest) or dict (a Python "
        "dict, about 150 bytes per key)",
    )
    share_routes: bool = Field(
        True,
        description="Every router replica counts every request's load and predictions: a gateway tells the other "
        "replicas of each route and all of them of its progress (off: only the replica that routed it, which then "
        "prices the groups on its own share of the load)",
    )
    snapshot_dir: str | None = Field(
        None,
        description="Where each router replica writes its index (and the event stream cursors it matches) every "
        "``snapshot_interval_s``, ``<dir>/kvgrid-router-<i>.snap`` on its node; a replica that Ray restarts loads "
        "it and reads the streams on from there instead of from their start. Needs the compact index",
    )
    snapshot_interval_s: float = Field(
        300.0, gt=0, allow_inf_nan=False, description="Seconds between a router replica's index snapshots"
    )

    @model_validator(mode="after")
    def _snapshots_need_the_compact_index(self) -> RoutingConfig:
        if self.snapshot_dir is not None and self.index != "compact":
            raise ValueError("routing.snapshot_dir needs routing.index: compact (the dict index has no snapshot)")
        return self


class LoraConfig(_Strict):
    """Every group's LoRA adapter slots (the tenants' ``adapters``)."""

    max_loras: int = Field(
        8, ge=1, le=64, description="Adapters resident on a group's device at once: one step mixes at most this many"
    )
    max_lora_rank: int = Field(64, ge=1, le=512, description="The largest adapter rank accepted (slots are this wide)")
    max_cpu_loras: int = Field(
        32, ge=1, description="Adapters kept in host memory after leaving the device (beyond: read from disk again)"
    )


class TracingConfig(_Strict):
    """OpenTelemetry traces of the requests (router/gateway/tracing.py; off without this section): one trace per
    request, exported over OTLP/HTTP by every gateway replica, with spans for auth, the chat template,
    tokenizing, routing, queueing in the group, prefill and decode. A client's W3C ``traceparent`` is
    continued. No prompt, completion or key is ever put in a span."""

    otlp_endpoint: str = Field(
        description="The OTLP/HTTP collector, e.g. ``http://otel-collector:4318`` (spans are sent to its "
        "``/v1/traces``; a URL that already ends in ``/v1/traces`` is used as it is)."
    )
    service_name: str = Field(
        "kvgrid", min_length=1, max_length=256, description="The ``service.name`` resource attribute of the spans."
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="The share of requests traced (by trace id) when the client sends no ``traceparent``; a "
        "client's ``traceparent`` decides for its own request (its sampled flag).",
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        url = urlsplit(v.strip())
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError("must be an http:// or https:// URL, e.g. http://otel-collector:4318")
        if url.query or url.fragment:
            raise ValueError("must not have a query or a fragment")
        return v.strip().rstrip("/")

    @property
    def traces_url(self) -> str:
        """Where the spans are POSTed: the endpoint's ``/v1/traces``."""
        return self.otlp_endpoint if self.otlp_endpoint.endswith("/v1/traces") else self.otlp_endpoint + "/v1/traces"


class ServeConfig(_Strict):
    """The top level of ``kvgrid serve``'s config file."""

    model: str = Field(
        "demo",
        description="The model: demo, demo:qwen2, smollm2, a GGUF file, a Hugging Face model folder or an org/name "
        "Hub id (built, converted or downloaded once into $KVGRID_CACHE)",
    )
    served_model_name: str | None = Field(
        None,
        max_length=256,
        description="The model name clients send and GET /v1/models reports (default: demo, or the last part of "
        "model's path or id)",
    )
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block, the unit of prefix reuse (a power of 2)")
    groups: int = Field(1, ge=1, description="Worker groups started with the server (each a model replica)")
    tensor_parallel: int = Field(1, ge=1, description="Ranks (GPUs, or CPU processes) per worker group")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the groups compute; auto: CUDA when the Ray cluster has GPUs, else CPU"
    )
    kv_cache_bytes: int = Field(
        512 * 2**20,
        ge=1,
        description="Bytes of KV cache per rank on CPU (on CUDA the cache takes 85% of the GPU memory left after "
        "the weights)",
    )
    max_model_len: int | None = Field(
        None, ge=2, description="The longest sequence (prompt and output) served (default: the model's context)"
    )
    max_queued_prefill_tokens: int = Field(
        1_000_000, ge=1, description="Prompt tokens waiting for prefill per group; beyond it requests get 429"
    )
    router_replicas: int = Field(
        1, ge=1, description="Router replicas (RouterService actors), each with its own copy of the prefix index"
    )
    max_groups: int | None = Field(
        None, ge=1, description="The most groups `kvgrid scale` may ask for (default: 2 x groups)"
    )
    http: HttpConfig = Field(HttpConfig(), description="The HTTP gateway: address, port, replicas, connections")
    admin_keys: list[str] = Field(
        [],
        description="Keys of the admin API (/admin: scaling, groups, metrics), at least 16 characters each; none: "
        "no admin API. Each may be ${NAME}, an environment variable's value; an example key is refused on an "
        "http.host other machines reach",
    )
    redis_password: str | None = Field(
        None,
        min_length=1,
        description="The password of --redis's Redis when its URL names none (before $KVGRID_REDIS_PASSWORD); "
        "may be ${NAME}",
    )
    server_secret: str | None = Field(
        None,
        min_length=1,
        description="The secret that salts the tenants' root keys (before $KVGRID_SECRET; default: a random one "
        "per start); may be ${NAME}",
    )
    redis_timeout_s: float = Field(
        1.0, gt=0, le=60, description="Seconds after which a Redis call fails (503) instead of waiting"
    )
    step_timeout_s: float = Field(
        60.0, gt=0, description="Seconds an engine step may run; a group whose step runs longer has failed"
    )
    cpus_per_rank: int | None = Field(
        None,
        ge=1,
        description="Threads each rank computes its steps with (default: this machine's cores over the groups' "
        "ranks, at least 1)",
    )
    decode_cpus_per_rank: int | None = Field(
        None,
        ge=1,
        description="CPU threads of a rank's decode-only steps (default: one fewer than cpus_per_rank, at least 1, "
        "so the HTTP path streaming the tokens keeps a core)",
    )
    engine_process: bool = Field(
        False,
        description="Run each group's engine steps in a process of its own beside its rank 0 actor (default: on a "
        "thread of the actor)",
    )
    cuda_graphs: bool = Field(
        True, description="On CUDA, decode steps replay captured CUDA graphs (eager otherwise, and always on CPU)"
    )
    # bfloat16 on a CPU with AVX512-BF16 or AMX runs about 1.5-2x faster than float32 (what vLLM's CPU build
    # downcasts float32 models to by default), at bfloat16's precision.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Weights, activations and KV cache; auto: float32 on CPU, on CUDA the model's float16 or "
        "bfloat16, else bfloat16",
    )
    kv_tiers: KVTiersServeConfig = Field(
        KVTiersServeConfig(), description="Host RAM and disk tiers under every group's KV cache (off)"
    )
    routing: RoutingConfig = Field(RoutingConfig(), description="The router's cost of hits in host RAM or on disk")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapter slots per group (tenants' adapters)")
    monitoring: MonitoringConfig = Field(MonitoringConfig(), description="Every tenant's hit-rate drop alarm")
    metrics: MetricsConfig = Field(MetricsConfig(), description="The tenants' Prometheus metrics (on)")
    logging: LoggingConfig = Field(
        LoggingConfig(), description="The console's format (text or json) and the per-request access log (on)"
    )
    tracing: TracingConfig | None = Field(
        None, description="OpenTelemetry tracing of the requests (OTLP/HTTP); none (the default) = off: no tracer."
    )
    tenants: list[TenantConfig] = Field(
        min_length=1, description="The tenants: each with its name, API keys, caching, limits and prices"
    )

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
        for i, t in enumerate(self.tenants):
            problem = adapter_problem(t, self.model_id, self.lora.max_lora_rank)
            if problem is not None:
                raise ValueError(f"tenants[{i}].{problem}")
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


# An error about one of these fields never shows the value.
_SECRET_FIELDS = frozenset({"api_keys", "admin_keys", "redis_password", "server_secret"})


def _shown(value: object) -> str:
    """A value given in the config, as a short text for an error message (YAML's spelling of its scalars)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= 60 else text[:56] + "...'"
    return "a list" if isinstance(value, list) else "a mapping" if isinstance(value, dict) else type(value).__name__


def config_error_message(exc: ValidationError, source: str, fix: str | None = None) -> str:
    """The first error of a serve config's validation in one line, ``"{source}: {field path}: {problem} (got
    {value}); {fix}"``: the path with list indices in brackets (``tenants[0].cache.min_prefix_tokens``), the value
    given for a wrong type or value (never an API or admin key's), ``(and N more)`` when there are more errors.
    ``fix`` defaults to correcting the field in ``source``; an unknown field's is to remove or respell it."""
    first = exc.errors()[0]
    where = field_path(first["loc"], "config", brackets=True)
    kind = first["type"]
    problem = " ".join(first["msg"].removeprefix("Value error, ").split())
    value = first.get("input")
    secret = bool(_SECRET_FIELDS & {str(p) for p in first["loc"]})
    shown = kind not in ("extra_forbidden", "value_error", "assertion_error", "missing") and not secret
    got = f" (got {_shown(value)})" if shown else ""
    if kind == "extra_forbidden":
        problem = "unknown field"
        fix = "remove it, or check its spelling and indentation"
    elif kind in ("int_type", "float_type") and isinstance(value, bool):
        fix = "write a number, not true or false"
    elif kind in ("int_type", "float_type") and isinstance(value, str):
        fix = "write a number, without quotes (YAML reads 1e6 as text: write 1000000)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{source}: {where}: {problem}{got}{more}; {fix or f'correct it in {source}'}"


def _read_fix(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "check the path"
    if isinstance(exc, IsADirectoryError):
        return "give the YAML file, not a folder"
    if isinstance(exc, PermissionError):
        return "check the file's permissions"
    return "check the file"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (never the text around it, which may hold a key)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        what = ": ".join(s for s in (exc.context, exc.problem) if s) or "a syntax error"
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return " ".join(f"{what}{where}".split())
    return " ".join(str(exc).split())


def load_config(path: str | Path) -> ServeConfig:
    """The serve config in the YAML file ``path``, validated; ``ConfigError`` with a one-line message naming the
    file, the field and the fix otherwise."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror or exc}; {_read_fix(exc)}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(exc)}; fix the syntax there") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read config {path}: it is not UTF-8 text; give a YAML file") from exc
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the config must be a mapping of fields (got {_shown(raw)}); write it as `field: value` "
            "lines, with at least a tenants list"
        )
    try:
        raw = resolve_env_refs(raw)
    except ConfigError as exc:
        raise ConfigError(
            f"{path}: {exc}; set it in kvgrid serve's environment, or write the value in {path}"
        ) from None
    try:
        return ServeConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(config_error_message(exc, str(path))) from exc
