"""The compact prefix index (router/routing/compact_index.py on router/routing/keytable.py): the hash table's growth,
deletion and load limit, the index against a plain dict model under random events, snapshots, and more than 64
groups."""

from __future__ import annotations

import io
import random
from pathlib import Path

import numpy as np
import pytest

from common.events import AllCleared, BlockRemoved, BlockStored, KVEvent, Tier
from router.routing.compact_index import CompactPrefixIndex as PrefixIndex, key_codes
from router.routing.index_base import TierMatch
from router.routing.keytable import MAX_LOAD, MIN_CAPACITY, KeyTable

pytestmark = pytest.mark.usefixtures("key_table_path")  # every test on the C table and on the numpy one


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def random_keys(rng: random.Random, n: int) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(n)]


def test_key_codes_are_the_first_8_bytes_and_never_the_empty_mark():
    codes = key_codes([k(5), k(0), b"\x01" * 32, b"ab"])
    assert codes[0] == 5 and codes[1] != 0 and codes[2] == int.from_bytes(b"\x01" * 8, "little")
    assert codes[3] == int.from_bytes(b"ab", "little")


def test_table_grows_across_doublings_and_finds_every_key():
    rng = np.random.default_rng(1)
    table = KeyTable()
    inserted = []
    for _ in range(6):  # 1024 slots to 32768: five doublings
        codes = np.sort(rng.integers(1, 2**63, 3000, dtype=np.int64).astype(np.uint64))
        slots = table.insert(codes)
        assert (table.codes[slots] == codes).all()
        inserted.append(codes)
        assert table.used <= MAX_LOAD * table.capacity
    assert table.capacity == 32768 and table.used == 18000
    everything = np.concatenate(inserted)
    slots = table.find(everything)
    assert (slots >= 0).all() and (table.codes[slots] == everything).all()
    assert (table.find(np.arange(1, 1000, dtype=np.uint64) * np.uint64(3)) == -1).all()


