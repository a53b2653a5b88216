"""Sampling, stop conditions, log-probabilities and streaming through the engine."""

from __future__ import annotations

import pytest
import torch

from common.sampling import SamplingParams
from worker.engine import Engine, EngineConfig
from worker.sampler import Sampler
from worker.sequence import Sequence

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
    rid = engine.add_prompt(PROMPT, SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    assert engine.stats().blocks_used > 0
    assert engine.abort(rid) and not engine.abort(rid)
    assert engine.stats().blocks_used == 0 and not engine.has_unfinished()


def test_a_vanishing_temperature_is_greedy_and_does_not_break_the_step(engine):
    expected = greedy(engine).token_ids
    p = SamplingParams(max_tokens=12, temperature=1e-39, ignore_eos=True)
    assert engine.generate([PROMPT], p)[0].token_ids == expected


def _seq(rid: str, tokens: list[int], **kw) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(**kw), "t", b"")


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[4.0, 3.0, -1.0, 0.5], [4.0, 3.0, -1.0, 0.5]])
    seqs = [_seq("a", [0, 2, 0], temperature=0.0, repetition_penalty=2.0, logprobs=0), _seq("b", [0], temperature=0.0)]
    raw = logits.clone()
    res = Sampler(0)(logits, seqs)
    assert torch.equal(logits[0], torch.tensor([2.0, 3.0, -2.0, 0.5]))  # token 0 halved, token 2 doubled
    assert torch.equal(logits[1], raw[1])  # a row without a penalty is untouched
    assert res[0].token_id == 1 and res[1].token_id == 0  # greedy follows the penalised logits
    assert res[0].logprob == pytest.approx(float(torch.log_softmax(raw[0], -1)[1]))  # the model's own logprob


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    # probabilities about 0.6, 0.3, 0.1: min_p 0.4 keeps the tokens at 0.24 and above (the first two)
    logits = torch.tensor([0.6, 0.3, 0.1]).log().repeat(400, 1)
    seqs = [_seq(f"r{i}", [0], temperature=1.0, min_p=0.4, seed=i) for i in range(400)]
    picked = {r.token_id for r in Sampler(0)(logits, seqs)}
    assert picked == {0, 1}
    seqs = [_seq(f"r{i}", [0], temperature=1.0, seed=i) for i in range(400)]
    assert {r.token_id for r in Sampler(0)(logits, seqs)} == {0, 1, 2}


def test_min_p_and_repetition_penalty_are_validated_naming_the_field():
    for kw, field in (
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 11.0}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
    ):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            SamplingParams(**kw)


def test_a_repetition_penalty_steers_greedy_decoding_away_from_seen_tokens(engine):
    def repeats(out: list[int]) -> list[int]:
        return [i for i, t in enumerate(out) if t in PROMPT or t in out[:i]]

    plain = greedy(engine, n=40).token_ids
    first = repeats(plain)[0]  # the demo model repeats itself within 40 tokens
    penalised = greedy(engine, n=40, repetition_penalty=2.0).token_ids
    assert repeats(penalised) == [] and penalised[:first] == plain[:first]
    assert greedy(engine, n=40, repetition_penalty=1.0).token_ids == plain
