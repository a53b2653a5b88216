"""Per-request KV allocation on top of the block pool: prefix lookup, growth, registration, release, and the
pool-wide operations the engine needs (pins, usage, reset, the cached keys). The manager owns its pool: the
engine and the worker group go through these methods, never to the pool itself."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator

from common.events import EventSink, HeldKeys, Tier
from common.hashing import block_keys
from common.stats import PrefixCacheStats, TierStats
from worker.block_pool import Block, BlockPool, PoolUsage
from worker.kv_tier_index import TierIndex
from worker.kv_tiers import TierOps
from worker.sequence import Sequence


class KVCacheManager:
    """One engine's KV blocks: which blocks each sequence holds, and the pool they come from."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_algo: str,
        sink: EventSink | None = None,
        shares: dict[str, float] | None = None,
        tiers: TierIndex | None = None,
    ) -> None:
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.tiers = tiers  # host RAM and disk below the pool (worker/kv_tiers.py)
        self._pool = BlockPool(num_blocks, sink, shares, on_evict=tiers.on_gpu_evict if tiers else None)
        self.stats: dict[str, PrefixCacheStats] = defaultdict(PrefixCacheStats)

    def keys_of(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The first ``num_blocks`` full-block keys of ``seq``, hashing only blocks not hashed before."""
        have = len(seq.block_keys)
        if num_blocks > have:
            parent = seq.block_keys[-1] if have else seq.root_key
            upto = seq.token_ids[: num_blocks * self.block_size]
            seq.block_keys.extend(block_keys(upto, self.block_size, parent, self.hash_algo, start_block=have))
        return seq.block_keys[:num_blocks]

    def find_prefix(self, seq: Sequence) -> list[Block]:
        """The longest run of cached leading blocks of ``seq``, leaving at least its last token to compute."""
        return self._pool.cached_prefix(self.keys_of(seq, (seq.num_tokens - 1) // self.block_size))

    def find_lower(self, seq: Sequence, start: int) -> int:
        """How many blocks of ``seq`` from block ``start`` on (past its GPU prefix) host RAM holds: blocks
        admission loads instead of computing (leaving at least the last token to compute)."""
        if self.tiers is None:
            return 0
        keys = self.keys_of(seq, (seq.num_tokens - 1) // self.block_size)[start:]
        return self.tiers.host_run(keys, seq.tenant)

    def stage(self, waiting: Iterable[Sequence], max_seqs: int) -> None:
        """Before scheduling: read from disk into host RAM the blocks that continue the prefix of the first
        ``max_seqs`` waiting requests past what the GPU pool and host RAM hold."""
        if self.tiers is None or self.tiers.disk is None:
            return
        self.tiers.poll()
        for seq in itertools.islice(waiting, max_seqs):
            keys = self.keys_of(seq, (seq.num_tokens - 1) // self.block_size)
            start = len(self._pool.cached_prefix(keys))
            start += self.tiers.host_run(keys[start:], seq.tenant)
            self.tiers.stage(keys[start:], seq.tenant)

    def is_loading(self, key: bytes) -> bool:
        """Whether a disk read is bringing ``key``'s block into host RAM now (its request waits for it)."""
        return self.tiers is not None and key in self.tiers.loading

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` lacks to hold its computed tokens plus ``num_new_tokens`` more."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_admit(self, seq: Sequence, prefix: list[Block], num_new_tokens: int, lower: int = 0) -> bool:
        """Whether the pool can take ``seq`` with its cached ``prefix``, ``lower`` blocks loaded from host RAM
        after it, and ``num_new_tokens`` to compute."""
        assert not seq.block_table
        have = len(prefix) + lower
        fresh = -(-(have * self.block_size + num_new_tokens) // self.block_size) - len(prefix)
        # Touching a cached-but-free prefix block takes it out of the free queue too.
        reclaimed = sum(1 for b in prefix if b.ref_cnt == 0)
        return fresh + reclaimed <= self._pool.num_free

    def admit(self, seq: Sequence, prefix: list[Block], num_new_tokens: int, lower: int = 0) -> None:
        """Attach the cached ``prefix`` (no copy), then ``lower`` fresh blocks that the coming step loads from host
        RAM (registered now: they count as cached), and allocate blocks for the next ``num_new_tokens``."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        self._pool.touch(prefix)
        seq.block_table = list(prefix)
        if lower:
            assert self.tiers is not None
            start = len(prefix)
            keys = seq.block_keys[start : start + lower]
            held = self.tiers.hold(keys)
            loaded = self._pool.allocate(lower, seq.tenant)
            self.tiers.load(keys, held, loaded)
            seq.block_table.extend(loaded)
            parent = seq.block_keys[start - 1] if start else None
            self._pool.cache(loaded, keys, parent, seq.tenant)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_registered_blocks = len(seq.block_table)
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            st = self.stats[seq.tenant]
            st.requests += 1
            st.queried_tokens += seq.num_prompt_tokens
            st.hit_tokens += seq.num_cached_tokens
        ok = self.grow(seq, num_new_tokens)
        assert ok, "admit() without can_admit()"

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens; False (and nothing allocated) if the pool is short."""
        n = self.blocks_needed(seq, num_new_tokens)
        if n > self._pool.num_free:
            return False
        seq.block_table.extend(self._pool.allocate(n, seq.tenant))
        return True

    def register(self, seq: Sequence) -> list[bytes]:
        """Publish the blocks ``seq`` has completely computed since last time; returns their keys."""
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.num_registered_blocks
        if num_full <= start:
            return []
        keys = self.keys_of(seq, num_full)[start:]
        # A prompt's first block has the tenant's root key as its parent: that key never leaves the engine.
        parent = seq.block_keys[start - 1] if start else None
        self._pool.cache(seq.block_table[start:num_full], keys, parent, seq.tenant)
        seq.num_registered_blocks = num_full
        return keys

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Give ``child`` the K/V of ``parent``'s computed tokens (n > 1: a choice of the same prompt): the full
        blocks are shared by reference count, the last partial block (where both will write their next tokens)
        is copy-on-write: ``child`` gets a fresh block, and the caller must copy the parent's into it before
        either writes. Returns those (source, destination) block-id copies, or None (nothing changed) when the
        pool has no free block for the copy."""
        assert not child.block_table
        full, partial = divmod(parent.num_computed_tokens, self.block_size)
        if partial and self._pool.num_free < 1:
            return None
        shared = parent.block_table[:full]
        self._pool.touch(shared)
        child.block_table = list(shared)
        copies = []
        if partial:
            (block,) = self._pool.allocate(1, child.tenant)
            child.block_table.append(block)
            copies.append((parent.block_table[full].block_id, block.block_id))
        child.block_keys = list(parent.block_keys)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = min(parent.num_registered_blocks, full)
        child.admitted, child.num_cached_tokens = True, parent.num_cached_tokens
        return copies

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's blocks, tail first; their computed content stays cached until evicted."""
        self._pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # -- the pool as a whole ----------------------------------------------------------------------------------

    def pin(
        self,
        keys: list[bytes],
        until: float,
        tenant: str,
        limit_blocks: int | None = None,
        total_limit_blocks: int | None = None,
    ) -> int:
        """Pin (or refresh) the cached blocks of ``keys`` until ``until``; returns how many leading keys are
        pinned (see ``BlockPool.pin`` for the limits). With a host tier the pins live there (the blocks are
        copied down), so that pinned prefixes never hold GPU blocks: a pinned prefix is a GPU hit while the pool
        keeps it, a host load after."""
        if self.tiers is not None and self.tiers.host_enabled:
            return self.tiers.pin(self._pool, keys, until, tenant, limit_blocks, total_limit_blocks)
        return self._pool.pin(keys, until, tenant, limit_blocks, total_limit_blocks)

    @property
    def pin_capacity(self) -> int:
        """The blocks pins are a fraction of: the host tier's, when pins live there, else the GPU pool's."""
        if self.tiers is not None and self.tiers.host_enabled:
            return self.tiers.host.num_blocks
        return self._pool.num_blocks

    def expire_pins(self, now: float) -> int:
        """Release the pins whose deadline has passed; returns how many."""
        n = self._pool.expire_pins(now)
        if self.tiers is not None:
            n += self.tiers.host.expire_pins(now)
        return n

    def usage(self) -> PoolUsage:
        u = self._pool.usage()
        if self.tiers is not None:
            u = u._replace(pinned=u.pinned + len(self.tiers.host.pins))
        return u

    def forget_tenant(self, tenant: str) -> tuple[int, int]:
        """``BlockPool.forget_tenant`` on the GPU pool and the host and disk tiers: a deleted tenant's pins and
        unused cached blocks go (pins, blocks; summed over the tiers)."""
        pools = [self._pool]
        if self.tiers is not None:
            pools += [p for p in (self.tiers.host, self.tiers.disk) if p is not None]
        done = [p.forget_tenant(tenant) for p in pools]
        return sum(d[0] for d in done), sum(d[1] for d in done)

    def reset(self) -> bool:
        """Forget every cached block, in every tier (only while no block is in use); returns whether it
        happened."""
        if self.tiers is not None and self.tiers.host.pins:
            return False  # pinned blocks stay, as in the GPU pool
        if not self._pool.reset():
            return False
        if self.tiers is not None:
            self.tiers.reset()
        return True

    def write_down(self, round_blocks: int = 1024) -> Iterator[None]:
        """Queue tier copies that put every cached GPU block the disk tier lacks on disk (through host RAM),
        yielding after each round (as many blocks as host RAM has free slots for, at most ``round_blocks``, which
        bounds the copies queued for the writer at once): the caller then runs the queued ops and resumes."""
        assert self.tiers is not None
        queued = 0
        for b in list(self._pool.key_to_block.values()):
            if b.key is None:
                continue
            if queued >= round_blocks or not self.tiers.copy_down(b.block_id, b.key, b.parent, b.tenant):
                yield
                queued = 0
                if not self.tiers.copy_down(b.block_id, b.key, b.parent, b.tenant):
                    return  # no host slot even after a round: give up
            queued += 1
        yield

    def take_tier_ops(self) -> TierOps | None:
        """The tier copies the coming step makes first (None without tiers)."""
        return self.tiers.take_ops() if self.tiers is not None else None

    def tier_step_done(self, load_s: float) -> None:
        if self.tiers is not None:
            self.tiers.step_done(load_s)

    def tier_stats(self) -> dict[str, TierStats]:
        return self.tiers.tier_stats() if self.tiers is not None else {}

    def held_keys(self) -> HeldKeys:
        """What a KV event snapshot lists: the GPU pool's cached keys, and with tiers every tier's."""
        if self.tiers is None:
            return self.cached_keys()
        return {Tier.GPU: self.cached_keys(), **self.tiers.held_keys()}

    def cached_keys(self) -> list[bytes]:
        """The key of every block the pool holds cached (in use or free): a snapshot of what it has published."""
        return list(self._pool.key_to_block)
