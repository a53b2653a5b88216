"""The compact prefix index (``CompactPrefixIndex``; ``routing: {index: compact}``): which worker groups hold which
block keys, in which tier, fed by the groups' KV events, for fleets whose index runs to tens of millions of keys.

Each group gets a bit. The index is a ``KeyTable`` (``router/routing/keytable.py``): an open-addressing hash
table in numpy arrays whose slots hold a key's code and, per tier (GPU pool, host RAM, disk), the bitmask of the
groups holding it there: 8 bytes of key plus 3 mask words per slot (one byte each up to 8 groups), 18 to 37
bytes per key as the load goes from 0.3 to 0.6, where a dict of bytes keys costs well over a hundred. ``match``
walks a prompt's keys in order and returns, for every group, the length of the longest run of leading keys it
holds in any tier, and how many of those it would load from host RAM or disk. It looks up a prompt's first 64
keys one at a time in Python (as the dict index does: a prompt no group holds stops at its first key), then the
rest a batch at a time with numpy (batches eight times larger each), and stops asking for chunks once no group is
left. Events of up to a few hundred keys (what a live worker sends) are applied one key at a time in Python too;
larger ones, in a few dozen numpy calls whatever their size.

A key's code is its first 8 bytes (little-endian uint64). Block keys are cryptographic hashes (xxh3-128 or
SHA-256 of the tenant-rooted chain), so codes are uniform and two keys rarely share one (about n²/2⁶⁵ pairs among
n keys). A shared code makes the router believe a group holds a block it does not: a routing guess that may be
wrong, never a wrong cache hit, because the engine matches full keys before it reuses a block.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from common.events import AllCleared, BlockRemoved, BlockStored, KVEvent, Tier
from router.routing.index_base import TierMatch
from router.routing.keytable import KeyTable

TIER_ROWS = {Tier.GPU: 0, Tier.HOST: 1, Tier.DISK: 2}  # a tier's mask row in the table
_ZERO_CODE = np.uint64(0x9E3779B97F4A7C15)  # the code of a key whose first 8 bytes are zero (0 marks empty slots)
_FIRST_BATCH = 64  # keys of a prompt looked up at first (one at a time); each later batch is 8 times larger
# Keys of a table operation up to which it runs one key at a time in Python, not in numpy calls: a batch costs a
# few dozen numpy calls whatever its size (100-400 us on the 2-core dev box), a key in Python 1-2 us.
SMALL = 128  # stores
SMALL_REMOVE = 384  # removals (their batch path has the most calls)
SMALL_LOOKUP = 32  # ``holders_many`` (its batch path has the fewest) in a large table: a read there in Python
# waits for memory, where numpy's gathers overlap their reads; in a table of up to this many slots (a few MB,
# in the CPU's caches) up to SMALL
CACHED_SLOTS = 1 << 18


def key_codes(keys: Sequence[bytes]) -> np.ndarray:
    """Each key's first 8 bytes as a little-endian uint64 (a key shorter than 8 bytes padded with zeros).

    Keys of one length (what a router's hash algorithm gives) are read straight from their joined bytes; the
    length is checked on the total and on the first and last keys only, as checking every key would cost as much
    as the rest. Keys of mixed lengths that pass this check would only make wrong codes: routing guesses."""
    n = len(keys)
    buf = b"".join(keys)
    size = len(buf) // n if n else 8
    if size * n == len(buf) and size >= 8 and (not n or len(keys[0]) == size == len(keys[-1])):
        if size % 8 == 0:
            codes = np.frombuffer(buf, "<u8")[:: size // 8].astype(np.uint64)
        else:
            codes = np.frombuffer(buf, np.uint8).reshape(n, size)[:, :8].copy().view("<u8").reshape(n)
            codes = codes.astype(np.uint64, copy=False)
    else:
        raw = b"".join(k[:8].ljust(8, b"\0") for k in keys)
        codes = np.frombuffer(raw, "<u8").astype(np.uint64)
    if not codes.all():
        codes[codes == 0] = _ZERO_CODE
    return codes


def small_codes(keys: Sequence[bytes]) -> list[int]:
    """``key_codes`` as a list of ints, computed one key at a time (for a few keys: no numpy call)."""
    zero = int(_ZERO_CODE)
    return [int.from_bytes(k[:8], "little") or zero for k in keys]


class CompactPrefixIndex:
    def __init__(self) -> None:
        self._table = KeyTable()
        self._bit: dict[str, int] = {}
        self._by_bit: dict[int, str] | None = None  # (``_groups_by_bit``)
        self._free_bits: list[int] = []
        self._tiered = False  # whether a key was ever stored in host RAM or on disk (else a walk reads GPU masks only)

    def __len__(self) -> int:
        return self._table.used

    def nbytes(self) -> int:
        """Bytes of the table's arrays."""
        return self._table.nbytes()

    def groups(self) -> list[str]:
        """The groups the index has bits for."""
        return list(self._bit)

    def bit(self, group: str) -> int:
        """The group's bit, adding the group if it is new."""
        b = self._bit.get(group)
        if b is None:
            b = self._free_bits.pop() if self._free_bits else 1 << len(self._bit)
            t = self._table
            while b.bit_length() > t.word_bits * t.words:
                t.widen()
            self._bit[group] = b
            self._by_bit = None
        return b

    def _word(self, bit: int) -> tuple[int, int]:
        """A group bit's mask word and its value there."""
        i, width = bit.bit_length() - 1, self._table.word_bits
        return i // width, 1 << (i % width)

    def apply(self, group: str, event: KVEvent) -> None:
        b = self.bit(group)
        if isinstance(event, BlockStored):
            if event.keys:
                self._tiered |= event.tier != Tier.GPU
                self._store(b, event.keys, TIER_ROWS[event.tier])
        elif isinstance(event, BlockRemoved):
            if event.keys:
                self._remove(b, event.keys, TIER_ROWS[event.tier])
        elif isinstance(event, AllCleared):
            self._clear(b)
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def apply_many(self, events: Iterable[tuple[str, KVEvent]]) -> None:
        """Apply a batch of ``(group, event)``: each group's events in their order, its consecutive events of one
        kind and tier merged into one table operation. Groups' bits are independent, so the order between
        groups does not matter."""
        if isinstance(events, list | tuple) and len(events) == 1:  # (what a poll of a quiet stream brings)
            self.apply(*events[0])
            return
        ops: dict[str, list[tuple[type, Tier | None, list[bytes]]]] = {}
        for group, event in events:
            run = ops.setdefault(group, [])
            if isinstance(event, AllCleared):
                if not run or run[-1][0] is not AllCleared:
                    run.append((AllCleared, None, []))
            elif isinstance(event, (BlockStored, BlockRemoved)):
                if run and run[-1][0] is type(event) and run[-1][1] == event.tier:
                    run[-1][2].extend(event.keys)
                else:
                    run.append((type(event), event.tier, list(event.keys)))
            else:
                raise TypeError(f"not a KV event: {event!r}")
        for group, run in ops.items():
            for kind, tier, keys in run:
                if kind is AllCleared:
                    self.apply(group, AllCleared())
                elif kind is BlockStored:
                    self.apply(group, BlockStored(keys, None, tier or Tier.GPU))
                else:
                    self.apply(group, BlockRemoved(keys, tier or Tier.GPU))

    def _store(self, bit: int, keys: Sequence[bytes], row: int) -> None:
        t = self._table
        word, value = self._word(bit)
        if len(keys) <= SMALL and not t.native:
            placed = t.insert_small(small_codes(keys))
            if placed is not None:
                mv, words = t.mask_view, t.words
                at = row * t.capacity * words + word
                for s in placed:
                    mv[at + s * words] |= value
                return
        t.add_bit(key_codes(keys), row, word, value)

    def _remove(self, bit: int, keys: Sequence[bytes], row: int) -> None:
        t = self._table
        word, value = self._word(bit)
        if len(keys) <= SMALL_REMOVE and not t.native:
            t.clear_small(small_codes(keys), row, word, value, self._tiered)
            return
        t.drop_bit(key_codes(keys), row, word, value, self._tiered)

    def _clear(self, bit: int) -> None:
        """Drop the group's bit from every key (a vectorised pass over the table), and the keys left unheld."""
        t = self._table
        t.delete(t.unused(t.clear_bit(*self._word(bit))))

    def remove_group(self, group: str) -> None:
        """Forget a group and every entry it had (at once)."""
        b = self._bit.pop(group, None)
        if b is None:
            return
        self._by_bit = None
        self._clear(b)
        self._free_bits.append(b)

    def _groups_by_index(self) -> dict[int, str]:
        return {b.bit_length() - 1: g for g, b in self._bit.items()}

    def _groups_by_bit(self) -> dict[int, str]:
        """Bit -> group (kept until a group is added or removed: every walk asks for it)."""
        if self._by_bit is None:
            self._by_bit = {b: g for g, b in self._bit.items()}
        return self._by_bit

    def key_counts(self) -> dict[str, int]:
        """Keys held per group (in any tier), counted from the table's masks; bits of no current group count
        under ``"?"`` (there should be none)."""
        by_index = self._groups_by_index()
        out: dict[str, int] = {}
        counts = self._table.bit_counts()
        for i in np.flatnonzero(counts).tolist():
            g = by_index.get(i, "?")
            out[g] = out.get(g, 0) + int(counts[i])
        return out

    def tier_counts(self) -> dict[str, dict[str, int]]:
        """Keys held per group and tier (a key in several tiers of a group counts in each)."""
        per_tier = {str(t): self._table.bit_counts(row) for t, row in TIER_ROWS.items()}
        return {g: {t: int(c[i]) for t, c in per_tier.items()} for i, g in self._groups_by_index().items()}

    def holders(self, key: bytes) -> int:
        """Bits of the groups holding ``key`` in any tier."""
        return self.holders_many([key])[0]

    def holders_many(self, keys: Sequence[bytes]) -> list[int]:
        """``holders`` of each key, looked up together."""
        if not keys:
            return []
        t = self._table
        if len(keys) <= (SMALL if t.capacity <= CACHED_SLOTS else SMALL_LOOKUP) and t.words == 1 and not t.native:
            mv, cap = t.mask_view, t.capacity
            return [mv[i] | mv[cap + i] | mv[2 * cap + i] if i >= 0 else 0 for i in t.find_small(small_codes(keys))]
        slots = t.find(key_codes(keys))
        if t.words == 1:  # one plain gather per tier (slot -1 reads the last slot: masked out after)
            m = t.masks
            one = m[0, :, 0].take(slots)
            if self._tiered:  # (else those rows are zero: reading them would only fault their pages in)
                one |= m[1, :, 0].take(slots) | m[2, :, 0].take(slots)
            one[slots < 0] = 0
            return one.tolist()
        found = slots >= 0
        held: np.ndarray = np.zeros((len(keys), t.words), t.dtype)
        m = t.masks[:, slots[found]]
        held[found] = m[0] | m[1] | m[2]
        return self._ints(held)

    def _ints(self, words: np.ndarray) -> list[int]:
        """Rows of mask words as ints of group bits."""
        if words.shape[1] == 1:
            return words[:, 0].tolist()
        width = self._table.word_bits
        return [sum(int(w) << (width * j) for j, w in enumerate(row)) for row in words.tolist()]

    def _words(self, values: list[int]) -> np.ndarray:
        """Ints of group bits as rows of mask words."""
        t = self._table
        if t.words == 1:
            return np.array(values, np.uint64).astype(t.dtype).reshape(-1, 1)
        full = (1 << t.word_bits) - 1
        return np.array([[(v >> (t.word_bits * j)) & full for j in range(t.words)] for v in values], t.dtype)

    def match(self, keys: list[bytes], extra: dict[bytes, int] | None = None) -> dict[str, int]:
        """Blocks of the longest leading run each group holds in any tier (``extra``: more holders per key, e.g.
        predictions). Groups holding no leading block are absent."""
        return self.match_chunks([keys], extra)

    def match_chunks(self, chunks: Iterable[Sequence[bytes]], extra: dict[bytes, int] | None = None) -> dict[str, int]:
        """``match`` over keys that arrive in chunks (computed lazily: no chunk is asked for once no group is
        left)."""
        return {g: t.blocks for g, t in self.match_tiers(chunks, extra).items()}

    def match_tiers(
        self, chunks: Iterable[Sequence[bytes]], extra: dict[bytes, int] | None = None
    ) -> dict[str, TierMatch]:
        """``match_chunks`` with each run's split by tier: of a group's run, the blocks it holds in host RAM but
        not in its GPU pool, and those it holds on disk only. A block predicted for a group (``extra``) and not
        held there counts as GPU (it is being computed there)."""
        by_bit = self._groups_by_bit()
        if not by_bit:
            return {}
        t = self._table
        if t.words == 1:
            alive: np.ndarray | np.generic = t.dtype(sum(self._bit.values()))
        else:
            alive = self._words([sum(self._bit.values())])[0]
        walk = _Walk(alive, t.word_bits * t.words)
        chunks_left = iter(chunks)
        want = _FIRST_BATCH
        while walk.alive.any():
            keys: list[bytes] = []
            for chunk in chunks_left:
                keys.extend(chunk)
                if len(keys) >= want:
                    break
            if not keys:
                break
            if walk.n == 0 and self._table.words == 1:  # the first keys one at a time: a cold prompt stops at one
                self._match_small(walk, keys[:_FIRST_BATCH], extra)
                if len(keys) > _FIRST_BATCH and walk.alive.any():
                    self._match_batch(walk, keys[_FIRST_BATCH:], extra)
            else:
                self._match_batch(walk, keys, extra)
            want *= 8
        walk.record(walk.alive, walk.n)
        if walk.host is None or walk.disk is None:  # (no run reached a block below a GPU pool: the usual case)
            return {by_bit[b]: TierMatch(k) for b, k in walk.runs.items() if k > 0 and b in by_bit}
        host, disk = walk.host.tolist(), walk.disk.tolist()
        return {
            by_bit[b]: TierMatch(k, host[b.bit_length() - 1], disk[b.bit_length() - 1])
            for b, k in walk.runs.items()
            if k > 0 and b in by_bit
        }

    def _match_small(self, walk: _Walk, keys: list[bytes], extra: dict[bytes, int] | None) -> None:
        """``_match_batch`` one key at a time (one mask word per tier), as the dict index walks: it stops at the
        first key that leaves no group in the run, and costs no numpy call."""
        t = self._table
        cv, mv, cap = t.code_view, t.mask_view, t.capacity
        mask, tiered = cap - 1, self._tiered
        alive, n, zero = int(walk.alive), walk.n, int(_ZERO_CODE)
        for key in keys:
            c = int.from_bytes(key[:8], "little") or zero
            i = c & mask
            while True:
                s = cv[i]
                if s == c:
                    gpu = mv[i]
                    host, disk = (mv[cap + i], mv[2 * cap + i]) if tiered else (0, 0)
                    break
                if not s:
                    gpu = host = disk = 0
                    break
                i = (i + 1) & mask
            m = (gpu | host | disk) & alive
            if m != alive and extra:  # predictions matter only for groups the index alone would drop
                m |= alive & extra.get(key, 0)
            if m != alive:
                walk.record(alive & ~m, n)
                alive = m
                if not alive:
                    break
            below = m & (host | disk) & ~gpu  # groups of the run that hold this block in host RAM or on disk
            if below:
                walk.count(below & host, below & ~host)
            n += 1
        walk.alive, walk.n = t.dtype(alive), n

    def _match_batch(self, walk: _Walk, keys: list[bytes], extra: dict[bytes, int] | None) -> None:
        """Extend the walk by ``keys``: the groups holding each of them (``extra`` counted where a group still in
        the run lacks one), the prefix AND of those sets, and the tier split of the blocks within each run. With
        one mask word per tier (up to 64 groups) a key's groups are one number, else a row of words."""
        t = self._table
        one = t.words == 1
        masks = t.masks[:, :, 0] if one else t.masks
        slots = t.find(key_codes(keys))
        found = slots >= 0
        rows = slice(None) if self._tiered else slice(0, 1)
        if found.all():
            tiers = masks[rows, slots]
        else:
            tiers = np.zeros((3 if self._tiered else 1, len(keys), *masks.shape[2:]), t.dtype)
            tiers[:, found] = masks[rows, slots[found]]
        lower = tiers[1] | tiers[2] if self._tiered else None
        held = tiers[0] | lower if lower is not None else tiers[0].copy()
        alive = walk.alive
        if extra:  # predictions matter only for groups the index alone would drop
            short = np.flatnonzero(_rows_differ(held & alive, alive))
            if short.size:
                more = [extra.get(keys[i], 0) for i in short.tolist()]
                if any(more):
                    words = self._words(more)
                    held[short] |= words[:, 0] if one else words
        run = np.bitwise_and.accumulate(held & alive, axis=0)  # groups holding every key so far
        if _rows_differ(run[-1:], alive)[0]:  # some group dropped out in this batch: where, and which
            before = np.empty_like(run)
            before[0], before[1:] = alive, run[:-1]
            for r in np.flatnonzero(_rows_differ(run, before)).tolist():
                walk.record(before[r] & ~run[r], walk.n + r)
        below = run & lower & ~tiers[0] if lower is not None else None  # a run's blocks in host RAM or on disk
        if below is not None and below.any():
            walk.add(_bit_sums(below & tiers[1], walk.width), _bit_sums(below & ~tiers[1], walk.width))
        walk.alive = run[-1]
        walk.n += len(keys)

    # -- snapshot ---------------------------------------------------------------------------------------------

    def write(self, f: BinaryIO, extra: dict | None = None) -> None:
        """Write the index to ``f`` as one buffer: a small header (the groups' bits, and ``extra``, JSON that the
        caller reads back with ``read_extra``) and the table's raw arrays."""
        meta = {"groups": self._bit, "free_bits": self._free_bits, "tiered": self._tiered, "extra": extra or {}}
        self._table.write(f, meta)

    @classmethod
    def read(cls, f: BinaryIO) -> CompactPrefixIndex:
        """An index as ``write`` wrote it."""
        return cls.read_extra(f)[0]

    @classmethod
    def read_extra(cls, f: BinaryIO) -> tuple[CompactPrefixIndex, dict]:
        """An index as ``write`` wrote it, and the ``extra`` written with it."""
        index = cls()
        index._table, head = KeyTable.read(f)
        index._bit = {g: int(b) for g, b in head["groups"].items()}
        index._by_bit = None
        index._free_bits = [int(b) for b in head["free_bits"]]
        index._tiered = bool(head.get("tiered", True))
        return index, head.get("extra", {})

    def copy(self) -> CompactPrefixIndex:
        """An independent copy (the arrays copied: a snapshot of this moment that later events leave alone)."""
        other = CompactPrefixIndex()
        other._table = self._table.copy()
        other._bit, other._free_bits, other._tiered = dict(self._bit), list(self._free_bits), self._tiered
        return other

    def to_bytes(self) -> bytes:
        import io

        buf = io.BytesIO()
        self.write(buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> CompactPrefixIndex:
        import io

        return cls.read(io.BytesIO(data))

    def save(self, path: str | Path, extra: dict | None = None) -> None:
        """``write`` to a file, through a temporary name so that a reader never sees half a snapshot."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            self.write(f, extra)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> CompactPrefixIndex:
        return cls.load_extra(path)[0]

    @classmethod
    def load_extra(cls, path: str | Path) -> tuple[CompactPrefixIndex, dict]:
        with open(path, "rb") as f:
            return cls.read_extra(f)


class _Walk:
    """The state of a prompt's walk through the index: the groups still in the run (mask words), the keys
    walked, each dropped group's run length (by its bit), and per bit the run's blocks in host RAM / on disk
    (None until a run reaches such a block)."""

    def __init__(self, alive: np.ndarray | np.generic, width: int) -> None:
        self.alive, self.n, self.width = alive, 0, width
        self.runs: dict[int, int] = {}
        self.host: np.ndarray | None = None
        self.disk: np.ndarray | None = None

    def add(self, host: np.ndarray, disk: np.ndarray) -> None:
        """More blocks per bit of the runs in host RAM and on disk."""
        if self.host is None or self.disk is None:
            self.host, self.disk = host.copy(), disk.copy()
        else:
            self.host += host
            self.disk += disk

    def record(self, words: np.ndarray | np.generic | int, n: int) -> None:
        """The groups set in ``words`` (or an int of group bits) ran ``n`` blocks."""
        bits = words if isinstance(words, int) else _int(words)
        runs = self.runs
        while bits:
            low = bits & -bits
            runs[low] = n
            bits ^= low

    def count(self, host: int, disk: int) -> None:
        """One more block in host RAM for each group set in ``host``, on disk for each set in ``disk``."""
        if self.host is None or self.disk is None:
            self.host, self.disk = np.zeros(self.width, np.int64), np.zeros(self.width, np.int64)
        for bits, counts in ((host, self.host), (disk, self.disk)):
            while bits:
                low = bits & -bits
                counts[low.bit_length() - 1] += 1
                bits ^= low


def _int(words: np.ndarray | np.generic) -> int:
    """Mask words (one number, or a row of words) as one int of group bits."""
    width = words.dtype.itemsize * 8
    return sum(int(w) << (width * j) for j, w in enumerate(np.atleast_1d(words).tolist()))


def _rows_differ(a: np.ndarray, b: np.ndarray | np.generic) -> np.ndarray:
    """Per row, whether ``a`` and ``b`` differ (rows of one number, or of several words)."""
    differ = a != b
    return differ if differ.ndim == 1 else differ.any(axis=1)


def _bit_sums(rows: np.ndarray, width: int) -> np.ndarray:
    """Per bit of the mask words: how many rows have it set."""
    rows = rows.reshape(len(rows), -1)
    if sys.byteorder == "big":
        rows = rows.byteswap()
    bits = np.unpackbits(np.ascontiguousarray(rows).view(np.uint8), axis=1, bitorder="little")
    return bits.sum(axis=0, dtype=np.int64)[:width]
