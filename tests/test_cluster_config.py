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


def test_cluster_commands_are_real_kvgrid_commands_with_a_valid_config():
    cfg = cluster()
    commands = [c for key, v in cfg.items() if key.endswith("_commands") for c in v]
    kvgrid = [c for c in commands if "kvgrid " in c and "pip install" not in c]
    assert kvgrid, "the cluster never starts kvgrid"
    for command in kvgrid:
        # Shell substitutions (the head's address) become a placeholder; the redirection is dropped.
        words = shlex.split(re.sub(r"\$\([^)]*\)", "HOST", command).replace("nohup ", "").split(">")[0])
        args = build_parser().parse_args(words[words.index("kvgrid") + 1 :])
        assert args.command == "serve" and args.address == "auto" and args.redis
        mounted = args.config.replace("/home/ubuntu/kvgrid/", "")
        assert load_config(ROOT / mounted).tensor_parallel >= 1
