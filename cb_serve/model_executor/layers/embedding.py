"""The token embedding, split by vocabulary rows over tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.distributed.sharding import TensorParallelShard


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of this rank's vocabulary shard: a token outside it looks up zeros, and
    the sum over ranks is the full lookup. One rank is a plain embedding.

    On the CPU, exactly-low-bit rows (a dequantized GGUF embedding: ``cpu_ops.exact_quant``) are kept as
    their groups only (``prepare_for_cpu``), or read from a tied LM head's (``read_rows_from``): each lookup
    dequantizes its rows into the same float32 values."""

    packed_rows: torch.Tensor | None = None  # exact_quant.pack_decode_weight_quantized's layout of the rows

    def __init__(self, shard: TensorParallelShard, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__(len(shard.vocab), hidden_size)
        self.vocab_start, self.tp = shard.vocab.start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = self.lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (this rank's numbering) of the float32 embedding, however it is kept."""
        if self.packed_rows is None:
            return F.embedding(ids, self.weight)
        rows = exact_quant.decode_weight_rows(self.packed_rows, ids.reshape(-1))
        return rows.view(*ids.shape, self.embedding_dim)

    def bytes_read(self, num_tokens: int) -> int:
        """Bytes a lookup of ``num_tokens`` rows reads (of low-bit rows: their share of the packing)."""
        if self.packed_rows is None:
            return num_tokens * self.embedding_dim * self.weight.element_size()
        return num_tokens * self.packed_rows.nbytes // self.num_embeddings

    @torch.no_grad()
    def prepare_for_cpu(self, groups: exact_quant.QuantGroups | None) -> None:
        """Keeps the rows as ``groups`` (the weight's exact low-bit groups, or None: left as it is) and drops
        the float32 weight."""
        if groups is not None and cpu_ops.available():
            self.read_rows_from(exact_quant.pack_decode_weight_quantized(groups))

    def read_rows_from(self, packed: torch.Tensor) -> None:
        """Looks rows up in ``packed`` (a tied LM head's low-bit packing of this very weight) and drops the
        float32 weight (an empty tensor of its dtype; a tied head already dropped it)."""
        self.packed_rows = packed
        self.weight.data = self.weight.data.new_empty(0)
