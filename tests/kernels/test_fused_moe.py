"""The mixture-of-experts pieces against HF transformers' own modules and the torch reference:

- the routers equal HF's ``*TopKRouter`` modules bit for bit (weights and ids);
- the expert loop (``fused_experts`` over ``TorchExpertGemm``) equals HF's ``*Experts.forward`` (both its
  ``eager`` and ``grouped_mm`` experts) bit for bit when each expert's rows come in HF's order: the same
  GEMMs per expert, the same weighting, the same summation order. In its own order (tokens ascending) it
  agrees within float32 summation-order error: MKL's SGEMM may split the rows among threads, and on some
  CPUs and thread counts (AMD Zen 5 on 2 threads; any CPU under ``MKL_CBWR=COMPATIBLE``) a row's sums then
  depend on its place (gpt-oss: within float32 error in either order, as HF runs its GEMMs on the weight as
  stored, ``[H, 2I]``, then adds the bias);
- the C++ grouped GEMM equals ``decode_gemm`` run per expert bit for bit (the same FMA chain per output),
  and HF's per-expert ``F.linear`` within float32 summation-order error: both sum K products of the same
  float32 numbers, in a different order (MKL's blocked sums, ``decode_gemm``'s sequential chain), so each
  output differs by at most about K * 2^-24 * sum|x_k w_k|; the check allows 1e-5 of that scale;
- expert parallelism: the ranks' shares sum to the whole.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models import tiny_config

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant
from cb_serve.model_executor.layers.fused_experts import (
    CpuExpertGemm,
    ExpertRouting,
    TorchExpertGemm,
    fused_experts,
    route_pairs,
)
from cb_serve.model_executor.layers.moe import MoESpec, activation_fn
from cb_serve.model_executor.layers.moe_router import RouterSpec, select_experts
from cb_serve.model_executor.layers.moe_weights import read_experts

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="cb_serve CPU kernels did not build here")


def hf_block(arch: str, seed: int = 0, experts_implementation: str | None = None):
    """The first layer's MoE block of a tiny random ``arch`` model, with non-trivial biases (HF's experts:
    its default, ``grouped_mm`` in transformers 5, or the one named)."""
    import transformers

    torch.manual_seed(seed)
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch, 256), dtype=torch.float32, **kwargs)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model.config, block


ROUTERS = {
    "mixtral": lambda c: RouterSpec(8, 2, renormalize=True, float32_weights=True),
    "qwen3_moe": lambda c: RouterSpec(8, 2, renormalize=True),
    "olmoe": lambda c: RouterSpec(8, 2, renormalize=False),
    "gpt_oss": lambda c: RouterSpec(8, 2, scoring="topk_softmax", bias=True),
}


@pytest.mark.bitwise
@pytest.mark.parametrize("arch", list(ROUTERS))
def test_routers_equal_hf(arch):
    config, block = hf_block(arch)
    router = block.router if arch == "gpt_oss" else block.gate
    x = torch.randn(37, config.hidden_size)
    _, ref_weights, ref_ids = router(x)
    weights, ids = select_experts(
        torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None)), ROUTERS[arch](config)
    )
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    assert weights.dtype == ref_weights.dtype


def spec_of(arch: str, config) -> MoESpec:
    if arch == "gpt_oss":
        return MoESpec(ROUTERS[arch](config), config.intermediate_size, "swiglu_oai", True, True)
    return MoESpec(ROUTERS[arch](config), getattr(config, "moe_intermediate_size", config.intermediate_size))


def ours(arch: str, config, block, x, gemm, use_cpu_ops: bool = False, experts: range = range(8), row_order=None):
    """The block's output by ``fused_experts``; ``row_order``: the flat pair order (``t * top_k + j`` into the
    router's ids) to put each expert's rows in (by default ``route_pairs``': tokens ascending)."""
    spec = spec_of(arch, config)
    router = block.router if arch == "gpt_oss" else block.gate
    weights, ids = select_experts(
        torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None)), spec.router
    )
    state = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}
    parts = read_experts(state, "model.layers.0.", experts, range(spec.intermediate_size), spec.interleaved)
    w13, w2 = gemm.prepare(parts["w13"]), gemm.prepare(parts["w2"])
    routing = route_pairs(weights, ids, experts, 8)
    if row_order is not None:
        routing = in_row_order(routing, ids, row_order(ids))
    sizes = (2 * spec.intermediate_size, config.hidden_size)
    act = activation_fn(spec, use_cpu_ops)
    return fused_experts(x, routing, gemm, w13, w2, sizes, act, parts.get("b13"), parts.get("b2"))


