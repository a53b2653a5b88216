from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.events import AllCleared, BlockRemoved, BlockStored, ListSink
from common.hashing import block_keys, tenant_root_key
from common.sampling import SamplingParams
from worker.block_pool import BlockPool
from worker.kv_cache_manager import KVCacheManager
from worker.sequence import Sequence

BS = 4
ROOT = tenant_root_key(b"test-secret", "acme")


ROOTS = {"acme": ROOT, "globex": tenant_root_key(b"test-secret", "globex")}


def make_seq(rid: str, tokens: list[int], root: bytes = ROOT, tenant: str = "acme") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=4), tenant, root)


def compute_all(kv: KVCacheManager, seq: Sequence) -> None:
    """Admit ``seq`` with its cached prefix and pretend the model computed the rest."""
    prefix = kv.find_prefix(seq)
    n = seq.num_tokens - len(prefix) * BS
    assert kv.can_admit(seq, prefix, n)
    kv.admit(seq, prefix, n)
    seq.num_computed_tokens += n
    kv.register(seq)


def test_free_queue_is_lru_and_a_hit_leaves_it_from_the_middle():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert [b.block_id for b in pool.free_queue] == [2, 0, 3, 1]
    pool.touch([blocks[3]])
    assert [b.block_id for b in pool.free_queue] == [2, 0, 1]
    assert [b.block_id for b in pool.allocate(2)] == [2, 0]


def test_freed_cached_block_keeps_its_key_until_reused():
    sink = ListSink()
    pool = BlockPool(2, sink)
    b = pool.allocate(1)
    pool.cache(b, [b"k" * 16], ROOT)
    pool.free(b)
    assert pool.lookup(b"k" * 16) is b[0] and pool.usage().cached == 1
    pool.allocate(1)  # the never-cached block goes first
    assert pool.lookup(b"k" * 16) is b[0]
    pool.allocate(1)
    assert pool.lookup(b"k" * 16) is None
    assert sink.events == [BlockStored([b"k" * 16], ROOT), BlockRemoved([b"k" * 16])]


def test_referenced_blocks_are_never_evicted():
    pool = BlockPool(3)
    held = pool.allocate(2)
    pool.cache(held, [b"a" * 16, b"b" * 16], ROOT)
    pool.allocate(1)
    assert pool.num_free == 0
    try:
        pool.allocate(1)
    except RuntimeError:
        pass
    else:
        raise AssertionError("allocated a block while every block is referenced")
    assert pool.lookup(b"a" * 16) is held[0] and pool.lookup(b"b" * 16) is held[1]


def test_finished_sequence_frees_tail_first_so_its_tail_is_evicted_first():
    sink = ListSink()
    kv = KVCacheManager(4, BS, "xxh3_128", sink)
    seq = make_seq("a", list(range(12)) + [99])
    compute_all(kv, seq)
    keys = list(seq.block_keys[:3])
    kv.release(seq)
    sink.drain()
    kv._pool.allocate(2)  # the uncached partial tail block, then the last full block
    assert sink.events == [BlockRemoved([keys[2]])]


def test_second_request_sharing_blocks_attaches_them_without_copy():
    kv = KVCacheManager(16, BS, "xxh3_128")
    a = make_seq("a", list(range(10)))
    compute_all(kv, a)
    b = make_seq("b", list(range(9)) + [77, 78])
    compute_all(kv, b)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] is not a.block_table[2]
    assert a.block_table[0].ref_cnt == 2


def test_last_token_is_always_computed():
    kv = KVCacheManager(16, BS, "xxh3_128")
    compute_all(kv, make_seq("a", list(range(8))))
    again = make_seq("b", list(range(8)))
    compute_all(kv, again)
    assert again.num_cached_tokens == 4


def test_stored_events_carry_the_chained_keys_the_router_computes():
    sink = ListSink()
    kv = KVCacheManager(16, BS, "xxh3_128", sink)
    tokens = list(range(100, 113))
    compute_all(kv, make_seq("a", tokens))
    assert sink.events == [BlockStored(block_keys(tokens, BS, ROOT), None)]  # the root key is never published
    assert kv.cached_keys() == block_keys(tokens, BS, ROOT)


