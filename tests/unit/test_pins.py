"""Explicit cache entries: pinned prefix blocks stay resident until their TTL, refreshed by hits."""

from __future__ import annotations

import time

import pytest

from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig

ONE = SamplingParams(max_tokens=1, temperature=0.0)
PREFIX = list(range(3000, 3064))  # 4 blocks


@pytest.fixture()
def make_engine(demo_path):
    def make(**kw) -> Engine:
        return Engine(EngineConfig(model=str(demo_path), device="cpu", num_blocks=20, **kw))

    return make


def run(engine: Engine, prompt: list[int], tenant: str = "acme", **pin):
    rid = engine.add_prompt(prompt, ONE, tenant, **pin)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def flood(engine: Engine, n: int = 4) -> None:
    """Unique prompts that need every unpinned block of the pool, more than once over."""
    for i in range(n):
        run(engine, [(i * 131 + j * 17) % 4000 for j in range(120)])


def test_pinned_prefix_survives_a_flood_that_evicts_an_unpinned_one(make_engine):
    pinned, unpinned = make_engine(), make_engine()
    out = run(pinned, PREFIX + [1, 2], pin_tokens=64, pin_ttl_s=60)
    assert out.num_pinned_tokens == 64 and pinned.stats().blocks_pinned == 4
    run(unpinned, PREFIX + [1, 2])
    flood(pinned)
    flood(unpinned)
    assert run(pinned, PREFIX + [5]).num_cached_tokens == 64
    assert run(unpinned, PREFIX + [5]).num_cached_tokens == 0


def test_pin_expires_after_its_ttl(make_engine):
    engine = make_engine()
    run(engine, PREFIX + [1], pin_tokens=64, pin_ttl_s=0.3)
    time.sleep(0.4)
    flood(engine)
    assert engine.stats().blocks_pinned == 0
    assert run(engine, PREFIX + [5]).num_cached_tokens == 0


def test_a_hit_refreshes_the_pin(make_engine):
    engine = make_engine()
    run(engine, PREFIX + [1], pin_tokens=64, pin_ttl_s=1.5)
    time.sleep(1.0)
    hit = run(engine, PREFIX + [2], pin_tokens=64, pin_ttl_s=1.5)  # refreshed until ~2.5 s
    assert hit.num_cached_tokens == 64 and hit.num_pinned_tokens == 64
    time.sleep(0.7)  # past the first deadline, before the refreshed one
    flood(engine)
    assert run(engine, PREFIX + [5]).num_cached_tokens == 64


def test_per_tenant_pin_limit_caps_one_tenant_not_the_other(make_engine):
    engine = make_engine(max_pinned_tokens_per_tenant=32)
    assert run(engine, PREFIX + [1], "acme", pin_tokens=64, pin_ttl_s=60).num_pinned_tokens == 32
    other = list(range(3500, 3564))
    assert run(engine, other + [1], "globex", pin_tokens=64, pin_ttl_s=60).num_pinned_tokens == 32
    assert engine.stats().blocks_pinned == 4


def test_bad_pin_arguments_raise(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="pin"):
        engine.add_prompt([1, 2, 3], ONE, pin_tokens=10)
    with pytest.raises(ValueError, match="pin"):
        engine.add_prompt([1, 2, 3], ONE, pin_tokens=2, pin_ttl_s=0)


def test_pins_never_take_more_than_their_share_of_the_cache(make_engine):
    engine = make_engine(max_pinned_fraction=0.25)  # 5 of 20 blocks
    out = run(engine, list(range(3000, 3128)) + [1], pin_tokens=128, pin_ttl_s=60)
    assert out.num_pinned_tokens == 5 * 16 and engine.stats().blocks_pinned == 5
    # Another request needing the rest of the cache still runs.
    assert len(run(engine, list(range(200, 420))).token_ids) == 1
