"""Pure-PyTorch paged varlen attention: the CPU path and the reference for GPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cb_serve.attention.base import AttentionBackend, AttentionMetadata


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens stored in ``block_ids`` of one K or V cache, ``[length, H, D]``."""
    return cache[block_ids].flatten(0, 1)[:length]


def causal_mask(query_len: int, key_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean ``[query_len, key_len]`` mask (True = attend), aligned to the bottom right:
    query ``i`` sits at position ``key_len - query_len + i``."""
    q_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    k_pos = torch.arange(key_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


class TorchAttentionBackend(AttentionBackend):
    """Decode rows (one query each) in one batched gather + matmul; prefill chunks one
    sequence at a time through SDPA (straight from the new K/V when there is no context)."""

    name = "torch"

    def forward(
        self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None = None
    ) -> torch.Tensor:
        self.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, sliding_window)
        start = nd
        for i in range(nd, meta.num_seqs):
            q_len, k_len = meta.query_lens[i], meta.seq_lens[i]
            end = start + q_len
            if q_len == k_len:
                ks, vs = k[start:end], v[start:end]
            else:
                block_ids = meta.block_table[i, : -(-k_len // kv_cache.shape[2])]
                ks, vs = gather_kv(kv_cache[0], block_ids, k_len), gather_kv(kv_cache[1], block_ids, k_len)
            out[start:end] = self._prefill(q[start:end], ks, vs, scale, sliding_window)
            start = end
        return out

    @staticmethod
    def _prefill(q, k, v, scale: float, sliding_window: int | None) -> torch.Tensor:
        q_len, k_len = q.shape[0], k.shape[0]
        if q_len == k_len and sliding_window is None:
            mask, is_causal = None, True
        else:
            mask, is_causal = causal_mask(q_len, k_len, sliding_window, q.device), False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1)

    @staticmethod
    def _decode(q, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
        nd = q.shape[0]
        num_heads, head_dim = q.shape[1:]
        num_kv_heads, block_size = kv_cache.shape[-2], kv_cache.shape[2]
        max_len = max(meta.seq_lens[:nd])
        block_ids = meta.block_table[:nd, : -(-max_len // block_size)]
        k = kv_cache[0][block_ids].flatten(1, 2)  # [nd, S, Hkv, D]
        v = kv_cache[1][block_ids].flatten(1, 2)
        qg = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).mul_(scale)  # [nd, Hkv, G, S]
        seq_lens = meta.seqused_k[:nd, None]
        k_pos = torch.arange(k.shape[1], device=q.device)[None, :]
        invalid = k_pos >= seq_lens
        if sliding_window is not None:
            invalid |= k_pos <= seq_lens - 1 - sliding_window
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v.transpose(1, 2))  # [nd, Hkv, G, D]
        return out.reshape(nd, num_heads, head_dim)
