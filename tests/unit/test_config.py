from __future__ import annotations

import re

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
        (("mode: implicit", "mode: sometimes"), "tenants[0].cache.mode"),
        (("groups: 2", "groups: 0"), "groups"),
        (("block_size: 16", "block_size: 24"), "block_size"),
        (("default_ttl: 5m", "default_ttl: soon"), "tenants[1].cache.default_ttl"),
        (("name: globex", "name: Globex Corp"), "tenants[1].name"),
        (("sk-globex-1", "sk-acme-1"), "an API key may belong to one tenant only"),
        (("port: 8000", "port: 99999"), "http.port"),
        (("tensor_parallel: 1", "tensor_parallel: 1\ncolour: blue"), "colour"),
        (("name: globex", "name: admin"), "the tenant name 'admin' is reserved"),
        (("groups: 2", "groups: 2\nadmin_keys: [short]"), "admin_keys"),
        (("groups: 2", "groups: 2\nmax_groups: 1"), "max_groups must be >= groups"),
        (("default_ttl: 5m", "default_ttl: 5m, share: 0"), "tenants[1].cache.share"),
        (
            ("cache: {mode: explicit, default_ttl: 5m}", "limits: {requests_per_s: 0}"),
            "tenants[1].limits.requests_per_s",
        ),
        (("cache: {mode: explicit, default_ttl: 5m}", "limits: {burst: 3}"), "tenants[1].limits.burst"),
        (("groups: 2", "groups: 2\ncpus_per_rank: 0"), "cpus_per_rank"),
        (("groups: 2", "groups: 2\ncuda_graphs: sometimes"), "cuda_graphs"),
    ],
)
def test_invalid_config_names_the_field(tmp_path, change, field):
    with pytest.raises(ConfigError, match=re.escape(field)) as info:
        load_config(write(tmp_path, GOOD.replace(*change)))
    assert "\n" not in str(info.value) and "; " in str(info.value)  # one line: the cause, then the fix


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


# -- strict types: no coercion between YAML's types, one line per error naming the field and the value given --------


@pytest.mark.parametrize(
    "change, message",
    [
        (("groups: 2", "groups: true"), "groups: Input should be a valid integer (got true); write a number, not"),
        (
            ("min_prefix_tokens: 64", 'min_prefix_tokens: "64"'),
            "tenants[0].cache.min_prefix_tokens: Input should be a valid integer (got '64'); write a number, without "
            "quotes",
        ),
        (("groups: 2", "groups: 2\nkv_cache_bytes: 1e6"), "kv_cache_bytes: Input should be a valid integer (got '1e6'"),
        (("groups: 2", "groups: 2.0"), "groups: Input should be a valid integer (got 2.0)"),
        (("port: 8000", "port: '8000'"), "http.port: Input should be a valid integer (got '8000')"),
        (("host: 127.0.0.1", "host: 127"), "http.host: Input should be a valid string (got 127)"),
        (("groups: 2", "groups: 2\ncuda_graphs: 1"), "cuda_graphs: Input should be a valid boolean (got 1)"),
        (("groups: 2", "groups: 2\ncuda_graphs: 'yes'"), "cuda_graphs: Input should be a valid boolean (got 'yes')"),
        (("model: demo", "model: 7"), "model: Input should be a valid string (got 7)"),
        (("groups: 2", "groups: 2\nredis_timeout_s: '1'"), "redis_timeout_s: Input should be a valid number (got '1')"),
        (("groups: 2", "groups: 2\nrouting: {host_load_weight: true}"), "routing.host_load_weight: Input should be"),
        (("http: {host: 127.0.0.1, port: 8000}", "http: 8000"), "http: Input should be a valid dictionary"),
        (
            ("tensor_parallel: 1", "tensor_parallel: 1\ncolour: blue"),
            "colour: unknown field; remove it, or check its spelling and indentation",
        ),
        (("mode: implicit", "mode: implicit, ttl: 5m"), "tenants[0].cache.ttl: unknown field"),
        (("sk-globex-1]", "sk-globex-1, 12345678]"), "tenants[1].api_keys[1]: Input should be a valid string;"),
    ],
)
def test_values_are_not_coerced_from_another_type(tmp_path, change, message):
    path = write(tmp_path, GOOD.replace(*change))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text, text


def test_yamls_natural_types_and_durations_still_load(tmp_path):
    extra = (
        "redis_timeout_s: 2\n"  # an int for a float
        "step_timeout_s: 1.5\n"
        "http: {host: 127.0.0.1, port: 8000, idle_timeout_s: 5, docs: true}\n"
        "monitoring: {window: 90s, baseline: 10, drop_ratio: 0.25}\n"
        "routing: {disk_load_weight: 1}\n"
    )
    text = GOOD.replace("http: {host: 127.0.0.1, port: 8000}\n", extra).replace(
        "default_ttl: 5m}", "default_ttl: 5m}\n    advice: {sample: 4, ttl: 1h}\n    prices: {input: 3, output: 1.25}"
    )
    text = text.replace("min_prefix_tokens: 64}", "min_prefix_tokens: 64, default_ttl: 45}\n    keep_alive: off")
    cfg = load_config(write(tmp_path, text))
    assert cfg.redis_timeout_s == 2.0 and isinstance(cfg.redis_timeout_s, float) and cfg.step_timeout_s == 1.5
    assert cfg.http.idle_timeout_s == 5.0 and cfg.http.docs is True
    assert (cfg.monitoring.window, cfg.monitoring.baseline) == (90.0, 10.0)
    assert cfg.routing.disk_load_weight == 1.0
    acme, globex = cfg.tenants
    assert acme.cache.default_ttl == 45.0 and acme.keep_alive == "off"
    assert globex.cache.default_ttl == 300.0 and globex.advice.ttl == 3600.0
    assert globex.prices is not None and (globex.prices.input, globex.prices.output) == (3.0, 1.25)


@pytest.mark.parametrize(
    "text, message",
    [
        ("groups: 2\nhttp: {port: 80a\n", "is not valid YAML: while parsing a flow mapping: expected ','"),
        ("tenants:\n- name: a\n\tapi_keys: x\n", "is not valid YAML: while scanning for the next token: found"),
        ("", "the config must be a mapping of fields (got null)"),
        ("- a list\n", "the config must be a mapping of fields (got a list)"),
    ],
)
def test_a_file_that_is_no_config_is_one_line_naming_the_place(tmp_path, text, message):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert message in str(info.value) and "\n" not in str(info.value) and "; " in str(info.value), str(info.value)


def test_an_error_never_shows_a_key(tmp_path):
    """A YAML error shows where, not the text there; a key of the wrong type is not shown either."""
    secret = "sk-very-secret-key-0001"
    for text in (
        f"tenants:\n  - name: acme\n    api_keys: [{secret}\n",
        f"tenants:\n  - name: acme\n    api_keys: {secret}\n",
        f"admin_keys: {secret}\ntenants:\n  - name: acme\n    api_keys: [sk-acme-1]\n",
    ):
        with pytest.raises(ConfigError) as info:
            load_config(write(tmp_path, text))
        assert secret not in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_folder_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config .*: No such file or directory; check the path"):
        load_config(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match=r"Is a directory; give the YAML file, not a folder"):
        load_config(tmp_path)
