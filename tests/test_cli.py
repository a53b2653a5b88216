from __future__ import annotations

import os
import re
import subprocess
import sys

from transformers import AutoConfig


def kvgrid(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_demo_model_command_writes_a_loadable_folder(tmp_path):
    out = kvgrid("demo-model", str(tmp_path / "m"), "--variant", "qwen2")
    assert out.returncode == 0, out.stderr
    cfg = AutoConfig.from_pretrained(str(tmp_path / "m"))
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings


def test_generate_reports_the_shared_prefix_as_cached(demo_path):
    out = kvgrid("generate", "--model", str(demo_path), "--max-tokens", "4")
    assert out.returncode == 0, out.stderr
    found = re.findall(r"prompt: (\d+) tokens, (\d+) from the prefix cache", out.stdout)
    assert len(found) == 2
    (n1, c1), (n2, c2) = [(int(a), int(b)) for a, b in found]
    assert c1 == 0
    assert c2 >= 160 and c2 % 16 == 0 and c2 < n2
    assert out.stdout.count("time to first token") == 2


def test_bad_model_path_exits_2_with_a_message(tmp_path):
    out = kvgrid("generate", "--model", str(tmp_path / "missing"))
    assert out.returncode == 2
    assert "kvgrid: error:" in out.stderr and "missing" in out.stderr


def test_serve_with_an_invalid_config_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model: demo\ngroups: 2\ntenants:\n  - name: acme\n    api_keys: [sk-acme-123]\n    cache: {mode: sometimes}\n"
    )
    out = kvgrid("serve", "--config", str(bad))
    assert out.returncode == 2
    assert "tenants.0.cache.mode" in out.stderr


def test_demo_config_of_make_run_is_valid():
    from pathlib import Path

    from common.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "router" / "demo.yaml")
    assert cfg.groups == 2 and len(cfg.tenants) == 2


def test_the_cli_logs_kvgrid_diagnostics_from_info_and_other_libraries_from_warning():
    code = (
        "import logging, sys; from router import cli; cli.configure_logging(); cli.configure_logging();"
        "logging.getLogger('router.routing.service').info('group g0 paused');"
        "logging.getLogger('worker.engine').warning('request r1 failed');"
        "logging.getLogger('httpx').info('HTTP Request: POST');"
        "logging.getLogger('httpx').warning('httpx warned');"
        "print('the result')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "the result\n"  # diagnostics never mix with what a command answers
    lines = out.stderr.splitlines()
    assert len(lines) == 3, lines  # configured once, however often it is called
    assert lines[0].endswith(" INFO router.routing.service: group g0 paused")
    assert lines[1].endswith(" WARNING worker.engine: request r1 failed")
    assert lines[2].endswith(" WARNING httpx: httpx warned")


def test_bench_engine_reports_decode_and_the_closed_loop_of_bench_serve(demo_path, capsys):
    import json

    from router.cli import main

    flags = ["--prompt-len", "64", "--cached", "32", "--batch", "1", "3", "--decode-steps", "4", "--repeats", "1"]
    assert main(["bench", "engine", "--model", str(demo_path), "--decode-threads", "1", *flags, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["hit_cached_tokens"] == 32 and r["ttft_cold_ms"] > 0
    assert set(r["decode_tokens_per_s"]) == {"1", "3"} and min(r["decode_tokens_per_s"].values()) > 0
    loop = r["closed_loop"]
    assert (loop["prompt_tokens"], loop["output_tokens"]) == (128, 64)
    for streams in ("1", "3"):
        assert loop[streams]["tokens_per_s"] > 0 and loop[streams]["step_ms"] > 0 and loop[streams]["step_cpu_ms"] > 0
