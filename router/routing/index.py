"""The global prefix index: which worker groups hold which block keys, in which tier, fed by the groups' KV events;
``match`` walks a prompt's keys in order and returns, for every group, its longest leading run and how much of it
it would load from host RAM or disk. Two implementations with the same behaviour (``routing: {index: ...}``):

    compact   router/routing/compact_index.py  the default: an open-addressing table in numpy arrays
                                               (router/routing/keytable.py, its operations in C where a compiler
                                               is found: keytable.c): about 15-40 bytes per key, a snapshot that is
                                               the arrays; faster than dict at every size measured
    dict      router/routing/dict_index.py     a dict of bytes keys: about 130-170 bytes per key; kept as the
                                               reference the compact index is tested against

docs/benchmarks.md has both measured side by side."""

from __future__ import annotations

from router.routing.compact_index import CompactPrefixIndex
from router.routing.dict_index import DictPrefixIndex
from router.routing.index_base import TierMatch, clear_bit

__all__ = ["INDEX_KINDS", "CompactPrefixIndex", "DictPrefixIndex", "PrefixIndex", "TierMatch", "clear_bit", "new_index"]

PrefixIndex = DictPrefixIndex | CompactPrefixIndex
INDEX_KINDS = {"dict": DictPrefixIndex, "compact": CompactPrefixIndex}


def new_index(kind: str = "compact") -> PrefixIndex:
    """An empty index of ``kind`` (``INDEX_KINDS``)."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"unknown prefix index {kind!r}; expected one of: {', '.join(INDEX_KINDS)}")
    return DictPrefixIndex() if kind == "dict" else CompactPrefixIndex()