def in_row_order(routing: ExpertRouting, ids: torch.Tensor, order: torch.Tensor) -> ExpertRouting:
    """``routing`` with each expert's rows in ``order``: flat indices ``t * top_k + j`` into the router's
    ``ids`` ``[T, top_k]``, grouped by expert ascending (all experts on this rank)."""
    k = routing.top_k
    assert torch.equal(ids.reshape(-1)[order], ids.reshape(-1).sort().values)  # still grouped by expert
    place = ids.argsort(dim=1).argsort(dim=1).reshape(-1)  # each pair's place among its token's experts
    rows = routing.slot_rows.reshape(-1)[order // k * k + place[order]]
    slots = routing.pair_slots[rows]
    slot_rows = torch.empty_like(routing.slot_rows.reshape(-1))
    slot_rows[slots] = torch.arange(rows.numel())
    return dataclasses.replace(
        routing,
        pair_tokens=routing.pair_tokens[rows],
        pair_weights=routing.pair_weights[rows],
        pair_slots=slots,
        slot_rows=slot_rows.view_as(routing.slot_rows),
    )


def hf_row_order(implementation: str):
    """The order HF's experts take each expert's (token, position) pairs in, as flat indices into ``ids``."""

    def order(ids: torch.Tensor) -> torch.Tensor:
        if implementation == "grouped_mm":  # HF sorts the flat ids, unstably: its own call, the same order
            return torch.sort(ids.reshape(-1)).indices
        assert implementation == "eager"  # per expert: torch.where over the [top_k, T] mask, positions first
        k = ids.shape[1]
        return torch.cat([pos + k * tok for e in range(8) for pos, tok in [torch.where(ids.T == e)]])

    return order


@pytest.mark.bitwise
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("arch", list(ROUTERS))
def test_the_expert_loop_equals_hf_bit_for_bit(arch, implementation):
    """In HF's row order the same calls, so the same bits on any CPU and dispatch. In ours, within float32
    summation-order error: a GEMM's sums taken in another order differ by at most about K * 2^-24 of
    sum |x_k w_k| (K <= 128 here), so 1e-5 of the output's scale is allowed."""
    config, block = hf_block(arch, experts_implementation=implementation)
    assert config._experts_implementation == implementation
    x = torch.randn(37, config.hidden_size)
    with torch.no_grad():
        ref = block(x[None])
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0]
        in_hf_order = ours(arch, config, block, x, TorchExpertGemm(), row_order=hf_row_order(implementation))
        got = ours(arch, config, block, x, TorchExpertGemm())
    scale = ref.abs().max().item() + 1.0
    assert (got - ref).abs().max().item() <= 1e-5 * scale
    if arch == "gpt_oss":  # HF multiplies by the [H, 2I] weight as stored, then adds the bias: another GEMM
        assert (in_hf_order - ref).abs().max().item() <= 1e-5 * scale  # layout than F.linear's, same products
    else:
        assert torch.equal(in_hf_order, ref)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 5, 64, 200])
def test_the_cpu_kernel_equals_the_reference(arch, tokens):
    config, block = hf_block(arch, seed=tokens)
    x = torch.randn(tokens, config.hidden_size)
    with torch.no_grad():
        ref = ours(arch, config, block, x, TorchExpertGemm())
        got = ours(arch, config, block, x, CpuExpertGemm(), use_cpu_ops=True)
    scale = ref.abs().max().item() + 1.0
    assert (got - ref).abs().max().item() <= 1e-5 * scale


@needs_kernels
def test_grouped_gemm_is_decode_gemm_per_expert():
    torch.manual_seed(0)
    counts = [3, 0, 17, 1, 40, 0]
    weight, bias = torch.randn(len(counts), 70, 96), torch.randn(len(counts), 70)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    x = torch.randn(sum(counts), 96)
    packed = CpuExpertGemm().prepare(weight)
    out = cpu_ops.grouped_gemm(x, offsets, packed, 70, bias)
    per_expert = [
        cpu_ops.decode_gemm(x[offsets[e] : offsets[e + 1]].contiguous(), packed[e], 70, bias[e])
        for e in range(len(counts))
        if counts[e]
    ]
    assert torch.equal(out, torch.cat(per_expert))
    assert cpu_ops.grouped_gemm(x[:0], torch.zeros(7, dtype=torch.long), packed, 70, None).shape == (0, 70)


