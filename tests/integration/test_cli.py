from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from transformers import AutoConfig


def kvgrid(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_demo_model_command_writes_a_loadable_folder(tmp_path):
    out = kvgrid("demo-model", str(tmp_path / "m"), "--variant", "qwen2")
    assert out.returncode == 0, out.stderr
    # What it builds, on stderr: a line before and one after, with the time it took.
    before, after = out.stderr.strip().splitlines()
    assert before.startswith("building the qwen2 demo model") and "tokenizer" in before
    assert re.fullmatch(r"built the qwen2 demo model in \d+\.\d s", after), after
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
    assert "tenants[0].cache.mode" in _error_line(out.stderr)


def test_demo_config_of_make_run_is_valid():
    from pathlib import Path

    from common.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "router" / "demo.yaml")
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


# -- kvgrid serve's command line and kvgrid model-path -------------------------------------------------------------


def _serve_args(*argv: str):
    from router.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_override_the_configs_values(tmp_path):
    from router.cli import serve_config_from_args

    path = tmp_path / "serve.yaml"
    path.write_text(
        "model: demo\nblock_size: 32\ngroups: 2\nkv_cache_bytes: 1048576\nhttp: {host: 127.0.0.1, port: 9000}\n"
        "tenants:\n  - name: acme\n    api_keys: [sk-acme-123]\n"
    )
    cfg, generated = serve_config_from_args(_serve_args("--config", str(path)))
    assert (cfg.model, cfg.groups, cfg.http.port, cfg.model_id, generated) == ("demo", 2, 9000, "demo", None)
    flags = ["--port", "8123", "--host", "0.0.0.0", "--groups", "3", "--tensor-parallel", "2", "--dtype", "bfloat16"]
    cfg, generated = serve_config_from_args(
        _serve_args("demo:qwen2", "--config", str(path), *flags, "--served-model-name", "my-llm")
    )
    assert (cfg.model, cfg.http.host, cfg.http.port, cfg.groups, cfg.tensor_parallel, cfg.dtype) == (
        "demo:qwen2",
        "0.0.0.0",
        8123,
        3,
        2,
        "bfloat16",
    )
    assert cfg.model_id == "my-llm" and cfg.served_model_name == "my-llm"
    # What no flag names stays the config's; its tenants keep their keys (no default tenant, no generated key).
    assert (cfg.block_size, cfg.kv_cache_bytes) == (32, 1048576)
    assert [(t.name, t.api_keys) for t in cfg.tenants] == [("acme", ["sk-acme-123"])] and generated is None


def test_serve_without_config_has_one_default_tenant_keyed_by_api_key_or_environment(monkeypatch):
    from common.config import ServeConfig
    from router.cli import serve_config_from_args

    monkeypatch.setenv("KVGRID_API_KEY", "sk-from-the-environment")
    cfg, generated = serve_config_from_args(_serve_args("demo", "--host", "0.0.0.0"))
    assert [(t.name, t.api_keys) for t in cfg.tenants] == [("default", ["sk-from-the-environment"])]
    assert generated is None and cfg.http.host == "0.0.0.0"
    cfg, generated = serve_config_from_args(_serve_args("demo", "--api-key", "sk-from-the-flag"))
    assert [(t.name, t.api_keys) for t in cfg.tenants] == [("default", ["sk-from-the-flag"])] and generated is None
    # Everything else as the config's defaults have it.
    defaults = ServeConfig.model_validate({"tenants": [{"name": "default", "api_keys": ["sk-from-the-flag"]}]})
    assert cfg == defaults and (cfg.http.host, cfg.http.port, cfg.groups) == ("127.0.0.1", 8000, 1)


def _no_start(monkeypatch) -> list:
    """Replace serve.run (no Ray, no server) by a recorder of the configs it is given."""
    from router.control import serve

    started: list = []
    monkeypatch.setattr(serve, "run", lambda cfg, **kw: started.append((cfg, kw)) or 0)
    return started


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvgrid: error: "), err
    return lines[0]


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.com", "::"])
def test_serve_refuses_a_host_reachable_from_elsewhere_without_a_key(host, monkeypatch, capsys):
    from router.cli import main

    started = _no_start(monkeypatch)
    monkeypatch.delenv("KVGRID_API_KEY", raising=False)
    assert main(["serve", "demo", "--host", host]) == 2
    out, err = capsys.readouterr()
    line = _error_line(err)
    assert "--api-key" in line and "KVGRID_API_KEY" in line and host in line
    assert started == [] and out == ""


