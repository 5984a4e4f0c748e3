"""Soft-capping (Gemma 2) and attention sinks (gpt-oss) in the PyTorch reference backend, on ragged
paged batches (decode rows, chunked and fresh prefills, stale cache blocks), against a dense eager
computation per sequence: HF's own ``eager_attention_forward`` of Gemma 2 (soft-cap) and gpt-oss
(sinks), and their composition where both are on. The other backends are checked against this
reference in ``test_cpu_ops.py`` and ``test_triton_attention.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cb_serve.attention.base import AttentionMetadata
from cb_serve.attention.torch_backend import TorchAttentionBackend

# (softcap, sinks): each feature alone and both
FEATURES = [(None, False), (1.5, False), (None, True), (1.5, True)]


def paged_batch(query_lens: list[int], seq_lens: list[int], block_size: int, gen: torch.Generator):
    """Metadata of sequences with ``query_lens`` new tokens ending ``seq_lens``, their blocks scattered
    over a cache with spare (stale) blocks; returns it with the cache's block count."""
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(counts) + 4
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(counts) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(counts):
        table[i, :n] = order[used : used + n].int()
        used += n
    slots = [
        int(table[i, p // block_size]) * block_size + p % block_size
        for i, (q, n) in enumerate(zip(query_lens, seq_lens))
        for p in range(n - q, n)
    ]
    meta = AttentionMetadata(
        num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        cu_seqlens_q=torch.tensor([0, *query_lens]).cumsum(0).int(),
        cu_seqlens_k=torch.tensor([0, *seq_lens]).cumsum(0).int(),
        seqused_k=torch.tensor(seq_lens, dtype=torch.int32),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens),
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
    )
    return meta, num_blocks


def dense_eager(q, k, v, mask, scale, softcap, sinks, groups):
    """``q [1, H, Q, D]``, ``k``/``v [1, KVH, K, D]``, additive ``mask``: HF's eager functions."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    module = SimpleNamespace(num_key_value_groups=groups, head_dim=q.shape[-1], training=False, sinks=sinks)
    if sinks is None:
        return gemma2_eager(module, q, k, v, mask, scaling=scale, softcap=softcap)[0]
    if softcap is None:
        return gpt_oss_eager(module, q, k, v, mask, scaling=scale)[0]
    # both: Gemma 2's capped scores (mask added after the cap), then gpt-oss's softmax with the sink column
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / softcap) * softcap + mask
    scores = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores - scores.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.matmul(probs, v).transpose(1, 2)


@pytest.mark.parametrize("softcap,sinks", FEATURES)
@pytest.mark.parametrize("window", [None, 7])
def test_reference_matches_dense_eager(softcap, sinks, window):
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, scale = 6, 2, 32, 16, 32**-0.5
    query_lens, seq_lens = [1, 1, 1, 9, 20, 12], [70, 17, 1, 40, 20, 12]  # decodes, chunked, fresh prefills
    meta, num_blocks = paged_batch(query_lens, seq_lens, block_size, gen)
    tokens = sum(query_lens)
    q = 3 * torch.randn(tokens, heads, head_dim, generator=gen)  # scores large enough for the cap to bite
    k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    sink_logits = 2 * torch.randn(heads, generator=gen) + 1 if sinks else None
    out = TorchAttentionBackend().forward(q, k, v, cache, meta, scale, window, softcap=softcap, sinks=sink_logits)
    start = 0
    for i, (q_len, k_len) in enumerate(zip(query_lens, seq_lens)):
        slots = [int(meta.block_table[i, p // block_size]) * block_size + p % block_size for p in range(k_len)]
        keys, values = (cache[j].view(-1, kv_heads, head_dim)[slots].transpose(0, 1)[None] for j in (0, 1))
        q_pos, k_pos = torch.arange(k_len - q_len, k_len)[:, None], torch.arange(k_len)[None]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - window if window else True)
        mask = torch.zeros(q_len, k_len).masked_fill(~allowed, torch.finfo(torch.float32).min)
        qs = q[start : start + q_len].transpose(0, 1)[None]
        expected = dense_eager(qs, keys, values, mask, scale, softcap, sink_logits, heads // kv_heads)[0]
        torch.testing.assert_close(out[start : start + q_len], expected, atol=1e-5, rtol=1e-5)
        start += q_len
    if softcap is not None:  # the cap must change the result, else the test proves nothing
        plain = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, scale, window, sinks=sink_logits)
        assert (plain - out).abs().max() > 1e-2


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


def test_sinks_are_a_per_rank_parameter_loaded_from_the_checkpoint():
    """``AttentionSpec(sinks=True)``: the layer owns ``sinks`` ``[its heads]``, read from the checkpoint's
    ``self_attn.sinks`` sliced like the query heads (rank 1 of 2 takes heads 2 and 3)."""
    from transformers import LlamaForCausalLM as HFLlama

    from cb_serve.distributed.group import TensorParallelGroup
    from cb_serve.distributed.sharding import shard_for
    from cb_serve.model_executor.layers.attention import AttentionSpec
    from cb_serve.model_executor.models.llama import LlamaForCausalLM
    from cb_serve.model_executor.models.plan import LayerPlan, ModelPlan

    class SinkLlama(LlamaForCausalLM):
        @classmethod
        def plan(cls, config):
            return ModelPlan((LayerPlan(AttentionSpec(softcap=3.0, sinks=True)),) * config.num_hidden_layers)

    config = tiny_llama_config()
    state = HFLlama(config).state_dict()
    for i in range(config.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.sinks"] = torch.arange(4.0) + 10 * i
    tables = torch.zeros(1, 8, 8)
    rank1 = TensorParallelGroup(1, 2, process_group=object())  # never communicates here
    model = SinkLlama(config, TorchAttentionBackend(), tables, tables, shard_for(config, 1, 2), rank1)
    model.load_hf_state_dict(state)
    for i, layer in enumerate(model.layers):
        assert layer.self_attn.softcap == 3.0
        assert torch.equal(layer.self_attn.sinks, torch.tensor([2.0, 3.0]) + 10 * i)
    assert "layers.0.self_attn.sinks" in dict(model.named_parameters())


def test_flash_attn_refuses_sinks():
    """flash-attn 2 has no sinks: a model with them is refused when built on it, and its forward refuses too."""
    from cb_serve.attention.flash_backend import FlashAttentionBackend
    from cb_serve.distributed.group import TensorParallelGroup
    from cb_serve.distributed.sharding import single_shard
    from cb_serve.model_executor.layers.attention import Attention, AttentionSpec

    flash = FlashAttentionBackend.__new__(FlashAttentionBackend)  # its __init__ needs CUDA and flash-attn
    config = tiny_llama_config()
    with pytest.raises(ValueError, match="no attention sinks"):
        Attention(config, flash, AttentionSpec(sinks=True), single_shard(config), TensorParallelGroup.single())
    Attention(config, flash, AttentionSpec(softcap=50.0), single_shard(config), TensorParallelGroup.single())
    meta, _ = paged_batch([1], [1], 16, torch.Generator())
    q = torch.zeros(1, 4, 8)
    with pytest.raises(NotImplementedError, match="sinks"):
        flash.forward(q, q[:, :2], q[:, :2], torch.zeros(2, 1, 16, 2, 8), meta, 1.0, sinks=torch.zeros(4))


def test_gemma3_still_refuses_attention_softcapping():
    """HF's Gemma 3 never applies ``attn_logit_softcapping`` (its attention does not pass it on), so
    neither applying it nor ignoring it would be faithful: refused. Gemma 2 serves it."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from cb_serve.model_executor.models import model_class

    config = Gemma3TextConfig(attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        model_class(config)(config, TorchAttentionBackend(), None, None)
    specs = model_class(Gemma2Config()).attention_specs(Gemma2Config(num_hidden_layers=2))
    assert [(s.softcap, s.sliding_window, s.qk_norm) for s in specs] == [(50.0, 4096, None), (50.0, None, None)]


def no_write_backends() -> list:
    """Every backend that runs here: ``(name, backend, head sizes)``; the CPU kernels take head sizes 64
    and 128 (32 runs their PyTorch fallback), Triton runs in its interpreter without CUDA."""
    import os

    from cb_serve import cpu_ops
    from cb_serve.attention.cpu_backend import CpuAttentionBackend

    out = [("torch", TorchAttentionBackend(), (32,))]
    if cpu_ops.available():
        out.append(("cpu", CpuAttentionBackend(), (32, 64)))
    try:
        import triton  # noqa: F401
    except ImportError:
        return out
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        from cb_serve.attention.triton_backend import TritonAttentionBackend

        out.append(("triton", TritonAttentionBackend(), (32,)))
    return out


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("name,backend,head_dims", no_write_backends(), ids=lambda v: v if isinstance(v, str) else "")
def test_kv_shared_layer_reads_the_cache_and_writes_nothing(name, backend, head_dims, window):
    """Gemma 4's KV-shared layers: ``k=v=None`` attends over the cache as the source layer left it after
    writing this step's K/V (decodes, a chunked prefill, fresh prefills: those a backend would otherwise
    take straight from the new K/V) and writes nothing; the result equals the writing layer's."""
    gen = torch.Generator().manual_seed(5)
    query_lens, seq_lens = [1, 1, 9, 20, 12], [70, 17, 40, 20, 12]
    meta, num_blocks = paged_batch(query_lens, seq_lens, 16, gen)
    tokens, heads, kv_heads = sum(query_lens), 4, 2
    for head_dim in head_dims:
        q = torch.randn(tokens, heads, head_dim, generator=gen)
        k, v = torch.randn(2, tokens, kv_heads, head_dim, generator=gen)
        cache = torch.randn(2, num_blocks, 16, kv_heads, head_dim, generator=gen)
        source = backend.forward(q, k, v, cache, meta, head_dim**-0.5, window)  # the source layer writes
        written = cache.clone()
        shared = backend.forward(q, None, None, cache, meta, head_dim**-0.5, window, softcap=None)
        assert torch.equal(cache, written), f"{name}: a KV-shared layer wrote the cache"
        torch.testing.assert_close(shared, source, atol=1e-5, rtol=1e-5)
        reference = TorchAttentionBackend().forward(q, None, None, written.clone(), meta, head_dim**-0.5, window)
        torch.testing.assert_close(shared, reference, atol=1e-5, rtol=1e-5)