@needs_kernels
@pytest.mark.parametrize("isa", [None, "avx2", "scalar"])
def test_mxfp4_experts_stay_fp4_and_give_the_float32_gemm_bit_for_bit(isa):
    """Experts whose values are MXFP4's (gpt-oss's, dequantized) are packed as their FP4 codes and power-of-two
    scales (0.625 bytes a weight); every build's grouped GEMM, in registers (few rows) or from a dequantized tile
    (many), gives the float32 packing's bits. A weight one value off MXFP4's stays float32."""
    if isa is not None and not cpu_ops.decode_gemm_variant(isa):
        pytest.skip(f"no {isa} build here")
    g = torch.Generator().manual_seed(4)
    counts, n, k = [3, 0, 17, 1, 60, 0, 13], 70, 96
    codes = torch.randint(0, 16, (len(counts), n, k), generator=g)
    scales = torch.randint(-9, 3, (len(counts), n, k // 32, 1), generator=g).float().exp2()
    values = torch.tensor(exact_quant.E2M1_VALUES)[codes].view(len(counts), n, k // 32, 32)
    weight = (values * scales).view(len(counts), n, k)
    bias, x = torch.randn(len(counts), n, generator=g), torch.randn(sum(counts), k, generator=g)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    packed = CpuExpertGemm().prepare(weight)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.nbytes == len(counts) * 96 * k * 5 // 8  # 70 -> 96 columns
    off = weight.clone()
    off[2, 5, 7] = 0.7 * scales[2, 5, 0, 0]
    assert CpuExpertGemm().prepare(off).dtype == torch.float32
    f32 = torch.stack([cpu_ops.pack_decode_weight(w) for w in weight])
    op = torch.ops.cb_serve.grouped_gemm if isa is None else getattr(torch.ops.cb_serve, f"grouped_gemm_{isa}")
    outs = []
    for p in (packed, f32):
        out = x.new_empty(x.shape[0], n)
        op(out, x, offsets, p, bias)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_expert_parallel_shares_sum_to_the_whole():
    config, block = hf_block("qwen3_moe")
    x = torch.randn(29, config.hidden_size)
    with torch.no_grad():
        whole = ours("qwen3_moe", config, block, x, TorchExpertGemm())
        shares = [ours("qwen3_moe", config, block, x, TorchExpertGemm(), experts=r) for r in (range(0, 3), range(3, 8))]
    torch.testing.assert_close(shares[0] + shares[1], whole, rtol=1e-6, atol=1e-6)


@pytest.mark.bitwise
def test_gemma4_router_equals_hf():
    """Gemma 4's router: its own unscaled norm, input scale, softmax, top k renormalized, per-expert scales."""
    import transformers

    from cb_serve.model_executor.models.gemma4 import Gemma4Router

    torch.manual_seed(0)
    config = tiny_config("gemma4_moe", 256)
    hf = transformers.models.gemma4.modeling_gemma4.Gemma4TextRouter(config)
    with torch.no_grad():
        hf.scale.copy_(0.5 + torch.rand_like(hf.scale))
        hf.per_expert_scale.copy_(0.5 + torch.rand_like(hf.per_expert_scale))
    ours = Gemma4Router(config.hidden_size, config.num_experts, config.rms_norm_eps)
    ours.load_state_dict({"scale": hf.scale, "proj.weight": hf.proj.weight})
    spec = RouterSpec(8, 2, renormalize=True, float32_weights=True, per_expert_scale=True)
    x = torch.randn(37, config.hidden_size)
    with torch.no_grad():
        _, ref_weights, ref_ids = hf(x)
        weights, ids = select_experts(ours(x), spec)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights * hf.per_expert_scale[ids], ref_weights)


@pytest.mark.bitwise
@needs_kernels
def test_the_cpu_combine_is_the_reference_combine_bit_for_bit():
    """``cpu_ops.moe_combine`` (``CpuExpertGemm.combine``): the same products and sums, in the same order, with
    another rank's pairs (expert parallelism) skipped."""
    from cb_serve.model_executor.layers.fused_experts import combine

    torch.manual_seed(0)
    weights, ids = torch.rand(37, 4), torch.stack([torch.randperm(16)[:4] for _ in range(37)])
    for experts in (range(16), range(5, 12)):
        routing = route_pairs(weights, ids, experts, 16)
        y = torch.randn(routing.pair_tokens.numel(), 48)
        assert torch.equal(CpuExpertGemm().combine(y, routing, torch.float32), combine(y, routing, torch.float32))


def bf16_experts(counts: list[int], n: int, k: int, seed: int = 0):
    """Weights exact in bf16 (a bf16 checkpoint's, in float32), biases, offsets and rows for ``counts``."""
    torch.manual_seed(seed)
    weight, bias = torch.randn(len(counts), n, k).bfloat16().float(), torch.randn(len(counts), n)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    return weight, bias, offsets, torch.randn(sum(counts), k)


@needs_kernels
@pytest.mark.parametrize("isa", [None, "avx2", "scalar"])
def test_bf16_experts_are_the_float32_gemm_bit_for_bit(isa):
    """Weights exact in bf16 are packed as bf16 (half the bytes) and widened exactly: every build's
    grouped GEMM gives the float32 packing's bits; other weights stay float32."""
    if isa is not None and not cpu_ops.decode_gemm_variant(isa):
        pytest.skip(f"no {isa} build here")
    weight, bias, offsets, x = bf16_experts([3, 0, 17, 1, 40, 0, 13], 70, 96)
    packed = CpuExpertGemm().prepare(weight)
    assert packed.dtype == torch.bfloat16 and CpuExpertGemm().prepare(weight + 1e-3).dtype == torch.float32
    f32 = torch.stack([cpu_ops.pack_decode_weight(w) for w in weight])
    op = torch.ops.cb_serve.grouped_gemm if isa is None else getattr(torch.ops.cb_serve, f"grouped_gemm_{isa}")
    outs = []
    for p in (packed, f32):
        out = x.new_empty(x.shape[0], 70)
        op(out, x, offsets, p, bias)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1], cpu_ops.grouped_gemm(x, offsets, f32, 70, bias))


