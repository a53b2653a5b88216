"""Picks each sequence's next token from its logits: greedy, or temperature with top-k / top-p."""

from __future__ import annotations

import torch

from worker.sequence import Sequence


class SampleResult:
    __slots__ = ("token_id", "logprob", "top")

    def __init__(self, token_id: int, logprob: float | None, top: dict[int, float] | None) -> None:
        self.token_id, self.logprob, self.top = token_id, logprob, top


class Sampler:
    def __init__(self, seed: int) -> None:
        # Unseeded requests draw from one engine-wide stream, so a whole run is reproducible from its seed.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        logits = logits.float()
        greedy = logits.argmax(-1).tolist()
        want_lp = any(s.params.logprobs is not None for s in seqs)
        logp = torch.log_softmax(logits, -1) if want_lp else None
        out = []
        for i, seq in enumerate(seqs):
            p = seq.params
            tok = greedy[i] if p.greedy else self._sample(logits[i], seq)
            lp = top = None
            if p.logprobs is not None:
                assert logp is not None
                lp = float(logp[i, tok])
                if p.logprobs > 0:
                    vals, idx = logp[i].topk(p.logprobs)
                    top = dict(zip(idx.tolist(), vals.tolist()))
            out.append(SampleResult(tok, lp, top))
        return out

    def _sample(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        row = row.cpu() / p.temperature
        if 0 < p.top_k < row.numel():
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the token that crosses it included).
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p
            probs[order[drop]] = 0.0
        gen = seq.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=gen))
