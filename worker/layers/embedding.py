"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.distributed import all_gather, all_reduce, tp_rank, tp_size
from worker.layers.linear import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.rank, self.world = tp_rank(), tp_size()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.world)  # the last rank's slice is zero-padded
        self.start = self.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)
        self.weight.weight_loader = self.load_sharded  # type: ignore[attr-defined]

    def load_sharded(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        part = loaded[self.start : self.start + self.per_rank]
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mine.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary: each rank scores its slice, then the slices are gathered."""

    packable = True  # unless tied to the embedding (pack_linear_weights leaves shared weights alone)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather(linear(hidden, self.weight), dim=-1)
        return logits[..., : self.vocab_size]
