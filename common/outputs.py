"""What the engine returns for a request: cumulative results plus this step's increment, for streaming."""

from __future__ import annotations

from dataclasses import dataclass


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
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_pinned_tokens: int = 0  # prompt tokens this request pinned or refreshed (explicit cache entry)
    logprobs: list[float] | None = None  # of each chosen token, when asked for
    top_logprobs: list[dict[int, float]] | None = None
    ttft: float | None = None  # seconds from arrival to the first output token
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None for EOS)
    error: str | None = None  # why the engine failed this request alone (finish_reason "error")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
