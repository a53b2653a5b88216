from __future__ import annotations

import pytest

from common.config import ConfigError, load_config, parse_duration

GOOD = """
model: demo
block_size: 16
groups: 2
tensor_parallel: 1
http: {host: 127.0.0.1, port: 8000}
tenants:
  - name: acme
    api_keys: [sk-acme-1]
    cache: {mode: implicit, min_prefix_tokens: 64}
  - name: globex
    api_keys: [sk-globex-1]
    cache: {mode: explicit, default_ttl: 5m}
"""


def write(tmp_path, text):
    p = tmp_path / "kvgrid.yaml"
    p.write_text(text)
    return p


def test_the_documented_example_loads(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.groups == 2 and cfg.http.port == 8000
    assert cfg.tenants[0].cache.min_prefix_tokens == 64
    assert cfg.tenants[1].cache.mode == "explicit" and cfg.tenants[1].cache.default_ttl == 300.0
    assert cfg.cuda_graphs is True and cfg.cpus_per_rank is None


@pytest.mark.parametrize(
    "change, field",
    [
        (("mode: implicit", "mode: sometimes"), "tenants.0.cache.mode"),
        (("groups: 2", "groups: 0"), "groups"),
        (("block_size: 16", "block_size: 24"), "block_size"),
        (("default_ttl: 5m", "default_ttl: soon"), "tenants.1.cache.default_ttl"),
        (("name: globex", "name: Globex Corp"), "tenants.1.name"),
        (("sk-globex-1", "sk-acme-1"), "an API key may belong to one tenant only"),
        (("port: 8000", "port: 99999"), "http.port"),
        (("tensor_parallel: 1", "tensor_parallel: 1\ncolour: blue"), "colour"),
        (("name: globex", "name: admin"), "the tenant name 'admin' is reserved"),
        (("groups: 2", "groups: 2\nadmin_keys: [short]"), "admin_keys"),
        (("groups: 2", "groups: 2\nmax_groups: 1"), "max_groups must be >= groups"),
        (("default_ttl: 5m", "default_ttl: 5m, share: 0"), "tenants.1.cache.share"),
        (
            ("cache: {mode: explicit, default_ttl: 5m}", "limits: {requests_per_s: 0}"),
            "tenants.1.limits.requests_per_s",
        ),
        (("cache: {mode: explicit, default_ttl: 5m}", "limits: {burst: 3}"), "tenants.1.limits.burst"),
        (("groups: 2", "groups: 2\ncpus_per_rank: 0"), "cpus_per_rank"),
        (("groups: 2", "groups: 2\ncuda_graphs: sometimes"), "cuda_graphs"),
    ],
)
def test_invalid_config_names_the_field(tmp_path, change, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(write(tmp_path, GOOD.replace(*change)))


def test_an_admin_key_cannot_be_a_tenant_key(tmp_path):
    text = GOOD.replace("api_keys: [sk-acme-1]", "api_keys: [sk-acme-1-long-enough]").replace(
        "groups: 2", "groups: 2\nadmin_keys: [sk-acme-1-long-enough]"
    )
    with pytest.raises(ConfigError, match="admin key cannot also be a tenant's API key"):
        load_config(write(tmp_path, text))


def test_unreadable_or_non_mapping_config(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- just\n- a list\n"))


@pytest.mark.parametrize("text, seconds", [("5m", 300), ("1h", 3600), ("90s", 90), (45, 45), ("250ms", 0.25)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "tiers, message",
    [
        ("{host_bytes: 1000000000000000}", r"kv_tiers\.host_bytes: 1000000000000000 bytes is more than this machine's"),
        ("{host_bytes: 1e15}", r"kv_tiers\.host_bytes"),
        ("{host_bytes: 1048576, disk_path: /, disk_bytes: 1}", r"kv_tiers\.disk_path: must be a folder of its own"),
        ("{host_bytes: 1048576, disk_path: /tmp, disk_bytes: 1}", r"kv_tiers\.disk_path: .*not /tmp"),
        ("{host_bytes: 1048576, disk_path: ../../../etc, disk_bytes: 1}", r"kv_tiers\.disk_path: must be an absolute"),
        (
            "{host_bytes: 1048576, disk_path: /srv/kv/../../etc, disk_bytes: 1}",
            r"kv_tiers\.disk_path: must not hold '\.\.'",
        ),
        (
            "{host_bytes: 1048576, disk_path: /dev/null, disk_bytes: 1}",
            r"kv_tiers\.disk_path: must not be in the system folder /dev",
        ),
        ("{host_bytes: 1048576, disk_path: /etc/kvgrid, disk_bytes: 1}", r"kv_tiers\.disk_path: .*system folder /etc"),
        ("{host_bytes: 1048576, disk_path: //usr/kv, disk_bytes: 1}", r"kv_tiers\.disk_path: .*system folder /usr"),
        ("{host_bytes: 1048576, disk_path: kv, disk_bytes: 1}", r"kv_tiers\.disk_path: must be an absolute"),
        (
            "{host_bytes: 1048576, disk_path: /srv/kv, disk_bytes: 1000000000000000000000}",
            r"kv_tiers: disk_bytes .* filesystem",
        ),
    ],
)
def test_kv_tiers_are_bounded_by_the_machine_and_kept_out_of_system_folders(tmp_path, tiers, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, GOOD + f"kv_tiers: {tiers}\n"))


def test_a_kv_tiers_disk_path_under_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(
        write(tmp_path, GOOD + "kv_tiers: {host_bytes: 1048576, disk_path: ~/kv//tier/, disk_bytes: 4096}\n")
    )
    assert cfg.kv_tiers.disk_path == str(tmp_path / "kv" / "tier")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        load_config(write(tmp_path, GOOD + f"kv_tiers: {{host_bytes: 1, disk_path: {tmp_path}/file, disk_bytes: 1}}\n"))
