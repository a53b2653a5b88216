"""The counters a worker group's engine reports (``RankActor.stats``, ``GroupClient.stats``): what crosses from the
engine to the router, the admin metrics and the stats line. Plain dataclasses, importing nothing of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups of one tenant, in prompt tokens (counted once per request, on first admission)."""

    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0


@dataclass
class TierStats:
    """One lower tier: blocks held and its capacity, and since start: blocks stored (written down), hit blocks
    (found for an admitted request), loads (copies up: host to GPU, or disk to host), their bytes and seconds, and
    misses (a block that failed its checks)."""

    blocks: int = 0
    capacity: int = 0
    stored: int = 0
    hits: int = 0
    loads: int = 0
    load_bytes: int = 0
    load_s: float = 0.0
    bad: int = 0


@dataclass
class EngineStats:
    running: int
    waiting: int
    queued_prefill_tokens: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    blocks_pinned: int
    num_preemptions: int
    computed_tokens: int
    prefix_cache: dict[str, PrefixCacheStats]
    # The lower KV tiers ("host", "disk"; empty without tiers), and the figures the admin metrics read.
    kv_tiers: dict[str, TierStats] = field(default_factory=dict)
    host_blocks: int = 0
    disk_blocks: int = 0
    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    tier_load_bytes: int = 0
    tier_load_seconds: float = 0.0
    # Steps that computed a batch since the engine started, their wall time and their thread's CPU time.
    steps: int = 0
    step_seconds: float = 0.0
    step_cpu_seconds: float = 0.0
    lora_adapters: list[str] = field(default_factory=list)  # ids of the LoRA adapters loaded in device slots
