"""Sampling, stop conditions, log-probabilities and streaming through the engine."""

from __future__ import annotations

import pytest
import torch

from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig

PROMPT = list(range(500, 540))


@pytest.fixture(scope="module")
def engine(demo_path):
    return Engine(EngineConfig(model=str(demo_path), device="cpu"))


def greedy(engine, n=12, **kw):
    return engine.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw))[0]


def test_seeded_request_is_reproducible_whatever_else_is_in_the_batch(engine):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPT], p)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batched = engine.generate([[1, 2, 3], PROMPT, [4, 5, 6, 7]], [others, p, others])[1].token_ids
    assert alone == batched
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True)
    assert engine.generate([PROMPT], other_seed)[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_sample_the_greedy_tokens(engine):
    expected = greedy(engine).token_ids
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        p = SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True, **kw)
        assert engine.generate([PROMPT], p)[0].token_ids == expected


def test_high_temperature_leaves_the_greedy_path(engine):
    p = SamplingParams(max_tokens=12, temperature=5.0, seed=3, ignore_eos=True)
    assert engine.generate([PROMPT], p)[0].token_ids != greedy(engine).token_ids


def test_stop_token_id_ends_the_output_and_is_kept(engine):
    full = greedy(engine).token_ids
    stop_at = next(i for i, t in enumerate(full) if i >= 2 and t not in full[:i])
    out = greedy(engine, stop_token_ids=[full[stop_at]])
    assert out.token_ids == full[: stop_at + 1] and out.finish_reason == "stop"


def test_stop_string_cuts_the_text(engine):
    full = greedy(engine, n=16)
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    out = greedy(engine, n=16, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert len(out.token_ids) < 16


def test_max_tokens_finishes_with_length(engine):
    out = greedy(engine, n=5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_logprobs_are_the_models_log_softmax(engine, demo_path):
    from transformers import AutoModelForCausalLM

    out = greedy(engine, n=6, logprobs=3)
    hf = AutoModelForCausalLM.from_pretrained(str(demo_path), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    ref = torch.log_softmax(logits.float(), -1)
    chosen = ref[torch.arange(6), torch.tensor(out.token_ids)]
    assert torch.allclose(torch.tensor(out.logprobs), chosen, atol=1e-4)
    assert len(out.top_logprobs) == 6
    for i, top in enumerate(out.top_logprobs):
        assert list(top) == ref[i].topk(3).indices.tolist()
        assert max(top.values()) == pytest.approx(out.logprobs[i], abs=1e-5)  # greedy picks the top token


def test_streamed_deltas_add_up_to_the_final_output(engine):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    chunks = list(engine.stream(PROMPT, params))
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert sum((c.new_token_ids for c in chunks), []) == chunks[-1].token_ids
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text
    assert chunks[0].ttft is not None and chunks[0].ttft > 0


def test_streamed_text_never_shows_a_stop_string(engine):
    full = greedy(engine, n=16).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    streamed = "".join(c.delta_text for c in engine.stream(PROMPT, params))
    assert stop not in streamed and streamed == full[: full.find(stop)]


def test_abort_releases_the_request(engine):
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    assert engine.stats().blocks_used > 0
    assert engine.abort(rid) and not engine.abort(rid)
    assert engine.stats().blocks_used == 0 and not engine.has_unfinished()


def test_a_vanishing_temperature_is_greedy_and_does_not_break_the_step(engine):
    expected = greedy(engine).token_ids
    p = SamplingParams(max_tokens=12, temperature=1e-39, ignore_eos=True)
    assert engine.generate([PROMPT], p)[0].token_ids == expected
