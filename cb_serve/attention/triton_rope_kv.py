"""RoPE with the KV write, in one Triton kernel (the triton backend's ``rope_and_write_kv``): each token's
q heads rotated into a new ``q``, its k heads rotated and its v heads written straight to their slot of the
paged cache (the layout ``write_kv`` writes: ``[2, num_blocks, block_size, kv_heads, head_dim]``). Replaces
the PyTorch RoPE's ops on q and k (two products, a negation, a concatenation, a sum) and the KV write.

Rotate-half RoPE as HF computes it in the model's dtype: ``x * cos + rotate_half(x) * sin`` with ``cos`` and
``sin`` already in that dtype, each product and the sum rounded to it (nearest even; ``triton_kernels.rounded``),
so bfloat16 gives PyTorch's bits; dims past the rotary ones (partial rotary) pass through. A negative slot
(a CUDA graph's padding row) writes nothing.
"""

from __future__ import annotations

import torch

from cb_serve.attention.triton_kernels import WRITE_KV_UNSPECIALIZED_ALIGNMENT, jit_options, rounded, tl, triton

if triton is not None:

    @triton.jit(**jit_options(pointers=WRITE_KV_UNSPECIALIZED_ALIGNMENT))
    def _rope_write_kv_kernel(
        q,
        k,
        v,
        cos,
        sin,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_rt,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_ct,
        stride_ch,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        ROT_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        """Token ``program_id(0)``, head ``program_id(1)``: a q head (into ``q_out``) or, past ``NUM_HEADS``,
        a kv head (rotated k and v into the cache at the token's slot)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D_PAD)
        in_head = d < HEAD_DIM
        half: tl.constexpr = ROT_DIM // 2
        rot = d < ROT_DIM
        partner = tl.where(d < half, d + half, d - half)
        c = tl.load(cos + t * stride_rt + d, mask=rot, other=0.0).to(tl.float32)
        s = tl.load(sin + t * stride_rt + d, mask=rot, other=0.0).to(tl.float32)
        if h < NUM_HEADS:
            src = q + t * stride_qt + h * stride_qh
        else:
            src = k + t * stride_kt + (h - NUM_HEADS) * stride_kh
        x = tl.load(src + d, mask=in_head, other=0.0)
        dtype = x.dtype
        other = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
        other = tl.where(d < half, -other, other)  # rotate_half: (-x2, x1)
        turned = rounded(
            rounded(x.to(tl.float32) * c, dtype).to(tl.float32) + rounded(other * s, dtype).to(tl.float32), dtype
        )
        y = tl.where(rot, turned, x)
        if h < NUM_HEADS:
            tl.store(q_out + t * stride_ot + h * stride_oh + d, y, mask=in_head)
        else:
            kv_h = h - NUM_HEADS
            slot = tl.load(slot_mapping + t).to(tl.int64)
            ok = in_head & (d * 0 + slot >= 0)  # no scalar masks: the interpreter
            dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kv_h * stride_ch + d
            tl.store(k_cache + dst, y.to(k_cache.dtype.element_ty), mask=ok)
            val = tl.load(v + t * stride_vt + kv_h * stride_vh + d, mask=ok, other=0.0)
            tl.store(v_cache + dst, val.to(v_cache.dtype.element_ty), mask=ok)


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``q`` rotated (a new ``[T, heads, head_dim]`` tensor); ``k`` rotated and ``v`` into the cache at
    ``slot_mapping``. ``cos``/``sin``: ``[T, rotary_dim]`` in the model's dtype (the step's rows of the tables,
    each half repeated as HF's); q/k/v may be strided views of the fused projection (unit stride per head)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rope_write_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, ROT_DIM=cos.shape[-1], D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2], num_warps=1,
    )  # fmt: skip
    return q_out
