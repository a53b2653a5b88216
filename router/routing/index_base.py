"""What the two prefix indexes share (router/routing/dict_index.py, compact_index.py): a group's leading run of a
prompt's blocks by tier (``TierMatch``), and clearing one group's bit in a dict of bitmasks (``clear_bit``)."""

from __future__ import annotations

from typing import NamedTuple


class TierMatch(NamedTuple):
    """A group's leading run of a prompt's blocks: ``blocks`` in all, of which ``host`` are best held in host RAM
    (not in its GPU pool) and ``disk`` on disk only; the rest (``gpu``) are in its GPU pool (or predicted)."""

    blocks: int
    host: int = 0
    disk: int = 0

    @property
    def gpu(self) -> int:
        return self.blocks - self.host - self.disk


def clear_bit(masks: dict[bytes, int], key: bytes, bit: int) -> bool:
    """Clear ``bit`` in ``masks[key]``; drop the key when no bit is left (returns whether it was dropped)."""
    m = masks.get(key, 0) & ~bit
    if m:
        masks[key] = m
        return False
    masks.pop(key, None)
    return True