@pytest.mark.parametrize(
    ("host", "base"),
    [
        (None, "http://127.0.0.1:8123"),
        ("127.0.0.2", "http://127.0.0.2:8123"),
        ("localhost", "http://localhost:8123"),
        ("::1", "http://[::1]:8123"),
    ],
)
def test_serve_on_loopback_without_a_key_generates_one_and_prints_it_once(host, base, monkeypatch, capsys):
    from router.cli import main

    started = _no_start(monkeypatch)
    monkeypatch.delenv("KVGRID_API_KEY", raising=False)
    argv = ["serve", "demo", "--port", "8123", "--redis", "redis://x:1/0", *(["--host", host] if host else [])]
    assert main(argv) == 0
    ((cfg, kw),) = started
    assert kw == {"address": None, "redis_url": "redis://x:1/0"}
    ((key,),) = [t.api_keys for t in cfg.tenants]
    assert cfg.tenants[0].name == "default" and key.startswith("sk-") and len(key) >= 32
    out = capsys.readouterr().out
    assert out.count(key) == 1 and f"KVGRID_API_KEY={key}" in out and f"{base}/default/v1" in out
    main(argv)
    assert started[1][0].tenants[0].api_keys != [key]  # a new one each run


def test_serve_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    from harness import free_port
    from router.cli import main

    monkeypatch.delenv("KVGRID_API_KEY", raising=False)
    cases = [
        ([], "give a model or --config"),
        (["demo", "--api-key", "short"], "--api-key: an API key must have at least 8 characters"),
        (["demo", "--groups", "0"], "--groups: groups:"),
        (["demo", "--served-model-name", "my llm"], "--served-model-name: served_model_name: must be a name"),
        (["--config", str(tmp_path / "none.yaml")], "cannot read config"),
        (["demo", "--config", "router/demo.yaml", "--api-key", "sk-12345678"], "--api-key is for serving without"),
        # serve.run resolves the model before Ray starts, and fails at once
        ([str(tmp_path / "missing"), "--port", str(free_port())], "missing"),
    ]
    for argv, expected in cases:
        assert main(["serve", *argv]) == 2, argv
        assert expected in _error_line(capsys.readouterr().err), argv


def test_serve_dtype_choices_are_the_configs():
    import typing

    from common.config import ServeConfig
    from router.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (dtype,) = [a for a in serve._actions if a.dest == "dtype"]
    assert list(dtype.choices) == list(typing.get_args(ServeConfig.model_fields["dtype"].annotation))


