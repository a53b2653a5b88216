"""`cluster.yaml` passes Ray's own launcher validation, and its commands are real kvgrid commands."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import jsonschema
import yaml

from common.config import load_config
from router.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


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


def commands() -> list[str]:
    return [c for key, v in cluster().items() if key.endswith("_commands") for c in v]


def words(command: str) -> list[str]:
    """The command's words: shell substitutions (the head's address) become HOST, a redirection is dropped."""
    return shlex.split(re.sub(r"\$\([^)]*\)", "HOST", command).split(" > ")[0])


def test_cluster_commands_are_real_kvgrid_commands_with_a_valid_config():
    kvgrid = [c for c in commands() if "kvgrid" in words(c)]
    assert kvgrid, "the cluster never starts kvgrid"
    for command in kvgrid:
        w = words(command)
        args = build_parser().parse_args(w[w.index("kvgrid") + 1 :])
        assert args.command == "serve" and args.address == "auto" and args.redis
        assert "@" not in args.redis  # the password comes from the environment, never from the command line
        mounted = args.config.replace("/home/ubuntu/kvgrid/", "")
        assert load_config(ROOT / mounted).tensor_parallel >= 1


def test_redis_on_the_head_is_private_and_needs_a_generated_password():
    text = "\n".join(commands())
    assert "0.0.0.0" not in text and "protected-mode no" not in text
    [start] = [c for c in commands() if "/usr/bin/redis-server" in words(c)]
    w = words(start)
    conf = w[w.index("/usr/bin/redis-server") + 1]  # the password is in this private file, not on the command line
    options: dict[str, list[str]] = {}
    for word in w[w.index("/usr/bin/redis-server") + 2 :]:
        if word.startswith("--"):
            current = options.setdefault(word, [])
        else:
            current.append(word)
    assert "--requirepass" not in options and "KVGRID_REDIS_PASSWORD" not in start
    [written] = [c for c in cluster()["head_setup_commands"] if "requirepass" in c]
    assert "umask 077" in written and "requirepass $KVGRID_REDIS_PASSWORD" in written
    assert conf.replace("$HOME", "~") in written
    assert options["--protected-mode"] == ["yes"]
    assert options["--bind"] and set(options["--bind"]) <= {"127.0.0.1", "HOST"}  # HOST: the private address
    # A setup command generates the password into a private file; Redis and `kvgrid serve` read it from there.
    env_file = "~/.kvgrid-redis.env"
    [made] = [c for c in cluster()["head_setup_commands"] if "KVGRID_REDIS_PASSWORD=" in c]
    assert env_file in made and "umask 077" in made and "rand" in made
    serve = next(c for c in commands() if "kvgrid" in words(c))
    for command in (written, serve):
        assert words(command)[:3] == [".", env_file, "&&"] or f". {env_file} &&" in command
