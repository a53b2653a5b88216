"""The block pool: physical KV blocks, their reference counts, the key -> block map and the LRU free queues.

A block with references is in use. A block without references is free; if it still has a key it is
*cached*: a later request with that key takes it back (O(1), from anywhere in its queue). Only when a fresh
block is needed and no keyless block is left is a cached block evicted and its key forgotten (lazy eviction).

Tenant shares: every cached key belongs to one tenant (keys are chained from the tenant's root), and each tenant
has its own LRU queue of cached free blocks. An eviction takes the least recently freed block of the tenant
that holds the most blocks for its weight (``shares``, default 1 each). So a tenant flooding the cache with
unique prompts evicts its own blocks first: another tenant's cached blocks go only once that tenant holds more
than the flooder, for their weights, or when every block of the flooder is in use by a running request.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from common.events import AllCleared, BlockRemoved, BlockStored, EventSink

# Called with (block id, key, parent key, tenant) of a cached block just before an eviction reuses it: its K/V is
# still intact (the KV tiers copy it down, worker/kv_tiers.py).
EvictHook = Callable[[int, bytes, "bytes | None", str], None]


class Block:
    __slots__ = ("block_id", "ref_cnt", "key", "parent", "tenant", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: bytes | None = None
        self.parent: bytes | None = None  # the key before ``key`` in its chain (None: a prompt's first block)
        self.tenant = ""  # the tenant holding it (in use by its request, or caching its key)
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: O(1) pop, append and removal."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def append(self, b: Block) -> None:
        assert b.prev is None and b.next is None, f"{b} is already queued"
        last = self._tail.prev
        assert last is not None
        last.next, b.prev, b.next, self._tail.prev = b, last, self._tail, b
        self._len += 1

    def remove(self, b: Block) -> None:
        assert b.prev is not None and b.next is not None, f"{b} is not queued"
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self._len -= 1

    def popleft(self) -> Block:
        b = self._head.next
        assert b is not None and b is not self._tail, "free queue is empty"
        self.remove(b)
        return b

    def __iter__(self):
        b = self._head.next
        while b is not self._tail:
            assert b is not None
            yield b
            b = b.next


class PoolUsage(NamedTuple):
    used: int  # referenced by a request or a pin
    cached: int  # unreferenced, still holding a key (evictable)
    free: int
    pinned: int


class BlockPool:
    """Owns ``num_blocks`` physical block ids; the K/V tensors they index live in the model runner."""

    def __init__(
        self,
        num_blocks: int,
        sink: EventSink | None = None,
        shares: dict[str, float] | None = None,
        on_evict: EvictHook | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if shares and any(w <= 0 for w in shares.values()):
            raise ValueError("tenant shares must be positive")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)  # free blocks without a key
        self.cached_queues: dict[str, FreeBlockQueue] = {}  # per tenant: free blocks that still hold a key
        self._num_cached_free = 0
        self.resident: dict[str, int] = defaultdict(int)  # per tenant: blocks it holds (in use, or cached)
        self.shares = dict(shares or {})
        self.key_to_block: dict[bytes, Block] = {}
        self.sink = sink
        # Pins: explicit cache entries. A pinned block holds one reference until its deadline.
        self.pins: dict[int, tuple[float, str]] = {}  # block id -> (until, tenant)
        self._pin_deadlines: list[tuple[float, int]] = []
        self.pinned_blocks_of: dict[str, int] = defaultdict(int)
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free or cached without references)."""
        return len(self.free_queue) + self._num_cached_free

    def free_blocks(self):
        """Every block without references: the keyless ones, then each tenant's cached ones (LRU first)."""
        yield from self.free_queue
        for q in self.cached_queues.values():
            yield from q

    def _enqueue(self, b: Block) -> None:
        if b.key is None:
            self.free_queue.append(b)
            return
        q = self.cached_queues.get(b.tenant)
        if q is None:
            q = self.cached_queues[b.tenant] = FreeBlockQueue(())
        q.append(b)
        self._num_cached_free += 1

    def _dequeue(self, b: Block) -> None:
        if b.key is None:
            self.free_queue.remove(b)
        else:
            self.cached_queues[b.tenant].remove(b)
            self._num_cached_free -= 1

    def _victim(self) -> Block:
        """The block to hand out next: a keyless one, else the LRU cached block of the tenant holding the most
        blocks for its share."""
        if len(self.free_queue):
            return self.free_queue.popleft()
        tenant = max(
            (t for t, q in self.cached_queues.items() if len(q)),
            key=lambda t: self.resident[t] / self.shares.get(t, 1.0),
        )
        self._num_cached_free -= 1
        return self.cached_queues[tenant].popleft()

    def lookup(self, key: bytes) -> Block | None:
        return self.key_to_block.get(key)

    def cached_prefix(self, keys: Iterable[bytes]) -> list[Block]:
        """The blocks of the longest run of leading ``keys`` that are cached (not referenced yet)."""
        hits = []
        for key in keys:
            b = self.key_to_block.get(key)
            if b is None:
                break
            hits.append(b)
        return hits

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self._dequeue(b)
            b.ref_cnt += 1

    def allocate(self, n: int, tenant: str = "") -> list[Block]:
        """Hand out ``n`` blocks with one reference each: keyless blocks first, then cached ones evicted by tenant
        share and LRU order."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        out, evicted = [], []
        for _ in range(n):
            b = self._victim()
            assert b.ref_cnt == 0
            if b.key is not None:
                if self.key_to_block.get(b.key) is b:
                    del self.key_to_block[b.key]
                evicted.append(b.key)
                if self.on_evict is not None:
                    self.on_evict(b.block_id, b.key, b.parent, b.tenant)
                b.key = b.parent = None
                self.resident[b.tenant] -= 1
            b.ref_cnt = 1
            b.tenant = tenant
            self.resident[tenant] += 1
            out.append(b)
        if evicted and self.sink is not None:
            self.sink.publish(BlockRemoved(evicted))
        return out

    def cache(self, blocks: list[Block], keys: list[bytes], parent_key: bytes | None, tenant: str = "") -> int:
        """Register full blocks whose K/V is now written under ``tenant``'s chained keys; returns how many were
        new.

        A key another block already holds (the same prefix computed twice) keeps its first block; the
        duplicate stays uncached and returns to the pool like any other block.
        """
        assert len(blocks) == len(keys)
        run: list[bytes] = []
        run_parent = parent_key
        stored = 0
        for b, key in zip(blocks, keys):
            assert b.ref_cnt > 0, f"caching unreferenced {b}"
            if b.key is None and key not in self.key_to_block:
                if b.tenant != tenant:  # allocated without an owner
                    self.resident[b.tenant] -= 1
                    self.resident[tenant] += 1
                b.key, b.tenant = key, tenant
                b.parent = run[-1] if run else run_parent
                self.key_to_block[key] = b
                run.append(key)
                stored += 1
            else:
                self._publish_stored(run, run_parent)
                run = []
                run_parent = key
        self._publish_stored(run, run_parent)
        return stored

    def _publish_stored(self, keys: list[bytes], parent_key: bytes | None) -> None:
        if keys and self.sink is not None:
            self.sink.publish(BlockStored(keys, parent_key))

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the order given (callers pass a sequence tail first, so
        its tail blocks are evicted before the prefix other requests are likely to share)."""
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.key is None:  # nothing cached: the tenant lets go of it
                    self.resident[b.tenant] -= 1
                    b.tenant = ""
                self._enqueue(b)

    def drop(self, key: bytes) -> bool:
        """Forget the cached, unreferenced block of ``key`` (its content is bad or gone); returns whether it was
        held."""
        b = self.key_to_block.get(key)
        if b is None or b.ref_cnt:
            return False
        self._dequeue(b)
        del self.key_to_block[key]
        self.resident[b.tenant] -= 1
        b.key = b.parent = None
        b.tenant = ""
        self._enqueue(b)
        if self.sink is not None:
            self.sink.publish(BlockRemoved([key]))
        return True

    def pin(
        self,
        keys: list[bytes],
        until: float,
        tenant: str,
        limit_blocks: int | None = None,
        total_limit_blocks: int | None = None,
    ) -> int:
        """Keep the cached blocks of ``keys`` resident until ``until`` (a ``time.monotonic`` deadline): a pin
        holds a reference, so the block never reaches the free queue. Pinning a pinned block moves its deadline
        later (a refresh). Stops at the first key not cached or beyond the tenant's ``limit_blocks``; returns
        how many leading keys are pinned. ``total_limit_blocks`` caps pins over all tenants."""
        n = 0
        for key in keys:
            b = self.key_to_block.get(key)
            if b is None:
                break
            cur = self.pins.get(b.block_id)
            if cur is None:
                if limit_blocks is not None and self.pinned_blocks_of[tenant] >= limit_blocks:
                    break
                if total_limit_blocks is not None and len(self.pins) >= total_limit_blocks:
                    break
                self.touch([b])
                self.pinned_blocks_of[tenant] += 1
                self.pins[b.block_id] = (until, tenant)
                heapq.heappush(self._pin_deadlines, (until, b.block_id))
            elif until > cur[0]:
                self.pins[b.block_id] = (until, cur[1])
                heapq.heappush(self._pin_deadlines, (until, b.block_id))
            n += 1
        return n

    def expire_pins(self, now: float) -> int:
        """Release pins whose deadline has passed (their blocks become ordinary cached blocks)."""
        released = 0
        heap = self._pin_deadlines
        while heap and heap[0][0] <= now:
            _, block_id = heapq.heappop(heap)
            cur = self.pins.get(block_id)
            if cur is not None and cur[0] <= now:
                del self.pins[block_id]
                self.pinned_blocks_of[cur[1]] -= 1
                self.free([self.blocks[block_id]])
                released += 1
        return released

    def forget_tenant(self, tenant: str) -> tuple[int, int]:
        """A deleted tenant: release its pins and forget its cached blocks that no request uses, publishing their
        removal (the routers drop them from their indexes). Blocks its running requests hold are left to them;
        returns (pins released, blocks forgotten)."""
        released = 0
        for block_id, (_, owner) in list(self.pins.items()):
            if owner == tenant:
                del self.pins[block_id]  # (its deadline entry is skipped when it comes up)
                self.pinned_blocks_of[tenant] -= 1
                self.free([self.blocks[block_id]])
                released += 1
        q = self.cached_queues.pop(tenant, None)
        gone: list[bytes] = []
        while q is not None and len(q):
            b = q.popleft()
            self._num_cached_free -= 1
            if b.key is not None and self.key_to_block.get(b.key) is b:
                del self.key_to_block[b.key]
                gone.append(b.key)
            self.resident[tenant] -= 1
            b.key = b.parent = None
            b.tenant = ""
            self.free_queue.append(b)
        if gone and self.sink is not None:
            self.sink.publish(BlockRemoved(gone))
        return released, len(gone)

    def reset(self) -> bool:
        """Forget every cached key. Only possible while no block is in use; returns whether it happened."""
        if self.num_free != self.num_blocks:
            return False
        for q in self.cached_queues.values():
            while len(q):
                b = q.popleft()
                b.key = b.parent = None
                self.free_queue.append(b)
        self.cached_queues.clear()
        self._num_cached_free = 0
        self.resident.clear()
        self.key_to_block.clear()
        if self.sink is not None:
            self.sink.publish(AllCleared())
        return True

    def usage(self) -> PoolUsage:
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.key is not None)
        return PoolUsage(used, cached, self.num_blocks - used - cached, len(self.pins))