def test_model_path_prints_the_demo_folder_only(tmp_path):
    out = kvgrid("model-path", "demo", env_extra={"KVGRID_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    path = out.stdout.removesuffix("\n")
    assert out.stdout == path + "\n" and os.path.dirname(path) == str(tmp_path)  # only the path, in the cache
    assert "building the llama demo model" in out.stderr  # built on first use, said on stderr
    assert AutoConfig.from_pretrained(path).model_type == "llama"


def test_model_path_of_a_bad_model_exits_2_with_one_line(tmp_path):
    out = kvgrid("model-path", str(tmp_path / "missing"), env_extra={"KVGRID_CACHE": str(tmp_path)})
    assert out.returncode == 2 and out.stdout == ""
    assert "missing" in _error_line(out.stderr)


def test_the_gateway_reports_and_accepts_the_served_model_name_only(demo_path, redis_client):
    import asyncio

    import httpx

    from common.config import ServeConfig
    from router.gateway.app import create_app
    from router.gateway.core import Gateway
    from router.gateway.store import KeyRing

    key = "sk-default-123"
    config = ServeConfig.model_validate(
        {"model": str(demo_path), "served_model_name": "my-llm", "tenants": [{"name": "default", "api_keys": [key]}]}
    )
    gw = Gateway(config, KeyRing.from_config(config), str(demo_path), [None], f"unix://{redis_client.socket_file}")
    app = create_app(gw)

    async def run() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            h = {"Authorization": f"Bearer {key}"}
            models = await client.get("/default/v1/models", headers=h)
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
            other = await client.post("/default/v1/chat/completions", headers=h, json={**body, "model": "demo"})
            anthropic = await client.post("/default/v1/messages", headers=h, json={**body, "model": demo_path.name})
        await gw.close()
        return models, other, anthropic

    models, other, anthropic = asyncio.run(asyncio.wait_for(run(), 60))
    assert [m["id"] for m in models.json()["data"]] == ["my-llm"]
    assert other.status_code == 404 and "'my-llm'" in other.json()["error"]["message"]
    assert anthropic.status_code == 404 and "'my-llm'" in anthropic.json()["error"]["message"]


def test_version_names_the_installed_package():
    import subprocess
    import sys
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-m", "router.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"kvgrid {version('kvgrid')}"


# -- kvgrid config check ---------------------------------------------------------------------------------------------


def test_config_check_prints_the_resolved_config_with_the_keys_redacted(tmp_path, capsys):
    import yaml

    from common.config import ServeConfig
    from router.cli import main

    path = tmp_path / "kvgrid.yaml"
    path.write_text(
        "groups: 2\nadmin_keys: [adm-secret-0123456789]\nmonitoring: {window: 2m}\n"
        "tenants:\n  - name: acme\n    api_keys: [sk-acme-secret-0001, sk-acme-secret-0002]\n"
        "    cache: {mode: explicit, default_ttl: 1h}\n"
    )
    assert main(["config", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "secret-0" not in out  # no key (the field server_secret is named "secret")
    shown = yaml.safe_load(out)
    assert shown["admin_keys"] == ["adm-se…"] and shown["tenants"][0]["api_keys"] == ["sk-acm…", "sk-acm…"]
    # Every field with its value: the defaults filled in, durations in seconds.
    defaults = ServeConfig.model_validate({"tenants": [{"name": "acme", "api_keys": ["sk-acme-secret-0001"]}]})
    assert shown.keys() == defaults.model_dump().keys()
    assert shown["tenants"][0].keys() == defaults.tenants[0].model_dump().keys()
    assert shown["http"] == defaults.http.model_dump() and shown["groups"] == 2
    assert shown["monitoring"]["window"] == 120.0 and shown["tenants"][0]["cache"]["default_ttl"] == 3600.0
    assert shown["tenants"][0]["limits"] == defaults.tenants[0].limits.model_dump()


def test_a_short_key_is_redacted_to_less_than_a_third():
    from router.cli import redact_key

    assert redact_key("sk-12345") == "sk…" and redact_key("sk-0123456789abcdefghij") == "sk-012…"


# -- every failure of a command: one line on stderr, `kvgrid: error: <cause>; <fix>`, exit code 2 --------------------

TENANT = "tenants:\n  - name: acme\n    api_keys: [sk-acme-123]\n"
KEY = "sk-test-key-0001"


def _fails(capsys, argv: list[str], *expected: str) -> str:
    """Run ``kvgrid argv`` in this process: exit code 2 and one line on stderr that holds ``expected``."""
    from router.cli import main

    assert main(argv) == 2, argv
    line = _error_line(capsys.readouterr().err)
    assert "; " in line, line  # the cause, then the fix
    for text in expected:
        assert text in line, (text, line)
    return line


@pytest.mark.parametrize("command", [["serve", "--config"], ["config", "check"]])
@pytest.mark.parametrize(
    "text, expected",
    [
        (None, ["cannot read config", "No such file or directory; check the path"]),
        ("tenants: [\n  - name: acme\n", ["is not valid YAML: while parsing", "at line 2, column 3; fix the syntax"]),
        ("groups: true\n" + TENANT, ["groups: Input should be a valid integer (got true); write a number"]),
        (TENANT + "    cache: {min_prefix_tokens: '64'}\n", ["tenants[0].cache.min_prefix_tokens: ", "(got '64')"]),
        ("colour: blue\n" + TENANT, ["colour: unknown field; remove it, or check its spelling"]),
    ],
)
def test_a_bad_config_file_fails_in_one_line_naming_the_cause(tmp_path, monkeypatch, capsys, command, text, expected):
    started = _no_start(monkeypatch)
    path = tmp_path / "kvgrid.yaml"
    if text is not None:
        path.write_text(text)
    _fails(capsys, [*command, str(path)], str(path), *expected)
    assert started == []


def test_serve_on_a_port_in_use_fails_in_one_line(demo_path, capsys):
    import socket

    from harness import free_port

    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        _fails(
            capsys,
            ["serve", "demo", "--port", str(port), "--api-key", KEY],
            f"http: 127.0.0.1:{port} is in use by another program; choose another port (--port",
        )


def test_serve_with_an_unreachable_redis_fails_in_one_line_without_its_password(demo_path, capsys):
    from harness import free_port

    closed = free_port()  # nothing listens there
    url = f"redis://:pw-secret-1@127.0.0.1:{closed}/0"
    line = _fails(
        capsys,
        ["serve", "demo", "--port", str(free_port()), "--api-key", KEY, "--redis", url],
        f"--redis: cannot reach Redis at redis://:***@127.0.0.1:{closed}/0",
        "Connection refused",
        "start it or fix the URL",
    )
    assert "pw-secret-1" not in line


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("/no/such/model", "model '/no/such/model' is not a file or folder, nor a Hub id (org/name); check the path"),
        ("demo:nosuch", "unknown demo model variant 'nosuch'; expected one of: llama, qwen2"),
    ],
)
def test_serve_of_a_missing_model_fails_in_one_line(model, expected, capsys):
    from harness import free_port

    _fails(capsys, ["serve", model, "--port", str(free_port()), "--api-key", KEY], expected)  # embedded Redis


def test_serve_fails_in_one_line_when_ray_cannot_start(demo_path, redis_client, capsys):
    """--address where no Ray cluster answers: ray.init would retry for minutes and then exit the process; kvgrid
    serve finds out in seconds."""
    from harness import free_port

    closed = free_port()
    start = time.monotonic()
    _fails(
        capsys,
        ["serve", "demo", "--port", str(free_port()), "--api-key", KEY, "--address", f"127.0.0.1:{closed}"]
        + ["--redis", f"unix://{redis_client.socket_file}"],
        f"Ray: nothing answers at --address 127.0.0.1:{closed} (Connection refused); start the cluster's head",
    )
    assert time.monotonic() - start < 60


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError("the Serve application 'kvgrid' did not start:\n  kvgrid-gateway: boom"), "start: kvgrid-"),
        (RuntimeError(""), "RuntimeError; rerun with kvgrid --debug for the traceback"),
        (PermissionError(13, "Permission denied", "/srv/x"), "Permission denied: /srv/x; check the path"),
        (ZeroDivisionError("boom"), "unexpected ZeroDivisionError: boom; rerun with kvgrid --debug for the traceback"),
    ],
)
def test_any_error_of_a_command_is_one_line(monkeypatch, capsys, error, expected):
    from router.control import serve

    def fail(cfg, **kw):
        raise error

    monkeypatch.setattr(serve, "run", fail)
    _fails(capsys, ["serve", "demo", "--api-key", KEY], expected)


