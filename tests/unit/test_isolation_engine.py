"""Tenant isolation inside one engine: scheduling order, cache capacity under a flood, the pin budget; each test
twice, without and with lower KV tiers (a host tier and a disk tier below the pool, with the pool's shares)."""

from __future__ import annotations

import random

import pytest

from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.kv_tiers import KVTiersConfig

ONE = SamplingParams(max_tokens=1, temperature=0.0)
BLOCK_BYTES = 64 * 2**10  # of the demo model, block size 16


@pytest.fixture(params=["no tiers", "tiers"], autouse=True)
def tiers(request, tmp_path):
    """Every test of this module runs without and with tiers of as many blocks as the test's pool."""
    request.node.tiers = request.param == "tiers"
    request.node.disk = tmp_path
    yield


def engine(demo_path, request, **kw) -> Engine:
    if request.node.tiers:
        blocks = kw.get("num_blocks", 64)
        kw["kv_tiers"] = KVTiersConfig(
            host_bytes=blocks * BLOCK_BYTES, disk_path=str(request.node.disk), disk_bytes=blocks * BLOCK_BYTES
        )
    return Engine(EngineConfig(model=str(demo_path), device="cpu", secret=b"isolation-secret", **kw))


def run(e: Engine, prompt: list[int], tenant: str, **kw):
    rid = e.add_prompt(prompt, ONE, tenant, **kw)
    while True:
        for out in e.step():
            if out.request_id == rid and out.finished:
                return out


def schedule_trace(e: Engine, requests: list[tuple[str, list[int]]]) -> list[tuple[str, int, int]]:
    """Queue ``requests`` at once, step to the end; (request, step of its first token, cached tokens) each."""
    ids = [e.add_prompt(p, ONE, t, request_id=f"{t}-{i}") for i, (t, p) in enumerate(requests)]
    first: dict[str, tuple[int, int]] = {}
    step = 0
    while e.has_unfinished():
        step += 1
        for out in e.step():
            first.setdefault(out.request_id, (step, out.num_cached_tokens))
    return [(rid, *first[rid]) for rid in ids]


def test_scheduling_order_uses_only_the_requesting_tenants_hits(demo_path, request):
    rng = random.Random(5)
    secret = [rng.randrange(5, 4000) for _ in range(160)]
    fresh = [rng.randrange(5, 4000) for _ in range(160)]
    batch = [("globex", secret + [7]), ("globex", fresh + [7]), ("globex", secret + [8])]
    traces = []
    for acme_cached in (secret, [rng.randrange(5, 4000) for _ in range(160)]):
        e = engine(demo_path, request, num_blocks=64, max_num_batched_tokens=64)
        run(e, acme_cached + [1], "acme")  # acme has (or has not) cached globex's probe prompt
        traces.append(schedule_trace(e, batch))
    # Whether acme holds the prompt changes nothing globex can observe: order, step of first token, reuse.
    assert traces[0] == traces[1]
    # The same scheduler does favour a tenant's own hits: globex's third request reuses its first one.
    assert traces[0][2][2] == 160 and traces[0][0][2] == 0
    # Power check within one tenant: acme's own cached prompt gets its first token in fewer steps.
    own = []
    for cached in (True, False):
        e = engine(demo_path, request, num_blocks=64, max_num_batched_tokens=64)
        if cached:
            run(e, secret + [1], "acme")
        own.append(schedule_trace(e, [("acme", secret + [9])])[0][1])
    assert own[0] < own[1]


def test_a_flood_from_one_tenant_leaves_anothers_working_set_cached(demo_path, request):
    """Two tenants with equal shares of a 64-block pool: globex's working set (2 prefixes of 8 blocks) is far
    below its half, so acme's unique long prompts must not evict it: every globex request is a full hit."""
    rng = random.Random(9)
    prefixes = [[rng.randrange(5, 4000) for _ in range(128)] for _ in range(2)]
    e = engine(demo_path, request, num_blocks=64, tenant_shares={"acme": 1.0, "globex": 1.0})
    for p in prefixes:
        run(e, p + [1], "globex")
    hits = []
    for i in range(12):
        run(e, [rng.randrange(5, 4000) for _ in range(400)], "acme")  # 25 blocks of unique tokens each
        hits.append(run(e, prefixes[i % 2] + [2 + i], "globex").num_cached_tokens)
    assert hits == [128] * 12
    # When globex's share is tiny its working set is over it, and the same flood evicts it: shares decide.
    lru = engine(demo_path, request, num_blocks=64, tenant_shares={"acme": 50.0, "globex": 1.0})
    for p in prefixes:
        run(lru, p + [1], "globex")
    # With tiers the flood must also fill them (64 + 64 blocks below the pool): they keep the shares too.
    for _ in range(10 if request.node.tiers else 3):
        run(lru, [rng.randrange(5, 4000) for _ in range(400)], "acme")
    assert run(lru, prefixes[0] + [99], "globex").num_cached_tokens == 0


def test_one_tenants_pins_cannot_use_up_anothers_pin_budget(demo_path, request):
    e = engine(demo_path, request, num_blocks=40, tenant_shares={"acme": 1.0, "globex": 1.0})
    assert e.pin_limit_blocks("acme") == e.pin_limit_blocks("globex") == 10  # half of 0.5 x 40 each
    rng = random.Random(2)
    pinned = 0
    for _ in range(6):  # acme tries to pin 6 x 4 blocks
        out = run(e, [rng.randrange(5, 4000) for _ in range(65)], "acme", pin_tokens=64, pin_ttl_s=60)
        pinned += out.num_pinned_tokens
    assert pinned // 16 <= 10
    out = run(e, [rng.randrange(5, 4000) for _ in range(129)], "globex", pin_tokens=128, pin_ttl_s=60)
    assert out.num_pinned_tokens == 128  # globex's budget is untouched


@pytest.mark.parametrize("shares", [{"acme": 0.0}, {"acme": -1.0}])
def test_shares_must_be_positive(demo_path, request, shares):
    with pytest.raises(ValueError, match="positive"):
        engine(demo_path, request, num_blocks=8, tenant_shares=shares)
