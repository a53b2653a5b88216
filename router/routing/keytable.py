"""An open-addressing hash table of 64-bit key codes in numpy arrays, with three bitmask words per key (one per
KV tier: GPU, host RAM, disk) that ``PrefixIndex`` uses as sets of worker groups.

Slots live in two arrays: ``codes`` (uint64, 0 marks an empty slot) and ``masks`` (shape ``(3, capacity,
words)``, an unsigned dtype of 8 to 64 bits: the narrowest that holds the groups' bits, widened as groups join).
Collisions are resolved by linear probing from the slot ``code & (capacity - 1)``: the codes are cut from
cryptographic hashes, so their low bits are already uniform. Every operation works on whole batches of codes with
numpy (one loop step per probe distance, not per key). The table doubles once more than ``MAX_LOAD`` of its
slots are used. Deleting a batch empties, in each cluster (run of used slots) holding doomed slots, the stretch
from its first doomed slot to its end, but for the entries in their home slots, and inserts the entries taken out
again: what a backward shift does one key at a time, done for every cluster at once, and it leaves no tombstones.
"""

from __future__ import annotations

import json
import sys
from typing import BinaryIO

import numpy as np

TIERS = 3  # mask rows per slot: GPU, host RAM, disk
MAX_LOAD = 0.6  # used slots over capacity above which the table doubles (then 0.3: short probe sequences)
MIN_CAPACITY = 1024
WINDOW = 8  # slots a lookup reads at once from each probe position (one or two cache lines)
WIDE_WINDOW = 64  # ... once a first window did not settle a code
_DTYPES = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_MAGIC = b"KVGIDX1\n"