def test_a_redis_error_is_one_line_naming_redis(monkeypatch, capsys):
    import redis

    from router.control import serve

    def fail(cfg, **kw):
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6390.\nConnection refused.")

    monkeypatch.setattr(serve, "run", fail)
    _fails(capsys, ["serve", "demo", "--api-key", KEY], "Redis: ConnectionError: Error 111", "check that Redis runs")


def test_ctrl_c_exits_130_quietly(monkeypatch, capsys):
    from router.cli import main
    from router.control import serve

    def interrupted(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve, "run", interrupted)
    assert main(["serve", "demo", "--api-key", KEY]) == 130
    assert capsys.readouterr().err == ""


def test_debug_shows_the_traceback_then_the_line(tmp_path):
    kvgrid_bin = os.path.join(os.path.dirname(sys.executable), "kvgrid")
    missing = str(tmp_path / "none.yaml")
    for argv, traceback in ((["serve", "--config", missing], False), (["--debug", "serve", "--config", missing], True)):
        out = subprocess.run([kvgrid_bin, *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stdout == ""
        lines = out.stderr.strip().splitlines()
        assert lines[-1].startswith("kvgrid: error: cannot read config") and missing in lines[-1]
        assert ("Traceback (most recent call last):" in out.stderr) == traceback
        assert len(lines) > 1 if traceback else len(lines) == 1, out.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_on_a_burst_of_signals(sig):
    """kvgrid serve's wait returns on SIGINT or SIGTERM, also when several arrive at once (a double Ctrl-C), and
    leaves a stop event set by another thread working."""
    from router.control.serve import wait_for_stop

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    burst = threading.Timer(0.3, lambda: [os.kill(os.getpid(), sig) for _ in range(5)])
    try:
        burst.start()
        start = time.monotonic()
        wait_for_stop(threading.Event())
        assert time.monotonic() - start < 10
        burst.join()
        time.sleep(0.2)  # the burst's last signals are handled here, by the first wait's handler
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        wait_for_stop(stop)
        assert stop.is_set()
    finally:
        burst.cancel()
        for s, handler in before.items():
            signal.signal(s, handler)
