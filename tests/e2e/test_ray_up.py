"""`ray up` for real: Ray's cluster launcher, with its on-premise provider (router/control/onprem.yaml), brings a
three-node cluster up over SSH on loopback, kvgrid serves from it, `kvgrid scale` adds and removes a group through
`ray exec`, and `ray down` leaves no process, listening port or temporary file of the cluster.

The machines: an SSH server (asyncssh) on port 22 of 127.0.0.2 (the head), 127.0.0.3 and 127.0.0.4 (the workers),
with a throwaway host key and client key. Each address is a machine of its own as far as processes go: every
session runs in that node's PID and mount namespace (``unshare``), with that node's HOME and a private /tmp, so
Ray's ``ray stop`` on a node (which `ray down` and the start commands run) sees and stops only that node's
processes, never another Ray on this machine. The network and the rest of the file system are shared: every node
runs this checkout's .venv (the nodes' ~/.bashrc puts it on the PATH and sets KVGRID_INSTALLED, so `setup`
installs nothing), which is what a pre-built machine image is. The launcher itself runs with a temporary HOME and
TMPDIR; the SSH client it runs reads the key given in the config only and writes no known_hosts.
"""

from __future__ import annotations

import asyncio
import fcntl
import getpass
import hashlib
import json
import os
import pty
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import psutil
import pytest
import yaml

from harness import ACME_KEY, ADMIN_KEY, GLOBEX_KEY, SYSTEM, TWO_TENANTS, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Not 127.0.0.1: a worker joining a head at 127.0.0.1 would reach it at this machine's own address instead (Ray
# takes 127.0.0.1 for "this machine" and replaces it), and the head's Ray would announce that address too.
HEAD, WORKERS = "127.0.0.2", ["127.0.0.3", "127.0.0.4"]
SSH_PORT = 22  # Ray's launcher has no port option: the nodes listen where sshd would
LAUNCH_TIMEOUT_S = 480

