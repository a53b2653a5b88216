"""`cluster.yaml` passes Ray's own launcher validation; it and the on-premise config run the same node commands
(router/control/node.sh), whose head keeper starts a real `kvgrid serve` and a private Redis."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from common.config import load_config
from router.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def cluster() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def test_cluster_yaml_passes_the_launchers_schema_and_checks():
    import ray.autoscaler
    from ray.autoscaler._private.util import fillout_defaults, validate_config

    schema = json.loads((Path(os.path.dirname(ray.autoscaler.__file__)) / "ray-schema.json").read_text())
    cfg = cluster()
    jsonschema.validate(cfg, schema)
    validate_config(fillout_defaults(cfg))
    assert cfg["available_node_types"][cfg["head_node_type"]]["resources"]["GPU"] == 0


def commands(cfg: dict) -> list[str]:
    return [c for key, v in cfg.items() if key.endswith("_commands") for c in v]


def node_commands(cfg: dict) -> list[list[str]]:
    """The node.sh calls of a launcher config: [subcommand, ...] without the ray start options."""
    calls = []
    for command in commands(cfg):
        w = shlex.split(command)
        script = next(i for i, word in enumerate(w) if word.endswith("router/control/node.sh"))
        assert w[script - 1] == "sh" and w[script] == "~/kvgrid/router/control/node.sh", command
        calls.append(w[script + 1 : script + 2])
    return calls


def test_aws_and_on_premise_configs_run_the_same_node_commands():
    import yaml

    onprem = yaml.safe_load((ROOT / "router" / "control" / "onprem.yaml").read_text())
    aws = cluster()
    for cfg in (aws, onprem):
        assert cfg["file_mounts"] == {"~/kvgrid": "."} and ".venv" in cfg["rsync_exclude"]
        assert node_commands(cfg) == [["setup"], ["start-head"], ["start-worker"]]
        assert cfg["setup_commands"] == aws["setup_commands"]
    assert onprem["worker_start_ray_commands"] == aws["worker_start_ray_commands"]


def keeper(tmp_path: Path, node_ip: str = "10.0.0.1", redis_port: int = 6380):
    from router.control.node import HeadKeeper

    config = str(ROOT / "router" / "cluster-serve.yaml")
    return HeadKeeper(node_ip, 6379, redis_port, config, tmp_path / "state", wait_workers_s=1)


def test_the_head_runs_a_real_kvgrid_serve_command_with_a_valid_config(tmp_path):
    w = keeper(tmp_path).serve_command()
    args = build_parser().parse_args(w[1:])
    assert Path(w[0]).name == "kvgrid"
    assert args.command == "serve" and args.address == "auto" and args.redis == "redis://10.0.0.1:6380/0"
    assert "@" not in args.redis  # the password comes from the environment, never from the command line
    assert load_config(args.config).tensor_parallel >= 1


def test_redis_on_the_head_is_private_and_needs_a_generated_password(tmp_path):
    import psutil
    import redis

    from harness import free_port
    from router.control.node import redis_password

    port = free_port()
    k = keeper(tmp_path, "127.0.0.1", port)
    k.state.mkdir(mode=0o700)
    password = redis_password(k.state)
    assert len(password) == 64 and redis_password(k.state) == password  # made once, then read back
    env_file = k.state / "redis.env"
    assert env_file.stat().st_mode & 0o777 == 0o600
    assert env_file.read_text() == f"export KVGRID_REDIS_PASSWORD={password}\n"
    proc = k.start_redis(password)
    try:
        conf = k.state / "redis" / "auth.conf"
        assert conf.stat().st_mode & 0o777 == 0o600 and conf.read_text() == f"requirepass {password}\n"
        w = k.redis_command(conf)
        assert w[w.index("--protected-mode") + 1] == "yes" and "--requirepass" not in w
        assert w[w.index("--bind") + 1 : w.index("--protected-mode")] == ["127.0.0.1"]
        assert keeper(tmp_path).redis_command(conf)[w.index("--bind") + 1 : w.index("--bind") + 3] == [
            "127.0.0.1",
            "10.0.0.1",
        ]
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, password=password, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "Redis did not start"
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=1).ping()
        assert password not in " ".join(psutil.Process(proc.pid).cmdline())  # `ps` does not show it
    finally:
        proc.terminate()
        proc.wait(10)