def test_reset_clears_only_when_idle():
    sink = ListSink()
    kv = KVCacheManager(8, BS, "xxh3_128", sink)
    seq = make_seq("a", list(range(9)))
    compute_all(kv, seq)
    assert not kv.reset()
    kv.release(seq)
    assert kv.reset() and kv.usage().cached == 0 and kv.cached_keys() == []
    assert sink.events[-1] == AllCleared()


def test_a_flooding_tenant_evicts_its_own_blocks_before_another_tenants():
    pool = BlockPool(16)
    b_blocks = pool.allocate(4, "globex")
    pool.cache(b_blocks, [bytes([66, i]) * 8 for i in range(4)], ROOT, "globex")
    pool.free(b_blocks)
    for i in range(200):  # acme: unique prompts of 3 blocks, released at once (a flood)
        blocks = pool.allocate(3, "acme")
        pool.cache(blocks, [bytes([65, i % 256, j]) + bytes(13) for j in range(3)], ROOT, "acme")
        pool.free(blocks)
    assert all(pool.lookup(bytes([66, i]) * 8) is not None for i in range(4))  # globex kept everything
    assert pool.resident["acme"] == 12 and pool.resident["globex"] == 4


def test_a_tenant_over_its_weighted_share_is_evicted_first():
    pool = BlockPool(8, shares={"acme": 1.0, "globex": 3.0})
    g = pool.allocate(5, "globex")
    pool.cache(g, [bytes([66, i]) * 8 for i in range(5)], ROOT, "globex")
    a = pool.allocate(3, "acme")
    pool.cache(a, [bytes([65, i]) * 8 for i in range(3)], ROOT, "acme")
    pool.free(g + a)
    pool.allocate(1, "globex")  # globex holds 5/3 per share, acme 3/1: acme's oldest block goes
    assert pool.lookup(bytes([65, 0]) * 8) is None
    assert (pool.resident["globex"], pool.resident["acme"]) == (6, 2)  # the new block counts for globex
    even = BlockPool(8)
    g = even.allocate(5, "globex")
    even.cache(g, [bytes([66, i]) * 8 for i in range(5)], ROOT, "globex")
    a = even.allocate(3, "acme")
    even.cache(a, [bytes([65, i]) * 8 for i in range(3)], ROOT, "acme")
    even.free(g + a)
    even.allocate(1, "acme")  # equal shares: globex holds more, so its oldest block goes
    assert even.lookup(bytes([66, 0]) * 8) is None
    assert (even.resident["globex"], even.resident["acme"]) == (4, 4)


def test_when_the_flooder_s_blocks_are_all_in_use_other_tenants_yield():
    pool = BlockPool(6)
    g = pool.allocate(2, "globex")
    pool.cache(g, [bytes([66, i]) * 8 for i in range(2)], ROOT, "globex")
    pool.free(g)
    held = pool.allocate(4, "acme")  # acme: running, every block referenced
    pool.cache(held, [bytes([65, i]) * 8 for i in range(4)], ROOT, "acme")
    assert len(pool.allocate(1, "acme")) == 1 and pool.resident["globex"] == 1  # the only free block was globex's


BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5]]