# PID 1 of a node's namespace: it reaps the orphans Ray's daemons leave (as init does), so a stopped process is gone.
_REAPER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
open("/tmp/.node-ready", "w").close()
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)
"""


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


USER_HOME = Path(pwd.getpwuid(os.getuid()).pw_dir)  # the home OpenSSH's client expands ~ to (not $HOME)


class Node:
    """One loopback machine: its address, its own home directory and /tmp (mounted over the user's home and /tmp
    in its mount namespace, so the real ones are never touched), and the namespace its sessions run in."""

    def __init__(self, ip: str, folder: Path, bashrc: str) -> None:
        self.ip, self.home, self.tmp = ip, folder / "home", folder / "tmp"
        self.home.mkdir(parents=True)
        self.tmp.mkdir()
        (self.home / ".bashrc").write_text(bashrc)
        mounts = []
        # A checkout (and its .venv) under /tmp stays visible under the node's own /tmp, at the same path: bound
        # into the node's tmp first, which then goes over /tmp with its submounts (--rbind).
        if ROOT.is_relative_to("/tmp"):
            inside = self.tmp / ROOT.relative_to("/tmp")
            inside.mkdir(parents=True)
            mounts.append(f"mount --bind {shlex.quote(str(ROOT))} {shlex.quote(str(inside))}")
        mounts.append(f"mount --rbind {shlex.quote(str(self.tmp))} /tmp")
        python = Path(sys.base_prefix)  # the venv's interpreter, which may live in the user's home (pyenv)
        if python.is_relative_to(USER_HOME):
            inside = self.home / python.relative_to(USER_HOME)
            inside.mkdir(parents=True)
            mounts.append(f"mount --bind {shlex.quote(str(python))} {shlex.quote(str(inside))}")
        mounts.append(f"mount --rbind {shlex.quote(str(self.home))} {shlex.quote(str(USER_HOME))}")
        script = " && ".join([*mounts, f"exec {sys.executable} -c {shlex.quote(_REAPER)}"])
        with open(folder / "namespace.log", "wb") as log:
            # If the test process dies, unshare does (PR_SET_PDEATHSIG), and with it the node's init and so every
            # process of the node (--kill-child): a crashed run leaves no cluster behind either.
            argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL", "sh", "-c", script]
            self.unshare = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        wait_for(self._ready, 60, f"the namespace of node {ip}")
        [init] = psutil.Process(self.unshare.pid).children()
        self.init_pid = init.pid
        self.namespace = pid_namespace(self.init_pid)

    def _ready(self) -> bool:
        """Whether the node's init runs; an AssertionError with its log if its namespace could not be made."""
        if (self.tmp / ".node-ready").exists():
            return True
        if self.unshare.poll() is not None:
            log = (self.tmp.parent / "namespace.log").read_text(errors="replace")
            raise AssertionError(f"the namespace of node {self.ip} ended ({self.unshare.returncode}): {log}")
        return False

    def processes(self) -> list[psutil.Process]:
        """Every process of this node except its init."""
        found = []
        for proc in psutil.process_iter():
            if proc.pid != self.init_pid and pid_namespace(proc.pid) == self.namespace:
                found.append(proc)
        return found

    def titles(self) -> list[str]:
        out = []
        for proc in self.processes():
            try:
                out.append(" ".join(proc.cmdline()) or proc.name())
            except psutil.Error:
                pass
        return out

    def kill(self) -> None:
        """SIGKILL the namespace's init: the kernel kills every process of the node with it."""
        try:
            os.kill(self.init_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.unshare.wait(30)


class LoopbackMachines:
    """The SSH server of the loopback nodes, on its own event loop thread."""

    def __init__(self, base: Path, bashrc: dict[str, str]) -> None:
        import asyncssh

        self.base = base
        self.nodes = {ip: Node(ip, base / "nodes" / ip, text) for ip, text in bashrc.items()}
        self.client_key = base / "laptop" / "id_ed25519"
        self.client_key.parent.mkdir(parents=True, exist_ok=True)
        key = asyncssh.generate_private_key("ssh-ed25519")
        key.write_private_key(str(self.client_key))
        os.chmod(self.client_key, 0o600)
        self._authorized = asyncssh.import_authorized_keys(key.export_public_key().decode())
        self._host_key = asyncssh.generate_private_key("ssh-ed25519")
        self._connections: set = set()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="loopback-sshd", daemon=True)
        self._thread.start()
        self._servers = [self._call(self._listen(ip)) for ip in self.nodes]

    def _call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _listen(self, ip: str):
        import asyncssh

        connections = self._connections

        class Server(asyncssh.SSHServer):
            def connection_made(self, conn) -> None:
                self.conn = conn
                connections.add(conn)

            def connection_lost(self, exc) -> None:
                connections.discard(self.conn)

        return await asyncssh.create_server(
            Server,
            ip,
            SSH_PORT,
            server_host_keys=[self._host_key],
            authorized_client_keys=self._authorized,
            process_factory=self._session,
            encoding=None,
            allow_scp=False,
            agent_forwarding=False,
            x11_forwarding=False,
        )

    async def _session(self, process) -> None:
        """One SSH session, like sshd: `$SHELL -c COMMAND` (a login shell without one) in the node, on a pty
        when the client asked for one (Ray's `ssh -tt`), else on pipes (rsync)."""
        local_ip, local_port = process.get_extra_info("sockname")[:2]
        peer_ip, peer_port = process.get_extra_info("peername")[:2]
        node = self.nodes[local_ip]
        env = {
            "HOME": str(USER_HOME),  # the node's own, inside its namespace
            "USER": getpass.getuser(),
            "LOGNAME": getpass.getuser(),
            "SHELL": "/bin/bash",
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "SSH_CONNECTION": f"{peer_ip} {peer_port} {local_ip} {local_port}",
        }
        command = process.command
        shell = ["/bin/bash", "-c", command] if command else ["/bin/bash", "-l", "-i"]
        argv = ["nsenter", "-t", str(node.init_pid), "-p", "-m", f"--wd={USER_HOME}", "--", *shell]
        try:
            if process.get_terminal_type():
                env["TERM"] = process.get_terminal_type()
                code = await self._on_pty(process, argv, env)
            else:
                code = await self._on_pipes(process, argv, env)
        except Exception as exc:  # the client sees why, as with a broken sshd
            process.stderr.write(f"loopback sshd: {type(exc).__name__}: {exc}\r\n".encode())
            code = 255
        try:
            process.exit(code if code >= 0 else 128 - code)
        except OSError:  # the client went away first
            pass

    @staticmethod
    async def _on_pipes(process, argv, env) -> int:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )

        async def out(reader, writer) -> None:
            while data := await reader.read(65536):
                writer.write(data)

        async def into() -> None:
            try:
                while data := await process.stdin.read(65536):
                    proc.stdin.write(data)
                    await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                proc.stdin.close()

        feeder = asyncio.ensure_future(into())
        try:
            await asyncio.gather(out(proc.stdout, process.stdout), out(proc.stderr, process.stderr))
            return await proc.wait()
        finally:
            feeder.cancel()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    @staticmethod
    async def _on_pty(process, argv, env) -> int:
        master, slave = pty.openpty()
        width, height = process.get_terminal_size()[:2]
        if width and height:
            fcntl.ioctl(
                slave,
                termios.TIOCSWINSZ,
                bytes(bytearray([height & 255, height >> 8, width & 255, width >> 8, 0, 0, 0, 0])),
            )
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # the pty is the session's terminal
            )
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        loop = asyncio.get_running_loop()
        closed = asyncio.Event()

        def readable() -> None:
            try:
                data = os.read(master, 65536)
            except BlockingIOError:
                return
            except OSError:  # EIO: every holder of the terminal closed it
                data = b""
            if data:
                process.stdout.write(data)
            else:
                loop.remove_reader(master)
                closed.set()

        async def into() -> None:
            try:
                while data := await process.stdin.read(65536):
                    os.write(master, data)
            except OSError:
                pass

        loop.add_reader(master, readable)
        feeder = asyncio.ensure_future(into())
        try:
            code = await proc.wait()
            # Like sshd: the session ends when its shell does; what is already written still goes out, and a
            # daemon that kept the terminal open gets EIO from then on.
            try:
                await asyncio.wait_for(closed.wait(), 0.5)
            except TimeoutError:
                readable()
            return code
        finally:
            feeder.cancel()
            if not closed.is_set():
                loop.remove_reader(master)
            os.close(master)

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
                await server.wait_closed()
            for conn in list(self._connections):
                conn.close()
                await conn.wait_closed()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=10)

        try:
            for node in self.nodes.values():  # first: the sessions' commands end with their node
                node.kill()
            self._call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def control_dir(cluster_name: str) -> Path:
    """Where Ray's SSH command runner keeps its ControlMaster sockets for this cluster (see SSHCommandRunner)."""
    user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    return Path("/tmp") / f"ray_ssh_{user}" / hashlib.sha256(cluster_name.encode()).hexdigest()[:10]


