"""Mooncake-format request traces (``tests/data/README.md``), read the same way by ``kvgrid bench serve --trace``
(router/sim/loadgen.py) and ``kvgrid replay`` (router/sim/replay.py): one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids``, one id per ``MOONCAKE_BLOCK`` tokens of the prompt.
``synthetic_conversations`` generates one (what ``kvgrid bench fleet`` runs without ``--trace``)."""

from __future__ import annotations

import json
import math
import random
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


def synthetic_conversations(
    requests: int, rate_per_s: float, seed: int = 0, system_prompts: int = 8, think_s: float = 20.0
) -> list[TraceEntry]:
    """A generated Mooncake-format trace of ``requests`` requests arriving at ``rate_per_s`` on average: multi-turn
    conversations (4 turns on average, at most 16), each opening with one of ``system_prompts`` shared system
    prompts of 4 blocks. Every turn resends the conversation so far, the last answer and a new user message (200
    to 2,000 tokens), so it shares all its earlier full blocks; the next turn follows the answer (100 to 800 tokens
    at 20 ms each) after an exponential think time of mean ``think_s``."""
    if requests < 1 or rate_per_s <= 0:
        raise ValueError("need requests >= 1 and rate_per_s > 0")
    rng = random.Random(seed)
    block, mean_turns = MOONCAKE_BLOCK, 4
    new_id = iter(range(system_prompts * 4, 1 << 62)).__next__
    out: list[TraceEntry] = []
    # Conversations start from well before 0 and only requests from 0 on are kept, so the trace opens at its
    # steady rate, some conversations mid-way (their earlier turns before the trace, as in a recorded one).
    start, cutoff = -15 * think_s, math.inf
    while start <= cutoff:  # until no later conversation can fall among the first ``requests`` requests
        start += rng.expovariate(rate_per_s / mean_turns)
        system = rng.randrange(system_prompts)
        ids = list(range(system * 4, system * 4 + 4))  # ids of the conversation's full blocks so far
        length, t = 4 * block, start
        for _ in range(16):
            length += rng.randint(200, 2000)  # the user's message
            full = length // block
            ids += [new_id() for _ in range(full - len(ids))]
            hash_ids = ids + ([new_id()] if length % block else [])  # a partial last block is never shared
            output = rng.randint(100, 800)
            if t >= 0:
                out.append(TraceEntry(t, length, output, tuple(hash_ids)))
            if rng.random() < 1 / mean_turns:
                break
            length += output
            t += output * 0.02 + rng.expovariate(1 / think_s)
        if cutoff == math.inf and len(out) >= requests:
            cutoff = sorted(e.timestamp_s for e in out)[requests - 1]
    out.sort(key=lambda e: e.timestamp_s)
    return out[:requests]
