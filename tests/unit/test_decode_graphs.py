"""CUDA-graph decode (worker/model_runner.py): batch-size buckets, padding, and the static-buffer forward that each
graph captures, checked on CPU through the Triton backend under the interpreter (the capture itself needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.model_runner import DecodeGraphs, graph_batch_sizes, pad_decode_inputs, pick_graph_size


def test_batch_sizes_cover_every_batch_up_to_the_limit():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(10_000)[-1] == 256
    sizes = graph_batch_sizes(100)
    for n in range(1, 101):
        size = pick_graph_size(n, sizes)
        assert size >= n and not [s for s in sizes if n <= s < size]  # the nearest one up
    assert pick_graph_size(101, sizes) is None


@pytest.fixture(scope="module")
def engine(demo_path):
    return Engine(EngineConfig(model=str(demo_path), device="cpu", attention_backend="triton", num_blocks=64))


def decode_step(engine: Engine, prompts: list[list[int]]):
    greedy = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_prompt(p, greedy)
    for _ in range(3):  # prefill, then a couple of decodes
        engine.step()
    batch = engine.scheduler.schedule()
    assert all(n == 1 for _, n in batch) and len(batch) == len(prompts)
    return engine.runner.prepare(batch)


def test_a_padded_decode_on_the_static_buffers_matches_eager_and_writes_only_real_slots(engine):
    assert engine.runner.graphs is None  # CPU: cuda_graphs is ignored, every step runs eagerly
    inp = decode_step(engine, [list(range(10, 40)), list(range(50, 67)), list(range(70, 75))])
    padded = pad_decode_inputs(inp, 4)
    assert padded.slot_mapping[3] == -1 and padded.seq_lens[3] == 1 and padded.sample_rows == [0, 1, 2]
    runner = engine.runner
    graphs = DecodeGraphs(runner, [2, 4, 8], max_blocks=engine.max_model_len // engine.config.block_size)
    assert graphs.fits(inp) and not graphs.fits(inp._replace(input_ids=inp.input_ids + [1]))
    before = runner.kv_cache.clone()
    # What earlier, longer steps would have left in the static block table: load must neither rewrite every
    # column nor let the attention read past a row's length (or past column 0 of a padding row).
    stale = 10_000
    graphs.block_tables.fill_(stale)
    with torch.inference_mode():
        size = graphs.load(inp)
        assert size == 4
        width = max(map(len, inp.block_tables))
        assert width < graphs.max_blocks
        for i, row in enumerate(inp.block_tables + [[0]]):
            assert graphs.block_tables[i, : len(row)].tolist() == row
        assert (graphs.block_tables[:, width:] == stale).all()
        static = graphs.forward(size)[:3].clone()
        after_static = runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        eager = runner._forward(inp)
    # The graphs' split-KV decode sums in another order than the eager one: equal up to rounding.
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after_static, runner.kv_cache, rtol=1e-5, atol=1e-5)
    # Only the real tokens' slots changed: the padding row (slot -1) wrote nowhere.
    per_slot = lambda kv: kv.flatten(2, 3).transpose(0, 2).flatten(1)  # noqa: E731 [slot, everything else]
    changed = (per_slot(after_static) != per_slot(before)).any(1).nonzero().flatten().tolist()
    assert changed == sorted(inp.slot_mapping)
