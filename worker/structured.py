"""Structured outputs: the per-request grammar state and the batched token masks the sampler applies.

A request whose ``SamplingParams.structured_output`` is set gets an llguidance ``LLMatcher`` (its grammar's parse
state) the first time one of its tokens is sampled, kept on its ``Sequence`` (``seq.grammar``). Each step, before
sampling, ``Grammars.apply`` computes the allowed-token bitmask of every constrained row of the batch in one call
(llguidance's executor fills them in parallel, into one int32 array: 32 tokens a word), unpacks it on the logits'
device (CPU or CUDA) and sets every disallowed logit to ``-inf``; rows without a constraint are not touched. The
engine starts that computation before the model's forward pass (``prefetch``), so the two overlap. After
sampling, ``advance`` feeds the chosen token to the matcher and says whether the grammar is complete (nothing more
can follow), which ends the request with ``stop``. EOS is allowed exactly where the grammar may end.

Sampling happens on rank 0 only (worker/engine.py, from logits gathered over the tensor-parallel ranks), so the
masks and the matchers live there and every rank gets the chosen token in the next step's plan.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from common.sampling import StructuredOutput

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from worker.sequence import Sequence


class GrammarError(ValueError):
    """A constrained request cannot go on: its grammar does not compile, or the matcher refused a token."""


class Grammars:
    """One per engine: the llguidance view of the tokenizer (built on first use), the executor that computes the
    batch's masks, and the compiled grammar of each constraint seen lately (compiling is the costly part; a
    matcher per request is then a copy)."""

    _CACHE = 64

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None
        self._executor: Any = None
        self._grammars: dict[StructuredOutput, LLMatcher] = {}  # a compiled matcher per constraint, never advanced
        self._tables: dict[torch.device, torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[list[LLMatcher], Future[torch.Tensor]] | None = None

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            eos = self.eos_token_ids or None
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def matcher(self, so: StructuredOutput) -> LLMatcher:
        """A fresh matcher at the start of ``so``'s grammar; ``GrammarError`` if it does not compile. Requests
        with the same constraint get copies of one compiled matcher, which share its lexer's lazily built states
        (building them is most of what a new grammar's first masks cost)."""
        from llguidance import LLMatcher

        base = self._grammars.get(so)
        if base is None:
            base = LLMatcher(self.tokenizer, so.grammar(), log_level=0)
            if base.is_error():
                raise GrammarError(f"structured output: {base.get_error()}")
            if len(self._grammars) >= self._CACHE:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[so] = base
        return base.deep_copy()

    def state(self, seq: Sequence) -> LLMatcher | None:
        """``seq``'s matcher (made on first use), or None for an unconstrained request."""
        so = seq.params.structured_output
        if so is None:
            return None
        if seq.grammar is None:
            seq.grammar = self.matcher(so)
        return seq.grammar

    def _fill(self, matchers: list[LLMatcher]) -> torch.Tensor:
        """The allowed-token bitmasks of ``matchers`` (one int32 row each), computed in one parallel call."""
        from llguidance import LLExecutor

        if self._executor is None:
            # Few threads: the masks of a batch take well under a millisecond each, and the cores are the model's.
            self._executor = LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)))
        words = (self.vocab_size + 31) // 32
        bits = torch.zeros((len(matchers), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, k) for k, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(matchers)
        )
        return bits

    def prefetch(self, seqs: list[Sequence]) -> None:
        """Start computing the masks of the constrained ``seqs`` (the rows the coming step samples) on a helper
        thread, so that they overlap the model's forward pass (llguidance drops the GIL); ``apply`` takes them
        if its matchers are these, else computes its own."""
        self._pending = None
        try:
            matchers = [m for s in seqs if (m := self.state(s)) is not None]
        except Exception:  # a grammar that does not compile: the sampler fails that request
            return
        if matchers:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvgrid-grammar")
            self._pending = (matchers, self._pool.submit(self._fill, matchers))

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[LLMatcher]) -> None:
        """Mask ``logits`` (batch x vocab, in place) so that row ``rows[k]`` allows only what ``matchers[k]``
        accepts next: one mask computation for all of them (the prefetched one when it is of these matchers),
        one masked fill on the logits' device."""
        pending, self._pending = self._pending, None
        bits = None
        if pending is not None:
            done = pending[1].result()  # waited for even when unused: it reads these matchers
            if len(pending[0]) == len(matchers) and all(a is b for a, b in zip(pending[0], matchers)):
                bits = done
        if bits is None:
            bits = self._fill(matchers)
        words = bits.shape[1]
        for m in matchers:
            if m.is_error():
                raise GrammarError(f"structured output: {m.get_error()}")
        dev = logits.device
        table = self._tables.get(dev)
        if table is None:  # byte value -> its 8 bits, negated: True where a token is not allowed
            byte = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
            table = self._tables[dev] = ((byte >> torch.arange(8, dtype=torch.int32)) & 1 == 0).to(dev)
        with torch.inference_mode():  # the model's logits are inference tensors: written in place in this mode
            # Little-endian words: byte j of a row holds tokens 8j..8j+7, lowest bit first.
            octets = bits.view(torch.uint8).to(dev, non_blocking=True).flatten().int()
            banned = table.index_select(0, octets).view(len(rows), words * 32)[:, : logits.shape[1]]
            if len(rows) == logits.shape[0]:  # every row constrained (rows are 0..n-1 in order): no gather
                logits.masked_fill_(banned, float("-inf"))
            else:
                index = torch.tensor(rows, device=dev)
                logits[index] = logits[index].masked_fill(banned, float("-inf"))


def advance(matcher: LLMatcher, token: int) -> bool:
    """Feed the sampled ``token`` to the request's matcher; True when the grammar is complete (the output must
    end: nothing but EOS could follow). ``GrammarError`` when the matcher refuses the token."""
    if not matcher.consume_token(token):
        raise GrammarError(f"structured output: token {token} does not fit the grammar ({matcher.get_error()})")
    return matcher.is_stopped()