class KeyTable:
    def __init__(self, capacity: int = MIN_CAPACITY, word_bits: int = 8, words: int = 1) -> None:
        capacity = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())  # a power of two: probing masks, not mods
        self.word_bits, self.words = word_bits, words
        self._set_codes(np.zeros(capacity + WINDOW, np.uint64))
        self.masks = np.zeros((TIERS, capacity, words), _DTYPES[word_bits])
        self.used = 0

    def _set_codes(self, padded: np.ndarray) -> None:
        """The codes array has ``WINDOW`` slots past its end that repeat its first ones, so that the ``WINDOW``
        slots from any position are one row of a strided view (``_windows``), read without wrapping."""
        self._padded = padded
        self.codes = padded[: len(padded) - WINDOW]
        self._windows = np.lib.stride_tricks.sliding_window_view(padded, WINDOW)

    def _sync(self) -> None:
        """Copy the first slots' codes to the padding (after every change to the codes)."""
        self._padded[self.capacity :] = self._padded[:WINDOW]

    @property
    def capacity(self) -> int:
        return len(self.codes)

    @property
    def dtype(self) -> type:
        return _DTYPES[self.word_bits]

    def nbytes(self) -> int:
        return self._padded.nbytes + self.masks.nbytes

    # -- lookups --------------------------------------------------------------------------------------------------

    def find(self, codes: np.ndarray) -> np.ndarray:
        """The slot of each code (int64), -1 where it is absent: a code is found, or known absent, at the first
        slot of its probe sequence that holds it or is empty. Reads ``WINDOW`` slots per step (one row of
        ``_windows``); a large batch first reads each code's home slot alone, which settles most of them."""
        n = len(codes)
        out = np.full(n, -1, np.int64)
        if not n or not self.used:
            return out
        mask = self.capacity - 1
        pos = (codes & np.uint64(mask)).astype(np.int64)
        want = codes
        if n > 4096:
            seen = self.codes.take(pos)
            hit = seen == codes
            out[hit] = pos[hit]
            active = np.flatnonzero(~(hit | (seen == 0)))
            pos, want = pos[active] + 1, codes[active]
        else:
            active = np.arange(n)
        window = WINDOW
        while active.size:
            if window == WINDOW:
                seen = self._windows[pos & mask]
                hit = seen == want[:, None]
                found = hit.view(np.uint64).reshape(len(pos)) != 0  # (WINDOW is 8: a row of bools is one uint64)
                if found.all() and len(active) == n:  # a prompt's keys, all held: the common case
                    return (pos + hit.argmax(axis=1)) & mask
                unsettled = (seen == 0).view(np.uint64).reshape(len(pos)) == 0
            else:
                seen = self.codes.take((pos[:, None] + np.arange(window)) & mask)
                hit = seen == want[:, None]
                found, unsettled = hit.any(axis=1), ~(seen == 0).any(axis=1)
            rows = np.flatnonzero(found)
            out[active[rows]] = (pos[rows] + hit[rows].argmax(axis=1)) & mask
            more = ~found & unsettled  # a present code precedes any empty slot of its probe sequence
            if not more.any():
                break
            active, pos, want = active[more], pos[more] + window, want[more]
            window = WIDE_WINDOW  # the codes left have long probe sequences
        return out

    # -- changes --------------------------------------------------------------------------------------------------

    def insert(self, codes: np.ndarray) -> np.ndarray:
        """The slot of each code, putting those absent from the table into empty slots (their masks zero; equal
        codes share one). Grows first when the new codes would take the table past ``MAX_LOAD``: counted only
        when a batch of all-new codes could (a batch of codes held already must not grow the table)."""
        if self.used + len(codes) > MAX_LOAD * self.capacity:
            self.reserve(len(distinct(codes[self.find(codes) < 0])))
        slots, placed = self._place(codes)
        self.used += placed
        return slots

    def _place(self, codes: np.ndarray) -> tuple[np.ndarray, int]:
        """Linear probing for a batch: each pending code looks from its current position for itself or the
        first empty slot (its home slot alone, then ``WINDOW`` slots at a time once few codes are left). Codes
        that pick the same empty slot write their own tags there; the one whose tag stays wins the slot, the
        others look on from it (an equal code then finds it there). Returns the slots and how many were new."""
        table, mask = self.codes, self.capacity - 1
        out = np.empty(len(codes), np.int64)
        pending = np.arange(len(codes))
        pos = (codes & np.uint64(mask)).astype(np.int64)
        want, placed = codes, 0
        while pending.size:
            if len(pending) > 4096:
                seen = table.take(pos & mask)
                pick, step = pos, 1
                hit, claims = seen == want, seen == 0
            else:
                window = self._windows[pos & mask]
                stop = (window == want[:, None]) | (window == 0)
                first = stop.argmax(axis=1)
                pick, step = pos + first, WINDOW
                seen = window[np.arange(len(pos)), first]
                settled = stop.view(np.uint64).reshape(len(pos)) != 0  # (a row of 8 bools is one uint64)
                hit, claims = settled & (seen == want), settled & (seen == 0)
            at = np.flatnonzero(claims)
            slot, tag = pick[at] & mask, pending[at].astype(np.uint64) + np.uint64(1)
            table[slot] = tag
            won = table.take(slot) == tag
            table[slot[won]] = want[at[won]]
            self._sync()
            placed += int(np.count_nonzero(won))
            hit[at[won]] = True
            out[pending[hit]] = pick[hit] & mask
            left = ~hit
            pos = np.where(claims, pick, pos + step)[left]  # a code that lost a claim looks on from that slot
            pending, want = pending[left], want[left]
        return out, placed

    def reserve(self, more: int) -> None:
        """Double the capacity until ``used + more`` slots stay within ``MAX_LOAD``."""
        cap = self.capacity
        while self.used + more > MAX_LOAD * cap:
            cap *= 2
        if cap != self.capacity:
            self._rebuild(cap)

    def _rebuild(self, capacity: int) -> None:
        """Insert every entry again into fresh arrays of ``capacity`` slots."""
        live = np.flatnonzero(self.codes)
        codes, masks = self.codes[live], self.masks[:, live]
        del live
        self._set_codes(np.zeros(capacity + WINDOW, np.uint64))
        self.masks = np.zeros((TIERS, capacity, self.words), self.dtype)
        slots, _ = self._place(codes)
        self.masks[:, slots] = masks

    def delete(self, slots: np.ndarray) -> None:
        """Empty these (distinct, used) slots, keeping every other entry findable."""
        if not len(slots):
            return
        if len(slots) * 8 > self.used:  # a large share of the table: insert the survivors into fresh arrays
            self.codes[slots] = 0
            self.masks[:, slots] = 0
            self.used -= len(slots)
            self._rebuild(self.capacity)
            return
        # The entries from a doomed slot to the end of its cluster (the next empty slot) may have probed past
        # it: empty that stretch, from the cluster's first doomed slot, and insert its other entries again.
        mask = self.capacity - 1
        end = self._empty_after(slots)
        reach, cluster_of = end - slots, end & mask
        order = np.lexsort((reach, cluster_of))
        last = np.ones(len(order), bool)  # per cluster, the doomed slot farthest from its end (sorted last)
        last[:-1] = cluster_of[order[1:]] != cluster_of[order[:-1]]
        first, length = slots[order[last]], reach[order[last]]
        offsets = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
        cluster = (np.repeat(first, length) + offsets) & mask
        # An entry in its home slot stays (its probe sequence is that slot alone); the others move.
        cluster = cluster[(self.codes[cluster] & np.uint64(mask)).astype(np.int64) != cluster]
        cluster = np.concatenate([cluster, slots])  # (a doomed slot may be a home slot)
        move = cluster[: len(cluster) - len(slots)]
        move = move[~contains(np.sort(slots), move)]
        codes, masks = self.codes[move], self.masks[:, move]
        self.codes[cluster] = 0
        self._sync()
        self.masks[:, cluster] = 0
        self.used -= len(slots)
        self.masks[:, self._place(codes)[0]] = masks

    def _empty_after(self, slots: np.ndarray) -> np.ndarray:
        """For each slot, the position (not wrapped into the table) of the first empty slot after it."""
        mask = self.capacity - 1
        out = np.empty(len(slots), np.int64)
        active = np.arange(len(slots))
        pos = slots.astype(np.int64) + 1
        while active.size:
            empty = self._windows[pos & mask] == 0
            done = empty.view(np.uint64).reshape(len(pos)) != 0  # any empty slot among the WINDOW
            out[active[done]] = pos[done] + empty[done].argmax(axis=1)
            active, pos = active[~done], pos[~done] + WINDOW
        return out

    def widen(self) -> None:
        """Room for more group bits: the next wider dtype up to 64 bits, then one more word per mask."""
        if self.word_bits < 64:
            self.word_bits *= 2
            self.masks = self.masks.astype(self.dtype)
        else:
            wider: np.ndarray = np.zeros((TIERS, self.capacity, self.words + 1), self.dtype)
            wider[:, :, : self.words] = self.masks
            self.masks, self.words = wider, self.words + 1

    def clear_bit(self, word: int, value: int) -> np.ndarray:
        """Clear one group bit in every slot and tier; returns the slots that held it (any tier)."""
        column = self.masks[:, :, word]
        bit = self.dtype(value)
        had = np.flatnonzero(((column & bit) != 0).any(axis=0))
        column[:, had] &= ~bit
        return had

    def unused(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` whose masks hold no bit in any tier."""
        return slots[~self.masks[:, slots].any(axis=(0, 2))]

    # -- counts ---------------------------------------------------------------------------------------------------

    def bit_counts(self, tier: int | None = None) -> np.ndarray:
        """Per group bit (``words * word_bits`` of them): used slots whose masks hold it, in ``tier`` or in any
        tier (None). One histogram of byte values per byte of the mask words, not one pass per bit."""
        masks = self.masks[0] | self.masks[1] | self.masks[2] if tier is None else self.masks[tier]
        data = np.ascontiguousarray(masks)
        if sys.byteorder == "big":
            data = data.byteswap()
        as_bytes = data.view(np.uint8).reshape(self.capacity, -1)
        bits_of = (np.arange(256)[:, None] >> np.arange(8)) & 1  # byte value -> its 8 bits
        out = [np.bincount(as_bytes[:, b], minlength=256) @ bits_of for b in range(as_bytes.shape[1])]
        return np.concatenate(out)

    # -- snapshot -------------------------------------------------------------------------------------------------

    def write(self, f: BinaryIO, meta: dict) -> None:
        """The table as one buffer: a magic line, a JSON header (``meta`` and the array shapes), zero padding
        to a multiple of 8 bytes, then the raw arrays (little-endian)."""
        head = dict(meta, capacity=self.capacity, word_bits=self.word_bits, words=self.words, used=self.used)
        text = json.dumps(head).encode()
        text += b" " * (-(len(_MAGIC) + 8 + len(text)) % 8)
        f.write(_MAGIC + len(text).to_bytes(8, "little") + text)
        for arr in (self.codes, self.masks):
            data = arr if sys.byteorder == "little" else arr.byteswap()
            f.write(data.reshape(-1).view(np.uint8).data)  # the array's own buffer, not a copy

    @classmethod
    def read(cls, f: BinaryIO) -> tuple[KeyTable, dict]:
        """What ``write`` wrote: the table and its ``meta``."""
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError("not a kvgrid prefix index snapshot")
        head = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        table = cls.__new__(cls)
        table.word_bits, table.words, table.used = head["word_bits"], head["words"], head["used"]
        cap = head["capacity"]
        table._set_codes(np.empty(cap + WINDOW, np.uint64))
        _read_into(f, table.codes)
        table._sync()
        table.masks = np.empty((TIERS, cap, table.words), _DTYPES[table.word_bits])
        _read_into(f, table.masks)
        return table, head


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted."""
    ordered = np.sort(values)
    first = np.ones(len(values), bool)
    first[1:] = ordered[1:] != ordered[:-1]
    return ordered[first]


def contains(ordered: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Whether each of ``values`` is in the sorted, non-empty array ``ordered``."""
    at = np.minimum(np.searchsorted(ordered, values), len(ordered) - 1)
    return ordered[at] == values


def _read_into(f: BinaryIO, arr: np.ndarray) -> None:
    """Fill ``arr`` (contiguous) with the little-endian values ``write`` wrote."""
    view = arr.reshape(-1).view(np.uint8).data
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise ValueError("truncated prefix index snapshot")
        got += n
    if sys.byteorder == "big":
        arr.byteswap(inplace=True)
