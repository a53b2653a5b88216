"""Mooncake-format request traces (``tests/data/README.md``), read the same way by ``kvgrid bench serve --trace``
(router/sim/loadgen.py) and ``kvgrid replay`` (router/sim/replay.py): one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids``, one id per ``MOONCAKE_BLOCK`` tokens of the prompt."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces


@dataclass(frozen=True)
class TraceEntry:
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: str | Path, limit: int | None = None) -> list[TraceEntry]:
    """The first ``limit`` records of a Mooncake-format JSONL trace; ValueError names a bad line."""
    out: list[TraceEntry] = []
    try:
        f = open(path)
    except OSError as exc:
        raise ValueError(f"cannot read --trace {path}: {exc.strerror}") from None
    with f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                entry = TraceEntry(
                    float(row["timestamp"]) / 1e3,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a trace record ({exc!r})") from None
            # The hash ids stand for the prompt's blocks: it must fit in them and reach into the last one.
            blocks = len(entry.hash_ids)
            if not (blocks - 1) * MOONCAKE_BLOCK < entry.input_length <= blocks * MOONCAKE_BLOCK:
                raise ValueError(
                    f"{path}:{n}: input_length {entry.input_length} does not match {blocks} hash_ids "
                    f"of {MOONCAKE_BLOCK} tokens"
                )
            if entry.output_length < 1 or entry.timestamp_s < 0:
                raise ValueError(f"{path}:{n}: output_length must be >= 1 and timestamp >= 0")
            out.append(entry)
    if not out:
        raise ValueError(f"{path}: no trace records (--trace)")
    return out
