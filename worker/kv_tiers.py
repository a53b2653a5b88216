"""KV tiers under a group's KV pool: host RAM, then a local disk directory.

This module holds their configuration and what travels between the two halves. ``TierStore``
(``worker/kv_tier_store.py``, every rank) holds the bytes: a host tensor of ``[slot, layer, k/v, token, head, dim]``
(pinned on CUDA) and a directory of block files written by a background thread. ``TierIndex``
(``worker/kv_tier_index.py``, rank 0, inside the KV cache manager) decides: which key sits in which host slot and
which keys are on disk, each tier an LRU ``BlockPool`` of its own, so the per-tenant shares of the GPU pool hold in
every tier. Its decisions travel to the ranks as ``TierOps`` inside each step's plan, so every rank moves its own
KV heads the same way.

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

import os
from dataclasses import dataclass
from typing import NamedTuple

from common.machine import disk_tier_path


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