class PoolMachine(RuleBasedStateMachine):
    """Random admissions (sharing prefixes), decode growth, finishes and evictions keep the pool sound."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(12, BS, "xxh3_128", ListSink(), shares={"acme": 1.0, "globex": 2.0})
        self.live: list[Sequence] = []
        self.n = 0
        self.now = 0.0

    @rule(
        base=st.sampled_from(BASES),
        cut=st.integers(1, 8),
        tail=st.lists(st.integers(0, 3), max_size=9),
        tenant=st.sampled_from(sorted(ROOTS)),
    )
    def admit(self, base: list[int], cut: int, tail: list[int], tenant: str) -> None:
        seq = make_seq(f"r{self.n}", base[:cut] + tail, ROOTS[tenant], tenant)
        self.n += 1
        prefix = self.kv.find_prefix(seq)
        n = seq.num_tokens - len(prefix) * BS
        if not self.kv.can_admit(seq, prefix, n):
            return
        self.kv.admit(seq, prefix, n)
        seq.num_computed_tokens += n
        self.kv.register(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 3))
    def decode(self, i: int, tok: int) -> None:
        seq = self.live[i % len(self.live)]
        seq.token_ids.append(tok)
        if self.kv.grow(seq, 1):
            seq.num_computed_tokens += 1
            self.kv.register(seq)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        self.kv.release(self.live.pop(i % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), ttl=st.floats(0.5, 5.0), limit=st.one_of(st.none(), st.integers(0, 4)))
    def pin(self, i: int, ttl: float, limit: int | None) -> None:
        seq = self.live[i % len(self.live)]
        before = self.kv._pool.pinned_blocks_of["acme"]
        self.kv.pin(seq.block_keys[: seq.num_registered_blocks], self.now + ttl, "acme", limit)
        if limit is not None:  # a limit stops new pins, never refreshes
            assert self.kv._pool.pinned_blocks_of["acme"] <= max(before, limit)

    @rule(dt=st.floats(0.0, 3.0))
    def advance_clock(self, dt: float) -> None:
        self.now += dt
        self.kv.expire_pins(self.now)

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.kv._pool  # white box: the pool's own bookkeeping
        queued = {b.block_id for b in pool.free_blocks()}
        refs = {b.block_id: 0 for b in pool.blocks}
        for seq in self.live:
            for b in seq.block_table:
                refs[b.block_id] += 1
        for block_id in pool.pins:
            refs[block_id] += 1
            assert pool.blocks[block_id].key is not None
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == refs[b.block_id]
            assert (b.block_id in queued) == (b.ref_cnt == 0)
            if b.key is not None:
                assert pool.key_to_block[b.key] is b
        for key, b in pool.key_to_block.items():
            assert b.key == key
        assert len(queued) == pool.num_free
        for tenant in ROOTS:  # per-tenant residency, which eviction uses: blocks in use by it or caching its keys
            assert pool.resident[tenant] == sum(
                1 for b in pool.blocks if (b.key is not None or b.ref_cnt) and b.tenant == tenant
            )
        for tenant, q in pool.cached_queues.items():
            assert all(b.key is not None and b.tenant == tenant and b.ref_cnt == 0 for b in q)

    def teardown(self) -> None:
        for seq in self.live:
            self.kv.release(seq)
        self.kv.expire_pins(self.now + 1e9)
        assert self.kv.usage().free + self.kv.usage().cached == self.kv._pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv._pool.blocks)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_forgetting_a_tenant_releases_its_pins_and_drops_only_its_unused_blocks():
    sink = ListSink()
    kv = KVCacheManager(12, BS, "xxh3_128", sink)
    pool = kv._pool
    acme, globex = make_seq("a", list(range(8))), make_seq("g", list(range(8)), ROOTS["globex"], "globex")
    for seq in (acme, globex):
        compute_all(kv, seq)
        kv.release(seq)
    acme_keys = block_keys(list(range(8)), BS, ROOT)
    assert pool.pin(acme_keys, until=1e18, tenant="acme") == 2
    running = make_seq("r", list(range(100, 108)))  # a request of acme still running: its blocks stay
    compute_all(kv, running)
    sink.drain()

    assert pool.forget_tenant("acme") == (2, 2)
    assert pool.pinned_blocks_of["acme"] == 0 and not pool.pins
    assert all(pool.lookup(k) is None for k in acme_keys)
    assert [e for e in sink.events if isinstance(e, BlockRemoved)] == [BlockRemoved(acme_keys)]
    globex_keys = block_keys(list(range(8)), BS, ROOTS["globex"])
    assert all(pool.lookup(k) is not None for k in globex_keys)  # another tenant's blocks stay cached
    assert all(pool.lookup(k) is not None for k in block_keys(list(range(100, 108)), BS, ROOT))  # in use: kept
    assert pool.num_free == 12 - 2  # everything but the running request's two blocks can be handed out
    assert pool.forget_tenant("acme") == (0, 0)