def node_bashrc(common: dict[str, str], start_args: str) -> str:
    lines = [f"export PATH={shlex.quote(str(VENV_BIN))}:$PATH"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in common.items()]
    lines.append(f"export KVGRID_RAY_START_ARGS={shlex.quote(start_args)}")
    return "\n".join(lines) + "\n"


def launcher(*args: str, env: dict[str, str], timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    """A `ray` launcher command from the checkout's root (the config's file mount `.`), its output kept."""
    proc = subprocess.run(
        [str(VENV_BIN / "ray"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode:
        raise AssertionError(
            f"ray {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def listening(ips: set[str], ports: set[int] | None = None) -> list[tuple[str, int]]:
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.ip in ips:
            if ports is None or conn.laddr.port in ports:
                found.append((conn.laddr.ip, conn.laddr.port))
    return found


def ranks_by_node(machines: LoopbackMachines) -> dict[str, int]:
    """How many worker-group rank processes run on each node (Ray titles an actor's process ``ray::Class``)."""
    return {ip: sum("ray::RankActor" in t for t in node.titles()) for ip, node in machines.nodes.items()}


def serve_log(machines: LoopbackMachines) -> str:
    """The head's kvgrid logs and the launcher's own log there (the autoscaler starts the workers), for a failure."""
    head = machines.nodes[HEAD]
    paths = [head.home / "kvgrid-serve.log", head.home / ".kvgrid" / "keeper.log"]
    paths += sorted(head.tmp.glob("ray/session_2*/logs/monitor.*"))[-3:]
    parts = []
    for path in paths:
        if path.exists():
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def raylet_ips(node: Node) -> list[str]:
    """The address each raylet of ``node`` announces."""
    ips = []
    for proc in node.processes():
        try:
            if proc.name() == "raylet":
                ips += [a.split("=", 1)[1] for a in proc.cmdline() if a.startswith("--node_ip_address=")]
        except psutil.Error:
            pass
    return ips


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.http
def test_ray_up_on_premise_cluster_serves_scales_and_goes_away(demo_path):
    # What the loopback machines need of this one; without it the test cannot run here (say why, do not fail).
    if shutil.which("rsync") is None:
        pytest.skip("Ray's launcher copies files with rsync: install it (`make test` tries: apt-get install rsync)")
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("the loopback nodes need root (port 22, PID and mount namespaces) and util-linux unshare/nsenter")
    busy = listening({HEAD, *WORKERS, "0.0.0.0", "::"}, {SSH_PORT})
    if busy:
        pytest.skip(f"port {SSH_PORT} is taken on {busy} (an sshd?): the loopback nodes listen there")
    real_home = Path(os.path.expanduser("~"))
    home_before = {p.name for p in real_home.iterdir()}
    # Not under /tmp: every node mounts a private /tmp of its own over it.
    base = Path(tempfile.mkdtemp(prefix="kvgrid-rayup-", dir="/var/tmp"))
    cluster_name = f"kvgrid-test-{os.getpid()}-{int(time.time())}"
    control = control_dir(cluster_name)
    http_port, gcs_port, redis_port, client_port = (free_port() for _ in range(4))
    agent_ports = {ip: free_port() for ip in [HEAD, *WORKERS]}
    ours = {http_port, gcs_port, redis_port, client_port, *agent_ports.values()}

    model = shutil.copytree(demo_path, base / "models" / "demo")  # where the nodes see it; served as "demo"
    serve_config = base / "serve.yaml"
    serve_config.write_text(
        f"model: {model}\nblock_size: 16\ngroups: 2\ntensor_parallel: 1\ndevice: cpu\nmax_model_len: 1024\n"
        f"kv_cache_bytes: 16777216\ncpus_per_rank: 1\nhttp: {{host: {HEAD}, port: {http_port}}}\n"
        f"admin_keys: [{ADMIN_KEY}]\n" + TWO_TENANTS
    )
    common = {
        "KVGRID_INSTALLED": "1",
        "KVGRID_RAY_PORT": str(gcs_port),
        "KVGRID_REDIS_PORT": str(redis_port),
        "KVGRID_SERVE_CONFIG": str(serve_config),
        "KVGRID_HEAD_LOST_S": "5",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }
    small = "--object-store-memory=100000000 --plasma-directory=/tmp"
    bashrc = {
        ip: node_bashrc(
            common,
            f"{small} --dashboard-agent-listen-port={agent_ports[ip]}"
            + (f" --include-dashboard=false --ray-client-server-port={client_port}" if ip == HEAD else ""),
        )
        for ip in [HEAD, *WORKERS]
    }
    machines: LoopbackMachines | None = None
    config = base / "laptop" / "cluster.yaml"
    env = {
        "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(base / "laptop"),
        "TMPDIR": str(base / "laptop" / "tmp"),
        "LANG": "C.UTF-8",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
    }
    launched = down = False
    try:
        machines = LoopbackMachines(base, bashrc)
        (base / "laptop" / "tmp").mkdir()
        cfg = yaml.safe_load((ROOT / "router" / "control" / "onprem.yaml").read_text())
        cfg["cluster_name"] = cluster_name
        cfg["provider"].update(head_ip=HEAD, worker_ips=WORKERS)
        cfg["auth"] = {"ssh_user": getpass.getuser(), "ssh_private_key": str(machines.client_key)}
        config.write_text(yaml.safe_dump(cfg))

        started = time.monotonic()
        launched = True
        launcher("up", "-y", "--no-config-cache", str(config), env=env, timeout=LAUNCH_TIMEOUT_S)
        up_s = time.monotonic() - started

        base_url = f"http://{HEAD}:{http_port}"
        oa = openai.OpenAI(base_url=f"{base_url}/acme/v1", api_key=ACME_KEY, max_retries=0, timeout=60)
        an = anthropic.Anthropic(base_url=f"{base_url}/globex", api_key=GLOBEX_KEY, max_retries=0, timeout=60)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}]

        def first_answer():
            try:
                return oa.chat.completions.create(model="demo", messages=messages, max_tokens=8)
            except (openai.APIError, httpx.HTTPError):
                return None

        try:
            first = wait_for(first_answer, LAUNCH_TIMEOUT_S - up_s, "the first answer of kvgrid serve", 2)
        except AssertionError:
            raise AssertionError(serve_log(machines)) from None
        first_s = time.monotonic() - started
        print(f"\nray up: {up_s:.0f} s; ray up to the first successful request: {first_s:.0f} s")
        assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0

        # Both tenants, through the official SDKs, with their usage: acme's repeat reads its cached prefix.
        again = oa.chat.completions.create(model="demo", messages=messages, max_tokens=8)
        assert again.usage.prompt_tokens == first.usage.prompt_tokens
        assert again.usage.prompt_tokens_details.cached_tokens >= 32
        answer = an.messages.create(
            model="demo",
            max_tokens=8,
            system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "How much is a cargo bike?"}],
        )
        assert answer.usage.input_tokens > 0 and answer.usage.output_tokens > 0
        assert answer.usage.cache_creation_input_tokens > 0

        # Each node's Ray announces its own loopback address. The groups run on the workers, one each; the
        # gateway, the router and the supervisor on the head.
        assert {ip: raylet_ips(node) for ip, node in machines.nodes.items()} == {ip: [ip] for ip in machines.nodes}
        assert ranks_by_node(machines) == {HEAD: 0, WORKERS[0]: 1, WORKERS[1]: 1}
        head_titles = machines.nodes[HEAD].titles()
        for actor in ("ray::ServeReplica:kvgrid:kvgrid-gateway", "ray::RouterService", "ray::Supervisor"):
            assert any(actor in t for t in head_titles), (actor, head_titles)
        [(http_ip, _)] = listening({HEAD}, {http_port})
        owners = {
            c.pid
            for c in psutil.net_connections(kind="inet")
            if c.laddr and c.laddr.port == http_port and c.status == psutil.CONN_LISTEN
        }
        assert owners and all(pid_namespace(p) == machines.nodes[HEAD].namespace for p in owners)
        # Redis: on the head, on loopback and the head's address only, and it wants the password.
        assert {ip for ip, _ in listening({"127.0.0.1", HEAD, *WORKERS, "0.0.0.0", "::"}, {redis_port})} == {
            "127.0.0.1",
            HEAD,
        }
        import redis

        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=HEAD, port=redis_port, socket_timeout=5).ping()

        # Scale through the launcher, as an operator would from their own machine: one group more, then back.
        scale = "KVGRID_ADMIN_KEY={} kvgrid scale --groups {} --url {}"
        launcher("exec", str(config), scale.format(ADMIN_KEY, 3, base_url), env=env, timeout=300)
        show = f"echo GROUPS-$((6*7)); KVGRID_ADMIN_KEY={ADMIN_KEY} kvgrid groups --json --url {base_url}"
        shown = launcher("exec", str(config), show, env=env, timeout=120)
        out = shown.stdout + shown.stderr  # the command's own output after the marker (not its echo)
        assert "GROUPS-42" in out, out
        groups, _ = json.JSONDecoder().raw_decode(out[out.index("GROUPS-42") + 9 :].lstrip())
        assert sorted(g["name"] for g in groups if g["state"] == "serving") == ["g0", "g1", "g2"]
        assert sum(ranks_by_node(machines).values()) == 3 and ranks_by_node(machines)[HEAD] == 0
        for i in range(3):
            reply = oa.completions.create(model="demo", prompt=f"A short answer, please, number {i}:", max_tokens=4)
            assert reply.usage.completion_tokens > 0
        launcher("exec", str(config), scale.format(ADMIN_KEY, 2, base_url), env=env, timeout=300)
        wait_for(lambda: sum(ranks_by_node(machines).values()) == 2, 60, "the drained group's rank to go")
        reply = an.messages.create(model="demo", max_tokens=4, messages=[{"role": "user", "content": "Thanks!"}])
        assert reply.usage.output_tokens > 0

        launcher("down", "-y", str(config), env=env, timeout=300)
        down = True
        # Nothing of the cluster is left: no process on any node (workers' Ray stops once it lost the head, after
        # KVGRID_HEAD_LOST_S), no SSH master of the launcher, no listening port.
        for ip, node in machines.nodes.items():
            try:
                wait_for(lambda node=node: not node.processes(), 60, f"every process of node {ip} to stop")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; left: {node.titles()}") from None
        wait_for(lambda: not _masters(control), 30, "the launcher's SSH masters to exit")
        assert not listening({"127.0.0.1", "0.0.0.0", "::"}, ours)
        machines.close()
        machines = None
        assert not listening({HEAD, *WORKERS})  # nothing at all on the nodes' addresses, not even SSH
    finally:
        if launched and not down:
            if machines is not None:
                print(serve_log(machines))
            launcher("down", "-y", str(config), env=env, timeout=300, check=False)
        if machines is not None:
            machines.close()
        for pid in _masters(control):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        leftovers = sorted(p.name for p in control.iterdir()) if control.exists() else []
        shutil.rmtree(control, ignore_errors=True)
        if control.parent.exists() and not any(control.parent.iterdir()):
            control.parent.rmdir()
        shutil.rmtree(base, ignore_errors=True)
    assert not leftovers, f"SSH control sockets left: {leftovers}"
    assert not base.exists()
    # Nothing of the launcher in the real HOME (no ~/.ssh, no bootstrap key or config); other tests' caches may appear.
    new_in_home = {p.name for p in real_home.iterdir()} - home_before
    assert not new_in_home & {".ssh", "ray_bootstrap_key.pem", "ray_bootstrap_config.yaml", "kvgrid", ".kvgrid"}


def _masters(control: Path) -> list[int]:
    """The launcher's SSH ControlMaster processes for this cluster (their command line names its control path)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "ssh" and any(str(control) in arg for arg in proc.info["cmdline"] or ()):
            found.append(proc.pid)
    return found
