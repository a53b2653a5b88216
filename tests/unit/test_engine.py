"""The engine against transformers, token for token, across the paths that reuse or rebuild K/V."""

from __future__ import annotations

import random

import pytest
import torch

from common.checks import is_power_of_two
from common.events import BlockStored, ListSink
from common.hashing import block_keys
from common.model_config import ModelConfig, max_model_len
from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module", params=["demo", "qwen"])
def model(request, demo_path, qwen_path):
    """(folder, transformers model, memoised greedy reference) for the GQA/untied and MHA/tied shapes."""
    from transformers import AutoModelForCausalLM

    path = demo_path if request.param == "demo" else qwen_path
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    memo: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            memo[key] = out[0, len(prompt) :].tolist()
        return memo[key]

    return path, hf, reference


def engine_for(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", secret=b"test-secret", **kw))


def prompts(seed: int, n: int = 20, vocab: int = 4000) -> list[list[int]]:
    """Random prompts, a few of them sharing long prefixes (so batches contain hits and near-misses)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(48)]
    out = []
    for i in range(n):
        head = shared[: rng.randrange(1, 48)] if i % 2 else []
        out.append(head + [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))])
    return out


def assert_matches(outs, batch, reference) -> None:
    for p, o in zip(batch, outs):
        assert o.token_ids == reference(p), f"prompt of {len(p)} tokens diverged"


def test_batch_of_20_matches_transformers(model):
    path, _, reference = model
    batch = prompts(1)
    assert_matches(engine_for(path).generate(batch, GREEDY), batch, reference)


def test_matches_transformers_with_prefix_hits(model):
    path, _, reference = model
    engine = engine_for(path)
    first = prompts(2)
    engine.generate(first, GREEDY)
    # Continue every earlier prompt: each now starts with cached full blocks.
    second = [p + [7, 8, 9, 10, 11] * 4 for p in first]
    outs = engine.generate(second, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [len(p) // 16 * 16 for p in first]
    assert_matches(outs, second, reference)


def test_matches_transformers_after_evictions(model):
    path, _, reference = model
    sink = ListSink()
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=24), event_sink=sink)
    batch = prompts(3)
    for p in batch:  # one at a time: the small pool must evict earlier prompts' blocks
        engine.generate([p], GREEDY)
    assert any(type(e).__name__ == "BlockRemoved" for e in sink.events)
    outs = engine.generate(batch[:6], GREEDY)
    assert_matches(outs, batch[:6], reference)


def test_matches_transformers_with_chunked_prefill(model):
    path, _, reference = model
    engine = engine_for(path, max_num_batched_tokens=7)
    batch = prompts(4, n=8)
    assert_matches(engine.generate(batch, GREEDY), batch, reference)


def test_matches_transformers_after_preemption(model):
    path, _, reference = model
    engine = engine_for(path, num_blocks=16, block_size=8)
    batch = prompts(5)
    outs = engine.generate(batch, GREEDY)
    assert engine.stats().num_preemptions > 0
    assert_matches(outs, batch, reference)
    assert engine.stats().blocks_used == 0


def test_second_request_reuses_full_blocks_of_a_finished_one(demo_path):
    engine = engine_for(demo_path)
    rng = random.Random(6)
    base = [rng.randrange(4000) for _ in range(5 * 16 + 3)]
    engine.generate([base], GREEDY)
    before = engine.stats().computed_tokens
    sibling = base[: 3 * 16] + [rng.randrange(4000) for _ in range(30)]
    out = engine.generate([sibling], GREEDY)[0]
    assert out.num_cached_tokens == 3 * 16
    # Only the uncached 30 prompt tokens and the decode steps ran through the model.
    assert engine.stats().computed_tokens - before == 30 + len(out.token_ids) - 1


def test_stats_count_the_steps_that_computed_and_their_time(demo_path):
    engine = engine_for(demo_path)
    engine.generate([list(range(10, 40))], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    s = engine.stats()
    assert s.steps == 6  # one prefill, then a decode per token after the first
    assert s.step_seconds > 0 and s.step_cpu_seconds > 0
    assert engine.step() == [] and engine.stats().steps == 6  # a step with nothing to compute is not counted


def test_identical_block_aligned_prompt_recomputes_its_last_block(demo_path):
    engine = engine_for(demo_path)
    prompt = list(range(100, 164))  # exactly 4 blocks
    engine.generate([prompt], GREEDY)
    assert engine.generate([prompt], GREEDY)[0].num_cached_tokens == 3 * 16


def test_same_new_prefix_in_one_batch_is_computed_once(demo_path):
    engine = engine_for(demo_path)
    shared = list(range(200, 264))
    a, b = shared + [5, 6, 7], shared + [8, 9]
    outs = engine.generate([a, b], SamplingParams(max_tokens=1, temperature=0.0))
    assert outs[1].num_cached_tokens == 64
    assert engine.stats().computed_tokens == len(a) + len(b) - 64


def test_second_tenant_gets_no_hit_on_same_prompt(demo_path):
    sink = ListSink()
    engine = Engine(EngineConfig(model=str(demo_path), device="cpu"), event_sink=sink)
    prompt = list(range(300, 370))
    engine.generate([prompt], GREEDY, tenant="acme")
    acme_keys = {k for e in sink.drain() if isinstance(e, BlockStored) for k in e.keys}
    out = engine.generate([prompt], GREEDY, tenant="globex")[0]
    globex_keys = {k for e in sink.drain() if isinstance(e, BlockStored) for k in e.keys}
    assert out.num_cached_tokens == 0
    assert acme_keys and globex_keys and not acme_keys & globex_keys
    stats = engine.stats().prefix_cache
    assert stats["globex"].hit_tokens == 0 and stats["acme"].queried_tokens == len(prompt)


def test_published_keys_equal_the_shared_hash_of_the_prompt(demo_path):
    sink = ListSink()
    engine = Engine(EngineConfig(model=str(demo_path), device="cpu", secret=b"s3"), event_sink=sink)
    prompt = list(range(400, 450))
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    stored = [k for e in sink.events if isinstance(e, BlockStored) for k in e.keys]
    from common.hashing import tenant_root_key

    assert stored == block_keys(prompt, 16, tenant_root_key(b"s3", "default"))


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "empty"),
        ([1, 2, 10**6], GREEDY, "vocabulary"),
        ([1, -3], GREEDY, "vocabulary"),
        ([1] * 5000, GREEDY, "context"),
        ("hello", GREEDY, "token ids"),
    ],
)
def test_bad_prompt_raises_and_engine_keeps_serving(model, prompt, params, match):
    path, _, reference = model
    engine = engine_for(path)
    good = [11, 12, 13, 14, 15]
    rid = engine.add_prompt(good, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_prompt(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [rid]
    assert outs[0].token_ids == reference(good)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_sampling_params_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_request_that_can_never_fit_gets_a_clear_error(demo_path):
    engine = engine_for(demo_path, num_blocks=4)
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_prompt(list(range(60)), SamplingParams(max_tokens=20))
    assert not engine.has_unfinished()


def test_generate_queues_nothing_when_a_later_prompt_is_bad(demo_path):
    engine = engine_for(demo_path, num_blocks=4)
    with pytest.raises(ValueError, match="KV cache"):
        engine.generate([[1, 2, 3], list(range(60))], SamplingParams(max_tokens=20))
    assert not engine.has_unfinished()


def test_a_request_filling_the_cache_exactly_is_accepted(demo_path):
    engine = engine_for(demo_path, num_blocks=1)
    # 16 prompt tokens and one output token: only the 16 prompt tokens ever need K/V.
    out = engine.generate([list(range(16))], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert len(out.token_ids) == 1


def test_max_model_len_is_the_configured_limit_within_the_models_context(demo_path):
    mcfg = ModelConfig.from_folder(demo_path)
    ctx = mcfg.max_position_embeddings
    assert max_model_len(mcfg, None) == ctx and max_model_len(mcfg, ctx + 1000) == ctx
    assert max_model_len(mcfg, 100) == 100
    assert engine_for(demo_path, num_blocks=8, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="context is 100"):
        engine_for(demo_path, num_blocks=8, max_model_len=100).add_prompt(list(range(100)))


@pytest.mark.parametrize("bad", [0, 3, 12, -16])
def test_block_size_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(block_size=bad)
    assert [n for n in range(-4, 70) if is_power_of_two(n)] == [1, 2, 4, 8, 16, 32, 64]


def test_bfloat16_on_cpu_keeps_weights_and_kv_in_bfloat16_within_its_error_of_transformers(model):
    """``dtype: bfloat16`` (the serve config's, what vLLM's CPU build downcasts float32 models to): the weights and
    the KV cache are bfloat16, and the log-probability of every token the engine picks is within bfloat16's error
    of transformers' float32 one, also over a cached prefix. Greedy tokens are not compared: on these random
    models bfloat16 rounding flips many near-tied argmaxes (about 30% of 10-token continuations diverge)."""
    path, hf, _ = model
    engine = engine_for(path, dtype="bfloat16")
    assert engine.dtype == torch.bfloat16 and engine.runner.kv_cache.dtype == torch.bfloat16
    assert {p.dtype for p in engine.runner.model.parameters()} == {torch.bfloat16}
    rng = random.Random(7)
    shared = [rng.randrange(4000) for _ in range(64)]
    batch = [shared + [rng.randrange(4000) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    outs = engine.generate(batch[:1], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=0))
    outs += engine.generate(batch[1:], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=0))
    assert all(o.num_cached_tokens >= 48 for o in outs[1:])  # the later prompts read the first one's blocks
    for prompt, out in zip(batch, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        ref = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=0.35), (out.logprobs, ref.tolist())
    fp32 = engine_for(path)
    assert fp32.dtype == torch.float32  # auto stays float32 on the CPU: the parity tests above run in it


def test_serve_config_dtype_reaches_the_engine():
    from common.config import ServeConfig
    from router.control.serve import _engine_config

    base = {"tenants": [{"name": "acme", "api_keys": ["sk-acme-test-key-1"]}]}
    assert _engine_config(ServeConfig.model_validate(base), "demo", "s", False).dtype == "auto"
    cfg = ServeConfig.model_validate({**base, "dtype": "bfloat16"})
    assert _engine_config(cfg, "demo", "s", False).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        ServeConfig.model_validate({**base, "dtype": "int8"})
