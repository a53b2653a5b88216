"""Rank 0's engine in a child process (``worker/engine_process.py``), driven without Ray: the same tokens as the
engine in-process, calls answered between steps with the engine's own errors, its KV events reaching the parent,
and both ways a process can die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from common.events import BlockStored, ListSink
from common.protocol import Submit
from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.engine_process import EngineProcess, EngineProcessDied

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def config(demo_path):
    return EngineConfig(model=str(demo_path), device="cpu", secret=b"s", block_size=16)


@pytest.fixture(scope="module")
def child(config):
    sink = ListSink()
    proc = EngineProcess(config, sink, threads=1)
    yield proc, sink
    proc.kill()


def run(proc: EngineProcess, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        proc.add_request(Submit(prompt, GREEDY, "default", rid))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    done: set[str] = set()
    while proc.has_unfinished():
        for d in proc.step():
            assert d.request_id not in done, "a delta after its request finished"
            tokens[d.request_id].extend(d.new_token_ids)
            if d.finished:
                done.add(d.request_id)
    assert done == set(prompts)
    return tokens


def test_the_child_computes_what_the_engine_computes_in_process(child, config):
    proc, sink = child
    assert proc.info["step_threads"] == 1 and proc.pid != os.getpid()
    prompts = {"a": list(range(10, 50)), "b": list(range(10, 42)) + [7, 8, 9], "c": [5, 6, 7]}
    got = run(proc, prompts)
    ref = Engine(config).generate(list(prompts.values()), GREEDY)
    assert got == {rid: out.token_ids for rid, out in zip(prompts, ref)}
    stored = {k for e in sink.events if isinstance(e, BlockStored) for k in e.keys}
    assert len(stored) == 2  # a's two full blocks (b's 32 leading tokens are a's; nobody fills a third block)
    assert set(proc.held_keys()) == stored  # nothing was evicted: the pool holds what its events said
    again = run(proc, {"a2": prompts["a"]})  # a prefix hit in the child: same tokens
    assert again["a2"] == got["a"]
    assert proc.stats().prefix_cache["default"].hit_tokens >= 32


def test_calls_raise_the_engines_own_errors_and_the_child_goes_on(child):
    proc, _ = child
    with pytest.raises(ValueError, match="outside the vocabulary"):
        proc.add_request(Submit([10**9], GREEDY, "default", "bad"))
    assert not proc.has_unfinished()
    assert proc.abort("never-added") is False
    assert run(proc, {"ok": [1, 2, 3]})["ok"]


def test_an_abort_between_steps_ends_the_request(child):
    proc, _ = child
    proc.add_request(
        Submit([1, 2, 3], SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True), request_id="r")
    )
    first = proc.step()
    assert first and not first[-1].finished
    assert proc.abort("r") is True
    while proc.has_unfinished():  # what the child had computed before the abort may still come; then nothing
        proc.step()
    assert proc.stats().running == 0


def test_a_killed_child_fails_the_next_step(config):
    proc = EngineProcess(config, ListSink())
    proc.add_request(
        Submit([1, 2, 3], SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True), request_id="r")
    )
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessDied, match=f"pid {proc.pid}"):
        for _ in range(10_000):
            proc.step()
    with pytest.raises(EngineProcessDied):
        proc.stats()


def test_the_child_exits_with_its_parent(config, tmp_path):
    script = textwrap.dedent(
        f"""
        import os, sys
        from common.events import ListSink
        from worker.engine import EngineConfig
        from worker.engine_process import EngineProcess
        proc = EngineProcess(EngineConfig(model={config.model!r}, device="cpu"), ListSink())
        print(proc.pid, flush=True)
        os._exit(0)  # no clean-up: as a SIGKILLed rank actor goes
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the engine process outlived its parent"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False
