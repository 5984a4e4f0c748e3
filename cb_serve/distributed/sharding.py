"""Which slice of each weight a tensor-parallel rank holds (Megatron-style), as pure functions.

- q/k/v and gate/up are split by output columns, o and down by input rows (their partial
  outputs are summed across ranks); the embedding and LM head are split over the vocabulary.
- Mixture-of-experts layers split each expert's intermediate columns like the MLP's, or, with expert
  parallelism (``expert_parallel``), give each rank whole experts (``experts``) and every column.
- Attention splits by KV head: each rank takes a contiguous run of KV heads and the query heads
  that read them, so grouped-query attention stays within a rank. Counts need not divide evenly
  (SmolLM2's 3 KV heads over 2 ranks: 2 and 1). With more ranks than KV heads, each KV head is
  replicated on ``size // num_kv_heads`` ranks, which split its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from cb_serve.config.layer_configs import layer_configs, layer_head_dim


def balanced_range(n: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous runs whose lengths differ by at most one."""
    assert 0 <= index < parts
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank ``rank`` of ``size``: the heads, MLP columns and vocabulary rows it holds."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range  # rows of the vocabulary padded to a multiple of ``size`` (equal shards for all-gather)
    expert_parallel: bool = False  # MoE layers: whole experts per rank (vLLM's ``enable_expert_parallel``)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def experts(self, num_experts: int) -> range:
        """The experts this rank holds: a contiguous run under expert parallelism, else all of them."""
        return balanced_range(num_experts, self.size, self.rank) if self.expert_parallel else range(num_experts)

    def linear_key_heads(self, num_key_heads: int) -> range:
        """A Gated DeltaNet layer's key heads this rank holds (with their value heads and their state)."""
        if self.size > num_key_heads:
            raise ValueError(
                f"tensor_parallel_size={self.size} cannot split {num_key_heads} linear-attention key heads: it must "
                "be at most their count."
            )
        return balanced_range(num_key_heads, self.size, self.rank)

    def mamba_heads(self, num_heads: int, num_groups: int) -> tuple[range, range]:
        """A Mamba2 layer's heads and B/C groups this rank holds: whole groups with their heads where the
        groups divide over the ranks, else (one group) every rank the group and a run of heads."""
        if num_groups % self.size == 0:
            groups = balanced_range(num_groups, self.size, self.rank)
            per = num_heads // num_groups
            return range(groups.start * per, groups.stop * per), groups
        if num_groups == 1 and self.size <= num_heads:
            return balanced_range(num_heads, self.size, self.rank), range(1)
        raise ValueError(
            f"tensor_parallel_size={self.size} cannot split a Mamba2 layer of {num_heads} heads in {num_groups} "
            "groups: the groups must divide over the ranks (or be one, with at least as many heads as ranks)."
        )

    def expert_columns(self, intermediate_size: int) -> range:
        """The intermediate columns of each held expert: all under expert parallelism, else this rank's run."""
        if self.expert_parallel:
            return range(intermediate_size)
        return balanced_range(intermediate_size, self.size, self.rank)


def shard_for(config, rank: int, size: int, expert_parallel: bool = False) -> TensorParallelShard:
    """Rank ``rank``'s shard of an HF Llama-family ``config``; raises ValueError when ``size``
    ranks cannot split its heads (or, under ``expert_parallel``, its experts). Layers of different KV heads
    or head sizes (Gemma 4) are not split: one rank holds them all (its layers take their own heads,
    ``kv_heads`` here is layer 0's)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside tensor_parallel_size={size}.")
    if getattr(config, "is_heterogeneous", False):
        layers = layer_configs(config)
        kv_heads = sorted({c.num_key_value_heads for c in layers})
        if size > 1 and len({(c.num_key_value_heads, layer_head_dim(c)) for c in layers}) > 1:
            raise ValueError(
                f"tensor_parallel_size={size} is not supported for {config.model_type}: its layers differ in KV "
                f"heads ({kv_heads}) or head size, which tensor parallelism does not split yet."
            )
        config = layers[0]
    num_heads, num_kv = config.num_attention_heads, config.num_key_value_heads
    group = num_heads // num_kv
    if size <= num_kv:
        kv = balanced_range(num_kv, size, rank)
        q = range(kv.start * group, kv.stop * group)
    elif size % num_kv == 0 and size // num_kv <= group:
        replicas = size // num_kv  # ranks sharing one KV head
        head = rank // replicas
        kv = range(head, head + 1)
        within = balanced_range(group, replicas, rank % replicas)
        q = range(head * group + within.start, head * group + within.stop)
    else:
        raise ValueError(
            f"tensor_parallel_size={size} cannot split {num_heads} query / {num_kv} KV heads: it must be at most "
            f"the KV head count, or a multiple of it no larger than the query head count."
        )
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    if expert_parallel and size > num_experts:
        raise ValueError(
            f"enable_expert_parallel over {size} ranks needs at least as many experts; the model has {num_experts}."
        )
    padded_vocab = -(-config.vocab_size // size) * size
    per_rank = padded_vocab // size
    return TensorParallelShard(
        rank=rank,
        size=size,
        q_heads=q,
        kv_heads=kv,
        intermediate=balanced_range(config.intermediate_size, size, rank),
        vocab=range(rank * per_rank, (rank + 1) * per_rank),
        expert_parallel=expert_parallel,
    )


def single_shard(config) -> TensorParallelShard:
    return shard_for(config, 0, 1)
