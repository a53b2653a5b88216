"""The router's index, policy behaviours, predictions and hashing, in small deterministic scenarios."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from common.events import AllCleared, BlockRemoved, BlockStored, ListSink
from common.sampling import SamplingParams
from router.routing.index import INDEX_KINDS, new_index
from router.routing.router import Router
from router.routing.transport import InProcessTransport
from router.sim.replay import load_trace, replay

SECRET = b"router-test-secret"
TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_1500.jsonl"  # see tests/data/README.md


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_index_follows_interleaved_events_like_a_naive_model(kind):
    rng = random.Random(3)
    index, model = new_index(kind), {g: set() for g in "abc"}
    for _ in range(3000):
        g, op = rng.choice("abc"), rng.random()
        keys = [k(rng.randrange(40)) for _ in range(rng.randrange(1, 5))]
        if op < 0.55:
            index.apply(g, BlockStored(keys, None))
            model[g].update(keys)
        elif op < 0.95:
            index.apply(g, BlockRemoved(keys))
            model[g].difference_update(keys)
        else:
            index.apply(g, AllCleared())
            model[g].clear()
        prompt = [k(i) for i in range(rng.randrange(0, 6))]
        expected = {}
        for grp, held in model.items():
            n = 0
            while n < len(prompt) and prompt[n] in held:
                n += 1
            if n:
                expected[grp] = n
        assert index.match(prompt) == expected


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_removing_a_group_drops_all_its_entries_at_once(kind):
    index = new_index(kind)
    index.apply("a", BlockStored([k(1), k(2)], None))
    index.apply("b", BlockStored([k(1)], None))
    index.remove_group("a")
    assert index.match([k(1), k(2)]) == {"b": 1}
    assert index.holders(k(2)) == 0 and len(index) == 1


def test_cold_traffic_does_not_pile_onto_the_first_group():
    router = Router(["g0", "g1", "g2", "g3"], SECRET)
    rng = random.Random(0)
    picks = [router.route("acme", [rng.randrange(32000) for _ in range(64)]).group for _ in range(8)]
    assert sorted(picks.count(g) for g in router.loads) == [2, 2, 2, 2]


def test_a_universal_first_block_does_not_collapse_routing_onto_one_group():
    router = Router(["g0", "g1", "g2", "g3"], SECRET)
    system = list(range(16))  # every prompt starts with this block, and every group holds it
    for g in router.loads:
        router.apply_event(g, BlockStored(router.keys_for("acme", system), None))
    rng = random.Random(1)
    picks = {router.route("acme", system + [rng.randrange(32000) for _ in range(200)]).group for _ in range(8)}
    assert picks == set(router.loads)


def test_hot_prefix_spreads_to_a_second_group_under_load_not_to_all():
    router = Router(["g0", "g1", "g2", "g3"], SECRET, prediction_ttl_s=0)
    hot = list(range(1000, 3048))  # 2048 tokens, held by g0
    router.apply_event("g0", BlockStored(router.keys_for("acme", hot), None))
    picks, rng = [], random.Random(2)
    for _ in range(56):  # a burst: nothing finishes, g0's queue grows by 512 tokens a request
        d = router.route("acme", hot + [rng.randrange(32000) for _ in range(512)])
        if d.group not in picks:  # the new holder computes the prefix: from now on it holds it too
            router.apply_event(d.group, BlockStored(router.keys_for("acme", hot), None))
        picks.append(d.group)
    counts = {g: picks.count(g) for g in set(picks)}
    assert picks[0] == "g0" and "g0" in counts and len(counts) == 2, counts
    assert min(counts.values()) >= 8, counts  # both holders serve a real share of the hot traffic


def test_a_burst_of_siblings_lands_together_before_any_event_arrives():
    router = Router(["g0", "g1", "g2", "g3"], SECRET)
    doc = list(range(5000, 5512))  # a shared 512-token document nobody holds yet
    groups = {router.route("acme", doc + [i, i + 1]).group for i in range(4)}
    assert len(groups) == 1


def test_predictions_lapse_when_no_event_confirms_them():
    now = [0.0]
    router = Router(["g0", "g1"], SECRET, prediction_ttl_s=5.0, clock=lambda: now[0])
    doc = list(range(64))
    first = router.route("acme", doc + [1]).group
    assert router.match(router.keys_for("acme", doc)) == {first: 4}
    now[0] = 6.0
    assert router.match(router.keys_for("acme", doc)) == {}


def test_router_keys_equal_the_engines_and_another_tenant_scores_zero(demo_path):
    from worker.engine import Engine, EngineConfig

    sink = ListSink()
    engine = Engine(EngineConfig(model=str(demo_path), device="cpu", secret=SECRET), event_sink=sink)
    prompt = list(range(100, 180))
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), tenant="acme")
    stored = [key for e in sink.events if isinstance(e, BlockStored) for key in e.keys]
    transport = InProcessTransport()
    router = Router(["g0", "g1"], SECRET, events=transport.subscribe())
    assert router.keys_for("acme", prompt) == stored
    transport.publish("g0", sink.drain())
    router.poll_events()
    assert router.match(router.keys_for("acme", prompt)) == {"g0": 5}
    assert router.match(router.keys_for("globex", prompt)) == {}
    assert router.route("globex", prompt).cached_tokens == 0


def test_two_replicas_reading_one_transport_keep_identical_indexes():
    transport = InProcessTransport()
    a = Router(["g0", "g1"], SECRET, events=transport.subscribe())
    b = Router(["g0", "g1"], SECRET, events=transport.subscribe())
    keys = a.keys_for("acme", list(range(64)))
    transport.publish("g1", [BlockStored(keys, None), BlockRemoved(keys[3:]), BlockStored(keys[:2], None)])
    transport.publish("g0", [BlockStored(keys[:1], None), AllCleared()])
    a.poll_events()
    b.poll_events()
    assert a.index.match(keys) == b.index.match(keys) == {"g1": 3}


def test_load_bookkeeping_returns_to_zero():
    router = Router(["g0"], SECRET)
    d = router.route("acme", list(range(100)))
    assert router.loads["g0"].queued_prefill_tokens == 100
    router.on_prefill_done(d.request_id)
    assert router.loads["g0"].queued_prefill_tokens == 0 and router.loads["g0"].running == 1
    router.on_finish(d.request_id)
    assert router.loads["g0"].running == 0


def test_replay_beats_round_robin_and_stays_below_the_infinite_cache():
    trace = load_trace(TRACE, limit=1500)
    ours = replay(trace, 4, 3_000_000, 512, "kvgrid", progress=False)
    rr = replay(trace, 4, 3_000_000, 512, "round_robin", progress=False)
    assert ours["hit_ratio"] > 2 * rr["hit_ratio"]
    assert ours["hit_ratio"] >= 0.9 * ours["pooled_lru_hit_ratio"]
    assert ours["hit_ratio"] <= ours["infinite_hit_ratio"] + 1e-9
    assert ours["pooled_lru_hit_ratio"] == rr["pooled_lru_hit_ratio"] > 0
    assert ours["imbalance"] >= 1.0 and ours["ttft_p99_s"] >= ours["ttft_p50_s"] > 0


def test_replay_command_prints_json(tmp_path):
    small = tmp_path / "t.jsonl"
    small.write_text("".join(TRACE.open().readlines()[:200]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.cli",
            "replay",
            "--trace",
            str(small),
            "--groups",
            "2",
            "--capacity-tokens",
            "200000",
            "--policy",
            "all",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert {r["policy"] for r in results} == {"kvgrid", "round_robin", "least_loaded", "prefix_affinity"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "replay", "--trace", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "not a trace record" in out.stderr


def test_a_restarted_group_under_the_same_name_starts_with_zero_load():
    router = Router(["g0"], SECRET)
    d = router.route("acme", list(range(64)))
    router.remove_group("g0")
    router.add_group("g0")
    router.on_prefill_done(d.request_id)
    router.on_finish(d.request_id)
    assert router.loads["g0"].queued_prefill_tokens == 0 and router.loads["g0"].running == 0


def test_a_prediction_lapses_per_group_even_when_another_group_renews_the_key():
    now = [0.0]
    router = Router(["g0", "g1"], SECRET, prediction_ttl_s=10.0, clock=lambda: now[0])
    keys = router.keys_for("acme", list(range(32)))
    router._predict(keys, "g0")
    now[0] = 5.0
    router._predict(keys, "g1")
    now[0] = 12.0
    assert router.match(keys) == {"g1": 2}


def test_full_queues_refuse_work_and_a_group_with_room_takes_it():
    import pytest

    from common.errors import Overloaded

    router = Router(["g0", "g1"], SECRET, max_queued_prefill_tokens=100)
    first = router.route("acme", list(range(150)))  # g0 or g1 is now over the limit
    second = router.route("acme", list(range(1000, 1150)))
    assert second.group != first.group
    with pytest.raises(Overloaded):
        router.route("acme", list(range(2000, 2010)))
    router.on_finish(first.request_id)
    assert router.route("acme", list(range(2000, 2010))).group == first.group


def test_paused_and_excluded_groups_get_no_requests_and_removal_leaves_no_key_behind():
    import pytest

    from common.errors import NoGroup

    router = Router(["g0", "g1", "g2"], SECRET)
    doc = list(range(256))
    keys = router.keys_for("acme", doc)
    router.apply_event("g1", BlockStored(keys, None))
    router.apply_event("g2", BlockStored(keys[:4], None))
    assert router.route("acme", doc + [1]).group == "g1"  # the prefix holder
    router.pause_group("g1")
    picks = {router.route("acme", doc + [i]).group for i in range(2, 8)}
    assert "g1" not in picks
    with pytest.raises(NoGroup):
        router.route("acme", doc + [10], exclude=["g0", "g2"])
    router.pause_group("g1", False)
    assert router.route("acme", doc + [11]).group == "g1"
    assert router.index.key_counts() == {"g1": len(keys), "g2": 4}  # predictions are not index entries
    router.remove_group("g1")
    counts = router.index.key_counts()
    assert "g1" not in counts and "?" not in counts
    assert "g1" not in router.match(keys)
    router.apply_event("g1", BlockStored(keys, None))  # a late event of the removed group is ignored
    assert "g1" not in router.index.key_counts()
    with pytest.raises(KeyError):
        router.pause_group("g1")


def test_a_tenant_filling_every_queue_is_refused_while_another_tenant_is_still_served():
    import pytest

    from common.errors import Overloaded

    router = Router(["g0", "g1"], SECRET, max_queued_prefill_tokens=100, tenant_shares={"acme": 1.0, "globex": 1.0})
    flood = [router.route("acme", list(range(i * 1000, i * 1000 + 150))) for i in range(2)]  # both queues full
    with pytest.raises(Overloaded):  # acme has its share (100 of 200) queued
        router.route("acme", list(range(5000, 5010)))
    served = router.route("globex", list(range(5000, 5060)))  # globex is under its share: still routed
    assert served.group in ("g0", "g1")
    assert router.queued_by_tenant == {"acme": 300, "globex": 60}
    for d in flood:
        router.on_prefill_done(d.request_id)
    router.on_finish(served.request_id)
    assert router.queued_by_tenant == {}
    assert router.route("acme", list(range(6000, 6010))).group in ("g0", "g1")


def test_a_cancelled_route_leaves_no_load_prediction_or_recent_prefill_behind():
    now = [0.0]
    router = Router(["g0", "g1"], SECRET, prediction_ttl_s=10.0, clock=lambda: now[0])
    prompt = list(range(64))
    keys = router.keys_for("acme", prompt)
    d = router.route("acme", prompt, "lost-hedge")
    assert router.match(keys) == {d.group: 4} and router.loads[d.group].recent_prefill_tokens == 64
    now[0] = 3.0
    router.cancel_route("lost-hedge")
    load = router.loads[d.group]
    assert (load.queued_prefill_tokens, load.running, load.recent_prefill_tokens) == (0, 0, 0)
    assert router.match(keys) == {} and router.queued_by_tenant == {}
    router.cancel_route("lost-hedge")  # a second cancel, or one for a route this replica never made: nothing
    router.cancel_route("never-routed")
    assert router.match(keys) == {} and load.queued_prefill_tokens == 0


def test_cancelling_a_route_keeps_the_predictions_of_the_routes_that_stand():
    now = [0.0]
    router = Router(["g0"], SECRET, prediction_ttl_s=10.0, clock=lambda: now[0])
    keys = router.keys_for("acme", list(range(64)))
    router.route("acme", list(range(64)), "first")  # predicts all 4 blocks until t=10
    now[0] = 4.0
    router.route("acme", list(range(64)), "renewing")  # renews them until t=14
    router.cancel_route("renewing")
    assert router.match(keys) == {"g0": 4}  # the first route's prediction stands...
    now[0] = 10.5
    assert router.match(keys) == {}  # ...until it lapses when it would have
    now[0] = 11.0
    router.route("acme", list(range(64)), "earlier")  # until t=21
    now[0] = 12.0
    router.route("acme", list(range(64)), "later")  # until t=22: predicted again after "earlier"
    router.cancel_route("earlier")
    assert router.match(keys) == {"g0": 4}
    router.on_finish("later")
    assert router.match(keys) == {"g0": 4}  # a finished request's prediction stays until events confirm it


def test_a_cancelled_route_whose_blocks_an_event_confirmed_keeps_them():
    router = Router(["g0"], SECRET)
    keys = router.keys_for("acme", list(range(32)))
    router.route("acme", list(range(32)), "r")
    router.apply_event("g0", BlockStored(keys, None))
    router.cancel_route("r")
    assert router.match(keys) == {"g0": 2}


def test_a_reported_failure_pauses_the_group_and_logs_a_warning(caplog):
    from router.routing.service import RouterService

    svc = RouterService({"g0": None, "g1": None}, b"s")
    with caplog.at_level("WARNING", logger="router.routing.service"):
        svc.report_failure("g0", "step timed out")
        svc.report_failure("g9", "unknown group")  # not this replica's: ignored, nothing logged
    assert svc.router.paused == {"g0"}
    assert [r.getMessage() for r in caplog.records] == ["group g0 paused after a failure (step timed out)"]
    assert caplog.records[0].levelname == "WARNING"


def _replicas(groups=("g0", "g1", "g2")) -> tuple[Router, Router, list[float]]:
    """Two replicas of the same groups on one clock."""
    now = [0.0]
    a, b = (Router(list(groups), SECRET, prediction_ttl_s=10.0, clock=lambda: now[0]) for _ in range(2))
    return a, b, now


def test_a_replica_told_of_anothers_routes_counts_them_as_its_own_and_they_end_on_both():
    a, b, now = _replicas()
    prompts = [[p * 1000 + i for i in range(16 * (p + 2))] for p in range(5)]
    decisions = []
    for p, tokens in enumerate(prompts):
        now[0] = float(p)
        d = a.route("acme", tokens, f"r{p}", n=3 if p == 1 else 1, adapter="ad-1" if p == 2 else None)
        b.note_route(d.note)
        decisions.append(d)
    assert b.loads == a.loads and b.queued_by_tenant == a.queued_by_tenant == {"acme": sum(map(len, prompts))}
    ad_group = decisions[2].group
    assert b.adapters.holds(ad_group, "ad-1") and a.adapters.holds(ad_group, "ad-1")
    # Before any event: B sends a repeat of A's prompt where A sent it, its blocks counted as held (predicted).
    repeat = b.route("acme", prompts[4], "again")
    assert repeat.group == decisions[4].group and repeat.cached_tokens == len(prompts[4])
    b.cancel_route("again")
    assert b.loads == a.loads
    for r in (a, b):
        for d in decisions:
            r.on_prefill_done(d.request_id)
    assert b.loads == a.loads and a.loads[decisions[1].group].running >= 3  # n=3 counts as 3 decoding
    for r in (a, b):
        for d in decisions:
            r.on_finish(d.request_id)
        assert all(load.queued_prefill_tokens == load.running == 0 for load in r.loads.values())
        assert r.queued_by_tenant == {}


def test_a_hedge_loser_told_of_the_winners_route_after_cancelling_its_own_counts_it_once():
    a, b, _ = _replicas()
    tokens = list(range(64))
    won = a.route("acme", tokens, "r")
    b.loads[won.group].queued_prefill_tokens = 5000  # B counts other load there: its own route goes elsewhere
    lost = b.route("acme", tokens, "r")
    assert lost.group != won.group
    b.cancel_route("r")
    b.note_route(won.note)
    b.note_route(won.note)  # told twice: counted once
    assert b.loads[won.group].queued_prefill_tokens == 5000 + len(tokens)
    assert b.loads[lost.group].queued_prefill_tokens == 0 and b.queued_by_tenant == {"acme": len(tokens)}
    assert b.match(b.keys_for("acme", tokens)) == {won.group: 4}  # the winner's prediction, not its own
    b.on_finish("r")
    assert b.loads[won.group].queued_prefill_tokens == 5000 and b.queued_by_tenant == {}


def test_notes_of_an_unknown_group_or_out_of_order_leave_no_load_behind():
    """Ray may run a gateway's calls to a replica out of order: whatever the order, nothing stays counted."""
    a, b, _ = _replicas()
    tokens = list(range(32))
    d = a.route("acme", tokens, "r")
    b.remove_group(d.group)
    b.note_route(d.note)  # a group B does not know (removed, or not handed to it yet): ignored
    assert "r" not in b._inflight
    b.add_group(d.group)
    b.on_finish("r")  # the request's end before its note...
    b.note_route(d.note)  # ...which then counts nothing
    for rid in ("r2", "r3"):
        b.route("acme", tokens, rid)  # a hedge's loser routes it...
        b.note_route(dataclasses.replace(d.note, request_id=rid))  # ...told of the winner's before its cancel...
        b.cancel_route(rid)  # ...which drops them both: counted nowhere here until it ends
        b.on_finish(rid)
    b.note_route(dataclasses.replace(d.note, request_id="r4"))  # the winner's note before the loser's own route:
    b.route("acme", tokens, "r4")  # that replaces it (priced with the note's predictions): counted once...
    assert list(b._inflight) == ["r4"] and b.queued_by_tenant.get("acme", 0) <= len(tokens)
    b.cancel_route("r4")  # ...and its cancel leaves nothing
    assert all(load.queued_prefill_tokens == load.running == 0 for load in b.loads.values())
    assert b.queued_by_tenant == {} and b._inflight == {}
