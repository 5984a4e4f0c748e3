// The greedy head's first pass on CPUs with AVX512-VNNI and no AMX (greedy_head.py): per row of x and
// tile of 32 LM-head columns, the maximum of approximate logits computed in integers from the 8-bit
// groups decode_gemm reads (cpu_ops/exact_quant.py: per tile and group of 32 inputs, d[32] float32, then
// 32 rows of 32 int8 q).
//
// x comes quantized per row and group of 32 inputs: x ~ s * xq, xq in -127..127 (greedy_head.py bounds the
// error), given as unsigned bytes xq + 128. Per group, sum_k xq[k] q[k][c] is exact in int32: vpdpbusd
// takes four inputs a lane, q rows 4p..4p+3 interleaved into byte quads per column (the unpacks below), times
// the four bytes of x broadcast; 128 * sum_k q[k][c] (the same instruction on 128s) is subtracted once per
// group. The group's sums then scale by d[c] * s into float32 accumulators. Four products per instruction
// and lane: a quarter of the instructions of the float32 FMA chains, and no dequantization.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "lowbit_groups.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace {

using lowbit::kCols;
using lowbit::kGroup;
constexpr int64_t kGroupBytes = lowbit::kQ8GroupBytes;
constexpr int kRows = 12;  // rows per block: 24 int32 accumulators in registers

// One block of `rows` rows over one tile: out[r] = the tile's largest approximate logit below `valid` columns.
// xu: per row and group, 8 int32 lanes of 4 unsigned bytes each (xq + 128, inputs 4p..4p+3 of lane p).
void tile_block(const int32_t* xu, const float* xs, int64_t groups, int rows, const int8_t* tile, int64_t valid,
                float* out, int64_t ld_out) {
  alignas(64) float acc[kRows][kCols];
  for (int r = 0; r < rows; ++r) std::fill_n(acc[r], kCols, 0.f);
  // 32-bit lane m of `a` holds column col_a[m] of 4 inputs, of `b` column col_a[m] + 8 (the unpacks below)
  const __m512i col_a = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i col_b = _mm512_add_epi32(col_a, _mm512_set1_epi32(8));
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));  // 128 as an unsigned byte
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* group = tile + g * kGroupBytes;
    const float* d = reinterpret_cast<const float*>(group);
    const int8_t* q = group + kCols * 4;
    __m512i sum_a[kRows], sum_b[kRows];
    for (int r = 0; r < rows; ++r) sum_a[r] = sum_b[r] = _mm512_setzero_si512();
    __m512i bias_a = _mm512_setzero_si512(), bias_b = _mm512_setzero_si512();  // 128 * sum_k q[k][c]
    for (int64_t p = 0; p < kGroup / 4; ++p) {
      const int8_t* rows4 = q + 4 * p * kCols;
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows4));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows4 + kCols));
      const __m256i r2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows4 + 2 * kCols));
      const __m256i r3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows4 + 3 * kCols));
      // bytes interleaved into quads (q[4p][c], q[4p+1][c], q[4p+2][c], q[4p+3][c]) per 32-bit lane; within
      // each 128-bit half (columns 16h..16h+15): lo8/lo16 -> 16h+0..3, lo8/hi16 -> +4..7, hi8/lo16 -> +8..11,
      // hi8/hi16 -> +12..15
      const __m256i p01l = _mm256_unpacklo_epi8(r0, r1), p01h = _mm256_unpackhi_epi8(r0, r1);
      const __m256i p23l = _mm256_unpacklo_epi8(r2, r3), p23h = _mm256_unpackhi_epi8(r2, r3);
      const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(p01l, p23l)),
                                           _mm256_unpackhi_epi16(p01l, p23l), 1);
      const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(p01h, p23h)),
                                           _mm256_unpackhi_epi16(p01h, p23h), 1);
      bias_a = _mm512_dpbusd_epi32(bias_a, offset, a);
      bias_b = _mm512_dpbusd_epi32(bias_b, offset, b);
      for (int r = 0; r < rows; ++r) {
        const __m512i quad = _mm512_set1_epi32(xu[(r * groups + g) * (kGroup / 4) + p]);
        sum_a[r] = _mm512_dpbusd_epi32(sum_a[r], quad, a);
        sum_b[r] = _mm512_dpbusd_epi32(sum_b[r], quad, b);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16);
    const __m512 d_a = _mm512_permutex2var_ps(d0, col_a, d1), d_b = _mm512_permutex2var_ps(d0, col_b, d1);
    for (int r = 0; r < rows; ++r) {
      const __m512 s = _mm512_set1_ps(xs[r * groups + g]);
      const __m512 dot_a = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum_a[r], bias_a));
      const __m512 dot_b = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum_b[r], bias_b));
      _mm512_store_ps(acc[r], _mm512_fmadd_ps(dot_a, _mm512_mul_ps(d_a, s), _mm512_load_ps(acc[r])));
      _mm512_store_ps(acc[r] + 16, _mm512_fmadd_ps(dot_b, _mm512_mul_ps(d_b, s), _mm512_load_ps(acc[r] + 16)));
    }
  }
  const __m512i limit = _mm512_set1_epi32(static_cast<int32_t>(valid));
  const __mmask16 m_a = _mm512_cmplt_epi32_mask(col_a, limit), m_b = _mm512_cmplt_epi32_mask(col_b, limit);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < rows; ++r) {
    const __m512 a = _mm512_mask_blend_ps(m_a, minus_inf, _mm512_load_ps(acc[r]));
    const __m512 b = _mm512_mask_blend_ps(m_b, minus_inf, _mm512_load_ps(acc[r] + 16));
    out[r * ld_out] = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  }
}

}  // namespace

