"""Every gateway replica serves HTTP itself: the ``kvgrid-gateway`` Serve deployment runs a uvicorn server in each
replica, on ``http.port`` of its node.

Ray Serve's own ingress puts a proxy actor in front of the replicas: each request, and every chunk of a stream,
crosses one more process as a Ray object (on a 2-core machine the proxy took as much CPU as the gateway, and
decode through HTTP ran at a third of the engine's speed). Here every replica binds the same port with
``SO_REUSEPORT``, so the kernel spreads new connections over the replicas of a node and a response goes from the
replica straight to the client. Serve still places, health-checks and restarts the replicas; its proxy is off.

A replica that dies takes its open connections with it (clients retry: both official SDKs do); new connections
go to the replicas left, and to the replacement once it has bound the port.

What a connection may cost before it is a request (idle, header and body deadlines, per-client and per-server
connection caps) is router/gateway/ingress.py's: uvicorn's own ``limit_concurrency`` counted idle sockets, so a
thousand of them turned every tenant away."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn
from fastapi import FastAPI
from ray import serve

from common.config import HttpConfig, ServeConfig
from common.log_relay import relay_logging
from router.clients import RouterClient, SupervisorClient
from router.gateway.admin import Admin, create_admin_app
from router.gateway.app import Gateway, create_app
from router.gateway.health import Health
from router.gateway.ingress import ConnectionGuard, ConnectionPolicy, connection_cap, protocol_for, quiet_disconnects
from router.gateway.store import KeyRing

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0  # open streams get this long to finish when a replica stops (then the usage is written)
# Serve kills a stopping replica after its graceful_shutdown_timeout_s: longer, so the usage gets written.
GRACEFUL_SHUTDOWN_S = STOP_TIMEOUT_S + 10


class PortInUse(RuntimeError):
    pass


def _socket(host: str, port: int, shared: bool, backlog: int | None) -> socket.socket:
    """A TCP socket bound to ``host:port``, listening unless ``backlog`` is None; ``shared`` lets the node's other
    gateway replicas bind it too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if backlog is not None:
            sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(f"http: {host}:{port} is in use by another program (set http.port)") from None
        raise
    sock.set_inheritable(False)
    return sock


def listen(host: str, port: int, backlog: int = 2048, shared: bool = True) -> socket.socket:
    """A listening TCP socket on ``host:port``; ``shared`` lets the node's other gateway replicas bind it too."""
    return _socket(host, port, shared, backlog)


def check_port_free(host: str, port: int) -> None:
    """Fail unless nothing listens on ``host:port``: a socket that shares the port (an earlier kvgrid's gateway)
    counts too, since a second server would silently take half of its connections."""
    listen(host, port, backlog=1, shared=False).close()


def reserve_port(host: str, port: int) -> socket.socket:
    """``check_port_free``, then a socket bound to ``host:port`` that does not listen, to hold until the gateway
    replicas of this node have bound the port. While a server starts, Ray and Redis open hundreds of outgoing
    connections; one whose kernel-chosen local port is ``port`` (any port of the ephemeral range, 32768-60999 on
    Linux, can be chosen) would make every replica's bind fail with EADDRINUSE. The kernel never picks a bound
    port for a connection, and the replicas share it (SO_REUSEPORT; only listening sockets get connections)."""
    check_port_free(host, port)
    return _socket(host, port, shared=True, backlog=None)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # uvloop is faster; asyncio's loop works the same
        return asyncio.new_event_loop
    return uvloop.new_event_loop


