"""What every config model shares: ``ConfigError``, durations (``parse_duration``: ``5m``, ``90s``, seconds) and
``Strict``, the base model that refuses unknown keys and coercions (common/config.py re-exports them)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ConfigError(ValueError):
    """The configuration is invalid; the message names the field."""


def parse_duration(value: str | int | float) -> float:
    """Seconds in ``value``: a number of seconds, or text like ``"90s"``, ``"5m"``, ``"1h"``."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or text like '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if m is None:
            raise ValueError(f"{value!r} is not a duration (use e.g. 30s, 5m, 1h)")
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


class Strict(BaseModel):
    """Every config model: unknown keys are refused, and values are not coerced from another type (``groups: true``
    and ``min_prefix_tokens: "64"`` are errors; an int is accepted for a float). Durations keep their own
    before-validators (``parse_duration``): ``5m``, ``90s`` or a number of seconds."""

    model_config = ConfigDict(extra="forbid", strict=True)
