"""The global prefix index: which worker groups hold which block keys, fed by the groups' KV events.

Each group gets a bit; a key maps to the bitmask of the groups holding it. ``match`` walks a prompt's keys
in order and returns, for every group, the length of the longest run of leading keys it holds: one dict
lookup and a few integer operations per block, stopping as soon as no group is left.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.events import AllCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    def __init__(self) -> None:
        self._mask: dict[bytes, int] = {}
        # Per-group keys as dicts of bytes -> None: unlike sets, such dicts are not traversed by the garbage
        # collector, whose full passes over millions of keys would otherwise stall routing.
        self._keys_of: dict[str, dict[bytes, None]] = {}
        self._bit: dict[str, int] = {}
        self._free_bits: list[int] = []

    def __len__(self) -> int:
        return len(self._mask)

    def bit(self, group: str) -> int:
        """The group's bit, adding the group if it is new."""
        b = self._bit.get(group)
        if b is None:
            b = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
            self._bit[group] = b
            self._keys_of[group] = {}
        return b

    def apply(self, group: str, event: KVEvent) -> None:
        b = self.bit(group)
        keys = self._keys_of[group]
        if isinstance(event, BlockStored):
            for k in event.keys:
                self._mask[k] = self._mask.get(k, 0) | b
            keys.update(dict.fromkeys(event.keys))
        elif isinstance(event, BlockRemoved):
            for k in event.keys:
                self._drop(k, b)
                keys.pop(k, None)
        elif isinstance(event, AllCleared):
            for k in keys:
                self._drop(k, b)
            keys.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def _drop(self, key: bytes, bit: int) -> None:
        clear_bit(self._mask, key, bit)

    def remove_group(self, group: str) -> None:
        """Forget a group and every entry it had (at once)."""
        b = self._bit.pop(group, None)
        if b is None:
            return
        for k in self._keys_of.pop(group):
            self._drop(k, b)
        self._free_bits.append(b)

    def key_counts(self) -> dict[str, int]:
        """Keys held per group, counted from the key -> groups map itself; bits of no current group count under
        ``"?"`` (there should be none)."""
        counts: dict[int, int] = {}
        for m in self._mask.values():
            while m:
                low = m & -m
                counts[low] = counts.get(low, 0) + 1
                m ^= low
        by_bit = {b: g for g, b in self._bit.items()}
        out: dict[str, int] = {}
        for b, n in counts.items():
            g = by_bit.get(b, "?")
            out[g] = out.get(g, 0) + n
        return out

    def holders(self, key: bytes) -> int:
        return self._mask.get(key, 0)

    def match(self, keys: list[bytes], extra: dict[bytes, int] | None = None) -> dict[str, int]:
        """Blocks of the longest leading run each group holds (``extra``: more holders per key, e.g.
        predictions). Groups holding no leading block are absent."""
        return self.match_chunks([keys], extra)

    def match_chunks(self, chunks: Iterable[list[bytes]], extra: dict[bytes, int] | None = None) -> dict[str, int]:
        """``match`` over keys that arrive in chunks (computed lazily: no chunk is asked for once no group is
        left)."""
        runs: dict[int, int] = {}
        alive = sum(self._bit.values())
        mask, more = self._mask, extra or {}
        n = 0
        for chunk in chunks:
            for key in chunk:
                m = alive & mask.get(key, 0)
                if m != alive and more:  # predictions matter only for groups the index just lost
                    m |= alive & more.get(key, 0)
                if m != alive:
                    _record(runs, alive & ~m, n)
                    alive = m
                    if not alive:
                        break
                n += 1
            if not alive:
                break
        _record(runs, alive, n)
        by_bit = {b: g for g, b in self._bit.items()}
        return {by_bit[b]: k for b, k in runs.items() if k > 0}


def clear_bit(masks: dict[bytes, int], key: bytes, bit: int) -> bool:
    """Clear ``bit`` in ``masks[key]``; drop the key when no bit is left (returns whether it was dropped)."""
    m = masks.get(key, 0) & ~bit
    if m:
        masks[key] = m
        return False
    masks.pop(key, None)
    return True


def _record(runs: dict[int, int], bits: int, n: int) -> None:
    while bits:
        low = bits & -bits
        runs[low] = n
        bits ^= low
