"""The dict prefix index (``DictPrefixIndex``; the default, ``routing: {index: dict}``): which worker groups hold
which block keys, in which tier, fed by the groups' KV events. Fastest per lookup and per event; about 130 bytes
per key.

Each group gets a bit; a key maps to one int that packs three bitmasks of groups: those holding it in any tier
(the low ``width`` bits), those holding it but not in their GPU pool (best tier host RAM or disk), and those
holding it on disk only. ``match`` walks a prompt's keys in order and returns, for every group, the length of
the longest run of leading keys it holds in any tier, and how many of those it would load from host RAM or disk:
one dict lookup and a few integer operations per block (one more test for a block some group holds below its
GPU pool), stopping as soon as no group is left.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.events import AllCleared, BlockRemoved, BlockStored, KVEvent, Tier
from router.routing.index_base import TierMatch

# A group's tiers of one key, as bits of the values of ``DictPrefixIndex._keys_of``.
TIER_BITS = {Tier.GPU: 1, Tier.HOST: 2, Tier.DISK: 4}
_DISK_ONLY = TIER_BITS[Tier.DISK]
_INTERN_MAX = 1 << 16  # distinct packed values shared as one int object each (then the table starts over)


class DictPrefixIndex:
    def __init__(self) -> None:
        self._mask: dict[bytes, int] = {}  # key -> any | below << width | disk_only << 2 * width
        # Per-group keys as dicts of bytes -> tier bits (TIER_BITS): unlike sets, dicts of bytes and small ints are
        # not traversed by the garbage collector, whose full passes over millions of keys would otherwise stall
        # routing.
        self._keys_of: dict[str, dict[bytes, int]] = {}
        self._bit: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._width = 16  # group bits per packed mask; doubled (every value re-packed) when a group needs more
        self._intern: dict[int, int] = {}  # packed values above 256 are shared, not one int object per key

    def __len__(self) -> int:
        return len(self._mask)

    def bit(self, group: str) -> int:
        """The group's bit, adding the group if it is new."""
        b = self._bit.get(group)
        if b is None:
            b = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
            while b >> self._width:
                self._widen()
            self._bit[group] = b
            self._keys_of[group] = {}
        return b

    def _widen(self) -> None:
        w, low = self._width, (1 << self._width) - 1
        self._width = w2 = 2 * w
        self._intern.clear()
        for k, v in self._mask.items():
            self._mask[k] = (v & low) | ((v >> w) & low) << w2 | (v >> 2 * w) << 2 * w2

    def _packing(self, bit: int) -> tuple[int, list[int]]:
        """For one group: the bits to clear in a packed value, and what to set there for each tier-bits value."""
        below, disk_only = bit << self._width, bit << 2 * self._width
        sets = [0] * 8
        for tiers in range(1, 8):
            sets[tiers] = (
                bit | (0 if tiers & TIER_BITS[Tier.GPU] else below) | (disk_only if tiers == _DISK_ONLY else 0)
            )
        return bit | below | disk_only, sets

    def apply(self, group: str, event: KVEvent) -> None:
        b = self.bit(group)
        keys = self._keys_of[group]
        mask, intern = self._mask, self._intern
        clear, sets = self._packing(b)
        if isinstance(event, BlockStored):
            t = TIER_BITS[event.tier]
            for k in event.keys:
                old = keys.get(k, 0)
                new = old | t
                if new == old:
                    continue
                keys[k] = new
                v = (mask.get(k, 0) & ~clear) | sets[new]
                mask[k] = intern.setdefault(v, v) if v > 256 else v
        elif isinstance(event, BlockRemoved):
            t = TIER_BITS[event.tier]
            for k in event.keys:
                old = keys.get(k, 0)
                new = old & ~t
                if new == old:
                    continue
                v = mask.get(k, 0) & ~clear
                if new:
                    keys[k] = new
                    v |= sets[new]
                else:
                    del keys[k]
                if v:
                    mask[k] = intern.setdefault(v, v) if v > 256 else v
                else:
                    mask.pop(k, None)
        elif isinstance(event, AllCleared):
            for k in keys:
                self._drop(k, clear)
            keys.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")
        if len(intern) > _INTERN_MAX:
            intern.clear()

    def _drop(self, key: bytes, clear: int) -> None:
        v = self._mask.get(key, 0) & ~clear
        if v:
            self._mask[key] = self._intern.setdefault(v, v) if v > 256 else v
        else:
            self._mask.pop(key, None)

    def remove_group(self, group: str) -> None:
        """Forget a group and every entry it had (at once)."""
        b = self._bit.pop(group, None)
        if b is None:
            return
        clear, _ = self._packing(b)
        for k in self._keys_of.pop(group):
            self._drop(k, clear)
        self._free_bits.append(b)

    def key_counts(self) -> dict[str, int]:
        """Keys held per group (in any tier), counted from the key -> groups map itself; bits of no current group
        count under ``"?"`` (there should be none)."""
        counts: dict[int, int] = {}
        low = (1 << self._width) - 1
        for v in self._mask.values():
            m = v & low
            while m:
                lowest = m & -m
                counts[lowest] = counts.get(lowest, 0) + 1
                m ^= lowest
        by_bit = {b: g for g, b in self._bit.items()}
        out: dict[str, int] = {}
        for b, n in counts.items():
            g = by_bit.get(b, "?")
            out[g] = out.get(g, 0) + n
        return out

    def tier_counts(self) -> dict[str, dict[str, int]]:
        """Keys held per group and tier (a key in several tiers of a group counts in each), from the per-group
        maps."""
        out = {}
        for g, keys in self._keys_of.items():
            by_bits: dict[int, int] = {}
            for tiers in keys.values():
                by_bits[tiers] = by_bits.get(tiers, 0) + 1
            out[g] = {str(t): sum(n for bits, n in by_bits.items() if bits & tb) for t, tb in TIER_BITS.items()}
        return out

    def holders(self, key: bytes) -> int:
        """Bits of the groups holding ``key`` in any tier."""
        return self._mask.get(key, 0) & ((1 << self._width) - 1)

    def holders_many(self, keys: Sequence[bytes]) -> list[int]:
        """``holders`` of each key."""
        mask, low = self._mask, (1 << self._width) - 1
        return [mask.get(k, 0) & low for k in keys]

    def apply_many(self, events: Iterable[tuple[str, KVEvent]]) -> None:
        """``apply`` each ``(group, event)`` in order (a dict gains nothing from batching)."""
        for group, event in events:
            self.apply(group, event)

    def match(self, keys: list[bytes], extra: dict[bytes, int] | None = None) -> dict[str, int]:
        """Blocks of the longest leading run each group holds in any tier (``extra``: more holders per key, e.g.
        predictions). Groups holding no leading block are absent."""
        return self.match_chunks([keys], extra)

    def match_chunks(self, chunks: Iterable[list[bytes]], extra: dict[bytes, int] | None = None) -> dict[str, int]:
        """``match`` over keys that arrive in chunks (computed lazily: no chunk is asked for once no group is
        left)."""
        return {g: t.blocks for g, t in self.match_tiers(chunks, extra).items()}

    def match_tiers(self, chunks: Iterable[list[bytes]], extra: dict[bytes, int] | None = None) -> dict[str, TierMatch]:
        """``match_chunks`` with each run's split by tier: of a group's run, the blocks it holds in host RAM but
        not in its GPU pool, and those it holds on disk only. A block predicted for a group (``extra``) and not
        held there counts as GPU (it is being computed there)."""
        runs: dict[int, int] = {}
        host: dict[int, int] = {}  # bits of groups -> blocks of their runs they would load from host RAM
        disk: dict[int, int] = {}  # ... from disk
        alive = sum(self._bit.values())
        mask, more = self._mask, extra or {}
        w = self._width
        gpu_only = 1 << w  # a packed value below this: every holder has the key in its GPU pool
        n = 0
        for chunk in chunks:
            for key in chunk:
                v = mask.get(key, 0)
                m = alive & v
                if m != alive and more:  # predictions matter only for groups the index just lost
                    m |= alive & more.get(key, 0)
                if m != alive:
                    _record(runs, alive & ~m, n)
                    alive = m
                    if not alive:
                        break
                if v >= gpu_only:
                    below = (v >> w) & m
                    if below:
                        d = (v >> 2 * w) & below
                        if d:
                            disk[d] = disk.get(d, 0) + 1
                        if below != d:
                            h = below & ~d
                            host[h] = host.get(h, 0) + 1
                n += 1
            if not alive:
                break
        _record(runs, alive, n)
        by_bit = {b: g for g, b in self._bit.items()}
        return {
            by_bit[b]: TierMatch(k, _count(host, b), _count(disk, b)) if host or disk else TierMatch(k)
            for b, k in runs.items()
            if k > 0
        }


def _count(counts: dict[int, int], bit: int) -> int:
    return sum(c for bits, c in counts.items() if bits & bit)


def _record(runs: dict[int, int], bits: int, n: int) -> None:
    while bits:
        low = bits & -bits
        runs[low] = n
        bits ^= low
