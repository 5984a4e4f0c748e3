"""Every instruction-set path of the low-bit GEMMs gives the same bits as its reference, on the GEMM shapes
of the test models (Llama, Qwen2 and Mistral test configs, SmolLM2):

- ``decode_gemm`` built for AVX-512 (where the CPU has it), for AVX2/FMA only and for scalar code only (both
  built on any x86-64 CPU, so CI covers the path a CPU without AVX-512 runs): each output one FMA chain over
  k in order, equal to ``F.linear``'s reference chain and to each other bit for bit, from 4-bit groups,
  8-bit groups and 8-bit groups with a scale per 16 inputs (Q6_K);
- ``bf16_gemm`` (AVX512-BF16, where present): bit for bit ``exact_quant.split_gemm_reference``, and as
  accurate as a float32 GEMM;
- ``amx_gemm`` (AMX, where present): its tiles round inside a dot product as the hardware does (no
  sequential float32 order reproduces it), so it is held to float32 accuracy (``test_exact_quant.py``) and
  to exactness where every partial sum is an integer.
"""

from __future__ import annotations

import pytest
import torch

from cb_serve import cpu_ops
from cb_serve.cpu_ops import exact_quant
from cb_serve.cpu_ops.kernel_choice import decide

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ kernels did not build")
needs_bf16 = pytest.mark.skipif(
    not cpu_ops.bf16_available(), reason="no AVX512-BF16 here (or its kernel did not build)"
)
needs_amx = pytest.mark.skipif(not cpu_ops.amx_available(), reason="no AMX-BF16 here (or its kernel did not build)")

# (out, in) of the projections: tests' random Llama / Qwen2 / Mistral configs and SmolLM2-135M
SHAPES = [(128, 64), (64, 64), (256, 64), (64, 128), (960, 576), (576, 576), (3072, 576), (576, 1536)]
ROWS = [1, 5, 8, 13, 24, 25, 64]  # AVX2 blocks: 6 x 16 columns, 2 x 32, 1 x 32; AVX-512: in registers up to 24


KINDS = [4, 8, 6, "fp8", "fp4"]  # random_groups' kinds


