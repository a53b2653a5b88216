"""Secrets in the serve config (common/config_secrets.py): ``${NAME}`` references in the secret fields, resolved
when the file is loaded, never shown; and the example admin key refused on an address other machines reach."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from common.config import ConfigError, load_config
from common.config_secrets import EXAMPLE_ADMIN_KEYS, check_admin_keys
from router.gateway.store_base import with_password

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "sk-admin-0123456789abcdef"


def write(tmp_path, data: dict):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def config(**top):
    return {
        "tenants": [
            {"name": "acme", "api_keys": ["sk-acme-literal", "${ACME_KEY}"]},
            {"name": "globex", "api_keys": ["${GLOBEX_KEY}"]},
        ],
        **top,
    }


@pytest.fixture()
def secrets_env(monkeypatch):
    values = {
        "ACME_KEY": "sk-acme-from-env-1",
        "GLOBEX_KEY": "sk-globex-from-env",
        "ADMIN_KEY": "sk-admin-from-env-0123456789",
        "REDIS_PW": "s3cret/p@ss",
        "SERVER_SECRET": "a-server-secret",
    }
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    return values


def test_references_are_resolved(tmp_path, secrets_env):
    cfg = load_config(
        write(
            tmp_path,
            config(admin_keys=["${ADMIN_KEY}"], redis_password="${REDIS_PW}", server_secret="${SERVER_SECRET}"),
        )
    )
    assert cfg.tenants[0].api_keys == ["sk-acme-literal", secrets_env["ACME_KEY"]]
    assert cfg.tenants[1].api_keys == [secrets_env["GLOBEX_KEY"]]
    assert cfg.admin_keys == [secrets_env["ADMIN_KEY"]]
    assert cfg.redis_password == "s3cret/p@ss" and cfg.server_secret == "a-server-secret"


def test_a_missing_variable_names_the_field_and_the_variable(tmp_path, secrets_env, monkeypatch):
    monkeypatch.delenv("ACME_KEY")
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, config()))
    message = str(err.value)
    assert "tenants[0].api_keys[1]: environment variable ACME_KEY is not set" in message
    assert message.startswith(str(tmp_path)) and "; set it" in message and "\n" not in message
    monkeypatch.setenv("ACME_KEY", "")
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.api_keys\[1\]: environment variable ACME_KEY is empty"):
        load_config(write(tmp_path, config()))
    monkeypatch.delenv("REDIS_PW")
    with pytest.raises(ConfigError, match="redis_password: environment variable REDIS_PW is not set"):
        load_config(write(tmp_path, config(redis_password="${REDIS_PW}")))


def test_a_literal_dollar_is_kept(tmp_path, secrets_env):
    cfg = load_config(
        write(
            tmp_path,
            {
                "model": "/models/$weird${dir}",  # not a secret field: never a reference
                "admin_keys": ["sk-admin-$dollar-${ADMIN_KEY}", "$${ADMIN_KEY}-escaped-0001"],
                "tenants": [{"name": "acme", "api_keys": ["sk-$ACME_KEY", "$${ACME_KEY}"]}],
            },
        )
    )
    assert cfg.model == "/models/$weird${dir}"
    assert cfg.admin_keys == ["sk-admin-$dollar-${ADMIN_KEY}", "$${ADMIN_KEY}-escaped-0001"]
    assert cfg.tenants[0].api_keys == ["sk-$ACME_KEY", "${ACME_KEY}"]  # $${NAME}: the text ${NAME}


def test_resolved_values_never_show_in_config_check(tmp_path, secrets_env, capsys):
    from router.cli.serve import _cmd_config_check

    top = {"admin_keys": ["${ADMIN_KEY}"], "redis_password": "${REDIS_PW}", "server_secret": "${SERVER_SECRET}"}
    path = write(tmp_path, config(**top))
    assert _cmd_config_check(argparse.Namespace(file=str(path))) == 0
    out = capsys.readouterr().out
    for value in secrets_env.values():
        assert value not in out
    assert "redis_password: …" in out and "server_secret: …" in out


def test_the_redis_password_reference_builds_the_url(tmp_path, secrets_env):
    cfg = load_config(write(tmp_path, config(redis_password="${REDIS_PW}")))
    assert with_password("redis://10.0.0.1:6380/0", cfg.redis_password) == "redis://:s3cret%2Fp%40ss@10.0.0.1:6380/0"
    assert with_password("redis://:own@10.0.0.1:6380/0", cfg.redis_password) == "redis://:own@10.0.0.1:6380/0"


@pytest.mark.parametrize("key", sorted(EXAMPLE_ADMIN_KEYS) + ["sk-admin-CHANGEME-please-01"])
def test_an_example_admin_key_is_refused_on_a_public_address(key):
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(ValueError) as err:
            check_admin_keys([ADMIN, key], host)
        message = str(err.value)
        assert message.startswith("admin_keys[1] is an example key") and message.count("; ") == 1
        assert key not in message
    for host in ("127.0.0.1", "::1", "localhost"):
        check_admin_keys([key], host)
    check_admin_keys([ADMIN], "0.0.0.0")  # a real key anywhere


def test_serve_refuses_the_demo_admin_key_before_starting(tmp_path):
    from router.control.serve import run

    demo = yaml.safe_load((ROOT / "router" / "demo.yaml").read_text())  # the published demo config, made public
    demo["http"] = {"host": "0.0.0.0", "port": 8000}
    with pytest.raises(ValueError, match="admin_keys\\[0\\] is an example key"):
        run(write(tmp_path, demo))