@pytest.mark.skipif(not cpu_ops.amx_available(), reason="no AMX here")
def test_amx_experts_are_float32_accurate():
    """The AMX kernel's products are exact (bf16 weights, x in three bf16 pieces) and its sums float32: its
    error against float64 is within twice MKL's float32 GEMM's on the same numbers. With a row threshold,
    experts with at least that many rows run on it and the rest on the FMA tiles, bit for bit theirs."""
    counts = [3, 0, 17, 1, 40, 0, 100, 16, 15, 32]
    weight, bias, offsets, x = bf16_experts(counts, 70, 256, seed=1)
    packed = CpuExpertGemm().prepare(weight)
    spans = [slice(int(offsets[e]), int(offsets[e + 1])) for e in range(len(counts))]
    exact = torch.cat([x[s].double() @ weight[e].double().T + bias[e].double() for e, s in enumerate(spans)])
    mkl = torch.cat([x[s] @ weight[e].T + bias[e] for e, s in enumerate(spans)])
    amx = cpu_ops.amx_grouped_gemm(x, offsets, packed, 70, bias)
    assert (amx.double() - exact).abs().max() <= 2 * (mkl.double() - exact).abs().max()
    fma = cpu_ops.grouped_gemm(x, offsets, packed, 70, bias)
    mixed = cpu_ops.grouped_gemm(x, offsets, packed, 70, bias, amx_min_rows=16)
    for count, s in zip(counts, spans):
        assert torch.equal(mixed[s], (amx if count >= 16 else fma)[s])


@needs_kernels
def test_the_reused_buffers_serve_inside_and_outside_inference_mode():
    """The CPU backend's per-thread intermediates: a buffer made under ``inference_mode`` is an inference
    tensor, which a forward under ``no_grad`` alone may not write into."""
    config, block = hf_block("qwen3_moe", seed=3)
    x = torch.randn(7, config.hidden_size)
    with torch.inference_mode():
        first = ours("qwen3_moe", config, block, x, CpuExpertGemm(), use_cpu_ops=True)
    with torch.no_grad():
        assert torch.equal(ours("qwen3_moe", config, block, x, CpuExpertGemm(), use_cpu_ops=True), first)
