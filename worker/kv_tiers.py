"""KV tiers under a group's KV pool: host RAM, then a local disk directory (issue 15).

Two halves. ``TierStore`` (every rank) holds the bytes: a host tensor of ``[slot, layer, k/v, token, head, dim]``
(pinned on CUDA) and a directory of block files written by a background thread. ``TierIndex`` (rank 0, inside
the KV cache manager) decides: which key sits in which host slot and which keys are on disk, each tier an LRU
``BlockPool`` of its own, so the per-tenant shares of the GPU pool hold in every tier. Its decisions travel to
the ranks as ``TierOps`` inside each step's plan, so every rank moves its own KV heads the same way.

* Eviction: a cached block the GPU pool hands out again is copied to a host slot at the start of the step that
  reuses it (before the model writes into it), all of the step's copies in one gather; a key the host tier
  already holds is only refreshed. A block landing in host RAM is also queued for disk (write-through, on the
  writer thread) unless the disk holds it already.
* Admission: a request whose prefix continues past the GPU hit in host RAM gets fresh GPU blocks for those
  blocks, registered at once, and the step copies them in before its forward pass: only the rest is prefilled.
  A prefix that continues on disk is first read into host slots, before the step is scheduled (``stage``).
* Safety: every file carries the fingerprint of the model (config, samples of every weight tensor), dtype, block
  size and rank layout, its key, parent key and tenant, and a MAC (keyed by the server secret) over all of it and
  an xxh3 digest of the payload. A file that is foreign, stale, truncated, corrupted or of another tenant (or key)
  is a miss: dropped, deleted, and the block is computed.
* Persistence: at start the disk index is rebuilt from the files' headers (payloads are checked when loaded).
* Ownership: a rank's folder holds a marker file (``.kvgrid-kv-tier``), written when kvgrid creates the folder or
  adopts an empty one (or one holding only its block files, from before markers). A non-empty folder without it
  is refused at start, untouched; kvgrid only ever deletes its own files there (``<hex key>.kvb``, ``.tmp``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import xxhash

from common.config import disk_tier_path, memory_bytes
from common.events import AllCleared, BlockRemoved, BlockStored, EventSink, KVEvent, Tier
from worker.block_pool import Block, BlockPool

if TYPE_CHECKING:
    from common.model_config import ModelConfig

_log = logging.getLogger(__name__)

_FORMAT_VERSION = 1
_MAGIC = b"KVGTIER1"
# magic, fingerprint, key length, parent length, tenant length, payload length, mtime-free header then MAC.
_HEADER = struct.Struct("<8s16sHHHQ")
_MAC_SIZE = 16
_SUFFIX = ".kvb"
_MAX_HEADER = _HEADER.size + 3 * 65535 + _MAC_SIZE
_MAX_NAME = 64  # tenant bytes a file is sized for
MARKER = ".kvgrid-kv-tier"  # in every folder kvgrid keeps block files in
_OWN = re.compile(r"^[0-9a-f]+\.(kvb|tmp)$")  # kvgrid's files there: the only ones it deletes


@dataclass
class KVTiersConfig:
    """Lower KV tiers of one group, per rank. ``host_bytes``: host RAM for evicted blocks (0: no tiers).
    ``disk_path``: a directory for block files (each group and rank uses its own subdirectory), kept within
    ``disk_bytes``; the disk tier needs a host tier (blocks reach disk through it)."""

    host_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("kv_tiers.host_bytes and kv_tiers.disk_bytes must be >= 0")
        if self.disk_path is not None:
            if not self.disk_path:
                raise ValueError("kv_tiers.disk_path must not be empty")
            if self.disk_bytes <= 0:
                raise ValueError("kv_tiers.disk_bytes must be > 0 with a disk_path")
            if self.host_bytes <= 0:
                raise ValueError("kv_tiers.host_bytes must be > 0 with a disk_path (blocks reach disk through host)")
            try:
                self.disk_path = disk_tier_path(self.disk_path)
            except ValueError as exc:
                raise ValueError(f"kv_tiers.disk_path: {exc}") from None

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0

    @property
    def has_disk(self) -> bool:
        return self.disk_path is not None

    def for_group(self, group: str) -> KVTiersConfig:
        """This config with the disk directory of group ``group`` (groups never share block files)."""
        if self.disk_path is None or not group:
            return self
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in group)
        return KVTiersConfig(self.host_bytes, os.path.join(self.disk_path, safe), self.disk_bytes)


class TierOps(NamedTuple):
    """What every rank does with its tiers at the start of a step, in this order."""

    offload: list[tuple[int, int]]  # (GPU block, host slot): evicted blocks, copied down before reuse
    disk_put: list[tuple[int, bytes, bytes | None, str]]  # (host slot, key, parent, tenant): write to disk
    disk_del: list[bytes]  # keys whose files go (the disk tier evicted them)
    load: list[tuple[int, int]]  # (host slot, GPU block): copied up for an admitted request
    # After a start: the keys rank 0 indexed; every rank deletes its other block files (a rank's directory could
    # hold files rank 0 dropped or never had), so that each stays within disk_bytes.
    disk_keep: frozenset[bytes] | None = None

    def __bool__(self) -> bool:
        return bool(self.offload or self.disk_put or self.disk_del or self.load or self.disk_keep is not None)


class StagePlan(NamedTuple):
    """Read these disk blocks into host slots: [(host slot, key, tenant)], one chain, leading blocks first."""

    blocks: list[tuple[int, bytes, str]]


@dataclass
class TierStats:
    """One lower tier: blocks held and its capacity, and since start: blocks stored (written down), hit blocks
    (found for an admitted request), loads (copies up: host to GPU, or disk to host), their bytes and seconds, and
    misses (a block that failed its checks)."""

    blocks: int = 0
    capacity: int = 0
    stored: int = 0
    hits: int = 0
    loads: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    bad: int = 0


# -- fingerprints and files -------------------------------------------------------------------------------------


def model_fingerprint(
    mcfg: ModelConfig, model: torch.nn.Module, dtype: torch.dtype, block_size: int, tp_size: int, tp_rank: int
) -> bytes:
    """16 bytes naming what a block's K/V depends on: the model's config and weights (a hash of samples of every
    tensor), the KV dtype, block size and the rank layout (which KV heads this rank holds)."""
    h = hashlib.sha256()
    conf = {k: v for k, v in asdict(mcfg).items() if k != "path"}
    h.update(json.dumps(conf, sort_keys=True, default=str).encode())
    h.update(f"|{_FORMAT_VERSION}|{dtype}|{block_size}|{tp_size}|{tp_rank}|".encode())
    params = list(model.state_dict().items())
    for i, (name, t) in enumerate(params):
        # 64 KiB of the first and last four tensors, and 1 KiB from the middle of every other one (a fine-tune
        # of any layer changes the fingerprint).
        flat = t.detach().reshape(-1)
        size = (65536 if i < 4 or i >= len(params) - 4 else 1024) // max(1, t.element_size())
        mid = max(0, (flat.numel() - size) // 2) if size < flat.numel() and 4 <= i < len(params) - 4 else 0
        h.update(name.encode())
        h.update(flat[mid : mid + size].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()[:16]


def mac_key(secret: bytes | str) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, b"kvgrid/kv-tiers/v1", hashlib.sha256).digest()


def _mac(mkey: bytes, head: bytes, payload_digest: bytes) -> bytes:
    return hmac.new(mkey, head + payload_digest, hashlib.blake2b).digest()[:_MAC_SIZE]


def encode_header(
    fingerprint: bytes, key: bytes, parent: bytes | None, tenant: str, payload: memoryview | bytes, mkey: bytes
) -> bytes:
    """What precedes the payload in a block file: header (magic, fingerprint, lengths), key, parent, tenant, MAC."""
    t = tenant.encode()
    p = parent or b""
    head = _HEADER.pack(_MAGIC, fingerprint, len(key), len(p), len(t), len(payload)) + key + p + t
    return head + _mac(mkey, head, xxhash.xxh3_128_digest(payload))


def encode_block(
    fingerprint: bytes, key: bytes, parent: bytes | None, tenant: str, payload: bytes, mkey: bytes
) -> bytes:
    """A whole block file."""
    return encode_header(fingerprint, key, parent, tenant, payload, mkey) + payload


class BlockHeader(NamedTuple):
    fingerprint: bytes
    key: bytes
    parent: bytes | None
    tenant: str
    payload_len: int
    head: bytes  # the header bytes the MAC covers
    mac: bytes


def decode_header(data: bytes) -> BlockHeader | None:
    """The header at the start of ``data``, or None if it is not one of ours (or cut short)."""
    if len(data) < _HEADER.size:
        return None
    magic, fp, kl, pl, tl, n = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        return None
    end = _HEADER.size + kl + pl + tl
    if len(data) < end + _MAC_SIZE:
        return None
    key = data[_HEADER.size : _HEADER.size + kl]
    parent = data[_HEADER.size + kl : _HEADER.size + kl + pl] or None
    try:
        tenant = data[_HEADER.size + kl + pl : end].decode()
    except UnicodeDecodeError:
        return None
    return BlockHeader(fp, key, parent, tenant, n, data[:end], data[end : end + _MAC_SIZE])


def file_name(key: bytes) -> str:
    return key.hex() + _SUFFIX


def claim(folder: Path) -> None:
    """Make ``folder`` a block folder of kvgrid's: create it with its ``MARKER``, or adopt it when it is empty
    or holds only kvgrid's block files (written before markers existed). ``ValueError`` for a folder holding
    anything else without the marker (it is not kvgrid's: nothing in it is touched) or a path that is no folder."""
    marker = folder / MARKER
    try:
        if marker.is_file():
            return
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"kv_tiers.disk_path: {folder} exists and is not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        foreign = sorted(p.name for p in folder.iterdir() if not _OWN.match(p.name))
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ValueError(
                f"kv_tiers.disk_path: {folder} holds files kvgrid did not write ({shown}) and no {MARKER} marker; "
                "give the disk tier a folder of its own (empty, or one kvgrid made)"
            )
        marker.write_text("kvgrid keeps KV cache block files here and deletes its own (*.kvb, *.tmp) as it sees fit.\n")
    except OSError as exc:
        raise ValueError(f"kv_tiers.disk_path: cannot use {folder}: {exc.strerror or exc}") from None


# -- every rank: the bytes --------------------------------------------------------------------------------------


class TierStore:
    """One rank's host slots and block directory. ``block_shape`` is one block of the KV cache
    ``[layer, k/v, token, head, dim]``."""

    def __init__(
        self,
        config: KVTiersConfig,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        fingerprint: bytes,
        secret: bytes | str,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.block_shape = tuple(block_shape)
        self.block_bytes = torch.empty((), dtype=dtype).element_size()
        for d in block_shape:
            self.block_bytes *= d
        self.fingerprint, self.mkey = fingerprint, mac_key(secret)
        memory = memory_bytes()
        if memory is not None and config.host_bytes > memory:
            raise ValueError(f"kv_tiers.host_bytes ({config.host_bytes}) is more than this node's memory ({memory})")
        self.num_host_slots = config.host_bytes // self.block_bytes if config.enabled else 0
        pin = device.type == "cuda"
        # Not zeroed: a slot is read only after a block was copied into it (and pages are touched as slots fill).
        self.host = torch.empty((self.num_host_slots, *self.block_shape), dtype=dtype, pin_memory=pin)
        self.dir: Path | None = None
        self.num_disk_slots = 0
        self._writes: queue.Queue = queue.Queue()
        self._pending: list[TierOps] = []  # ops whose disk writes are not queued yet (write_pending)
        self._writer: threading.Thread | None = None
        self.write_errors = 0
        if config.disk_path is not None and self.num_host_slots:
            self.dir = Path(config.disk_path) / f"tp{tp_size}-rank{tp_rank}"
            claim(self.dir)
            self.file_bytes = self._file_size()
            self.num_disk_slots = config.disk_bytes // self.file_bytes
            self._writer = threading.Thread(target=self._write_loop, name="kvgrid-kv-disk", daemon=True)
            self._writer.start()

    def _file_size(self) -> int:
        # The largest header a key of 32 bytes, a parent and a tenant name of up to 64 bytes give: a bound used
        # to size the tier (files of shorter names are smaller).
        return _HEADER.size + 32 + 32 + _MAX_NAME + _MAC_SIZE + self.block_bytes

    # -- steps

    def apply(self, kv_cache: torch.Tensor, ops: TierOps) -> float:
        """Run a step's tier ops against ``kv_cache`` (``[layer, k/v, block, ...]``); returns the seconds the
        loads (host to GPU) took."""
        on_cpu = kv_cache.device.type == "cpu"
        if ops.offload:
            if on_cpu:  # block by block: a 6x faster copy than a gather and a scatter of the whole set
                for g, s in ops.offload:
                    self.host[s].copy_(kv_cache[:, :, g])
            else:  # one gather on the device and one transfer
                gpu = torch.tensor([g for g, _ in ops.offload], device=kv_cache.device)
                down = kv_cache.index_select(2, gpu).movedim(2, 0).contiguous().to("cpu")
                self.host.index_copy_(0, torch.tensor([s for _, s in ops.offload]), down)
        if ops.disk_put or ops.disk_del or ops.disk_keep is not None:
            self._pending.append(ops)
        if not ops.load:
            return 0.0
        t0 = time.perf_counter()
        if on_cpu:
            for s, g in ops.load:
                kv_cache[:, :, g].copy_(self.host[s])
        else:  # one transfer from pinned memory, one scatter on the device
            slots = torch.tensor([s for s, _ in ops.load])
            gpu = torch.tensor([g for _, g in ops.load], device=kv_cache.device)
            staged = self.host.index_select(0, slots)
            if self.host.is_pinned():
                staged = staged.pin_memory()
            up = staged.to(kv_cache.device, non_blocking=True).movedim(0, 2)
            kv_cache.index_copy_(2, gpu, up)
            torch.cuda.current_stream(kv_cache.device).synchronize()
        return time.perf_counter() - t0

    def write_pending(self) -> None:
        """Queue the disk writes and deletes of the ops applied since last time (after the step's forward pass,
        and on rank 0 after its sampling: off the time to the step's tokens). Before the next step's ops."""
        pending, self._pending = self._pending, []
        if self._writer is None:
            return
        for ops in pending:
            if ops.disk_keep is not None:
                self._writes.put(("keep", ops.disk_keep))
            for slot, key, parent, tenant in ops.disk_put:
                # A copy: the slot may hold another block by the time the writer gets to it.
                self._writes.put(("put", key, parent, tenant, self.host[slot].clone()))
            for key in ops.disk_del:
                self._writes.put(("del", key))

    def stage(self, plan: StagePlan) -> int:
        """Read the plan's block files into their host slots, stopping at the first that fails a check;
        returns how many leading blocks were read."""
        assert self.dir is not None
        n = 0
        for slot, key, tenant in plan.blocks:
            payload = self._read(key, tenant)
            if payload is None:
                break
            self.host[slot].copy_(torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).view(self.block_shape))
            n += 1
        return n

    def _read(self, key: bytes, tenant: str) -> bytearray | None:
        """The payload of ``key``'s file if it passes every check, else None."""
        assert self.dir is not None
        try:
            data = (self.dir / file_name(key)).read_bytes()
        except OSError:
            return None
        h = decode_header(data)
        if (
            h is None
            or h.fingerprint != self.fingerprint
            or h.key != key
            or h.tenant != tenant
            or h.payload_len != self.block_bytes
        ):
            return None
        start = len(h.head) + _MAC_SIZE
        payload = bytearray(data[start:])  # writable, for torch.frombuffer
        if len(payload) != self.block_bytes:
            return None
        if not hmac.compare_digest(h.mac, _mac(self.mkey, h.head, xxhash.xxh3_128_digest(payload))):
            return None
        return payload

    # -- the writer thread

    def _write_loop(self) -> None:
        assert self.dir is not None
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                if item[0] == "put":
                    _, key, parent, tenant, t = item
                    payload = memoryview(t.view(torch.uint8).numpy()).cast("B")  # no copy
                    path = self.dir / file_name(key)
                    tmp = path.with_suffix(".tmp")
                    with tmp.open("wb") as f:
                        f.write(encode_header(self.fingerprint, key, parent, tenant, payload, self.mkey))
                        f.write(payload)
                    os.replace(tmp, path)
                elif item[0] == "keep":
                    names = {file_name(k) for k in item[1]}
                    for path in self.dir.iterdir():
                        if _OWN.match(path.name) and path.name not in names:  # (every .tmp, stray .kvb files)
                            path.unlink(missing_ok=True)
                else:
                    (self.dir / file_name(item[1])).unlink(missing_ok=True)
            except OSError as exc:  # a full or failing disk: that block is not kept (a later load misses)
                self.write_errors += 1
                _log.warning("kv disk tier: %s", exc)
            finally:
                self._writes.task_done()

    def delete(self, key: bytes) -> None:
        """Delete ``key``'s file (after the writes queued before)."""
        if self._writer is not None:
            self._writes.put(("del", key))

    def flush(self) -> None:
        """Wait until every queued write and delete is done."""
        if self._writer is not None:
            self._writes.join()

    def close(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None

    def scan(self) -> list[BlockHeader]:
        """The headers of this rank's block files, oldest first; files that are not ours, of another model or
        layout, or of the wrong size are deleted (the directory belongs to this rank of this group)."""
        assert self.dir is not None
        found: list[tuple[float, BlockHeader]] = []
        for path in self.dir.iterdir():
            if not _OWN.match(path.name):  # not kvgrid's: left alone
                continue
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
                continue
            try:
                st = path.stat()
                with path.open("rb") as f:
                    head = f.read(_MAX_HEADER)
            except OSError:
                continue
            h = decode_header(head)
            ok = (
                h is not None
                and h.fingerprint == self.fingerprint
                and h.payload_len == self.block_bytes
                and path.name == file_name(h.key)
                and st.st_size == len(h.head) + _MAC_SIZE + h.payload_len
            )
            if not ok:
                path.unlink(missing_ok=True)
                continue
            assert h is not None
            found.append((st.st_mtime, h))
        found.sort(key=lambda x: x[0])
        return [h for _, h in found]

    def disk_usage(self) -> int:
        """Bytes of block files in this rank's directory."""
        if self.dir is None:
            return 0
        return sum(p.stat().st_size for p in self.dir.iterdir() if p.suffix == _SUFFIX)


# -- rank 0: the index ------------------------------------------------------------------------------------------


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
        if len(tenant.encode()) > _MAX_NAME:
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
