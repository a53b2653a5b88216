"""Small checks of values that several components validate the same way."""

from __future__ import annotations


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8, ... (block sizes, split counts)."""
    return n >= 1 and n & (n - 1) == 0