def random_groups(n: int, k: int, bits: int | str, seed: int) -> exact_quant.QuantGroups:
    """``bits`` 4 or 8: scales per 32 inputs; 6: Q6_K's int8 -32..31 with a scale per 16 inputs; ``fp8``: every
    finite e4m3 code (subnormals and +-448 included) with float32 scales of full precision; ``fp4``: MXFP4's e2m1
    codes (-0 included) with powers of two."""
    g = torch.Generator().manual_seed(seed)
    if bits == "fp4":
        codes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
        return exact_quant.QuantGroups(codes, torch.randint(-12, 4, (n, k // 32), generator=g).float().exp2(), None)
    if bits == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8).view(torch.float8_e4m3fn)
        return exact_quant.QuantGroups(codes, torch.rand(n, k // 32, generator=g) * 1e-2 + 1e-4, None)
    d = (torch.rand(n, k // (16 if bits == 6 else 32), generator=g) * 0.02 + 1e-3).half().float()
    if bits == 6:
        return exact_quant.QuantGroups(torch.randint(-32, 32, (n, k), generator=g).to(torch.int8), d, None)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
        return exact_quant.QuantGroups(q, d, (-torch.rand(n, k // 32, generator=g) * 0.2).half().float())
    return exact_quant.QuantGroups(torch.randint(-127, 128, (n, k), generator=g).to(torch.int8), d, None)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]


def fma_chain_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``acc = fma(x[k], w[k], acc)`` over k in order, correctly rounded: the exact sum (float64 holds the
    product and, with the error term of the addition, the whole) rounded to float32 once per step."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k in range(x.shape[1]):
        product = x[:, k, None].double() * w[None, :, k].double()  # exact: 24 + 24 bits
        total = acc + product
        error = (acc - (total - (total - acc))) + (product - (total - acc))  # TwoSum: total + error is exact
        rounded = total.float()
        # total is one rounding away from the exact sum; redo the float32 rounding where it was a tie
        tie = (total - rounded.double()).abs() * 2 == (torch.nextafter(rounded, rounded * 2) - rounded).double().abs()
        nudged = torch.where(error > 0, torch.nextafter(total, total + 1), torch.nextafter(total, total - 1))
        acc = torch.where(tie & (error != 0), nudged.float(), rounded).double()
    out = acc.float()
    return out + (0.0 if bias is None else bias)


@needs_kernels
@pytest.mark.parametrize("bits", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_gemm_builds_agree_bit_for_bit(shape, bits):
    n, k = shape
    groups = random_groups(n, k, bits, seed=n + k)
    packed = exact_quant.pack_decode_weight_quantized(groups)
    isas = [None] + [isa for isa in ("avx2", "scalar") if cpu_ops.decode_gemm_variant(isa)]
    if len(isas) == 1:
        pytest.skip("no x86-64 ISA variants on this machine")
    bias = torch.randn(n)
    for rows in ROWS:
        x = activations(rows, k, seed=rows)
        outs = [cpu_ops.decode_gemm(x, packed, n, bias, isa) for isa in isas]
        assert all(torch.equal(outs[0], out) for out in outs[1:]), rows


@pytest.mark.bitwise
@needs_kernels
@pytest.mark.parametrize("bits", KINDS)
def test_decode_gemm_is_the_fma_chain_reference(bits):
    """(FP8: in registers for 9 rows, from a dequantized tile for 45; the scalar build too, whose e4m3 decoding
    is its own; and the packing's rows read back as the dequantized weight's.)"""
    n, k = 96, 160  # the AVX2 build walks k in chunks of 64: two and a partial one
    groups = random_groups(n, k, bits, seed=len(str(bits)))
    packed, bias = exact_quant.pack_decode_weight_quantized(groups), torch.randn(n)
    weight = groups.dequantize()
    for x in (activations(9, k, seed=len(str(bits))), activations(45, k, seed=3)):
        reference = fma_chain_reference(x, weight, bias)
        for isa in [None] + [isa for isa in ("avx2", "scalar") if cpu_ops.decode_gemm_variant(isa)]:
            assert torch.equal(cpu_ops.decode_gemm(x, packed, n, bias, isa), reference), isa
    rows = torch.tensor([0, 31, 32, 95])
    assert torch.equal(exact_quant.decode_weight_rows(packed, rows), weight[rows])


@pytest.mark.bitwise
@needs_kernels
def test_decode_gemm_on_float32_tiles_is_the_fma_chain_reference():
    """Unquantized tiles, k not a multiple of the chunk, a partial last tile, rows in every block size."""
    n, k = 70, 100
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = cpu_ops.pack_decode_weight(weight)
    for rows in (1, 2, 9, 14):
        x = activations(rows, k, seed=rows)
        reference = fma_chain_reference(x, weight, bias)
        for isa in [None] + [isa for isa in ("avx2", "scalar") if cpu_ops.decode_gemm_variant(isa)]:
            assert torch.equal(cpu_ops.decode_gemm(x, packed, n, bias, isa), reference), (rows, isa)


@needs_kernels
def test_the_native_decode_gemm_names_its_instruction_set():
    assert cpu_ops.decode_gemm_isa() in ("avx512", "avx2", "scalar")


@pytest.mark.bitwise
@needs_bf16
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_gemm_is_its_reference_bit_for_bit(shape, bits):
    n, k = shape
    groups = random_groups(n, k, bits, seed=n * k)
    packed, bias = exact_quant.pack_amx_weight(groups), torch.randn(n)
    for rows in [*ROWS, 300]:
        x = activations(rows, k, seed=rows + bits)
        out = cpu_ops.bf16_gemm(x, packed, n, bias)
        assert torch.equal(out, exact_quant.split_gemm_reference(x, groups, bias)), rows
        if rows == 300:  # as accurate as a float32 GEMM (measured: 0.5-0.9x MKL's RMS error)
            exact = x.double() @ groups.dequantize().double().T + bias.double()
            rms = [(y.double() - exact).pow(2).mean().sqrt() for y in (out, x @ groups.dequantize().T + bias)]
            assert rms[0] <= 1.25 * rms[1]


@needs_bf16
def test_bf16_gemm_propagates_non_finite_activations():
    groups = random_groups(64, 64, 4, seed=0)
    x = torch.randn(3, 64)
    x[1, 40] = float("inf")
    out = cpu_ops.bf16_gemm(x, exact_quant.pack_amx_weight(groups), 64, None)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_and_bf16_agree_where_every_partial_sum_is_an_integer(bits):
    if not cpu_ops.bf16_available():
        pytest.skip("no AVX512-BF16 kernel")
    groups = random_groups(96, 576, bits, seed=1)
    groups = exact_quant.QuantGroups(
        groups.q, torch.ones_like(groups.d), None if bits == 8 else -torch.ones_like(groups.d)
    )
    x = torch.randint(-255, 256, (40, 576), generator=torch.Generator().manual_seed(2)).float()
    packed = exact_quant.pack_amx_weight(groups)
    assert torch.equal(cpu_ops.amx_gemm(x, packed, 96, None), cpu_ops.bf16_gemm(x, packed, 96, None))


@pytest.mark.parametrize(
    ("forced", "amx", "bf16", "faster", "expected"),
    [
        (None, True, True, None, "amx"),
        (None, False, True, True, "avx512_bf16"),
        (None, False, True, False, "mkl"),
        (None, False, False, None, "mkl"),
        ("avx512_bf16", True, True, None, "avx512_bf16"),
        ("mkl", True, True, None, "mkl"),
        ("amx", False, True, False, "mkl"),  # not usable here: chosen as usual
    ],
)
def test_kernel_choice(forced, amx, bf16, faster, expected):
    assert decide(forced, amx, bf16, faster)[0] == expected


def test_an_unknown_forced_kernel_is_refused():
    with pytest.raises(ValueError, match="CB_SERVE_GEMM"):
        decide("avx9", False, False, None)


ZEN3_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})  # an AMD EPYC without AVX-512
SPR_FLAGS = ZEN3_FLAGS | {"avx512f", "avx512dq", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    ("name", "flags", "loadable"),
    [
        (cpu_ops.AMX_EXTENSION[0], SPR_FLAGS, True),
        (cpu_ops.AMX_EXTENSION[0], SPR_FLAGS - {"amx_tile"}, False),
        (cpu_ops.BF16_EXTENSION[0], SPR_FLAGS - {"amx_tile", "amx_bf16"}, True),
        (cpu_ops.BF16_EXTENSION[0], ZEN3_FLAGS, False),
        (cpu_ops.variant_extension("avx2"), ZEN3_FLAGS, True),
        (cpu_ops.variant_extension("avx2"), frozenset({"avx"}), False),
        (cpu_ops.variant_extension("scalar"), frozenset(), True),
    ],
)
def test_an_optional_build_is_never_loaded_on_a_cpu_without_its_instructions(name, flags, loadable):
    """Loading a library built for instructions the CPU lacks kills the process (SIGILL) in its
    initializers, before any check inside it could run."""
    assert (not cpu_ops.missing_flags(name, flags)) is loadable


def test_a_finished_build_loads_without_ninja(monkeypatch):
    """A build directory is keyed by its content: once finished, any checkout or virtual environment loads its
    library as it is. (Through torch's ``load``, ninja would rebuild it for each new environment, whose build line
    names torch's headers by that environment's path: every fresh clone's CI run once rebuilt every kernel.)"""
    import torch.utils.cpp_extension

    if not cpu_ops.available():
        pytest.skip("no C++ kernels here")
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: pytest.fail(f"ninja ran: {kwargs}"))
    for name, (source, flags) in cpu_ops.EXTENSIONS.items():
        cpu_ops.build(name, source, flags)


def test_a_build_is_kept_per_cpu(monkeypatch, tmp_path):
    """The builds are ``-march=native``: a build cache that outlives a change of CPU (a home directory moved to
    a Zen 3 from an AVX-512 machine) keeps one build per CPU, never loading another CPU's (SIGILL)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, source = cpu_ops.variant_extension("scalar"), "decode_gemm.cpp"
    dirs = {}
    for cpu, flags in [("AMD EPYC 7B13", ZEN3_FLAGS), ("Intel Xeon", SPR_FLAGS), ("Intel Xeon", SPR_FLAGS)]:
        monkeypatch.setattr(cpu_ops, "cpu_model_and_flags", lambda cpu=cpu, flags=flags: (cpu, frozenset(flags)))
        dirs.setdefault(cpu, set()).add(cpu_ops.build_directory(name, source, ["-O3"]))
    assert len(dirs["Intel Xeon"]) == 1 and dirs["Intel Xeon"] != dirs["AMD EPYC 7B13"]
