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

A batch of numpy calls costs a few microseconds per call whatever its size, dozens of them per operation: a few
codes (a live worker's event) go through the ``*_small`` methods instead, plain Python over memoryviews of the
arrays (``code_view``, ``mask_view``) one code at a time, with a true backward shift per deleted slot.
"""

from __future__ import annotations

import json
import sys
from typing import BinaryIO

import numpy as np

from router.routing import keytable_native

TIERS = 3  # mask rows per slot: GPU, host RAM, disk
MAX_LOAD = 0.6  # used slots over capacity above which the table doubles (then 0.3: short probe sequences)
MIN_CAPACITY = 1024
WINDOW = 8  # slots a lookup reads at once from each probe position (one or two cache lines)
WIDE_WINDOW = 64  # ... once a first window did not settle a code
_DTYPES = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_FORMATS = {8: "B", 16: "H", 32: "I", 64: "Q"}  # memoryview formats of those dtypes
_MAGIC = b"KVGIDX1\n"


class KeyTable:
    def __init__(self, capacity: int = MIN_CAPACITY, word_bits: int = 8, words: int = 1) -> None:
        capacity = max(MIN_CAPACITY, 1 << (capacity - 1).bit_length())  # a power of two: probing masks, not mods
        self.word_bits, self.words = word_bits, words
        self._c = keytable_native.load()  # the C operations (None: numpy and Python only)
        self._set_codes(np.zeros(capacity + WINDOW, np.uint64))
        self.masks = np.zeros((TIERS, capacity, words), _DTYPES[word_bits])
        self.used = 0

    def _set_codes(self, padded: np.ndarray) -> None:
        """The codes array has ``WINDOW`` slots past its end that repeat its first ones, so that the ``WINDOW``
        slots from any position are one row of a strided view (``_windows``), read without wrapping."""
        self._padded = padded
        self.codes = padded[: len(padded) - WINDOW]
        self._windows = np.lib.stride_tricks.sliding_window_view(padded, WINDOW)
        self.code_view = padded.data.cast("B").cast("Q")  # the padded codes, for the one-code-at-a-time paths
        self._codes_at = padded.ctypes.data  # (for the C operations; the array lives as long as the table uses it)

    @property
    def masks(self) -> np.ndarray:
        return self._masks

    @masks.setter
    def masks(self, masks: np.ndarray) -> None:
        """The masks array (C-contiguous), and a flat memoryview of it (``mask_view``; set ``word_bits`` first)."""
        self._masks = masks
        self.mask_view = masks.data.cast("B").cast(_FORMATS[self.word_bits])  # type: ignore[call-overload]
        self._masks_at = masks.ctypes.data

    @property
    def native(self) -> bool:
        """Whether the C operations serve this table (they take one mask word per tier)."""
        return self._c is not None and self.words == 1

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
        slot of its probe sequence that holds it or is empty. Reads each code's home slot alone first (one plain
        gather, which settles most of them at the table's load), then ``WINDOW`` slots per step (one row of
        ``_windows``: a gather of rows costs several times a plain one, so only for the codes left)."""
        n = len(codes)
        if not n or not self.used:
            return np.full(n, -1, np.int64)
        if self._c is not None:
            codes = np.ascontiguousarray(codes, np.uint64)
            out = np.empty(n, np.int64)
            self._c.kvgrid_kt_find(self._codes_at, self.capacity, codes.ctypes.data, n, out.ctypes.data)
            return out
        mask = self.capacity - 1
        pos = (codes & np.uint64(mask)).astype(np.int64)
        seen = self.codes.take(pos)
        hit = seen == codes
        if hit.all():
            return pos
        out = np.where(hit, pos, -1)
        active = np.flatnonzero(~hit & (seen != 0))
        pos, want = pos[active] + 1, codes[active]
        window = WINDOW
        while active.size:
            if window == WINDOW:
                seen = self._windows[pos & mask]
                hit = seen == want[:, None]
                found = hit.view(np.uint64).reshape(len(pos)) != 0  # (WINDOW is 8: a row of bools is one uint64)
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

    # -- a few codes at a time ------------------------------------------------------------------------------------
    # A live worker's event carries a few keys, and a batch of numpy calls costs a few microseconds each whatever
    # its size: for small batches these probe one code at a time in Python, through memoryviews of the arrays
    # (an element read or write there is a plain int operation, well under a microsecond).

    def find_small(self, codes: list[int]) -> list[int]:
        """``find`` for a few codes (ints), one at a time."""
        cv, mask = self.code_view, self.capacity - 1
        out = []
        for c in codes:
            i = c & mask
            while True:
                s = cv[i]
                if s == c:
                    out.append(i)
                    break
                if not s:
                    out.append(-1)
                    break
                i = (i + 1) & mask
        return out

    def insert_small(self, codes: list[int]) -> list[int] | None:
        """``insert`` for a few codes (ints), one at a time; None (nothing done) when they might take the table
        past ``MAX_LOAD``: ``insert`` grows it first."""
        if self.used + len(codes) > MAX_LOAD * self.capacity:
            return None
        cv, cap = self.code_view, self.capacity
        mask, out = cap - 1, []
        for c in codes:
            i = c & mask
            while True:
                s = cv[i]
                if s == c:
                    break
                if not s:
                    cv[i] = c
                    if i < WINDOW:  # (the padding repeats the first slots)
                        cv[cap + i] = c
                    self.used += 1
                    break
                i = (i + 1) & mask
            out.append(i)
        return out

    def clear_small(self, codes: list[int], row: int, word: int, value: int, tiered: bool = True) -> None:
        """Clear bit ``value`` of mask word ``word`` in tier ``row`` of each code's slot, emptying a slot left with
        no bit (a backward shift: the later entries of its cluster that may move back into the hole do). Each
        code is looked up after the previous one's shift, which may have moved it. ``tiered`` False: no slot has
        a bit in another tier than the GPU pool's (row 0), so that row alone says whether a slot is used."""
        cv, mv, cap, words = self.code_view, self.mask_view, self.capacity, self.words
        mask, keep, at = cap - 1, ~value, row * cap * words + word
        if words == 1:
            self._clear_small_1(codes, at, keep, tiered or row != 0)
            return
        rows = [r * cap * words for r in range(TIERS)]
        for c in codes:
            i = c & mask
            while True:
                s = cv[i]
                if s == c:
                    break
                if not s:
                    i = -1
                    break
                i = (i + 1) & mask
            if i < 0:
                continue
            mv[at + i * words] &= keep
            if not any(mv[r + i * words + w] for r in rows for w in range(words)):
                self._shift_out(i)

    def _clear_small_1(self, codes: list[int], at: int, keep: int, tiered: bool) -> None:
        """``clear_small`` with one mask word per tier, in one loop (the backward shift inlined): the path of a
        live worker's removal events, at about a microsecond per key."""
        cv, mv, cap = self.code_view, self.mask_view, self.capacity
        mask, cap2, used = cap - 1, 2 * cap, self.used
        for c in codes:
            i = c & mask
            s = cv[i]
            while s != c:
                if not s:
                    break
                i = (i + 1) & mask
                s = cv[i]
            if s != c:
                continue
            mv[at + i] &= keep
            if mv[i] or tiered and (mv[cap + i] or mv[cap2 + i]):
                continue
            hole = j = i
            while True:
                j = (j + 1) & mask
                x = cv[j]
                if not x:
                    break
                if ((x & mask) - hole - 1) & mask < (j - hole) & mask:  # its home is in (hole, j]: it stays
                    continue
                cv[hole] = x
                if hole < WINDOW:
                    cv[cap + hole] = x
                mv[hole], mv[cap + hole], mv[cap2 + hole] = mv[j], mv[cap + j], mv[cap2 + j]
                hole = j
            cv[hole] = mv[hole] = mv[cap + hole] = mv[cap2 + hole] = 0
            if hole < WINDOW:
                cv[cap + hole] = 0
            used -= 1
        self.used = used

    def _shift_out(self, hole: int) -> None:
        """Empty used slot ``hole`` (its masks zero): each later entry of its cluster whose home is not between
        the hole and itself moves back into the hole, which moves to where that entry was."""
        cv, mv, cap, words = self.code_view, self.mask_view, self.capacity, self.words
        mask, j = cap - 1, hole
        rows = (0, cap * words, 2 * cap * words)
        while True:
            j = (j + 1) & mask
            c = cv[j]
            if not c:
                break
            if ((c & mask) - hole - 1) & mask < (j - hole) & mask:  # its home is in (hole, j]: it stays
                continue
            cv[hole] = c
            if hole < WINDOW:
                cv[cap + hole] = c
            for base in rows:
                for w in range(words):
                    mv[base + hole * words + w] = mv[base + j * words + w]
            hole = j
        cv[hole] = 0
        if hole < WINDOW:
            cv[cap + hole] = 0
        for base in rows:
            for w in range(words):
                mv[base + hole * words + w] = 0
        self.used -= 1

    # -- changes --------------------------------------------------------------------------------------------------

    def insert(self, codes: np.ndarray) -> np.ndarray:
        """The slot of each code, putting those absent from the table into empty slots (their masks zero; equal
        codes share one). Grows first when the new codes would take the table past ``MAX_LOAD``."""
        self._make_room(codes)
        slots, placed = self._place(codes)
        self.used += placed
        return slots

    def _make_room(self, codes: np.ndarray) -> None:
        """Grow the table if inserting ``codes`` would take it past ``MAX_LOAD``: counted only when a batch of
        all-new codes could (a batch of codes held already must not grow the table)."""
        if self.used + len(codes) > MAX_LOAD * self.capacity:
            self.reserve(len(distinct(codes[self.find(codes) < 0])))

    def add_bit(self, codes: np.ndarray, row: int, word: int, value: int) -> None:
        """Set bit ``value`` of mask word ``word`` in tier ``row`` for each code, inserting the absent ones."""
        if not self.native:
            slots = self.insert(codes)  # (first: it may grow the table, replacing its arrays)
            self.masks[row, slots, word] |= self.dtype(value)
            return
        self._make_room(codes)
        codes = np.ascontiguousarray(codes, np.uint64)
        self.used += self._c.kvgrid_kt_insert(  # type: ignore[union-attr]
            self._codes_at, self._masks_at, self.masks.itemsize, self.capacity,
            codes.ctypes.data, len(codes), row, value, None,
        )  # fmt: skip

    def drop_bit(self, codes: np.ndarray, row: int, word: int, value: int, tiered: bool = True) -> None:
        """Clear bit ``value`` of mask word ``word`` in tier ``row`` for each code held, and empty the slots left
        with no bit (``tiered`` False: no slot has a bit below the GPU pool's row, which alone then says)."""
        if self.native:
            codes = np.ascontiguousarray(codes, np.uint64)
            self.used -= self._c.kvgrid_kt_remove(  # type: ignore[union-attr]
                self._codes_at, self._masks_at, self.masks.itemsize, self.capacity,
                codes.ctypes.data, len(codes), row, value, int(tiered or row != 0),
            )  # fmt: skip
            return
        slots = self.find(codes)
        slots = slots[slots >= 0]
        if not len(slots):
            return
        if self.words == 1:  # a plain gather and scatter of the tier's row, and its values say which slots are free
            column = self.masks[row, :, 0]
            left = column.take(slots) & ~self.dtype(value)
            column.put(slots, left)
            doomed = self.unused(slots) if tiered or row != 0 else slots[left == 0]
        else:
            self.masks[row, slots, word] &= ~self.dtype(value)
            doomed = self.unused(slots)
        self.delete(doomed)  # (a key given twice: its slot twice, which delete allows)

    def _place(self, codes: np.ndarray) -> tuple[np.ndarray, int]:
        """Linear probing for a batch: each pending code looks from its current position for itself or the
        first empty slot (its home slot alone, then ``WINDOW`` slots at a time once few codes are left). Codes
        that pick the same empty slot write their own tags there; the one whose tag stays wins the slot, the
        others look on from it (an equal code then finds it there). Returns the slots and how many were new."""
        if self._c is not None:
            codes = np.ascontiguousarray(codes, np.uint64)
            out = np.empty(len(codes), np.int64)
            placed = self._c.kvgrid_kt_insert(
                self._codes_at, None, 0, self.capacity, codes.ctypes.data, len(codes), 0, 0, out.ctypes.data
            )
            return out, placed
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
        codes, masks = self.codes[live], self.masks_at(live)
        del live
        self._set_codes(np.zeros(capacity + WINDOW, np.uint64))
        self.masks = np.zeros((TIERS, capacity, self.words), self.dtype)
        slots, _ = self._place(codes)
        self.set_masks(slots, masks)

    def delete(self, slots: np.ndarray) -> None:
        """Empty these used slots (a slot may be given twice), keeping every other entry findable. Their masks
        must be zero already (``unused``): only the entries that move carry theirs."""
        if not len(slots):
            return
        if self.native:  # the C backward shift, one code at a time: value 0 clears nothing, empties each slot
            codes = np.ascontiguousarray(self.codes[slots])
            self.used -= self._c.kvgrid_kt_remove(  # type: ignore[union-attr]
                self._codes_at, self._masks_at, self.masks.itemsize, self.capacity,
                codes.ctypes.data, len(codes), 0, 0, 1,
            )  # fmt: skip
            return
        if len(slots) * 8 > self.used:  # a large share of the table: insert the survivors into fresh arrays
            slots = distinct(slots)
            self.codes[slots] = 0
            self.masks[:, slots] = 0
            self.used -= len(slots)
            self._rebuild(self.capacity)
            return
        # The entries from a doomed slot to the end of its cluster (the next empty slot) may have probed past
        # it: empty that stretch, from the cluster's first doomed slot, and insert its other entries again.
        # A doomed slot followed by an empty one ends its cluster: it is just emptied (at the table's load, most
        # are). For the others one sort finds, per cluster (named by its end), that first doomed slot (the
        # farthest from the end), and drops repeated slots: (cluster, distance to its end) packed in an int64.
        mask, shift = self.capacity - 1, self.capacity.bit_length() - 1
        inner = self.codes.take((slots + 1) & mask) != 0
        tail, slots = slots[~inner], slots[inner]
        if len(tail):  # emptied below with the others; counted here, once each (a slot may be given twice)
            tags = np.arange(1, len(tail) + 1, dtype=np.uint64)
            self.codes[tail] = tags
            self.used -= int(np.count_nonzero(self.codes.take(tail) == tags))
            self.codes[tail] = 0
            if not len(slots):
                self._sync()
                return
        end = self._empty_after(slots)
        packed = ((end & mask) << shift) | (end - slots)
        packed.sort()
        fresh = np.ones(len(packed), bool)
        fresh[1:] = packed[1:] != packed[:-1]
        packed = packed[fresh]  # one per distinct slot
        cluster_of = packed >> shift
        last = np.ones(len(packed), bool)  # per cluster, its largest distance (sorted last)
        last[:-1] = cluster_of[1:] != cluster_of[:-1]
        length = packed[last] & mask
        first = (cluster_of[last] - length) & mask
        offsets = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
        stretch = (np.repeat(first, length) + offsets) & mask
        self.codes[slots] = 0  # the doomed first: they read as empty below
        held = self.codes[stretch]
        # An entry in its home slot stays (its probe sequence is that slot alone); the others move.
        move = stretch[(held != 0) & ((held & np.uint64(mask)).astype(np.int64) != stretch)]
        codes, masks = self.codes[move], self.masks_at(move)
        self.codes[move] = 0
        self._sync()
        self.set_masks(move, 0)
        self.used -= len(packed)
        self.set_masks(self._place(codes)[0], masks)

    def masks_at(self, slots: np.ndarray) -> np.ndarray:
        """The masks of these slots, shape ``(TIERS, len(slots), words)``: with one word, a plain gather per tier
        (several times faster than numpy's general indexing of the 3-d array)."""
        if self.words > 1:
            return self.masks[:, slots]
        return np.stack([self.masks[r, :, 0].take(slots) for r in range(TIERS)])[:, :, None]

    def set_masks(self, slots: np.ndarray, values: np.ndarray | int) -> None:
        """Set the masks of these slots (``values`` as ``masks_at`` gives them, or one number)."""
        if self.words > 1:
            self.masks[:, slots] = values
            return
        for r in range(TIERS):
            self.masks[r, :, 0].put(slots, values if isinstance(values, int) else values[r, :, 0])

    def _empty_after(self, slots: np.ndarray) -> np.ndarray:
        """For each slot, the position (not wrapped into the table) of the first empty slot after it."""
        mask = self.capacity - 1
        out = slots.astype(np.int64) + 1
        active = np.arange(len(slots))
        pos = out.copy()
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
        if self.words == 1:  # (three plain gathers: much faster than one of all three rows, then a reduction)
            m = self.masks
            return slots[(m[0, :, 0].take(slots) | m[1, :, 0].take(slots) | m[2, :, 0].take(slots)) == 0]
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

    def copy(self) -> KeyTable:
        """An independent copy of the table (its arrays copied)."""
        other = KeyTable.__new__(KeyTable)
        other.word_bits, other.words, other.used, other._c = self.word_bits, self.words, self.used, self._c
        other._set_codes(self._padded.copy())
        other.masks = self.masks.copy()
        return other

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
        table._c = keytable_native.load()
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
