"""What the engine does with each sampled token: append it, detokenize incrementally (``worker/detokenizer.py``),
check the stop conditions, and build the request's ``RequestOutput``.

Stop strings are searched only in the new text plus the last ``max stop length - 1`` characters before it, which
is all a match ending in the new text can span.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from common.outputs import FinishReason, RequestOutput, Timings
from worker.detokenizer import decoder, stable_len
from worker.sequence import Sequence

if TYPE_CHECKING:
    from worker.sampler import SampleResult


def partial_stop(text: str, end: int, stop: str) -> int:
    """The length of the longest proper prefix of ``stop`` that ``text[:end]`` ends with (0 if none)."""
    begin = max(0, end - len(stop) + 1)
    i = text.find(stop[0], begin, end)
    while i >= 0:
        if stop.startswith(text[i:end]):
            return end - i
        i = text.find(stop[0], i + 1, end)
    return 0


def timings(seq: Sequence) -> Timings:
    """Where a finished request's time went (queued, prefilled, decoded), as offsets from its arrival."""
    arrived = seq.arrival_time
    return Timings(
        scheduled=None if seq.scheduled_time is None else seq.scheduled_time - arrived,
        first_token=None if seq.first_token_time is None else seq.first_token_time - arrived,
        finished=time.perf_counter() - arrived,
    )


class OutputProcessor:
    """One per engine: turns each sampled token into the request's new state and its ``RequestOutput``."""

    def __init__(self, tokenizer, eos_token_ids: Collection[int], max_model_len: int, block_size: int) -> None:
        self.decode = decoder(tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.block_size = block_size

    def append(self, seq: Sequence, res: SampleResult, now: float) -> FinishReason | None:
        """Add the sampled token to ``seq`` and update its text; returns why it must finish now, if it must."""
        tok = res.token_id
        seq.token_ids.append(tok)
        if res.logprob is not None:
            seq.logprobs.append(res.logprob)
            if res.top is not None:
                seq.top_logprobs.append(res.top)
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        reason = None
        if tok in p.stop_token_ids:
            reason, seq.stop_reason = FinishReason.STOP, tok
        elif not p.ignore_eos and tok in self.eos_token_ids:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        seq.text = text = seq.detok.update(seq.token_ids, self.decode, seq.num_prompt_tokens)
        if p.stop:
            # Only text after what earlier steps searched can hold a new match, give or take a stop's length.
            start = max(0, seq.num_stop_checked_chars - max(map(len, p.stop)) + 1)
            found = min(((i, s) for s in p.stop if (i := text.find(s, start)) >= 0), default=None)
            if found is not None:
                seq.text, reason, seq.stop_reason = text[: found[0]], FinishReason.STOP, found[1]
            seq.num_stop_checked_chars = stable_len(text)
        return reason

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's state after this step, with what became final since its previous output."""
        text = seq.text
        if seq.is_finished:
            final = len(text)
        else:
            # Hold back an incomplete UTF-8 character and anything that may still turn into a stop string.
            final = stable_len(text)
            final -= max((partial_stop(text, final, s) for s in seq.params.stop), default=0)
        final = max(final, seq.num_emitted_chars)
        delta, seq.num_emitted_chars = text[seq.num_emitted_chars : final], final
        # One copy of the output tokens, shared by token_ids and new_token_ids (a slice of it).
        out_ids = seq.token_ids[seq.num_prompt_tokens :]
        new, seq.num_emitted_tokens = out_ids[seq.num_emitted_tokens :], len(out_ids)
        want_lp = seq.params.logprobs is not None
        return RequestOutput(
            request_id=seq.output_id,
            index=seq.choice,
            tenant=seq.tenant,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=out_ids,
            text=text,
            new_token_ids=new,
            delta_text=delta,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            num_pinned_tokens=seq.num_pinned_blocks * self.block_size,
            logprobs=list(seq.logprobs) if want_lp else None,
            top_logprobs=list(seq.top_logprobs) if want_lp and seq.params.logprobs else None,
            ttft=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            stop_reason=seq.stop_reason,
            timings=timings(seq) if seq.is_finished else None,
        )

    def failed(self, seq: Sequence) -> RequestOutput:
        """The final output of a request the engine failed alone (``seq.error`` says why)."""
        return RequestOutput(
            request_id=seq.output_id,
            index=seq.choice,
            tenant=seq.tenant,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.token_ids[seq.num_prompt_tokens :],
            text=seq.text[: seq.num_emitted_chars],
            new_token_ids=[],
            delta_text="",
            finished=True,
            finish_reason=FinishReason.ERROR,
            num_cached_tokens=seq.num_cached_tokens,
            num_pinned_tokens=seq.num_pinned_blocks * self.block_size,
            ttft=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            error=seq.error,
            timings=timings(seq),
        )
