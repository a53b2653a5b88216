"""The leader <-> caller protocol on a real local Ray: one subscription per caller carries every request's deltas,
once per step; outputs equal the one-request path; failures, aborts and dead subscribers end requests."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from common.sampling import SamplingParams
from harness import wait_for
from worker.engine import EngineConfig

LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def group(ray_local, demo_path):
    from worker.group import GroupConfig, WorkerGroup

    g = WorkerGroup(
        GroupConfig("g-streams", EngineConfig(model=str(demo_path), device="cpu", secret=b"s"), cpus_per_rank=2)
    )
    yield g
    g.shutdown()


def wait_idle(group, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (s := group.stats()).running + s.waiting:
        assert time.monotonic() < deadline, f"{s.running} running and {s.waiting} waiting were never aborted"
        time.sleep(0.1)


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_concurrent_requests_on_one_subscription_equal_one_by_one_and_arrive_batched(group, transport, monkeypatch):
    monkeypatch.setenv("KVGRID_GROUP_CHANNEL", transport)
    rng = random.Random(3)
    prompts = [[rng.randrange(4000) for _ in range(rng.randrange(4, 80))] for _ in range(24)]
    params = [
        SamplingParams(
            max_tokens=rng.randrange(3, 30), temperature=0.0, ignore_eos=i % 2 == 0, logprobs=2 if i % 3 == 0 else None
        )
        for i in range(24)
    ]
    probe = group.generate(prompts[0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    params[0] = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[probe.text[8:11]])
    params[1] = SamplingParams(max_tokens=12, temperature=0.7, seed=11)
    one_by_one = [group.generate(p, sp) for p, sp in zip(prompts, params)]
    assert one_by_one[0].finish_reason == "stop" and one_by_one[0].stop_reason == probe.text[8:11]

    async def collect(p, sp):
        outs = [out async for out in group.astream(p, sp, tenant="acme")]
        return outs

    async def together():
        runs = await asyncio.gather(*(collect(p, sp) for p, sp in zip(prompts, params)))
        return runs, group.client.link()  # this loop's one subscription, which every request used

    runs, link = asyncio.run(together())
    assert link.transport == transport
    for outs, ref in zip(runs, one_by_one):
        last = outs[-1]
        assert last.finished and [o.finished for o in outs].count(True) == 1
        assert (last.token_ids, last.text, last.finish_reason, last.stop_reason, last.prompt_token_ids) == (
            ref.token_ids,
            ref.text,
            ref.finish_reason,
            ref.stop_reason,
            ref.prompt_token_ids,
        )
        if ref.logprobs is None:
            assert last.logprobs is None and last.top_logprobs is None
        else:  # a batch computes in another order: equal up to float rounding
            assert last.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            assert [sorted(t) for t in last.top_logprobs] == [sorted(t) for t in ref.top_logprobs]
            assert [sorted(t.values()) for t in last.top_logprobs] == [
                pytest.approx(sorted(t.values()), abs=1e-4) for t in ref.top_logprobs
            ]
        assert [t for o in outs for t in o.new_token_ids] == last.token_ids
        assert "".join(o.delta_text for o in outs) == last.text
    # 24 requests decoding side by side: their deltas share messages (about one per step, not one per token)
    assert link.deltas >= sum(len(o) for o in runs) and link.messages * 4 < link.deltas


def test_a_group_killed_mid_stream_fails_every_subscribed_request_and_a_restart_subscribes_anew(ray_local, demo_path):
    from common.errors import GroupUnhealthyError
    from router.gateway.errors import GroupFailed, group_failure
    from worker.group import GroupConfig, WorkerGroup

    g = WorkerGroup(GroupConfig("g-die", EngineConfig(model=str(demo_path), device="cpu", kv_cache_bytes=2**25)))
    try:

        async def run():
            started = asyncio.Queue()

            async def one(i):
                async for _ in g.astream([i + 1, 2, 3], LONG):
                    started.put_nowait(i)

            tasks = [asyncio.ensure_future(one(i)) for i in range(6)]
            seen = set()
            while len(seen) < 6:
                seen.add(await started.get())
            old = g.client.link()
            ray_local.kill(g.leader)
            return await asyncio.gather(*tasks, return_exceptions=True), old

        results, old = asyncio.run(run())
        assert all(isinstance(r, GroupUnhealthyError) for r in results), results
        assert isinstance(group_failure(results[0], "g-die", "openai"), GroupFailed)  # the gateway retries elsewhere
        g.restart()

        async def again():
            outs = [o async for o in g.astream([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))]
            return outs[-1], g.client.link()

        last, link = asyncio.run(again())
        assert last.finished and link is not old and link.leader == g.leader
    finally:
        g.shutdown()


def test_a_dead_engine_process_fails_the_group_mid_stream_or_idle_and_a_restart_serves_again(ray_local, demo_path):
    from common.errors import GroupUnhealthyError
    from worker.group import GroupConfig, WorkerGroup

    cfg = EngineConfig(model=str(demo_path), device="cpu", kv_cache_bytes=2**25)
    g = WorkerGroup(GroupConfig("g-engine-die", cfg, engine_process=True))
    try:
        info = g.rank_infos()[0]
        assert info["engine_pid"] not in (None, info["pid"])  # the engine steps in a process of its own
        stream = g.stream([1, 2, 3], LONG)
        next(stream)  # running
        os.kill(info["engine_pid"], signal.SIGKILL)
        with pytest.raises(GroupUnhealthyError, match=f"engine process \\(pid {info['engine_pid']}\\) exited"):
            for _ in stream:
                pass
        assert "engine process" in (g.health() or "")
        with pytest.raises(GroupUnhealthyError):
            g.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert ray_local.get(g.leader.info.remote())["pid"] == info["pid"]  # the actor itself lives on
        g.restart()
        assert len(g.generate([1, 2, 3], SamplingParams(max_tokens=2)).token_ids) == 2
        pid = g.rank_infos()[0]["engine_pid"]
        os.kill(pid, signal.SIGKILL)  # idle: no step or call notices, the health check does
        deadline = time.monotonic() + 10
        while (reason := g.health()) is None:
            assert time.monotonic() < deadline, "a dead idle engine process was never noticed"
            time.sleep(0.1)
        assert reason == "rank 0: the engine process exited with code -9"
    finally:
        g.shutdown()


def test_an_engine_process_with_tp2_streams_the_tokens_of_the_engine_on_the_actors_thread(ray_local, group, demo_path):
    from worker.group import GroupConfig, WorkerGroup

    g = WorkerGroup(
        GroupConfig(
            "g-process",
            EngineConfig(model=str(demo_path), device="cpu", secret=b"s"),
            tp=2,  # the child, not the actor, is rank 0 of the group's process group
            engine_process=True,
        )
    )
    try:
        infos = g.rank_infos()
        assert infos[0]["engine_pid"] not in (None, infos[0]["pid"]) and infos[1]["engine_pid"] is None
        assert ray_local.get(group.leader.info.remote())["engine_pid"] is None  # the default: the actor's thread
        params = SamplingParams(max_tokens=12, temperature=0.0)
        prompts = [[7, 8, 9, 10], list(range(20, 60)), list(range(20, 52)) + [3]]  # the third hits the second
        outs = [g.generate(p, params) for p in prompts]
        assert [o.token_ids for o in outs] == [group.generate(p, params).token_ids for p in prompts]
        assert outs[2].num_cached_tokens == 32
        assert g.stats().prefix_cache["default"].hit_tokens == 32
    finally:
        g.shutdown()


def test_a_subscriber_that_dies_has_its_requests_aborted_on_the_group(ray_local, group):
    from common.protocol import Submit
    from worker.group_client import GroupClient

    @ray_local.remote(num_cpus=0)
    class Client:
        async def start(self, leader, n: int) -> int:
            self.client = GroupClient("g-streams", leader)
            started = asyncio.Queue()

            async def one(i):
                async for _ in self.client.astream(Submit([7, 8, i + 1], LONG)):
                    started.put_nowait(i)

            self.tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            seen = set()
            while len(seen) < n:
                seen.add(await started.get())
            return os.getpid()

    client = Client.remote()
    pid = ray_local.get(client.start.remote(group.leader, 5))
    assert group.stats().running == 5
    os.kill(pid, signal.SIGKILL)
    wait_idle(group)


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_closing_a_stream_or_an_abort_by_another_caller_ends_the_request(group, transport, monkeypatch):
    from common.errors import RequestAborted

    monkeypatch.setenv("KVGRID_GROUP_CHANNEL", transport)

    async def closed_early():
        stream = group.astream([9, 9, 9], LONG)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(closed_early())
    wait_idle(group)
    stream = group.stream([4, 4, 4], LONG)
    next(stream)
    stream.close()
    wait_idle(group)

    async def aborted():
        stream = group.astream([3, 1, 4], LONG, request_id="abort-me")
        await stream.__anext__()
        assert await asyncio.to_thread(group.abort, "abort-me")
        async for _ in stream:
            pass

    with pytest.raises(RequestAborted):
        asyncio.run(aborted())
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(group.astream([], LONG).__anext__())


class _Planted:
    """Unpickling this writes a file: what a stranger's frame would run if the leader unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_channel_takes_nothing_from_a_connection_without_its_token(ray_local, group, tmp_path):
    from common import channel

    host, port, token = ray_local.get(group.leader.channel.remote())
    assert host == "127.0.0.1" and len(token) == 32
    planted = tmp_path / "planted"

    async def connect(hello: bytes):
        """The leader's first frame after ``hello`` and a frame that plants a file when unpickled; None when the
        leader closes the connection instead."""
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(hello + channel.frame(("submit", 1, _Planted(str(planted)))))
        try:
            return await asyncio.wait_for(channel.read_frame(reader), 10)
        except channel.ChannelClosed:
            return None
        finally:
            writer.close()

    assert asyncio.run(connect(channel.hello("0" * 32, "sub-stranger"))) is None
    assert asyncio.run(connect(b"\x00\x00\x00\x05hello")) is None
    time.sleep(0.5)
    assert not planted.exists()
    # The same frames after the right hello are read (so the refusals above are the token's doing)
    assert asyncio.run(connect(channel.hello(token, "sub-known"))) == ("deltas", [])
    wait_for(planted.exists, 10, "the known subscriber's frame to be read")


