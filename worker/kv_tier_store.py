"""The bytes of the KV tiers, on every rank (``TierStore``): a host tensor of ``[slot, layer, k/v, token, head,
dim]`` (pinned on CUDA) and a directory of block files written by a background thread, and the block files' format
(a header with the model's fingerprint, the block's key, parent key and tenant, and a MAC over them and the
payload's digest). What moves where is decided on rank 0 (``worker/kv_tier_index.py``); see ``worker/kv_tiers.py``.
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
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import xxhash

from common.machine import memory_bytes
from worker.kv_tiers import KVTiersConfig, StagePlan, TierOps

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
MAX_NAME_BYTES = 64  # tenant bytes a file is sized for
MARKER = ".kvgrid-kv-tier"  # in every folder kvgrid keeps block files in
_OWN = re.compile(r"^[0-9a-f]+\.(kvb|tmp)$")  # kvgrid's files there: the only ones it deletes


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


# -- the store ------------------------------------------------------------------------------------------------


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
        return _HEADER.size + 32 + 32 + MAX_NAME_BYTES + _MAC_SIZE + self.block_bytes

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
