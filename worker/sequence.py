"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

import torch

from common.lora import AdapterRef
from common.outputs import FinishReason
from common.sampling import SamplingParams
from worker.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from worker.block_pool import Block


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens (prompt then output), the block table that holds their K/V, and how far they are computed."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant: str,
        root_key: bytes,
    ) -> None:
        self.request_id = request_id  # unique in the engine (choice c > 0 of a request is "{id}/{c}")
        self.output_id = request_id  # the id its outputs carry: the request's, for every choice
        self.choice = 0  # which of the request's choices (RequestOutput.index)
        self.num_choices = 1  # n: the choices forked from this sequence once its prompt is computed
        # The prompt, kept apart from ``token_ids`` (which grows) so every output can share it without a copy.
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.tenant = tenant
        self.root_key = root_key
        self.adapter: AdapterRef | None = None  # the LoRA adapter it runs under (its id also salts root_key)
        self.status = SequenceStatus.WAITING
        self.block_table: list[Block] = []
        self._ids_of: list[Block] | None = None  # the table ``_ids`` holds the ids of
        self._ids: list[int] = []
        self.block_keys: list[bytes] = []
        self.num_computed_tokens = 0
        self.num_registered_blocks = 0
        # Prompt tokens served from the cache on first admission (what usage reports).
        self.num_cached_tokens = 0
        self.admitted = False
        self.pin_blocks = 0  # leading full blocks to pin once computed or hit
        self.pin_ttl_s = 0.0
        self.num_pinned_blocks = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.text = ""
        self.detok = IncrementalDetokenizer()
        self.num_stop_checked_chars = 0  # text already searched for stop strings (they can only end later)
        self.error: str | None = None  # why the engine failed this request alone
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.arrival_time = time.perf_counter()
        self.scheduled_time: float | None = None  # first scheduled (the end of its queueing): Timings.scheduled
        self.first_token_time: float | None = None
        self.grammar: Any = None  # a structured output's llguidance matcher, made on first use (worker/structured.py)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def block_ids(self) -> list[int]:
        """The block table's ids. Tables only grow at the end until the KV manager replaces them with a new
        list (admission, release), so the ids are kept and extended rather than rebuilt every step."""
        table = self.block_table
        if self._ids_of is not table:
            self._ids_of, self._ids = table, []
        if len(self._ids) < len(table):
            self._ids.extend(b.block_id for b in table[len(self._ids) :])
        return self._ids
