"""OpenAI's prompt_cache_key: a tenant's requests with the same key go to the same worker group even when their
leading blocks differ (unless that group is overloaded), different keys spread over the groups; and
prompt_cache_retention "24h" pins the prompt."""

from __future__ import annotations

import random

import httpx

from harness import ACME_KEY, ADMIN_KEY, oa
from router.routing.policy import GroupLoad
from router.routing.router import CACHE_KEY_OVERLOAD_TOKENS, Router

GROUPS = ["g0", "g1", "g2", "g3"]


def prompt(seed: int, n: int = 64) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 4000) for _ in range(n)]


def test_same_key_same_group_whatever_the_blocks_and_keys_spread():
    router = Router(GROUPS, b"secret", block_size=16)
    other = Router(GROUPS, b"secret", block_size=16)  # another replica: the same map, no shared state
    for key in ("user-1", "user-2", "session-x"):
        groups = {router.route("acme", prompt(s), cache_key=key).group for s in range(6)}
        assert len(groups) == 1, key
        assert other.route("acme", prompt(99), cache_key=key).group in groups
    spread = {router.route("acme", prompt(1), cache_key=f"key-{i}").group for i in range(32)}
    assert spread == set(GROUPS)
    # Keys are per tenant: the same key of another tenant is a different key.
    assert len({router.route(f"tenant-{i}", prompt(1), cache_key="k").group for i in range(32)}) > 1


def test_the_key_wins_over_a_cached_prefix_unless_its_group_is_overloaded():
    router = Router(["a", "b"], b"secret", block_size=16)
    p = prompt(7)
    first = router.route("acme", p, "r1")  # no key: cache-aware, and its blocks are predicted there
    router.on_finish("r1")
    assert router.route("acme", p, "r2").group == first.group  # no key: follows the cached prefix
    router.on_finish("r2")
    key = next(k for k in (f"k{i}" for i in range(100)) if router.key_group("acme", k, router.loads) != first.group)
    assert router.route("acme", p, "r3", cache_key=key).group != first.group
    router.on_finish("r3")
    # Overloaded: its group has far more prefill queued than the other one; the policy chooses instead.
    mine = router.key_group("acme", key, router.loads)
    router.loads[mine] = GroupLoad(queued_prefill_tokens=CACHE_KEY_OVERLOAD_TOKENS + 1)
    assert router.key_group("acme", key, router.loads) is None
    assert router.route("acme", p, "r4", cache_key=key).group == first.group


def _admin(server, method: str, path: str, **kw):
    r = httpx.request(
        method, f"{server.base}/admin/v1{path}", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60, **kw
    )
    r.raise_for_status()
    return r.json()


def _holders(server, tokens: list[int]) -> set[str]:
    groups = _admin(server, "POST", "/match", json={"tenant": "acme", "token_ids": tokens})["groups"]
    return {g for g, blocks in groups.items() if blocks > 0}


def test_openai_same_key_lands_on_one_group_and_different_keys_spread(shared_server):
    client = oa(shared_server)
    names = sorted(g["name"] for g in _admin(shared_server, "GET", "/groups")["groups"])
    assert len(names) == 2
    salt = random.randrange(10**9)
    a, b = prompt(salt), prompt(salt + 1)  # different first blocks
    for p in (a, b):
        client.completions.create(model="demo", prompt=p, max_tokens=2, extra_body={"prompt_cache_key": "conv-1"})
    held_a, held_b = _holders(shared_server, a), _holders(shared_server, b)
    assert len(held_a) == 1 and held_a == held_b
    # Two keys that map to different groups: the same prompt lands on both, its cached prefix notwithstanding.
    router = Router(names, b"unused", block_size=16)
    loads = {g: GroupLoad() for g in names}
    k1 = "conv-1"
    (g1,) = held_a
    assert router.key_group("acme", k1, loads) == g1  # the service maps keys as the router's key_group does
    k2 = next(k for k in (f"conv-{i}" for i in range(2, 200)) if router.key_group("acme", k, loads) != g1)
    c = prompt(salt + 2)
    for key in (k1, k2):
        out = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hello"}], max_tokens=2, prompt_cache_key=key
        )
        assert out.choices
        client.completions.create(model="demo", prompt=c, max_tokens=2, extra_body={"prompt_cache_key": key})
    assert _holders(shared_server, c) == set(names)


def test_openai_prompt_cache_retention_24h_pins_the_prompt(shared_server):
    client = oa(shared_server)

    def pinned() -> int:
        r = httpx.get(
            f"{shared_server.base}/admin/v1/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        r.raise_for_status()
        return int(
            sum(
                float(ln.rsplit(" ", 1)[1]) for ln in r.text.splitlines() if ln.startswith("kvgrid_group_pinned_blocks")
            )
        )

    salt = random.randrange(10**9)
    before = pinned()
    client.completions.create(
        model="demo", prompt=prompt(salt, 70), max_tokens=2, extra_body={"prompt_cache_retention": "in_memory"}
    )
    assert pinned() == before
    out = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": f"{salt} keep this conversation for a day " * 4}],
        max_tokens=2,
        prompt_cache_retention="24h",
    )
    assert pinned() - before == out.usage.prompt_tokens // 16
    r = httpx.post(
        f"{shared_server.base}/acme/v1/completions",
        headers={"Authorization": f"Bearer {ACME_KEY}"},
        json={"model": "demo", "prompt": "x", "prompt_cache_retention": "forever"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt_cache_retention")