class IngressServer:
    """A uvicorn server on a thread and event loop of its own. ``make_app`` runs on that loop, so everything the
    app creates (Redis clients, background tasks, group subscriptions) lives on the loop that serves it;
    ``on_stop`` runs there too, after the last connection closed. It works on at most ``max_ongoing_requests``
    requests at once (503 with Retry-After past it); its connections keep to ``policy`` (router/gateway/ingress.py;
    default: ``HttpConfig``'s defaults), counted by ``guard``."""

    def __init__(
        self,
        make_app: Callable[[], FastAPI],
        host: str,
        port: int,
        max_ongoing_requests: int,
        on_stop: Callable[[], Coroutine[Any, Any, None]] | None = None,
        *,
        keep_alive_s: int,
        policy: ConnectionPolicy | None = None,
    ) -> None:
        self._make_app, self._address, self._on_stop = make_app, (host, port), on_stop
        self._sock: socket.socket | None = None
        self._keep_alive_s = keep_alive_s
        policy = policy if policy is not None else ConnectionPolicy.from_config(HttpConfig())
        # The fd limit is raised (to the hard limit) and the connection cap sized before anything binds.
        self.guard = ConnectionGuard(policy, connection_cap(policy.max_connections), max_ongoing_requests)
        self.server: uvicorn.Server | None = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvgrid-ingress", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the gateway's HTTP server did not start within {START_TIMEOUT_S:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"the gateway's HTTP server did not start: {self.error!r}") from self.error

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            try:
                runner.run(self._serve())
            except BaseException as exc:  # noqa: BLE001 - reported by alive() and the constructor
                self.error = exc
                log.exception("the gateway's HTTP server stopped")
            finally:
                self._ready.set()
                if self._on_stop is not None:
                    try:
                        runner.run(self._on_stop())
                    except Exception:
                        log.exception("stopping the gateway")
        if self._sock is not None:
            self._sock.close()

    async def _serve(self) -> None:
        config = uvicorn.Config(
            quiet_disconnects(self._make_app()),
            lifespan="off",
            log_level="warning",
            access_log=False,
            limit_concurrency=None,  # it counted idle sockets too: requests and connections are the guard's
            timeout_keep_alive=self._keep_alive_s,
            timeout_graceful_shutdown=int(STOP_TIMEOUT_S),
            http=protocol_for(self.guard),  # httptools (uvicorn[standard]) with the guard's deadlines and caps
            ws="none",
        )
        self.server = uvicorn.Server(config)
        # Bound only now that the app is ready: the kernel hands a bound socket its share of new connections at
        # once, and they would wait in its queue while a replacement replica loads its tokenizer.
        self._sock = listen(*self._address)
        serving = asyncio.ensure_future(self.server.serve(sockets=[self._sock]))
        while not self.server.started and not serving.done():
            await asyncio.sleep(0.01)
        self._ready.set()
        await serving

    def alive(self) -> bool:
        return (
            self._thread.is_alive()
            and self.error is None
            and self.server is not None
            and self.server.started
            and not self.server.should_exit
        )

    def stop(self, timeout_s: float = STOP_TIMEOUT_S + 5) -> None:
        """Stop accepting, let open requests finish (up to ``STOP_TIMEOUT_S``), run ``on_stop``."""
        if self.server is not None:
            self.server.should_exit = True
        self._thread.join(timeout_s)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class GatewayReplica:
    """One gateway replica: a ``Gateway`` served on ``config.http``'s host and port, with the admin API under
    ``/admin`` when it is given the ``supervisor`` (the config has ``admin_keys``). ``config`` carries no API keys
    (``keys`` holds their hashes)."""

    def __init__(
        self, config: ServeConfig, keys: KeyRing, model_path: str, routers: list, redis_url: str, supervisor=None
    ) -> None:
        self.gateway: Gateway | None = None
        # The access log and kvgrid's records go to `kvgrid serve`'s console (common/log_relay.py).
        relay_logging(config.logging.access_log)

        def make_app() -> FastAPI:
            clients = [RouterClient(r) for r in routers]
            self.gateway = Gateway(config, keys, model_path, clients, redis_url)
            health = Health(self.gateway.redis, clients)  # /ready and the admin API's /v1/status share its probes
            admin = None
            if supervisor is not None:
                sup = SupervisorClient(supervisor)
                admin = create_admin_app(
                    Admin(keys, [t.name for t in config.tenants], sup, clients, config.http.docs, health)
                )
            return create_app(self.gateway, admin, health)

        self.ingress = IngressServer(
            make_app,
            config.http.host,
            config.http.port,
            config.http.max_ongoing_requests,
            on_stop=self._close,
            keep_alive_s=config.http.keep_alive_s,
            policy=ConnectionPolicy.from_config(config.http),
        )

    async def _close(self) -> None:
        if self.gateway is not None:
            await self.gateway.close()

    def check_health(self) -> None:
        """Serve's health check: a replica whose HTTP server stopped is replaced."""
        if not self.ingress.alive():
            raise RuntimeError(f"the gateway's HTTP server is not running ({self.ingress.error!r})")

    async def __del__(self) -> None:
        """Serve calls this when it stops the replica."""
        await asyncio.to_thread(self.ingress.stop)
