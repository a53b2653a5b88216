"""The compact index's one-key-at-a-time paths (router/routing/keytable.py ``*_small``, compact_index.py for events
of a few keys and a prompt's first keys) against the dict index, on tables whose keys crowd into a few clusters
(the hard case for probing and backward shifts), with one mask word per tier and with several."""

from __future__ import annotations

import random

import numpy as np
import pytest

from common.events import AllCleared, BlockRemoved, BlockStored, Tier
from router.routing.compact_index import CompactPrefixIndex
from router.routing.dict_index import DictPrefixIndex
from router.routing.keytable import MIN_CAPACITY, WINDOW, KeyTable

pytestmark = pytest.mark.usefixtures("key_table_path")  # every test on the C table and on the numpy one


def clustered_keys(rng: random.Random, n: int) -> list[bytes]:
    """Distinct keys whose codes' low bits fall in a few narrow runs (long clusters, some wrapping around)."""
    codes: set[int] = set()
    while len(codes) < n:
        home = rng.choice([3, 200, 640, MIN_CAPACITY - 5]) + rng.randrange(24)
        codes.add(home + rng.randrange(1, 2**40) * 4 * MIN_CAPACITY)
    return [c.to_bytes(8, "little") + rng.randbytes(8) for c in codes]


@pytest.mark.parametrize("groups", [10, 70])  # one mask word per tier; two
def test_small_events_match_the_dict_index(groups):
    rng = random.Random(groups)
    pool = clustered_keys(rng, 1500)
    names = [f"g{i}" for i in range(groups)]
    compact, plain = CompactPrefixIndex(), DictPrefixIndex()
    for step in range(1500):
        g, tier = rng.choice(names), rng.choice([Tier.GPU, Tier.GPU, Tier.HOST, Tier.DISK])
        start = rng.randrange(len(pool))
        keys = pool[start : start + rng.choice([1, 2, 5, 16, 40, 600])]  # mostly small; now and then a batch
        op = rng.random()
        event = BlockStored(keys, None, tier) if op < 0.55 else BlockRemoved(keys, tier) if op < 0.995 else AllCleared()
        compact.apply(g, event)
        plain.apply(g, event)
        if step % 250 == 0:
            assert len(compact) == len(plain)
            assert compact.holders_many(pool) == plain.holders_many(pool)
            for _ in range(4):
                start = rng.randrange(len(pool))
                prompt = pool[start : start + rng.randrange(1, 200)]
                chunks = [prompt[i : i + 16] for i in range(0, len(prompt), 16)]
                assert compact.match_tiers(chunks) == plain.match_tiers([prompt])
    assert compact.key_counts() == plain.key_counts() and compact.tier_counts() == plain.tier_counts()
    assert [compact.holders_many(pool[i : i + 7]) for i in range(0, 70, 7)] == [
        plain.holders_many(pool[i : i + 7]) for i in range(0, 70, 7)
    ]
    t = compact._table
    assert (t.codes[:WINDOW] == t._padded[t.capacity :]).all()  # the padding still repeats the first slots


def test_a_prompts_first_keys_stop_at_the_first_miss_and_count_predictions():
    index = CompactPrefixIndex()
    keys = [i.to_bytes(16, "little") for i in range(1, 200)]
    index.apply("a", BlockStored(keys[:150], None))
    index.apply("a", BlockStored(keys[:10], None, Tier.HOST))
    index.apply("b", BlockStored(keys[:3], None, Tier.DISK))
    index.apply("a", BlockRemoved(keys[:10]))  # (GPU copies gone: host RAM only)
    b = index.bit("b")
    assert index.match_tiers([keys]) == {"a": (150, 10, 0), "b": (3, 0, 3)}
    assert index.match_tiers([keys], {keys[3]: b}) == {"a": (150, 10, 0), "b": (4, 0, 3)}


def test_batch_deletion_with_repeated_slots_and_clusters_that_end_at_a_doomed_slot():
    rng = np.random.default_rng(3)
    table = KeyTable()
    homes = rng.integers(MIN_CAPACITY - 60, MIN_CAPACITY + 60, 500) % MIN_CAPACITY
    codes = np.unique(homes.astype(np.uint64) + rng.integers(1, 2**40, 500).astype(np.uint64) * np.uint64(4096))
    table.insert(codes)
    alive = set(codes.tolist())
    for size in (5, 40, 13, 60, 1, 25):
        doomed = rng.choice(np.array(sorted(alive), np.uint64), size, replace=False)
        slots = table.find(doomed)
        table.delete(np.concatenate([slots, slots[: size // 2]]))  # some slots given twice
        alive -= set(doomed.tolist())
        assert table.used == len(alive) and (table.find(doomed) == -1).all()
        left = np.array(sorted(alive), np.uint64)
        assert (table.codes[table.find(left)] == left).all()
    assert (table.codes[:WINDOW] == table._padded[table.capacity :]).all()