def test_steps_run_on_one_thread_with_cpus_per_rank_threads(ray_local, group):
    from common.config import ServeConfig

    group.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    assert ray_local.get(group.leader.info.remote())["step_threads"] == 2
    tenants = [{"name": "a", "api_keys": ["sk-a-0001"]}]
    cores = os.cpu_count() or 1
    assert ServeConfig(groups=2, tenants=tenants).rank_threads == max(1, cores // 2)
    assert ServeConfig(groups=cores + 1, tenants=tenants).rank_threads == 1
    assert ServeConfig(groups=2, cpus_per_rank=3, tenants=tenants).rank_threads == 3


def test_a_blocking_stream_gives_up_on_a_leader_that_sends_nothing(ray_local):
    import threading

    from common.errors import GroupUnhealthyError
    from common.protocol import Submit
    from worker.group_client import GroupClient

    @ray_local.remote(num_cpus=0)
    class SilentLeader:
        def __init__(self) -> None:
            self.aborted: list[str] = []

        async def generate(self, req):
            await asyncio.Event().wait()
            yield []

        def abort(self, request_id: str) -> bool:
            self.aborted.append(request_id)
            return True

        def aborts(self) -> list[str]:
            return self.aborted

    leader = SilentLeader.remote()
    result: list = []

    def read() -> None:
        try:
            list(GroupClient("g-silent", leader).stream(Submit([1, 2, 3], request_id="silent"), timeout_s=0.5))
        except Exception as exc:
            result.append(exc)

    started = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)  # daemon: a wait that is never bounded fails, not hangs
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), "the wait for the leader's first output was not bounded"
    assert time.monotonic() - started < 10
    assert len(result) == 1 and isinstance(result[0], GroupUnhealthyError), result
    assert "sent no output for 0.5 s" in str(result[0])
    deadline = time.monotonic() + 10
    while ray_local.get(leader.aborts.remote()) != ["silent"]:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)