// out [M, tiles] float32; xu int32 [M, G, 8] (the quantized x plus 128 as unsigned bytes, four a lane, little-
// endian); xs float32 [M, G]
// (each row and group's scale); packed int8 [tiles, G, 1152] (pack_decode_weight_quantized's 8-bit layout,
// one scale per group); columns from `vocab` on are left out (a tile wholly past it gets -inf).
void int8_tile_max(at::Tensor out, const at::Tensor& xu, const at::Tensor& xs, const at::Tensor& packed,
                    int64_t vocab) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(2) == kGroupBytes,
              "packed: 8-bit decode_gemm groups [tiles, G, 1152]");
  const int64_t tiles = packed.size(0), groups = packed.size(1), m_dim = xu.size(0);
  TORCH_CHECK(xu.dim() == 3 && xu.is_contiguous() && xu.scalar_type() == at::kInt && xu.size(1) == groups &&
                  xu.size(2) == kGroup / 4,
              "xu: int32 [M, G, 8]");
  TORCH_CHECK(xs.is_contiguous() && xs.scalar_type() == at::kFloat && xs.numel() == m_dim * groups, "xs: [M, G]");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == m_dim && out.size(1) == tiles,
              "out: float32 [M, tiles]");
  const int32_t* xup = xu.data_ptr<int32_t>();
  const float* xsp = xs.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::clamp<int64_t>(vocab - t * kCols, 0, kCols);
      for (int64_t m0 = 0; m0 < m_dim; m0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m_dim - m0));
        tile_block(xup + m0 * groups * (kGroup / 4), xsp + m0 * groups, groups, rows, w + t * groups * kGroupBytes,
                   valid, op + m0 * tiles + t, tiles);
      }
    }
  });
}

bool int8_tile_max_supported() { return true; }
#else
void int8_tile_max(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "built without AVX512-VNNI");
}
bool int8_tile_max_supported() { return false; }
#endif

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("int8_tile_max(Tensor(a!) out, Tensor xu, Tensor xs, Tensor packed, int vocab) -> ()");
  m.def("int8_tile_max_supported() -> bool", &int8_tile_max_supported);
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) { m.impl("int8_tile_max", &int8_tile_max); }
