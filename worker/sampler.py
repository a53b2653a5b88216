"""Picks each sequence's next token from its logits: greedy, or temperature with top-k / min-p / top-p, after a
repetition penalty where a request asks for one.

Sampling never raises for parameters ``SamplingParams`` accepts, whatever the logits hold (tiny ``top_p``,
extreme temperatures, ``inf`` or ``NaN`` logits). If something still fails for one row, that row's result is
the exception and the other rows are sampled as usual: the engine fails that request alone.

Rows of requests with a structured output are masked first (worker/structured.py: one batched mask for all of
them, on the logits' device); log-probabilities are taken before the mask, from the model's own distribution.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from worker.sequence import Sequence
from worker.structured import Grammars, advance


class SampleResult:
    """A sampled token, its log-probability and top alternatives when asked, and ``done``: the request's
    structured output is complete with this token (the request ends with ``stop``)."""

    __slots__ = ("token_id", "logprob", "top", "done")

    def __init__(self, token_id: int, logprob: float | None, top: dict[int, float] | None, done: bool = False) -> None:
        self.token_id, self.logprob, self.top, self.done = token_id, logprob, top, done


class Sampler:
    def __init__(self, seed: int, grammars: Grammars | None = None) -> None:
        # Unseeded requests draw from one engine-wide stream, so a whole run is reproducible from its seed.
        self.generator = torch.Generator().manual_seed(seed)
        self.grammars = grammars  # None: structured outputs are refused (an engine without a tokenizer)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult | Exception]:
        """One result per row of ``logits``: the sample, or the exception that sampling that row raised."""
        logits = raw = logits.float()  # once for the batch (a no-op for float32): rows are masked in place
        failed: dict[int, Exception] = {}
        if any(s.params.structured_output is not None for s in seqs):
            if any(s.params.logprobs is not None for s in seqs):
                raw = logits.clone()  # log-probabilities come from the model's distribution, not the masked one
            failed = self._mask(logits, seqs)
        if any(s.params.repetition_penalty != 1.0 for s in seqs):
            if raw is logits and any(s.params.logprobs is not None for s in seqs):
                raw = logits.clone()  # log-probabilities stay the model's
            failed.update(self._penalize(logits, seqs, failed))
        try:
            batch = self._prepare(logits, raw, seqs)  # one device round trip for the whole batch
        except Exception:
            batch = None  # decide row by row below: only the rows that fail on their own fail
        out: list[SampleResult | Exception] = []
        for i, seq in enumerate(seqs):
            if i in failed:
                out.append(failed[i])
                continue
            try:
                if batch is not None:
                    greedy, logp = batch[0][i], None if batch[1] is None else batch[1][i]
                else:
                    (greedy,), lp_rows = self._prepare(logits[i : i + 1], raw[i : i + 1], [seq])
                    logp = None if lp_rows is None else lp_rows[0]
                out.append(self._pick(logits[i], seq, greedy, logp))
            except Exception as exc:
                out.append(exc)
        return out

    def prefetch(self, batch: Iterable[tuple[Sequence, int]]) -> None:
        """Before the model runs ``batch`` (sequence, tokens): start the masks of the rows it will sample."""
        if self.grammars is not None:
            sampled = [s for s, n in batch if s.num_computed_tokens + n == s.num_tokens]
            self.grammars.prefetch([s for s in sampled if s.params.structured_output is not None])

    def _mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, Exception]:
        """Apply the structured outputs' masks to their rows (in place; every mask in one batched call). Returns
        the rows that cannot be sampled, with why (a grammar that does not compile, a matcher in error)."""
        failed: dict[int, Exception] = {}
        rows: list[int] = []
        matchers: list[Any] = []
        for i, seq in enumerate(seqs):
            if seq.params.structured_output is None:
                continue
            try:
                if self.grammars is None:
                    raise ValueError("this engine cannot apply structured outputs (it has no tokenizer)")
                m = self.grammars.state(seq)
            except Exception as exc:
                failed[i] = exc
                continue
            rows.append(i)
            matchers.append(m)
        if rows:
            assert self.grammars is not None
            try:
                self.grammars.apply(logits, rows, matchers)
            except Exception:  # one matcher in error: mask row by row, so only that one fails
                for i, m in zip(rows, matchers):
                    try:
                        self.grammars.apply(logits, [i], [m])
                    except Exception as exc:
                        failed[i] = exc
        return failed

    @staticmethod
    def _penalize(logits: torch.Tensor, seqs: list[Sequence], failed: dict[int, Exception]) -> dict[int, Exception]:
        """Apply the rows' repetition penalties in place (vLLM's and transformers' rule: the logit of every token
        already in the prompt or the output is divided by the penalty when positive, multiplied when negative).
        Returns the rows that failed."""
        out: dict[int, Exception] = {}
        with torch.inference_mode():  # the model's logits are inference tensors: written in place in this mode
            for i, seq in enumerate(seqs):
                penalty = seq.params.repetition_penalty
                if penalty == 1.0 or i in failed:
                    continue
                try:
                    ids = torch.tensor(seq.token_ids, device=logits.device).unique()
                    ids = ids[ids < logits.shape[1]]
                    seen = logits[i, ids]
                    logits[i, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
                except Exception as exc:
                    out[i] = exc
        return out

    @staticmethod
    def _prepare(
        logits: torch.Tensor, raw: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Greedy picks (of the masked logits) and log-probabilities (of the ``raw`` ones) when any row wants them."""
        want_lp = any(s.params.logprobs is not None for s in seqs)
        return logits.argmax(-1).tolist(), torch.log_softmax(raw, -1) if want_lp else None

    def _pick(self, row: torch.Tensor, seq: Sequence, greedy: int, logp: torch.Tensor | None) -> SampleResult:
        p = seq.params
        tok = greedy if p.greedy else self._sample(row, seq)
        lp = top = None
        if p.logprobs is not None:
            assert logp is not None
            lp = float(logp[tok])
            if p.logprobs > 0:
                vals, idx = logp.topk(p.logprobs)
                top = dict(zip(idx.tolist(), vals.tolist()))
        done = seq.grammar is not None and advance(seq.grammar, tok)
        return SampleResult(tok, lp, top, done)

    def _sample(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        row = row.float().cpu() / p.temperature
        # NaN is never a candidate; +inf (or an overflow from a small temperature) becomes the largest finite
        # value, so softmax keeps a well-defined top token instead of producing NaN.
        row = torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
        if 0 < p.top_k < row.numel():
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(-1)
        if p.min_p > 0.0:  # the most likely token always stays
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the token that crosses it included). The most
            # likely token always stays, even when top_p rounds to 0 in float32.
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            drop[0] = False
            probs[order[drop]] = 0.0
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            if not bool(torch.isfinite(row).any()):
                raise ValueError("the model produced no finite logit for this request")
            return int(row.argmax())
        gen = seq.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=gen))
