"""CPU threads per step: with ``decode_threads`` a decode-only step runs on that many intra-op threads and every
other step (prefill, a chunk, a mixed batch) on all the engine thread has; the serve config's default keeps one
core for the HTTP path while decoding."""

from __future__ import annotations

import pytest
import torch

from common.config import ServeConfig
from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig

TENANTS = [{"name": "a", "api_keys": ["sk-a-0001"]}]


@pytest.fixture()
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _threads_per_step(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int]]:
    """(tokens in the step, threads it ran on) for every step until the requests finish."""
    seen: list[tuple[int, int]] = []
    forward = engine.runner._forward

    def recording(inp):
        seen.append((len(inp.input_ids), torch.get_num_threads()))
        return forward(inp)

    engine.runner._forward = recording
    for p in prompts:
        engine.add_prompt(p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    return seen


def test_decode_steps_run_on_decode_threads_and_prefill_on_all(demo_path, two_threads):
    engine = Engine(EngineConfig(model=str(demo_path), num_blocks=64, device="cpu", decode_threads=1))
    seen = _threads_per_step(engine, [list(range(10, 90)), list(range(100, 140))], max_tokens=4)
    prefill = [t for n, t in seen if n > 2]
    decode = [t for n, t in seen if n <= 2]
    assert prefill and decode, seen
    assert set(prefill) == {2} and set(decode) == {1}, seen
    # A new prompt after decoding gets both threads back.
    again = _threads_per_step(engine, [list(range(200, 260))], max_tokens=1)
    assert again[0] == (60, 2), again


def test_without_decode_threads_every_step_keeps_the_engine_threads(demo_path, two_threads):
    engine = Engine(EngineConfig(model=str(demo_path), num_blocks=64, device="cpu"))
    seen = _threads_per_step(engine, [list(range(10, 50))], max_tokens=3)
    assert len(seen) == 3 and {t for _, t in seen} == {2}, seen


def test_decode_threads_never_exceed_the_engine_threads(demo_path, two_threads):
    engine = Engine(EngineConfig(model=str(demo_path), num_blocks=64, device="cpu", decode_threads=8))
    seen = _threads_per_step(engine, [list(range(10, 50))], max_tokens=3)
    assert {t for _, t in seen} == {2}, seen


def test_serve_config_keeps_a_core_for_the_http_path_while_decoding():
    assert ServeConfig(groups=1, cpus_per_rank=2, tenants=TENANTS).decode_threads == 1
    assert ServeConfig(groups=1, cpus_per_rank=8, tenants=TENANTS).decode_threads == 7
    assert ServeConfig(groups=1, cpus_per_rank=1, tenants=TENANTS).decode_threads == 1
    assert ServeConfig(groups=1, cpus_per_rank=4, decode_cpus_per_rank=4, tenants=TENANTS).decode_threads == 4
    assert ServeConfig(groups=1, cpus_per_rank=2, decode_cpus_per_rank=6, tenants=TENANTS).decode_threads == 2
    with pytest.raises(ValueError):
        EngineConfig(decode_threads=0)
