// Shared by the split-bf16 GEMMs (amx_gemm.cpp, bf16_gemm.cpp): the argument checks and the unpacking of
// exact_quant.pack_amx_weight's q rows to bf16.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace split_gemm {

constexpr int64_t kGroup = 32;                      // inputs per scale
constexpr int64_t kScaleBytes = 16 * sizeof(float);  // d (or m) of one column tile

// Checks out [M, N] = x [M, K] @ w^T (+ bias) against packed (uint8 [N / 16, K / 32, 384] for 4 bits, int8
// [N / 16, K / 32, 576] for 8); returns the bytes per group of one column tile.
inline int64_t check_args(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const bool four_bit = packed.scalar_type() == at::kByte;
  const int64_t group_bytes = four_bit ? 2 * kScaleBytes + 256 : kScaleBytes + 512;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && (four_bit || packed.scalar_type() == at::kChar) &&
                  packed.size(0) % 2 == 0 && packed.size(2) == group_bytes,
              "packed: uint8 [N / 16, K / 32, 384] or int8 [N / 16, K / 32, 576], N / 16 even");
  const int64_t n = out.size(1), tiles = packed.size(0);
  TORCH_CHECK(x.size(1) == packed.size(1) * kGroup, "packed does not match x's K");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0) &&
                  n <= tiles * 16 && n > (tiles - 2) * 16,
              "out: contiguous float32 [M, N] matching packed");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "bias: float32 [N]");
  return group_bytes;
}

#if defined(__AVX512BF16__)
// bf16 of 0..15, indexed by vpermw.
inline __m512i nibble_table() {
  alignas(64) float v[32];
  for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(i & 15);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(v + 16), _mm512_load_ps(v));
}

// One column tile's q for one group (16 VNNI rows of 32 values) as bf16 into `rows`.
template <bool FourBit>
inline void unpack_q(const uint8_t* q, uint16_t* rows, __m512i table) {
  for (int r = 0; r < 16; ++r) {
    if constexpr (FourBit) {
      const __m128i b = _mm_loadu_si128((const __m128i*)(q + r * 16));
      const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
      const __m512i words = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
      _mm512_storeu_si512(rows + r * 32, _mm512_permutexvar_epi16(words, table));
    } else {
      const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + r * 32)));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(words)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(words, 1)));
      _mm512_storeu_si512(rows + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}
#endif

}  // namespace split_gemm
