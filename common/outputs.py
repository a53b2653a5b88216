"""What the engine returns for a request: cumulative results plus this step's increment, for streaming."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.StrEnum):
    """Why a request ended. A str enum: the values are what the APIs and the wire carry, and each compares equal
    to its value."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the model's context
    ABORT = "abort"  # cancelled before it finished
    ERROR = "error"  # the engine failed this request alone


@dataclass(frozen=True, slots=True)
class Timings:
    """Where a finished request's time in its worker group went, in seconds after it arrived at the engine: offsets
    on the engine process's own monotonic clock, free of any clock difference between the group's node and the
    caller's (the gateway places them on its own clock by when the final output came: router/gateway/tracing.py).
    Queueing is arrival to ``scheduled``, prefill ``scheduled`` to ``first_token``, decode ``first_token`` to
    ``finished``."""

    scheduled: float | None  # first scheduled (its prompt's computing started); None: never
    first_token: float | None  # its first output token was sampled; None: none was
    finished: float


@dataclass
class RequestOutput:
    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far
    text: str  # their text, stop strings cut, special tokens skipped
    new_token_ids: list[int]  # tokens produced since the previous output for this request
    delta_text: str  # text that became final since the previous output
    finished: bool
    finish_reason: FinishReason | None  # once finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_pinned_tokens: int = 0  # prompt tokens this request pinned or refreshed (explicit cache entry)
    logprobs: list[float] | None = None  # of each chosen token, when asked for
    top_logprobs: list[dict[int, float]] | None = None
    ttft: float | None = None  # seconds from arrival to the first output token
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None for EOS)
    error: str | None = None  # why the engine failed this request alone (finish_reason ERROR)
    index: int = 0  # which of the request's ``n`` choices this is (0 .. n-1; they share the prompt)
    timings: Timings | None = None  # on the final output of a request the engine ran (queue, prefill, decode)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def merge_choices(outs: list[RequestOutput]) -> RequestOutput:
    """The choices of one ``n`` > 1 request as one output for its usage: the prompt (and its cache reuse) once,
    the output tokens of every choice; finished once all are."""
    first = min(outs, key=lambda o: o.index)
    return RequestOutput(
        request_id=first.request_id,
        tenant=first.tenant,
        prompt_token_ids=first.prompt_token_ids,
        token_ids=[t for o in sorted(outs, key=lambda o: o.index) for t in o.token_ids],
        text="",
        new_token_ids=[],
        delta_text="",
        finished=all(o.finished for o in outs),
        finish_reason=first.finish_reason,
        num_cached_tokens=first.num_cached_tokens,
        num_pinned_tokens=first.num_pinned_tokens,
        ttft=first.ttft,
    )