def test_a_table_at_its_load_limit_still_finds_every_key_then_grows_by_one_more():
    table = KeyTable()
    limit = int(MAX_LOAD * MIN_CAPACITY)
    # Codes in a few narrow runs of home slots: long clusters, the hard case for probing and deletion.
    codes = np.sort(np.array([(h % 64) * 16 + (h // 64) * MIN_CAPACITY + 1 for h in range(limit)], np.uint64))
    table.insert(codes)
    assert table.capacity == MIN_CAPACITY and table.used == limit
    assert (table.find(codes) >= 0).all()
    table.insert(np.array([2**40 + 3], np.uint64))
    assert table.capacity == 2 * MIN_CAPACITY and (table.find(codes) >= 0).all()


@pytest.mark.parametrize("clustered", [False, True])
def test_deleting_in_random_order_keeps_every_other_key_findable(clustered):
    rng = np.random.default_rng(2)
    table = KeyTable()
    if clustered:  # homes in a handful of slots near the end of the table: one cluster that wraps around
        homes = rng.integers(MIN_CAPACITY - 40, MIN_CAPACITY + 8, 300)
        codes = homes.astype(np.uint64) + np.arange(300, dtype=np.uint64) * np.uint64(MIN_CAPACITY)
    else:
        codes = rng.integers(1, 2**63, 700, dtype=np.int64).astype(np.uint64)
    codes = np.sort(codes)
    table.insert(codes)
    alive = set(codes.tolist())
    order = rng.permutation(codes)
    start = 0
    while start < len(order):  # batches of various sizes, some with keys of one cluster
        size = (1, 3, 37, 90)[start % 4]
        doomed, start = order[start : start + size], start + size
        table.delete(np.unique(table.find(doomed)))
        alive -= set(doomed.tolist())
        assert table.used == len(alive)
        assert (table.find(doomed) == -1).all()
        if alive:
            left = np.array(sorted(alive), np.uint64)
            slots = table.find(left)
            assert (slots >= 0).all() and (table.codes[slots] == left).all()
    assert not alive and not table.codes.any()


class Model:
    """The reference: per group, key -> the set of tiers holding it."""

    def __init__(self) -> None:
        self.held: dict[str, dict[bytes, set[Tier]]] = {}

    def apply(self, group: str, event: KVEvent) -> None:
        held = self.held.setdefault(group, {})
        if isinstance(event, BlockStored):
            for key in event.keys:
                held.setdefault(key, set()).add(event.tier)
        elif isinstance(event, BlockRemoved):
            for key in event.keys:
                tiers = held.get(key, set())
                tiers.discard(event.tier)
                if not tiers:
                    held.pop(key, None)
        else:
            held.clear()

    def match_tiers(self, prompt: list[bytes]) -> dict[str, TierMatch]:
        out = {}
        for g, held in self.held.items():
            n = host = disk = 0
            while n < len(prompt) and prompt[n] in held:
                tiers = held[prompt[n]]
                host += Tier.GPU not in tiers and Tier.HOST in tiers
                disk += tiers == {Tier.DISK}
                n += 1
            if n:
                out[g] = TierMatch(n, host, disk)
        return out


def random_event(rng: random.Random, pool: list[bytes]) -> KVEvent:
    op, tier = rng.random(), rng.choice(list(Tier))
    start = rng.randrange(len(pool))
    keys = pool[start : start + rng.randrange(1, 300)]  # runs of a chain, as engines publish them
    if op < 0.6:
        return BlockStored(keys, None, tier)
    if op < 0.98:
        return BlockRemoved(keys, tier)
    return AllCleared()


def test_index_matches_a_dict_model_under_random_events():
    rng = random.Random(7)
    pool = random_keys(rng, 3000)
    groups = [f"g{i}" for i in range(12)]
    index, model = PrefixIndex(), Model()
    for step in range(600):
        g = rng.choice(groups)
        event = random_event(rng, pool)
        index.apply(g, event)
        model.apply(g, event)
        if step % 10 == 0:
            for _ in range(3):
                start = rng.randrange(len(pool))
                prompt = pool[start : start + rng.randrange(1, 400)]
                chunks = [prompt[i : i + 64] for i in range(0, len(prompt), 64)]
                assert index.match_tiers(chunks) == model.match_tiers(prompt)
    held = {g: len(keys) for g, keys in model.held.items() if keys}
    assert index.key_counts() == held
    assert len(index) == len(set().union(*(set(keys) for keys in model.held.values())))
    for g, keys in model.held.items():
        assert index.tier_counts()[g] == {str(t): sum(t in tiers for tiers in keys.values()) for t in Tier}
    index.remove_group("g3")
    del model.held["g3"]
    assert index.match_tiers([pool]) == model.match_tiers(pool)
    assert "g3" not in index.key_counts()


@pytest.mark.parametrize("n", [50, 20_000])  # a small batch probes by windows, a large one slot by slot first
def test_a_key_repeated_in_one_event_takes_one_slot(n):
    rng = random.Random(n)
    keys = random_keys(rng, n)
    repeated = keys + keys[: n // 2] + [keys[0]] * 3
    rng.shuffle(repeated)
    index = PrefixIndex()
    index.apply("a", BlockStored(repeated, None))
    assert len(index) == n == index.key_counts()["a"]
    index.apply("b", BlockStored(repeated[::-1], None))  # held already: no new slot
    assert len(index) == n
    assert index.match_tiers([keys]) == {"a": TierMatch(n), "b": TierMatch(n)}
    index.apply("a", BlockRemoved(repeated))
    index.apply("b", AllCleared())
    assert len(index) == 0 and not index._table.codes.any()


def test_a_batch_of_events_applies_like_one_event_at_a_time():
    rng = random.Random(8)
    pool = random_keys(rng, 500)
    batch = [(f"g{rng.randrange(4)}", random_event(rng, pool)) for _ in range(300)]
    one, many = PrefixIndex(), PrefixIndex()
    for g, e in batch:
        one.apply(g, e)
    many.apply_many(batch)
    assert one.tier_counts() == many.tier_counts() and len(one) == len(many)
    assert one.match_tiers([pool]) == many.match_tiers([pool])


def test_predictions_extend_a_run_and_count_as_gpu():
    index = PrefixIndex()
    keys = [k(i) for i in range(6)]
    index.apply("a", BlockStored(keys[:2], None))
    index.apply("a", BlockStored(keys[2:4], None, Tier.HOST))
    b = index.bit("a")
    assert index.match_tiers([keys]) == {"a": TierMatch(4, host=2)}
    assert index.match_tiers([keys], {keys[4]: b}) == {"a": TierMatch(5, host=2)}
    assert index.holders_many(keys) == [b, b, b, b, 0, 0]


def test_a_prompt_no_group_holds_asks_for_one_chunk():
    index = PrefixIndex()
    index.apply("a", BlockStored([k(1)], None))
    asked = []

    def chunks():
        for i in range(10):
            asked.append(i)
            yield [k(1000 + 64 * i + j) for j in range(64)]

    assert index.match_tiers(chunks()) == {}
    assert asked == [0]


def test_snapshot_round_trip(tmp_path):
    rng = random.Random(9)
    pool = random_keys(rng, 4000)
    index = PrefixIndex()
    for g in ("a", "b", "c"):
        index.apply(g, BlockStored(pool[: rng.randrange(1000, 4000)], None))
        index.apply(g, BlockStored(pool[:500], None, Tier.DISK))
    freed = index.bit("b")
    index.remove_group("b")  # a freed bit travels with the snapshot
    for copy in (PrefixIndex.from_bytes(index.to_bytes()), _saved(index, tmp_path)):
        assert len(copy) == len(index) and copy.tier_counts() == index.tier_counts()
        assert copy.match_tiers([pool]) == index.match_tiers([pool])
        assert copy.bit("d") == freed  # the freed bit, reused
        copy.apply("a", AllCleared())
        assert "a" not in copy.key_counts() and "a" in index.key_counts()
    with pytest.raises(ValueError):
        PrefixIndex.read(io.BytesIO(b"not a snapshot at all"))


def _saved(index: PrefixIndex, tmp_path) -> PrefixIndex:
    path = tmp_path / "index.snap"
    index.save(path)
    return PrefixIndex.load(path)


def test_more_than_64_groups_widen_the_masks():
    rng = random.Random(10)
    pool = random_keys(rng, 400)
    groups = [f"g{i}" for i in range(150)]
    index, model = PrefixIndex(), Model()
    for i, g in enumerate(groups):  # group i holds the first 400 - 2i keys, some in host RAM
        event = BlockStored(pool[: 400 - 2 * i], None, Tier.HOST if i % 7 == 0 else Tier.GPU)
        index.apply(g, event)
        model.apply(g, event)
    assert index.bit("g149") == 1 << 149 and index._table.words == 3
    assert index.match_tiers([pool]) == model.match_tiers(pool)
    assert index.holders(pool[399 - 2 * 140]) == sum(1 << i for i in range(141))
    assert index.key_counts() == {g: 400 - 2 * i for i, g in enumerate(groups)}
    index.remove_group("g100")
    index.apply("g120", AllCleared())
    for g in ("g100", "g120"):
        del model.held[g]
    assert index.match_tiers([pool]) == model.match_tiers(pool)
    copy = PrefixIndex.from_bytes(index.to_bytes())
    assert copy.match_tiers([pool]) == model.match_tiers(pool)


def test_a_trace_replayed_on_either_index_routes_every_request_the_same():
    # The same routing decisions end to end (predictions, tiers, evictions through the simulated groups): the two
    # indexes answer every lookup alike, or some request would land elsewhere and the figures would differ.
    from router.sim.replay import load_trace, replay

    trace = load_trace(Path(__file__).parents[1] / "data" / "mooncake_conversation_1500.jsonl")
    runs = [
        replay(trace, 4, 200_000, 512, host_capacity_tokens=100_000, progress=False, index=kind)
        for kind in ("dict", "compact")
    ]
    assert runs[0]["hit_ratio"] > 0.04  # the trace reuses prefixes: a broken index would lose them
    assert runs[0] == runs[1]
