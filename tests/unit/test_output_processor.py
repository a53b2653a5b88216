"""Incremental detokenization and stop strings (worker/detokenizer.py, worker/output_processor.py) against full decodes.

Token sequences are random draws from the demo tokenizer's vocabulary weighted towards single-byte tokens (which
split UTF-8 characters, or are invalid on their own), tokens of multi-byte text and special tokens, so windows
start and end inside characters, in invalid byte runs and around skipped tokens.
"""

from __future__ import annotations

import json
import pickle
import random

import pytest

from common.model_config import load_tokenizer
from common.outputs import FinishReason
from common.sampling import SamplingParams
from worker.detokenizer import IncrementalDetokenizer
from worker.output_processor import OutputProcessor
from worker.sampler import SampleResult
from worker.sequence import Sequence, SequenceStatus

MULTIBYTE = "naïve café — 世界の終わり 🎉🚀 Ωμέγα ünïcödé ∑∫√ 한국어 😀👍🏽"


@pytest.fixture(scope="module")
def tokenizer(demo_path):
    return load_tokenizer(demo_path)


def full(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def random_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    vocab = len(tokenizer)
    pieces = tokenizer(MULTIBYTE)["input_ids"]
    ids = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.35:  # a single byte: the byte-level alphabet comes right after the 5 special tokens
            ids.append(rng.randrange(5, 5 + 256))
        elif r < 0.6:  # a run of real multi-byte text, starting anywhere
            i = rng.randrange(len(pieces))
            ids.extend(pieces[i : i + rng.randrange(1, 6)])
        elif r < 0.7:
            ids.append(rng.randrange(5))  # special: skipped in the text
        else:
            ids.append(rng.randrange(vocab))
    return ids[:n]


def test_the_fixture_exercises_split_characters(tokenizer):
    # The premise of the tests below: some tokens end inside a character, so a prefix decodes to U+FFFD.
    ids = tokenizer(MULTIBYTE)["input_ids"]
    assert any(full(tokenizer, ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))


@pytest.mark.parametrize("seed", range(40))
def test_incremental_text_equals_a_full_decode_after_every_token(tokenizer, seed):
    rng = random.Random(seed)
    ids = random_ids(tokenizer, rng, rng.randrange(1, 120))
    detok = IncrementalDetokenizer()
    decode = OutputProcessor(tokenizer, [], 10**6, 16).decode
    for i in range(1, len(ids) + 1):
        assert detok.update(ids[:i], decode) == full(tokenizer, ids[:i]), (seed, i, ids[:i])


def test_each_step_decodes_only_the_last_tokens(tokenizer):
    ids = tokenizer("plain text, every token a whole word or sign. " * 8 + MULTIBYTE)["input_ids"]
    decode = OutputProcessor(tokenizer, [], 10**6, 16).decode
    windows = []
    detok = IncrementalDetokenizer()
    for i in range(1, len(ids) + 1):
        assert detok.update(ids[:i], lambda w: windows.append(len(w)) or decode(w)) == full(tokenizer, ids[:i])
    # A few tokens (the most bytes one character spans), where a full decode would have grown to every token.
    assert len(ids) > 150 and max(windows) <= 10


class _SliceCounter(list):
    """A list that counts the elements its slices copy."""

    copied = 0

    def __getitem__(self, i):
        item = super().__getitem__(i)
        if isinstance(i, slice):
            self.copied += len(item)
        return item


def test_appending_a_token_copies_a_few_tokens_not_the_whole_output(tokenizer):
    ids = tokenizer("plain text, every token a whole word or sign. " * 8 + MULTIBYTE)["input_ids"]
    proc = OutputProcessor(tokenizer, [], 10**6, 16)
    seq = Sequence("r", list(range(5, 105)), SamplingParams(max_tokens=10**6, ignore_eos=True), "t", b"k")
    seq.token_ids = _SliceCounter(seq.token_ids)
    for tok in ids:
        proc.append(seq, SampleResult(tok, None, None), 0.0)
    assert seq.text == full(tokenizer, ids)
    # The decode windows (a few tokens each), where slicing off the prompt would copy all len(ids)^2 / 2.
    assert len(ids) > 150 and seq.token_ids.copied <= 10 * len(ids)


class _Finisher:
    """Does what the engine does with a finish reason (the scheduler's part)."""

    @staticmethod
    def finish(seq: Sequence, reason: FinishReason) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason


def run(proc: OutputProcessor, ids: list[int], params: SamplingParams):
    seq = Sequence("r", [7, 8, 9], params, "t", b"k")
    outs = []
    for tok in ids:
        reason = proc.append(seq, SampleResult(tok, None, None), 0.0)
        if reason is not None:
            _Finisher.finish(seq, reason)
        outs.append(proc.output(seq))
        if seq.is_finished:
            break
    return outs


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_spanning_steps_cut_where_a_full_decode_first_contains_them(tokenizer, seed):
    rng = random.Random(1000 + seed)
    ids = random_ids(tokenizer, rng, 80)
    text = full(tokenizer, ids)
    a = rng.randrange(len(text) // 2)
    stop = text[a : a + rng.randrange(2, 9)].replace("\ufffd", "") or "x"  # usually several tokens long
    stops = [stop, "\u2603never\u2603"]
    proc = OutputProcessor(tokenizer, [], 10**6, 16)
    outs = run(proc, ids, SamplingParams(max_tokens=len(ids), stop=stops, ignore_eos=True))
    # The reference: the first step whose full decode contains a stop, cut at its earliest match.
    expected = None
    for i in range(1, len(ids) + 1):
        t = full(tokenizer, ids[:i])
        hits = [(t.find(s), s) for s in stops if s in t]
        if hits:
            idx, s = min(hits)
            expected = (i, t[:idx], s)
            break
    last = outs[-1]
    assert last.finished
    if expected is None:
        assert (last.finish_reason, last.text) == ("length", text)
    else:
        assert (len(outs), last.text, last.finish_reason, last.stop_reason) == (
            expected[0],
            expected[1],
            "stop",
            expected[2],
        )
    assert "".join(o.delta_text for o in outs) == last.text
    for i, o in enumerate(outs[:-1]):  # before the end: the whole text so far, never a stop
        assert o.text == full(tokenizer, ids[: i + 1]) and not o.finished
        assert stop not in "".join(x.delta_text for x in outs[: i + 1])
        assert o.token_ids == ids[: i + 1] and o.new_token_ids == [ids[i]]


def test_outputs_share_the_prompt_and_snapshot_the_tokens(tokenizer):
    proc = OutputProcessor(tokenizer, [], 10**6, 16)
    outs = run(proc, [300, 301, 302], SamplingParams(max_tokens=3, ignore_eos=True))
    assert outs[0].prompt_token_ids is outs[2].prompt_token_ids == [7, 8, 9]  # not copied per step
    assert [o.token_ids for o in outs] == [[300], [300, 301], [300, 301, 302]]  # earlier ones unchanged
    assert outs[-1].finish_reason == "length"


def test_finish_reasons_are_str_enum_members_with_the_wire_values(tokenizer):
    proc = OutputProcessor(tokenizer, [], 10**6, 16)
    stopped = run(proc, [40, 41, 42], SamplingParams(max_tokens=10, stop_token_ids=[41]))[-1]
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == 41
    long = run(proc, [40, 41, 42], SamplingParams(max_tokens=2, ignore_eos=True))[-1]
    assert long.finish_reason is FinishReason.LENGTH
    # What the gateway compares, serializes and receives over Ray stays the plain strings.
    assert long.finish_reason == "length" and f"{long.finish_reason}" == "length"
    assert json.dumps({"finish_reason": long.finish_reason}) == '{"finish_reason": "length"}'
    assert pickle.loads(pickle.dumps(long.finish_reason)) is FinishReason.LENGTH
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error"]
