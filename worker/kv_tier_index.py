"""The index of the KV tiers, on rank 0 inside the KV cache manager (``TierIndex``): which key sits in which host
slot and which keys are on disk, each tier an LRU ``BlockPool`` of its own, and the ``TierOps`` each step's plan
carries to every rank's ``TierStore`` (``worker/kv_tier_store.py``); see ``worker/kv_tiers.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from common.events import AllCleared, BlockRemoved, BlockStored, EventSink, KVEvent, Tier
from common.stats import TierStats
from worker.block_pool import Block, BlockPool
from worker.kv_tier_store import MAX_NAME_BYTES, TierStore
from worker.kv_tiers import StagePlan, TierOps

_log = logging.getLogger(__name__)


class _TierSink:
    """Publishes a tier pool's events with the tier named; pool resets are not forwarded (the GPU pool's
    ``AllCleared`` covers every tier)."""

    def __init__(self, sink: EventSink | None, tier: Tier) -> None:
        self.sink, self.tier = sink, tier

    def publish(self, event: KVEvent) -> None:
        if self.sink is None or isinstance(event, AllCleared):
            return
        if isinstance(event, (BlockStored, BlockRemoved)):
            event = event._replace(tier=self.tier)
        self.sink.publish(event)


StageFn = Callable[[StagePlan], int]


@dataclass
class _Pending:
    offload: list[tuple[int, int]] = field(default_factory=list)
    disk_put: list[tuple[int, bytes, bytes | None, str]] = field(default_factory=list)
    disk_del: list[bytes] = field(default_factory=list)
    load: list[tuple[int, int]] = field(default_factory=list)
    disk_keep: frozenset[bytes] | None = None


class TierIndex:
    """Which keys the lower tiers hold, and the ops that move blocks between them (rank 0)."""

    def __init__(
        self,
        store: TierStore,
        stage_fn: StageFn | None = None,
        sink: EventSink | None = None,
        shares: dict[str, float] | None = None,
        async_reads: bool = False,
    ) -> None:
        self.store = store
        self.stage_fn = stage_fn or store.stage
        self.block_bytes = store.block_bytes
        self.host = BlockPool(max(1, store.num_host_slots), _TierSink(sink, Tier.HOST), shares)
        self.host_enabled = store.num_host_slots > 0
        self.disk: BlockPool | None = None
        if store.num_disk_slots > 0:
            self.disk = BlockPool(
                store.num_disk_slots, _TierSink(sink, Tier.DISK), shares, on_evict=self._on_disk_evict
            )
        self._ops = _Pending()
        # One rank: disk reads run on a reader thread while the engine steps, and a request waits for its blocks
        # (``loading``); under tensor parallelism every rank reads in lockstep instead (``stage_fn``).
        self._reader: ThreadPoolExecutor | None = None
        if async_reads and self.disk is not None:
            self._reader = ThreadPoolExecutor(1, "kvgrid-kv-read")
        self._reads: list[tuple[str, list[bytes], Future, float]] = []
        self.loading: set[bytes] = set()  # keys a disk read is bringing into host RAM
        self._held: list[Block] = []  # host blocks an op of the coming step reads or writes
        self._applying: list[Block] = []  # ... of the step running now
        self.stats = {Tier.HOST: TierStats(capacity=store.num_host_slots), Tier.DISK: TierStats()}
        if self.disk is not None:
            self.stats[Tier.DISK].capacity = self.disk.num_blocks

    def rebuild_disk_index(self, sink: EventSink | None) -> int:
        """Index what the disk holds (at start): ``AllCleared``, then ``BlockStored(tier=DISK)`` of the files.
        Files beyond ``disk_bytes`` (the oldest) are deleted. Returns the blocks indexed."""
        if self.disk is None:
            return 0
        headers = self.store.scan()
        excess = len(headers) - self.disk.num_blocks
        for h in headers[: max(0, excess)]:
            self.store.delete(h.key)
        if sink is not None:
            sink.publish(AllCleared())
        n = 0
        for h in headers[max(0, excess) :]:
            [b] = self.disk.allocate(1, h.tenant)
            self.disk.cache([b], [h.key], h.parent, h.tenant)
            self.disk.free([b])
            n += 1
        self._ops.disk_keep = frozenset(self.disk.key_to_block)
        return n

    # -- GPU eviction

    def on_gpu_evict(self, block_id: int, key: bytes, parent: bytes | None, tenant: str) -> None:
        """A cached GPU block is about to be reused: copy it down, unless host RAM holds it already."""
        if not self.host_enabled:
            return
        hb = self.host.lookup(key)
        if hb is not None:
            if hb.ref_cnt == 0:  # refresh its place in the LRU
                self.host.touch([hb])
                self.host.free([hb])
            return
        if self.host.num_free == 0:
            return  # every slot is being moved this step: the block is dropped
        [hb] = self.host.allocate(1, tenant)
        self.host.cache([hb], [key], parent, tenant)
        self._held.append(hb)
        self._ops.offload.append((block_id, hb.block_id))
        self.stats[Tier.HOST].stored += 1
        if self.disk is not None:
            db = self.disk.lookup(key)
            if db is not None:
                self.disk.touch([db])
                self.disk.free([db])
            else:
                self._disk_store(hb.block_id, key, parent, tenant)

    def copy_down(self, block_id: int, key: bytes, parent: bytes | None, tenant: str) -> bool:
        """Queue what puts GPU block ``block_id`` (still in use there) on disk, unless the disk holds it; False
        when no host slot is free for it this round."""
        if self.disk is None or self.disk.lookup(key) is not None:
            return True
        hb = self.host.lookup(key)
        if hb is None:
            if self.host.num_free == 0:
                return False
            [hb] = self.host.allocate(1, tenant)
            self.host.cache([hb], [key], parent, tenant)
            self._ops.offload.append((block_id, hb.block_id))
            self.stats[Tier.HOST].stored += 1
        else:
            self.host.touch([hb])
        self._held.append(hb)
        self._disk_store(hb.block_id, key, parent, tenant)
        return True

    def pin(
        self,
        gpu: BlockPool,
        keys: list[bytes],
        until: float,
        tenant: str,
        limit_blocks: int | None,
        total_limit_blocks: int | None,
    ) -> int:
        """Pin the leading ``keys`` in host RAM (``BlockPool.pin`` there, with its limits), first queueing copies of
        the GPU blocks of those host RAM lacks (the GPU pool holds them computed: they are copied at the start
        of the next step, before anything could overwrite them). Returns how many leading keys are pinned."""
        n = 0
        for key in keys:
            if self.host.lookup(key) is None:
                b = gpu.lookup(key)
                if b is None or self.host.num_free == 0:
                    break
                [hb] = self.host.allocate(1, tenant)
                self.host.cache([hb], [key], b.parent, tenant)
                self._held.append(hb)
                self._ops.offload.append((b.block_id, hb.block_id))
                self.stats[Tier.HOST].stored += 1
                if self.disk is not None and self.disk.lookup(key) is None:
                    self._disk_store(hb.block_id, key, b.parent, tenant)
            n += 1
        return self.host.pin(keys[:n], until, tenant, limit_blocks, total_limit_blocks)

    def _disk_store(self, slot: int, key: bytes, parent: bytes | None, tenant: str) -> None:
        assert self.disk is not None
        if len(tenant.encode()) > MAX_NAME_BYTES:
            return  # longer than the file size the tier is counted in
        [db] = self.disk.allocate(1, tenant)
        self.disk.cache([db], [key], parent, tenant)
        self.disk.free([db])
        self._ops.disk_put.append((slot, key, parent, tenant))
        self.stats[Tier.DISK].stored += 1

    def _on_disk_evict(self, _block: int, key: bytes, _parent: bytes | None, _tenant: str) -> None:
        self._ops.disk_del.append(key)

    # -- admission

    def host_run(self, keys: Iterable[bytes], tenant: str) -> int:
        """How many leading ``keys`` host RAM holds for ``tenant``."""
        n = 0
        for key in keys:
            b = self.host.lookup(key)
            if b is None or b.tenant != tenant:
                break
            n += 1
        return n

    def hold(self, keys: list[bytes]) -> list[Block]:
        """Reserve the host blocks of ``keys`` for a load (before allocating the GPU blocks they go to, whose
        evictions take host slots too)."""
        held = []
        for key in keys:
            hb = self.host.lookup(key)
            assert hb is not None, "load of a key host RAM does not hold"
            held.append(hb)
        self.host.touch(held)
        self._held.extend(held)
        return held

    def load(self, keys: list[bytes], held: list[Block], gpu_blocks: list[Block]) -> None:
        """Copy the ``held`` host blocks of ``keys`` into ``gpu_blocks`` at the start of the coming step."""
        for hb, gb in zip(held, gpu_blocks):
            self._ops.load.append((hb.block_id, gb.block_id))
        st = self.stats[Tier.HOST]
        st.hits += len(keys)
        st.loads += len(keys)
        st.load_bytes += len(keys) * self.block_bytes

    def stage(self, keys: list[bytes], tenant: str) -> int:
        """Read the disk blocks of the leading ``keys`` (which neither GPU nor host RAM holds) into host RAM;
        returns how many are there now. Runs before the step is scheduled."""
        if self.disk is None or not keys:
            return 0
        run: list[bytes] = []
        for key in keys:
            db = self.disk.lookup(key)
            if db is None or db.tenant != tenant:
                break
            run.append(key)
        if self._reader is not None:
            run = [k for k in run[: self.host.num_blocks // 2] if k not in self.loading]
            if run and run[0] == keys[0]:
                self._reads.append((tenant, run, self._reader.submit(self._read_run, run, tenant), time.perf_counter()))
                self.loading.update(run)
            return 0
        # Leave half the host tier for the blocks this step evicts.
        run = run[: max(0, self.host.num_free - self.host.num_blocks // 2)]
        if not run:
            return 0
        slots = self.host.allocate(len(run), tenant)
        t0 = time.perf_counter()
        n = self.stage_fn(StagePlan([(b.block_id, k, tenant) for b, k in zip(slots, run)]))
        dt = time.perf_counter() - t0
        for b, key in zip(slots[:n], run[:n]):
            db = self.disk.lookup(key)
            assert db is not None
            self.host.cache([b], [key], db.parent, tenant)
            self.disk.touch([db])
            self.disk.free([db])
        self.host.free(slots)
        st = self.stats[Tier.DISK]
        st.hits += n
        st.loads += n
        st.load_bytes += n * self.block_bytes
        st.load_s += dt
        if n < len(run):  # that file failed its checks (the ranks deleted it)
            st.bad += 1
            self.disk.drop(run[n])
        return n

    def _read_run(self, run: list[bytes], tenant: str) -> list[bytearray]:
        """(The reader thread) the payloads of the leading blocks of ``run`` that pass every check."""
        out = []
        for key in run:
            payload = self.store._read(key, tenant)
            if payload is None:
                break
            out.append(payload)
        return out

    def poll(self) -> None:
        """Take in the disk reads that finished: their blocks go to host RAM (where admission loads them from); a
        file that failed its checks is dropped and deleted. Before the step is scheduled."""
        if not self._reads:
            return
        assert self.disk is not None
        left = []
        for tenant, run, fut, t0 in self._reads:
            if not fut.done():
                left.append((tenant, run, fut, t0))
                continue
            self.loading.difference_update(run)
            try:
                payloads = fut.result()
            except Exception as exc:  # the reader failed: the blocks are computed
                _log.warning("kv disk tier read failed: %s", exc)
                continue
            n = 0
            for key, payload in zip(run, payloads):
                db = self.disk.lookup(key)
                if db is None or db.tenant != tenant:
                    break  # dropped meanwhile (a reset, or evicted)
                if self.host.lookup(key) is None:
                    if self.host.num_free == 0:
                        break
                    [hb] = self.host.allocate(1, tenant)
                    self.store.host[hb.block_id].copy_(
                        torch.frombuffer(payload, dtype=torch.uint8).view(self.store.dtype).view(self.store.block_shape)
                    )
                    self.host.cache([hb], [key], db.parent, tenant)
                    self.host.free([hb])
                self.disk.touch([db])
                self.disk.free([db])
                n += 1
            st = self.stats[Tier.DISK]
            st.hits += n
            st.loads += n
            st.load_bytes += n * self.block_bytes
            st.load_s += time.perf_counter() - t0
            if len(payloads) < len(run):  # that file failed its checks
                st.bad += 1
                if self.disk.drop(run[len(payloads)]):
                    self.store.delete(run[len(payloads)])
        self._reads = left

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader = None

    # -- steps

    def take_ops(self) -> TierOps:
        """The ops queued since last time, for the coming step; their host slots stay held until ``step_done``
        (ops queued meanwhile, by evictions after the step's forward pass, hold theirs until the next one)."""
        ops, self._ops = self._ops, _Pending()
        self._applying.extend(self._held)
        self._held = []
        return TierOps(ops.offload, ops.disk_put, ops.disk_del, ops.load, ops.disk_keep)

    def step_done(self, load_s: float = 0.0) -> None:
        """The step ran the ops ``take_ops`` gave it (and queued their disk writes): release their host slots."""
        self.stats[Tier.HOST].load_s += load_s
        applied, self._applying = self._applying, []
        self.host.free(applied)

    def reset(self) -> None:
        """Forget every block of every lower tier (their files are deleted)."""
        self.host.reset()
        if self.disk is not None:
            self._ops.disk_del.extend(self.disk.key_to_block)
            self.disk.reset()

    def held_keys(self) -> dict[Tier, list[bytes]]:
        """Every key each lower tier holds (for a KV event snapshot)."""
        out = {Tier.HOST: list(self.host.key_to_block) if self.host_enabled else []}
        if self.disk is not None:
            out[Tier.DISK] = list(self.disk.key_to_block)
        return out

    def tier_stats(self) -> dict[str, TierStats]:
        self.stats[Tier.HOST].blocks = len(self.host.key_to_block) if self.host_enabled else 0
        if self.disk is not None:
            self.stats[Tier.DISK].blocks = len(self.disk.key_to_block)
        return {str(t): TierStats(**vars(s)) for t, s in self.stats.items()}
