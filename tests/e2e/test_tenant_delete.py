"""Deleting a tenant at run time on a real server (the shared one): its pins are released and its cached blocks
dropped on every group, and the routers' indexes let go of them, so a tenant made again under the same name starts
cold: nothing its predecessor computed is a hit."""

from __future__ import annotations

import time

import httpx

from harness import ADMIN_KEY, oa

NAME = "wayne"
SYSTEM = "You are the deletion test assistant. " + " ".join(f"Clause {i}: be brief." for i in range(16))


def _admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(
        method, f"{server.base}/admin/v1{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60, **kw
    )


def _tenant_with_key(server) -> str:
    r = _admin(server, "POST", "/tenants", json={"name": NAME, "cache": {"mode": "explicit"}})
    assert r.status_code == 201, r.text
    r = _admin(server, "POST", f"/tenants/{NAME}/keys")
    assert r.status_code == 201, r.text
    key = r.json()["key"]
    deadline = time.monotonic() + 10
    while True:  # every gateway replica within a second
        try:
            oa(server, NAME, key).models.list()
            return key
        except Exception:
            assert time.monotonic() < deadline, "the new tenant never served"
            time.sleep(0.1)


def _ask(server, key: str, question: str, retention: str | None = None):
    extra = {} if retention is None else {"prompt_cache_retention": retention}
    return oa(server, NAME, key).chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
        extra_body=extra,
    )


def test_a_deleted_tenant_leaves_no_pin_and_no_hit_for_its_successor(shared_server):
    key = _tenant_with_key(shared_server)
    question = f"What is left after a delete? ({time.time_ns()})"
    _ask(shared_server, key, question, retention="24h")  # its prompt pinned on its group
    assert _ask(shared_server, key, question).usage.prompt_tokens_details.cached_tokens > 0  # cached: a hit
    r = _admin(shared_server, "DELETE", f"/tenants/{NAME}")
    assert r.status_code == 200, r.text
    groups = r.json()["groups"]
    assert groups, r.json()  # every group answered
    pins, blocks = (sum(v[i] for v in groups.values()) for i in (0, 1))
    assert pins >= 1 and blocks >= 6, groups  # the pinned prompt's blocks (~7 of 16 tokens) went
    # The same name again, the same prompt: nothing of the predecessor's is reused.
    key = _tenant_with_key(shared_server)
    try:
        assert _ask(shared_server, key, question).usage.prompt_tokens_details.cached_tokens == 0
    finally:
        _admin(shared_server, "DELETE", f"/tenants/{NAME}")
