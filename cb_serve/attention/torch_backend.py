"""Pure-PyTorch paged varlen attention: the CPU path and the reference for GPU kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cb_serve.attention.base import AttentionBackend, AttentionMetadata


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Tokens of ``block_ids`` (``[..., n]``) of one K or V cache ``[num_blocks, block_size, H, D]``,
    as ``[..., n * block_size, H, D]``. ``index_select`` over whole blocks is a row memcpy, several
    times faster than advanced indexing."""
    num_blocks, block_size, heads, head_dim = cache.shape
    stored = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache  # (no FP8 index_select)
    rows = stored.view(num_blocks, -1).index_select(0, block_ids.reshape(-1)).view(cache.dtype)
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, heads, head_dim)


def causal_mask(
    query_len: int,
    key_len: int,
    sliding_window: int | None,
    device: torch.device,
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Boolean ``[query_len, key_len]`` mask (True = attend), aligned to the bottom right:
    query ``i`` sits at position ``key_len - query_len + i``. Within each of ``spans`` (an image's
    positions ``start:end``) every query sees every key, later ones too (HF's Gemma 3: causal or same
    image, and then inside the window)."""
    q_pos = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    k_pos = torch.arange(key_len, device=device)[None, :]
    mask = k_pos <= q_pos
    for start, end in spans or ():
        mask |= (q_pos >= start) & (q_pos < end) & (k_pos >= start) & (k_pos < end)
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


@dataclass(frozen=True)
class Extras:
    """A layer's score soft-cap and attention sinks (float32 ``[num_heads]``), which SDPA has not."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def any(self) -> bool:
        return self.softcap is not None or self.sinks is not None


NO_EXTRAS = Extras()


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, extra: Extras
) -> torch.Tensor:
    """HF's eager attention in float32 (Gemma 2's soft-cap, gpt-oss's sinks): ``q [B, H, Q, D]``,
    ``k``/``v [B, KVH, K, D]``, boolean ``mask`` (True = attend) broadcast to ``[B, H, Q, K]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.matmul(q.float(), k.transpose(2, 3)) * scale
    if extra.softcap is not None:  # HF's op order: / cap, tanh, * cap
        scores = torch.tanh(scores / extra.softcap) * extra.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if extra.sinks is not None:  # one more column per head, dropped after the softmax
        sinks = extra.sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sinks], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).to(q.dtype)


@dataclass
class DecodeBucket:
    """Decode rows ``start:end`` attend over ``num_blocks`` blocks each (their longest context);
    built once per step, used by every layer."""

    start: int
    end: int
    block_ids: torch.Tensor  # flat int64 [rows * num_blocks]
    num_blocks: int
    seq_lens: torch.Tensor  # [rows]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # sliding window -> [rows, 1, 1, S]

    def mask(self, block_size: int, sliding_window: int | None) -> torch.Tensor:
        if sliding_window not in self.masks:
            k_pos = torch.arange(self.num_blocks * block_size, device=self.seq_lens.device)[None, :]
            lens = self.seq_lens[:, None]
            mask = k_pos < lens
            if sliding_window is not None:
                mask &= k_pos >= lens - sliding_window
            self.masks[sliding_window] = mask[:, None, None, :]
        return self.masks[sliding_window]


def decode_buckets(meta: AttentionMetadata, block_size: int, slack: float = 0.8) -> list[DecodeBucket]:
    """Consecutive decode rows grouped while their context stays within ``slack`` of the
    group's first (the model runner sorts decode rows longest first, so padding stays small)."""
    if "torch_decode_buckets" in meta.backend_cache:
        return meta.backend_cache["torch_decode_buckets"]
    lens = meta.seq_lens[: meta.num_decodes]
    bounds, start = [], 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or lens[i] < slack * lens[start]:
            bounds.append((start, i))
            start = i
    buckets = []
    for start, end in bounds:
        num_blocks = -(-max(lens[start:end]) // block_size)
        block_ids = meta.block_table[start:end, :num_blocks].reshape(-1).long()
        buckets.append(DecodeBucket(start, end, block_ids, num_blocks, meta.seqused_k[start:end]))
    meta.backend_cache["torch_decode_buckets"] = buckets
    return buckets


class TorchAttentionBackend(AttentionBackend):
    """Decode rows (one query each) in a few length buckets, each one block gather and one
    masked SDPA; prefill chunks one sequence at a time through SDPA (straight from the new
    K/V when there is no cached context)."""

    name = "torch"
    supports_narrow_kv_cache = True
    supports_bidirectional_spans = True

    def forward(
        self,
        q,
        k,
        v,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if k is not None:  # None: a KV-shared layer, whose K/V an earlier layer wrote
            self.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        extra = Extras(softcap, None if sinks is None else sinks.float())
        if meta.num_decodes:
            self.decode(out, q, kv_cache, meta, scale, sliding_window, extra)
        if meta.num_seqs > meta.num_decodes:
            self.prefill(out, q, k, v, kv_cache, meta, scale, sliding_window, extra)
        return out

    def prefill(
        self,
        out,
        q,
        k,
        v,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        extra: Extras = NO_EXTRAS,
    ) -> None:
        """Attention of the prefill chunks (the rows after the decodes), written into ``out``."""
        block_size = kv_cache.shape[2]
        start = meta.num_decodes
        for i in range(meta.num_decodes, meta.num_seqs):
            q_len, k_len = meta.query_lens[i], meta.seq_lens[i]
            end = start + q_len
            if q_len == k_len and k is not None:
                ks, vs = k[start:end], v[start:end]
            else:
                block_ids = meta.block_table[i, : -(-k_len // block_size)]
                ks = gather_blocks(kv_cache[0], block_ids)[:k_len].to(q.dtype)
                vs = gather_blocks(kv_cache[1], block_ids)[:k_len].to(q.dtype)
            spans = meta.bidirectional_spans.get(i)
            out[start:end] = self._prefill(q[start:end], ks, vs, scale, sliding_window, extra, spans)
            start = end

    def decode(
        self,
        out,
        q,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        extra: Extras = NO_EXTRAS,
    ) -> None:
        """Attention of the ``meta.num_decodes`` one-token rows, written into ``out``."""
        block_size = kv_cache.shape[2]
        for b in decode_buckets(meta, block_size):
            n = b.end - b.start
            ks = gather_blocks(kv_cache[0], b.block_ids).view(n, -1, *kv_cache.shape[-2:]).transpose(1, 2).to(q.dtype)
            vs = gather_blocks(kv_cache[1], b.block_ids).view(n, -1, *kv_cache.shape[-2:]).transpose(1, 2).to(q.dtype)
            qs, mask = q[b.start : b.end].unsqueeze(2), b.mask(block_size, sliding_window)
            if extra.any:
                o = eager_attention(qs, ks, vs, mask, scale, extra)
            else:
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            out[b.start : b.end] = o.squeeze(2)

    @staticmethod
    def _prefill(
        q, k, v, scale: float, sliding_window: int | None, extra: Extras = NO_EXTRAS, spans=None
    ) -> torch.Tensor:
        q_len, k_len = q.shape[0], k.shape[0]
        if extra.any:
            mask = causal_mask(q_len, k_len, sliding_window, q.device, spans)
            o = eager_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, extra
            )
            return o[0].transpose(0, 1)
        if q_len == k_len and sliding_window is None and not spans:
            mask, is_causal = None, True
        else:
            mask, is_causal = causal_mask(q_len, k_len, sliding_window, q.device, spans), False
        o = F.scaled_dot_product_attention(  # 4-D inputs: CPU SDPA takes its flash kernel only for those
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)
