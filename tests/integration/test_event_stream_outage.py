"""A group's event writer through a stopped Redis (a real redis-server process, SIGSTOP / SIGCONT): the batch it
was writing when Redis stopped lands when Redis resumes, and readers get every event exactly once, without a
gap that would send them to a snapshot."""

from __future__ import annotations

import time

from common.event_stream import RedisStreamSink, RedisStreamSubscription, stream_client
from common.events import AllCleared, BlockStored
from harness import RedisServer, wait_for

TIMEOUT_S = 0.3  # the writer's socket timeout: a stopped Redis fails its calls after this long


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def read_all(sub: RedisStreamSubscription, want: int) -> list:
    got: list = []
    wait_for(lambda: got.extend(sub.poll()) or len(got) >= want, 10, f"{want} events")
    time.sleep(0.5)  # and nothing more (a duplicate written late would come now)
    got.extend(sub.poll())
    return got


def test_a_batch_cut_off_by_a_stopped_redis_lands_once_and_readers_see_no_gap(tmp_path, caplog):
    redis_server = RedisServer(tmp_path)
    held = [k(i) for i in range(3)]
    sink = RedisStreamSink(stream_client(redis_server.url, TIMEOUT_S), "g0", snapshot=lambda: list(held))
    sub = RedisStreamSubscription(stream_client(redis_server.url, 5.0), ["g0"])
    try:
        before = [BlockStored([k(i)], None) for i in range(3)]
        for e in before:
            sink.publish(e)
        assert sink.flush(10)
        assert read_all(sub, 4) == [("g0", AllCleared())] + [("g0", e) for e in before]
        redis_server.pause()
        try:
            during = [BlockStored([k(i)], k(i - 1)) for i in range(3, 8)]
            for e in during:
                sink.publish(e)
            # The writer's transaction is sent and sits unread in the stopped Redis's socket; the writer gives up
            # on it after TIMEOUT_S and pings until Redis answers again.
            time.sleep(6 * TIMEOUT_S)
            assert not sink.flush(0)
            assert any("writing kvgrid:events:g0 failed" in r.getMessage() for r in caplog.records)
        finally:
            redis_server.resume()
        assert sink.flush(10)
        after = [BlockStored([k(8)], k(7))]
        sink.publish(after[0])
        assert sink.flush(10)
        assert read_all(sub, len(during) + 1) == [("g0", e) for e in during + after]
        assert sub.next_n["g0"] == 1 + len(before) + len(during) + len(after)  # one history, numbered without gaps
        assert not sub.needs_resync
    finally:
        sink.close(1)
        redis_server.stop()
