// The greedy head's first pass on CPUs with AVX512-VNNI and no AMX (greedy_head.py): per row of x and
// tile of 32 LM-head columns, the maximum of approximate logits computed in integers from the 8-bit
// groups decode_gemm reads (cpu_ops/exact_quant.py: per tile and group of 32 inputs, d[32] float32, then
// 32 rows of 32 int8 q).
//
// x comes quantized per row and group of 32 inputs: x ~ s * xq, xq in -127..127 (greedy_head.py bounds the
// error), given as unsigned bytes xq + 128. Per group, sum_k xq[k] q[k][c] is exact in int32: vpdpbusd
// takes four inputs a lane, q rows 4p..4p+3 interleaved into byte quads per column (the unpacks below), times
// the four bytes of x broadcast; each sum starts at -128 * sum_k q[k][c] (the same instruction on 128s). The
// group's sums then scale by d[c] * s into float32 accumulators. Four products per instruction and lane: a
// quarter of the instructions of the float32 FMA chains, and no dequantization.
//
// Per tile, groups outer and rows inner: a group is interleaved once for all rows (not once per block of
// rows), and a block's 2 * kRows sums stay in registers (more rows, or a loop the compiler leaves rolled over
// the sum arrays, and it spills them to the stack at every instruction: bench/micro_kernels.py measures it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "lowbit_groups.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace {

using lowbit::kCols;
using lowbit::kGroup;
constexpr int64_t kGroupBytes = lowbit::kQ8GroupBytes;
constexpr int kQuads = kGroup / 4;  // vpdpbusd steps per group
constexpr int kRows = 10;           // rows per block: 20 int32 sums in registers

// One group of one tile, interleaved once for every row: 32-bit lane m of a[p] holds column col_a[m] of
// inputs 4p..4p+3, of b[p] column col_a[m] + 8; minus_bias_* = -128 * sum_k q[k][c] (the offset of x's bytes);
// d_* the columns' scales in the same lane order. Kept in memory (L1): the row loop's registers hold sums.
struct GroupQuads {
  __m512i a[kQuads], b[kQuads];
  __m512i minus_bias_a, minus_bias_b;
  __m512 d_a, d_b;
};

inline void interleave(const int8_t* group, __m512i col_a, __m512i col_b, GroupQuads& out) {
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));  // 128 as an unsigned byte
  const float* d = reinterpret_cast<const float*>(group);
  const int8_t* q = group + kCols * 4;
  __m512i bias_a = _mm512_setzero_si512(), bias_b = _mm512_setzero_si512();
  for (int p = 0; p < kQuads; ++p) {
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
    out.a[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(p01l, p23l)),
                                  _mm256_unpackhi_epi16(p01l, p23l), 1);
    out.b[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(p01h, p23h)),
                                  _mm256_unpackhi_epi16(p01h, p23h), 1);
    bias_a = _mm512_dpbusd_epi32(bias_a, offset, out.a[p]);
    bias_b = _mm512_dpbusd_epi32(bias_b, offset, out.b[p]);
  }
  out.minus_bias_a = _mm512_sub_epi32(_mm512_setzero_si512(), bias_a);
  out.minus_bias_b = _mm512_sub_epi32(_mm512_setzero_si512(), bias_b);
  const __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16);
  out.d_a = _mm512_permutex2var_ps(d0, col_a, d1);
  out.d_b = _mm512_permutex2var_ps(d0, col_b, d1);
}

// R rows' sums over one group (each starts at -bias: exact in int32), scaled by d[c] * s into acc (float32
// [R][kCols], lanes in col_a / col_b order). xg: row r's quads at xg[r * kQuads + p]; sg: its scale at sg[r].
template <int R>
inline void rows_group(const int32_t* xg, const float* sg, const GroupQuads& g, float* acc) {
  __m512i sum_a[R], sum_b[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) sum_a[r] = g.minus_bias_a, sum_b[r] = g.minus_bias_b;
#pragma GCC unroll 8
  for (int p = 0; p < kQuads; ++p) {
    const __m512i a = g.a[p], b = g.b[p];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i quad = _mm512_set1_epi32(xg[r * kQuads + p]);
      sum_a[r] = _mm512_dpbusd_epi32(sum_a[r], quad, a);
      sum_b[r] = _mm512_dpbusd_epi32(sum_b[r], quad, b);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 s = _mm512_set1_ps(sg[r]);
    float* out = acc + r * kCols;
    _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_a[r]), _mm512_mul_ps(g.d_a, s),
                                          _mm512_loadu_ps(out)));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_b[r]), _mm512_mul_ps(g.d_b, s),
                                               _mm512_loadu_ps(out + 16)));
  }
}

template <int R = kRows>
inline void rows_group_tail(int rows, const int32_t* xg, const float* sg, const GroupQuads& g, float* acc) {
  if constexpr (R > 1) {
    if (rows < R) return rows_group_tail<R - 1>(rows, xg, sg, g, acc);
  }
  rows_group<R>(xg, sg, g, acc);
}

// Every row of x over one tile: out[m * ld_out] = row m's largest approximate logit below `valid` columns.
// Groups outer, rows inner: each group is interleaved once for all rows. xt: int32 [G][M][kQuads], st: float32
// [G][M] (x by group, then row); acc: float32 [M][kCols], zeroed.
void tile_rows(const int32_t* xt, const float* st, int64_t groups, int64_t m_dim, const int8_t* tile,
               int64_t valid, float* acc, float* out, int64_t ld_out) {
  const __m512i col_a = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i col_b = _mm512_add_epi32(col_a, _mm512_set1_epi32(8));
  GroupQuads quads;
  for (int64_t g = 0; g < groups; ++g) {
    interleave(tile + g * kGroupBytes, col_a, col_b, quads);
    const int32_t* xg = xt + g * m_dim * kQuads;
    const float* sg = st + g * m_dim;
    for (int64_t m0 = 0; m0 < m_dim; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m_dim - m0));
      rows_group_tail(rows, xg + m0 * kQuads, sg + m0, quads, acc + m0 * kCols);
    }
  }
  const __m512i limit = _mm512_set1_epi32(static_cast<int32_t>(valid));
  const __mmask16 m_a = _mm512_cmplt_epi32_mask(col_a, limit), m_b = _mm512_cmplt_epi32_mask(col_b, limit);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < m_dim; ++m) {
    const __m512 a = _mm512_mask_blend_ps(m_a, minus_inf, _mm512_loadu_ps(acc + m * kCols));
    const __m512 b = _mm512_mask_blend_ps(m_b, minus_inf, _mm512_loadu_ps(acc + m * kCols + 16));
    out[m * ld_out] = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
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
  const int8_t* w = packed.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  // x by group, then row: a block of rows reads its quads at fixed offsets from one pointer
  const at::Tensor xt = xu.transpose(0, 1).contiguous(), st = xs.view({m_dim, groups}).t().contiguous();
  const int32_t* xtp = xt.data_ptr<int32_t>();
  const float* stp = st.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(m_dim * kCols);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::clamp<int64_t>(vocab - t * kCols, 0, kCols);
      std::fill(acc.begin(), acc.end(), 0.f);
      tile_rows(xtp, stp, groups, m_dim, w + t * groups * kGroupBytes, valid, acc.data(), op + t, tiles);
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