def _dead(ray_local, actor) -> bool:
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        ray_local.get(actor.health.remote(), timeout=5)
    except RayActorError:
        return True
    except GetTimeoutError:  # not answered yet: ask again
        pass
    return False


def test_the_clients_unary_calls_time_out_and_a_dead_leader_is_a_group_failure(ray_local):
    from common.errors import GroupUnhealthyError
    from worker.group_client import GroupClient

    @ray_local.remote(num_cpus=0)
    class Leader:
        async def health(self, hang: bool = False):
            if hang:
                await asyncio.Event().wait()
            return None

        def stats(self):
            raise ValueError("not a valid question")

    client = GroupClient("g-calls", Leader.remote())
    assert client.health() is None
    with pytest.raises(ValueError, match="not a valid question"):  # the leader's own error, by its class
        client.stats()
    with pytest.raises(TimeoutError):
        client._get(client.leader.health.remote(True), 0.3)
    with pytest.raises(TimeoutError):
        asyncio.run(client._aget(client.leader.health.remote(True), 0.3))
    ray_local.kill(client.leader)
    # The kill is asynchronous: a call sent right after it may still be served. Wait until the actor is gone.
    wait_for(lambda: _dead(ray_local, client.leader), 20, "the killed leader to be dead")
    with pytest.raises(GroupUnhealthyError, match="'g-calls' failed: (RayActorError|ActorDiedError)"):
        client.health(timeout_s=20)
    with pytest.raises(GroupUnhealthyError, match="'g-calls' failed"):
        asyncio.run(client.ahealth(timeout_s=20))
