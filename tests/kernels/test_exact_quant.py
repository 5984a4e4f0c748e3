"""Low-bit packing of float32 weights that are exactly dequantized GGUF Q4_1 / Q4_0 / Q4_K (4-bit) or Q8_0 /
Q5_0 / Q6_K (8-bit): recognized from the float32 values alone, the decode GEMM on the low-bit copy is bit for
bit the float32 one, and the AMX GEMM on the same low bits (q exact in bf16, x in three exact bf16 pieces) is
as accurate as a float32 GEMM."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant, group_recovery
from cb_serve.cpu_ops.kernel_choice import kernel_choice
from cb_serve.distributed.group import TensorParallelGroup
from cb_serve.model_executor.layers.embedding import VocabParallelEmbedding
from cb_serve.model_executor.layers.linear import DECODE_MAX_ROWS, Linear
from cb_serve.model_executor.layers.low_bit_linear import EXACT_LOW_BIT
from cb_serve.model_executor.weight_bytes import weight_bytes_by_format

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernels did not build")
needs_amx = pytest.mark.skipif(not cpu_ops.amx_available(), reason="no AMX-BF16 here (or its kernel did not build)")


def uses_split_kernel() -> bool:
    choice = kernel_choice()
    return choice is not None and choice.split != "mkl"


Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
Q5_0, Q4_K, Q6_K = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
FOUR_BIT = (Q4_1, Q4_0, Q4_K)
FORMATS = (Q4_1, Q4_0, Q4_K, Q8_0, Q5_0, Q6_K)
SPLIT_FORMATS = (Q4_1, Q4_0, Q4_K, Q8_0, Q5_0)  # amx_gemm / bf16_gemm take scales per 32 inputs only
GROUP_BYTES = {4: 768, 8: 1152, 6: 1280}  # decode_gemm's bytes per 32 x 32 weights: 4-bit, 8-bit, Q6_K's


def k_quant_blocks(blocks: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K super-blocks (gguf-py dequantizes but does not quantize these): float16 scales of a
    trained weight's size, random 6-bit sub-block scales / mins (Q4_K) or int8 scales (Q6_K) and quants."""
    scales = (rng.uniform(0.5, 1.0, (blocks, 2)) * 10.0 ** rng.uniform(-4, -2, (blocks, 1))).astype(np.float16)
    if qtype == Q4_K:  # d, dmin, 12 bytes of scales and mins, 128 bytes of quants
        return np.concatenate([scales.view(np.uint8), rng.integers(0, 256, (blocks, 140), dtype=np.uint8)], 1)
    # Q6_K: 128 + 64 bytes of quants, 16 int8 scales, d
    return np.concatenate([rng.integers(0, 256, (blocks, 208), dtype=np.uint8), scales[:, :1].view(np.uint8)], 1)


