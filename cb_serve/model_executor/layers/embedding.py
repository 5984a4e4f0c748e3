"""The token embedding, split by vocabulary rows over tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of this rank's vocabulary shard: a token outside it looks up zeros, and
    the sum over ranks is the full lookup. One rank is a plain embedding."""

    def __init__(self, shard: TensorParallelShard, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__(len(shard.vocab), hidden_size)
        self.vocab_start, self.tp = shard.vocab.start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
