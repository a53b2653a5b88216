"""Defaults that more than one module uses, each defined once."""

from __future__ import annotations

FIVE_MINUTES_S = 300.0
"""The vendors' short cache TTL: an entry living at most this long is written at the 5-minute price (longer: the
one-hour one), and a reuse within it reads an entry of that TTL."""

DEFAULT_PIN_TTL_S = FIVE_MINUTES_S
"""How long a pin (an explicit entry, the cached part of a prompt) lives when nothing names its TTL: a tenant's
``cache.default_ttl``, the engine's and a group's ``pin_ttl_s``, the keep-alive replay's entries."""