def gguf_weight(n: int, k: int, qtype: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """A random weight quantized and dequantized by gguf-py, as transformers loads a GGUF file."""
    rng = np.random.default_rng(seed)
    if qtype in (Q4_K, Q6_K):
        blocks = k_quant_blocks(n * k // 256, qtype, rng)
    else:
        blocks = quants.quantize(rng.normal(0, 0.05, (n, k)).astype(np.float32), qtype)
    return torch.from_numpy(quants.dequantize(blocks, qtype).reshape(n, k).astype(np.float32))


def shape_for(shape: tuple[int, int], qtype: GGMLQuantizationType) -> tuple[int, int]:
    """K-quants come in super-blocks of 256 inputs: K rounded up to one."""
    n, k = shape
    return (n, -(-k // 256) * 256) if qtype in (Q4_K, Q6_K) else shape


@pytest.mark.bitwise
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("shape", [(17, 64), (200, 96), (960, 576), (64, 1536)])  # (out, in)
def test_gguf_weights_are_recognized_exactly(shape, qtype):
    weight = gguf_weight(*shape_for(shape, qtype), qtype)
    groups = exact_quant.find_quant_groups(weight)
    assert groups is not None
    if qtype in FOUR_BIT:
        assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15 and groups.m is not None
    else:
        top = {Q8_0: 127, Q5_0: 16, Q6_K: 32}[qtype]
        assert groups.q.dtype == torch.int8 and int(groups.q.abs().max()) <= top and groups.m is None
    assert groups.group_size == (16 if qtype == Q6_K else 32)
    assert torch.equal(groups.dequantize(), weight)
    if qtype in (Q4_K, Q6_K):  # float16 times a 6- or 8-bit sub-block scale
        assert group_recovery.significant_bits_at_most(groups.d, 20 if qtype == Q4_K else 18).all()
    else:
        assert torch.equal(groups.d, groups.d.half().float())  # float16 scales: d * q is exact


@pytest.mark.bitwise
def test_a_projection_fused_from_parts_in_different_formats_is_recognized():
    """Gemma 3's qkv_proj: Q5_0 q and k, a Q8_0 v (8 bits per group, whichever format each group came from)."""
    weight = torch.cat([gguf_weight(128, 640, Q5_0), gguf_weight(32, 640, Q5_0, 1), gguf_weight(32, 640, Q8_0)])
    groups = exact_quant.find_quant_groups(weight)
    assert groups is not None and groups.q.dtype == torch.int8 and torch.equal(groups.dequantize(), weight)


@pytest.mark.bitwise
@pytest.mark.parametrize("qtype", FORMATS)
def test_row_permutations_and_constant_groups_are_still_recognized(qtype):
    weight = gguf_weight(*shape_for((96, 64), qtype), qtype)
    weight[5, 32:] = 0.0  # a constant group
    permuted = weight.view(3, 16, 2, -1).transpose(1, 2).reshape(96, -1)  # like the Llama Q/K permutation
    for w in (weight, permuted):
        groups = exact_quant.find_quant_groups(w)
        assert groups is not None and torch.equal(groups.dequantize(), w)


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(64, 64),  # plain float32
        gguf_weight(64, 64, GGMLQuantizationType.Q5_1),  # 5-bit with an offset: neither format
        gguf_weight(64, 64, Q4_1)[:, :40],  # K % 32 != 0
        gguf_weight(64, 64, Q4_1).double(),
    ],
    ids=["float32", "q5_1", "k-not-multiple-of-32", "float64"],
)
def test_other_weights_are_left_alone(weight):
    assert exact_quant.find_quant_groups(weight) is None


@pytest.mark.parametrize("qtype", FORMATS)
def test_one_off_value_rejects_the_whole_weight(qtype):
    weight = gguf_weight(*shape_for((128, 64), qtype), qtype)
    weight[100, 7] = torch.nextafter(weight[100, 7], torch.tensor(1.0))
    assert exact_quant.find_quant_groups(weight) is None


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("shape", [(17, 64), (200, 96), (960, 576), (576, 1536)])
def test_decode_gemm_on_low_bits_is_bit_identical_to_float32(shape, qtype):
    n, k = shape_for(shape, qtype)
    weight = gguf_weight(n, k, qtype, seed=n)
    packed = exact_quant.pack_decode_weight_quantized(exact_quant.find_quant_groups(weight))
    dtype = torch.uint8 if qtype in FOUR_BIT else torch.int8  # 0.75 / 1.125 / 1.25 bytes a weight
    group_bytes = GROUP_BYTES[4 if qtype in FOUR_BIT else 6 if qtype == Q6_K else 8]
    assert packed.dtype == dtype and packed.shape == (-(-n // 32), k // 32, group_bytes)
    reference = cpu_ops.pack_decode_weight(weight)
    bias = torch.randn(n)
    for rows in (1, 5, 12, 13, 34, 64):
        x = torch.randn(rows, k)
        for b in (None, bias):
            assert torch.equal(cpu_ops.decode_gemm(x, packed, n, b), cpu_ops.decode_gemm(x, reference, n, b))


@needs_kernels
def test_linear_keeps_only_4_bits_for_a_q4_weight_and_float32_otherwise():
    q4_layer, fp32_layer = Linear(576, 200, bias=True), Linear(576, 200, bias=True)
    with torch.no_grad():
        q4_layer.weight.copy_(gguf_weight(200, 576, Q4_1))
        fp32_layer.weight.copy_(q4_layer.weight)
        fp32_layer.bias.copy_(q4_layer.bias)
    weight, bias = q4_layer.weight.detach().clone(), q4_layer.bias.detach().clone()
    q4_layer.prepare_for_cpu(pack=True)
    assert q4_layer.decode_weight.dtype == torch.uint8 and q4_layer.method is EXACT_LOW_BIT
    assert q4_layer.weight.numel() == 0  # the float32 copy dropped
    assert (q4_layer.split_weight is not None) == uses_split_kernel()
    assert q4_layer.bytes_read(1) == q4_layer.decode_weight.nbytes + bias.nbytes
    fp32_layer.decode_weight = cpu_ops.pack_decode_weight(fp32_layer.weight)
    with torch.inference_mode():
        for rows in (1, 34, 300, 600):  # from 13 rows on AMX where there is one; else decode_gemm, 256 at a time
            x = torch.randn(rows, 576)
            torch.testing.assert_close(q4_layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
            if rows < q4_layer.split_min_rows or not uses_split_kernel():
                reference = cpu_ops.decode_gemm(x, cpu_ops.pack_decode_weight(weight), 200, bias)
                assert torch.equal(q4_layer(x), reference)  # each row one FMA chain, whatever the batch
        assert q4_layer(torch.randn(2, 3, 576)).shape == (2, 3, 200)
        assert q4_layer(torch.randn(0, 576)).shape == (0, 200)

    plain = Linear(64, 32)
    plain.prepare_for_cpu(pack=True)
    assert plain.decode_weight.dtype == torch.float32 and plain.split_weight is None and plain.weight.numel()


@pytest.mark.bitwise
@needs_kernels
def test_linear_runs_a_q6_k_weight_from_8_bits_at_every_size():
    """Scales per 16 inputs: decode_gemm only (no split kernel), bit for bit the float32 FMA chains."""
    layer = Linear(512, 96, bias=False)
    with torch.no_grad():
        layer.weight.copy_(gguf_weight(96, 512, Q6_K))
    weight = layer.weight.detach().clone()
    layer.prepare_for_cpu(pack=True)
    assert layer.decode_weight.dtype == torch.int8 and layer.decode_weight.shape[-1] == GROUP_BYTES[6]
    assert layer.split_weight is None
    reference = cpu_ops.pack_decode_weight(weight)
    with torch.inference_mode():
        for rows in (1, 17, DECODE_MAX_ROWS, 300):
            x = torch.randn(rows, 512)
            assert torch.equal(layer(x), cpu_ops.decode_gemm(x, reference, 96, None))


@pytest.mark.bitwise
@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS)
def test_embedding_rows_come_from_the_low_bit_packing(qtype):
    """``decode_weight_rows`` gives back the float32 rows bit for bit (every column position of a tile, a
    partial last tile), and a tied embedding looks its rows up there once the head dropped its weight."""
    n, k = shape_for((70, 64), qtype)
    weight = gguf_weight(n, k, qtype, seed=7)
    packed = exact_quant.pack_decode_weight_quantized(exact_quant.find_quant_groups(weight))
    rows = torch.tensor([0, 1, 15, 16, 17, 31, 32, 63, 69, 5, 5])
    assert torch.equal(exact_quant.decode_weight_rows(packed, rows), weight[rows])

    shard = types.SimpleNamespace(vocab=range(n))  # one rank's whole vocabulary
    embedding = VocabParallelEmbedding(shard, k, TensorParallelGroup.single())
    head = Linear(k, n, bias=False)
    head.weight = embedding.weight
    with torch.no_grad():
        embedding.weight.copy_(weight)
    head.prepare_for_cpu(pack=True, transpose=False)
    embedding.read_rows_from(head.decode_weight)
    assert embedding.weight.numel() == 0 and head.weight.numel() == 0
    ids = torch.tensor([[3, 69], [0, 31]])
    assert torch.equal(embedding(ids), weight[ids])
    assert embedding.bytes_read(4) == 4 * packed.nbytes // n


@needs_kernels
def test_the_default_model_decodes_from_4_bit_weights(smol_llm):
    """SmolLM2's GGUF is Q4_1 in every projection and Q8_0 in the tied embedding / LM head."""
    model = smol_llm.engine.runner.model
    projections = [
        linear
        for layer in model.layers
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    assert len(projections) == 120
    assert all(linear.decode_weight.dtype == torch.uint8 for linear in projections)
    assert model.lm_head.decode_weight.dtype == torch.int8
    assert all((linear.split_weight is not None) == uses_split_kernel() for linear in [*projections, model.lm_head])
    # Kept low-bit only: no float32 copy of any projection or of the tied embedding / LM head.
    weights = smol_llm.engine.get_stats().weight_bytes
    assert weights == weight_bytes_by_format(model)
    assert weights["q4_groups"] > weights["q8_groups"] / 2 > 0 and weights["float32"] < weights["q4_groups"] / 100
    assert model.embed_tokens.weight.numel() == 0


@needs_amx
@pytest.mark.parametrize("qtype", SPLIT_FORMATS)
@pytest.mark.parametrize("shape", [(17, 64), (200, 96), (960, 576), (576, 1536)])
def test_amx_gemm_is_as_accurate_as_a_float32_gemm(shape, qtype):
    """q on the tiles is exact, x is three exact bf16 pieces, d and m apply per group in float32: the RMS error
    against float64 is a float32 GEMM's, within 1.25x of MKL's on the same inputs (measured: 8-bit 0.25-0.37x,
    4-bit 0.6-0.7x at K >= 576 and ~1x at K = 64-96), at row and column counts that leave partial
    16-row / 32-column blocks, in decode-sized and chunked (> 256-row) batches. Losing the smallest x piece
    would make it ~100x."""
    n, k = shape_for(shape, qtype)
    weight = gguf_weight(n, k, qtype, seed=n)
    packed = exact_quant.pack_amx_weight(exact_quant.find_quant_groups(weight))
    dtype, group_bytes = (torch.uint8, 384) if qtype in FOUR_BIT else (torch.int8, 576)
    assert packed.dtype == dtype and packed.shape == (-(-n // 32) * 2, k // 32, group_bytes)
    sizes = [1, 13, 31, 65, 300]
    x = torch.randn(sum(sizes), k)
    out = torch.cat([cpu_ops.amx_gemm(rows, packed, n, None) for rows in x.split(sizes)])
    reference = x.double() @ weight.double().T
    rms = [(y.double() - reference).pow(2).mean().sqrt().item() for y in (out, x @ weight.T)]
    assert rms[0] <= 1.25 * rms[1], rms
    bias = torch.randn(n)
    torch.testing.assert_close(cpu_ops.amx_gemm(x, packed, n, bias), out + bias)


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_gemm_is_exact_where_float32_arithmetic_is(bits):
    """Small integers against weights on a 2^-6 grid: every product and sum is exact in float32, so the
    result must be the float64 one bit for bit (a misplaced weight, scale or group minimum cannot hide in a
    tolerance)."""
    n, k = 96, 1536
    g = torch.Generator().manual_seed(bits)
    d = 2.0 ** torch.randint(-6, -2, (n, k // 32), generator=g).float()
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
        groups = exact_quant.QuantGroups(q, d, -torch.randint(0, 9, d.shape, generator=g) * d)
    else:
        groups = exact_quant.QuantGroups(torch.randint(-8, 8, (n, k), generator=g).to(torch.int8), d, None)
    x = torch.randint(-16, 16, (70, k), generator=g).float()
    out = cpu_ops.amx_gemm(x, exact_quant.pack_amx_weight(groups), n, None)
    assert torch.equal(out.double(), x.double() @ groups.dequantize().double().T)


@needs_amx
def test_amx_gemm_keeps_every_bit_of_x():
    """A permutation weight gives back x's columns bit for bit: its three bf16 pieces hold all of float32."""
    n = k = 64
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[torch.arange(n), perm] = 1
    groups = exact_quant.QuantGroups(q, torch.ones(n, k // 32), torch.zeros(n, k // 32))
    x = torch.randn(40, k) * torch.logspace(-20, 20, k)
    assert torch.equal(cpu_ops.amx_gemm(x, exact_quant.pack_amx_weight(groups), n, None), x[:, perm])


def test_amx_packing_declines_a_k_over_the_kernels_limit_and_scales_per_16():
    wide = exact_quant.QuantGroups(torch.zeros(32, 16416, dtype=torch.uint8), torch.ones(32, 513), torch.zeros(32, 513))
    assert exact_quant.pack_amx_weight(wide) is None
    assert exact_quant.pack_amx_weight(exact_quant.find_quant_groups(gguf_weight(32, 256, Q6_K))) is None


def test_recovered_groups_and_dequantized_gguf_weights_are_cached_on_disk(tmp_path, monkeypatch):
    """``weight_cache``: within ``cached_quant_groups`` the groups of a weight are found once, then read back
    equal (keyed by its bytes: another weight misses), a weight of no format too; a damaged entry is recomputed.
    A GGUF file's dequantized state dict is made once per file and dtype, then read back lazily, equal, tied
    tensors once."""
    from cb_serve.model_executor import gguf_cache, weight_cache
    from cb_serve.model_executor.layers.checkpoint import materialize

    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path))
    weight = gguf_weight(64, 256, GGMLQuantizationType.Q4_K)
    assert weight_cache.find_quant_groups(weight) is not None and not (tmp_path / "quant-groups").exists()
    with weight_cache.cached_quant_groups():  # (the loader's, for GGUF models)
        found = weight_cache.find_quant_groups(weight)
        entries = list((tmp_path / "quant-groups").iterdir())
        assert len(entries) == 1
        again = weight_cache.find_quant_groups(weight.clone())
        assert torch.equal(again.q, found.q) and torch.equal(again.d, found.d) and torch.equal(again.m, found.m)
        other = gguf_weight(64, 256, GGMLQuantizationType.Q8_0, seed=1)
        assert torch.equal(weight_cache.find_quant_groups(other).dequantize(), other)
        plain = torch.randn(64, 256)
        assert weight_cache.find_quant_groups(plain) is None and weight_cache.find_quant_groups(plain) is None
        assert len(list((tmp_path / "quant-groups").iterdir())) == 3  # a weight of no format: found once too
        entries[0].write_bytes(b"damaged")
        assert torch.equal(weight_cache.find_quant_groups(weight).dequantize(), weight)

    calls = []
    embed = torch.randn(10, 4)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.ones(4)}

    def load():
        calls.append(1)
        return state

    stamp = ("/models/x.gguf", 123, 456)
    first = weight_cache.gguf_state_dict(stamp, torch.float32, load)
    cached = weight_cache.gguf_state_dict(stamp, torch.float32, load)
    assert first is state and len(calls) == 1 and sorted(cached) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert all(torch.equal(materialize(cached[name]), state[name]) for name in cached)
    weight_cache.gguf_state_dict(stamp, torch.bfloat16, load)
    assert len(calls) == 2  # another dtype, another entry


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_int4_checkpoint_groups_are_the_float32_dequantization(scale_dtype):
    """GPTQ / AWQ / compressed-tensors INT4 (``int4_groups``): ``fma(scale, q, -zero * scale)`` is
    ``(q - zero) * scale`` in float32 for half-precision scales; a float32 scale (more than 20 significant bits)
    is declined. Groups of a fused projection's parts stack (``QuantGroups.cat``), a Linear keeps them only while
    they still give its weight bit for bit (``checkpoint_groups``)."""
    from cb_serve.model_executor.layers.checkpoint import copy_parts
    from cb_serve.model_executor.layers.linear import checkpoint_groups

    g = torch.Generator().manual_seed(0)
    q, zero = torch.randint(0, 16, (64, 96), generator=g), torch.randint(0, 16, (64, 3), generator=g)
    scale = (torch.rand(64, 3, generator=g) * torch.logspace(-6, 1, 3)).to(scale_dtype)
    groups = exact_quant.int4_groups(q, zero, scale)
    expected = (q.view(64, 3, 32) - zero[..., None]).float() * scale.float()[..., None]
    assert groups is not None and torch.equal(groups.dequantize(), expected.view(64, 96))
    assert exact_quant.int4_groups(q, zero, torch.rand(64, 3, generator=g)) is None  # float32: d * q inexact
    q8 = torch.randint(-127, 128, (64, 96), generator=g)  # 8 bits (symmetric GPTQ's q - 128): int8_groups
    groups8 = exact_quant.int8_groups(q8, scale)
    assert torch.equal(groups8.dequantize(), (q8.view(64, 3, 32).float() * scale.float()[..., None]).view(64, 96))
    assert exact_quant.int8_groups(q8 + 1, scale) is None and exact_quant.int8_groups(q8, scale.float() / 3) is None
    if cpu_ops.available():
        packed, x = exact_quant.pack_decode_weight_quantized(groups), torch.randn(5, 96, generator=g)
        reference = cpu_ops.decode_gemm(x, cpu_ops.pack_decode_weight(groups.dequantize()), 64, None)
        assert torch.equal(cpu_ops.decode_gemm(x, packed, 64, None), reference)

    parts = [groups.dequantize()[:40], groups.dequantize()[40:]]  # as a fused projection's parts load
    for part, rows in zip(parts, (slice(0, 40), slice(40, 64))):
        part.quant_groups = exact_quant.QuantGroups(groups.q[rows], groups.d[rows], groups.m[rows])
    target = torch.nn.Parameter(torch.empty(64, 96), requires_grad=False)
    copy_parts(target, *parts)
    assert torch.equal(target.quant_groups.q, groups.q)
    assert checkpoint_groups(target) is not None and not hasattr(target, "quant_groups")  # handed over once
    copy_parts(target, *parts)
    target.data[3, 5] += 1  # a model changed the weight after loading: the groups no longer hold
    assert checkpoint_groups(target) is None
