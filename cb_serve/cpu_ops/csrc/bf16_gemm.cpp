// Float32-accurate GEMM with AVX512-BF16 (VDPBF16PS) for weights that are exactly low-bit (exact_quant.py),
// the same split as amx_gemm.cpp with every partial sum exact, so any order of summation (any CPU's
// VDPBF16PS) gives the same bits as exact_quant.split_gemm_reference:
//
// Per row and group of 32 inputs, with 2^e <= max |x| < 2^(e+1): N = rint(x * 2^(23 - e)) (|N| <= 2^24;
// exact for every x in the largest one's binade) = n0 * 2^16 + n1 * 2^8 + n2, with n1, n2 in -128..127 and
// |n0| <= 256: three integers exact in bf16. Against q (0..15, or -127..127) each piece's group sum c_p is
// an integer below 2^20 in magnitude, exact in float32 whatever the order. C = c0 2^16 + c1 2^8 + c2 is
// rounded to float32 once (via double, exact there) and scaled back by 2^(e - 23); then acc += d * C
// (4-bit: acc += m * S, S = float32(sum of N) * 2^(e - 23)), each a float32 multiply and add.
//
// The weight is the layout of exact_quant.pack_amx_weight: per 16 output columns and group, d[16] (m[16]),
// then 16 VNNI rows (input pair, column, pair member), each one VDPBF16PS operand once unpacked to bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "split_gemm.h"

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define CB_SERVE_BF16 1
#include <immintrin.h>
#endif

namespace {

using split_gemm::kGroup;
using split_gemm::kScaleBytes;
constexpr int kRows = 4;  // rows per register block: 4 rows x 2 column tiles x 3 pieces = 24 accumulators

#if defined(CB_SERVE_BF16)
struct Split {
  std::vector<uint32_t> pieces;  // [3][M][K / 2]: bf16 pairs of n0, n1, n2
  std::vector<float> unit;       // [M][K / 32]: 2^(e - 23), NaN for a group with a non-finite x
  std::vector<float> sums;       // [M][K / 32]: S
};

// One row's groups: pieces, units and sums (16 lanes at a time).
void split_row(const float* x, int64_t k, int64_t m, int64_t row, Split& s) {
  const int64_t groups = k / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 lo = _mm512_loadu_ps(x + g * kGroup), hi = _mm512_loadu_ps(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    int e = 0;
    if (amax > 0.f && amax <= 3.4028235e38f) e = std::ilogb(amax);
    const bool finite = amax <= 3.4028235e38f;
    const __m512 up = _mm512_set1_ps(static_cast<float>(23 - e));
    __m512i n[2] = {_mm512_cvtps_epi32(_mm512_scalef_ps(lo, up)), _mm512_cvtps_epi32(_mm512_scalef_ps(hi, up))};
    const int sum = finite ? _mm512_reduce_add_epi32(_mm512_add_epi32(n[0], n[1])) : 0;
    s.unit[row * groups + g] = finite ? std::ldexp(1.f, e - 23) : __builtin_nanf("");
    s.sums[row * groups + g] = std::ldexp(static_cast<float>(sum), e - 23);
    __m512 piece[3][2];
    for (int h = 0; h < 2; ++h) {
      const __m512i half = _mm512_set1_epi32(128), low = _mm512_set1_epi32(255);
      __m512i rest = finite ? n[h] : _mm512_setzero_si512();
      for (int p = 2; p >= 1; --p) {
        const __m512i digit = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(rest, half), low), half);
        piece[p][h] = _mm512_cvtepi32_ps(digit);
        rest = _mm512_srai_epi32(_mm512_sub_epi32(rest, digit), 8);
      }
      piece[0][h] = _mm512_cvtepi32_ps(rest);
    }
    for (int p = 0; p < 3; ++p)
      _mm512_storeu_si512(s.pieces.data() + (p * m + row) * (k / 2) + g * 16,
                          (__m512i)_mm512_cvtne2ps_pbh(piece[p][1], piece[p][0]));
  }
}

// One column tile's q for all groups as bf16 VNNI rows ([groups][16 pairs][32] into `tile`).
template <bool FourBit>
void unpack_tile(const uint8_t* w, int64_t groups, int64_t group_bytes, uint16_t* tile) {
  const __m512i table = split_gemm::nibble_table();
  for (int64_t g = 0; g < groups; ++g)
    split_gemm::unpack_q<FourBit>(w + g * group_bytes + (FourBit ? 2 : 1) * kScaleBytes, tile + g * 16 * 32, table);
}

// float32(c0 2^16 + c1 2^8 + c2) * unit, the c_p exact integers.
inline __m512 combine(__m512 c0, __m512 c1, __m512 c2, __m512 unit) {
  __m256 half[2];
  for (int h = 0; h < 2; ++h) {
    auto wide = [h](__m512 v) { return _mm512_cvtps_pd(h ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v)); };
    const __m512d v = _mm512_fmadd_pd(wide(c0), _mm512_set1_pd(65536.0), _mm512_fmadd_pd(wide(c1), _mm512_set1_pd(256.0), wide(c2)));
    half[h] = _mm512_cvtpd_ps(v);
  }
  return _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1), unit);
}

// out rows [r0, r0 + R) x the column tile pair's 32 columns, into acc (R x 32 floats).
template <int R, bool FourBit>
void block(const Split& s, int64_t m, int64_t k, int64_t r0, const uint16_t* t0, const uint16_t* t1,
           const uint8_t* w0, const uint8_t* w1, int64_t group_bytes, float* acc) {
  const int64_t groups = k / kGroup, pairs = k / 2;
  const uint8_t* w[2] = {w0, w1};
  for (int64_t g = 0; g < groups; ++g) {
    __m512 c[R][2][3];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2; ++j)
        for (int p = 0; p < 3; ++p) c[r][j][p] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < 16; ++kp) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(t0 + (g * 16 + kp) * 32);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(t1 + (g * 16 + kp) * 32);
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < 3; ++p) {
          const __m512bh a = (__m512bh)_mm512_set1_epi32(s.pieces[(p * m + r0 + r) * pairs + g * 16 + kp]);
          c[r][0][p] = _mm512_dpbf16_ps(c[r][0][p], a, b0);
          c[r][1][p] = _mm512_dpbf16_ps(c[r][1][p], a, b1);
        }
    }
    for (int j = 0; j < 2; ++j) {
      const uint8_t* scales = w[j] + g * group_bytes;
      const __m512 d = _mm512_loadu_ps((const float*)scales);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * groups + g;
        const __m512 v = combine(c[r][j][0], c[r][j][1], c[r][j][2], _mm512_set1_ps(s.unit[at]));
        __m512 a = _mm512_add_ps(_mm512_loadu_ps(acc + r * 32 + 16 * j), _mm512_mul_ps(d, v));
        if constexpr (FourBit) {
          const __m512 mins = _mm512_loadu_ps((const float*)(scales + kScaleBytes));
          a = _mm512_add_ps(a, _mm512_mul_ps(mins, _mm512_set1_ps(s.sums[at])));
        }
        _mm512_storeu_ps(acc + r * 32 + 16 * j, a);
      }
    }
  }
}

template <bool FourBit>
void gemm(float* out, int64_t m, int64_t n, int64_t k, const Split& s, const uint8_t* packed, int64_t group_bytes,
          int64_t tiles, const float* bias) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, tiles / 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> unpacked(2 * groups * 16 * 32);
    alignas(64) float acc[kRows * 32];
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint8_t* w0 = packed + 2 * pair * groups * group_bytes;
      const uint8_t* w1 = w0 + groups * group_bytes;
      uint16_t* t0 = unpacked.data();
      uint16_t* t1 = t0 + groups * 16 * 32;
      unpack_tile<FourBit>(w0, groups, group_bytes, t0);
      unpack_tile<FourBit>(w1, groups, group_bytes, t1);
      const int64_t col = 32 * pair, cols = std::min<int64_t>(32, n - col);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m - r0);
        std::fill(acc, acc + kRows * 32, 0.f);
        switch (rows) {
          case 4: block<4, FourBit>(s, m, k, r0, t0, t1, w0, w1, group_bytes, acc); break;
          case 3: block<3, FourBit>(s, m, k, r0, t0, t1, w0, w1, group_bytes, acc); break;
          case 2: block<2, FourBit>(s, m, k, r0, t0, t1, w0, w1, group_bytes, acc); break;
          default: block<1, FourBit>(s, m, k, r0, t0, t1, w0, w1, group_bytes, acc);
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) out[(r0 + r) * n + col + c] = acc[r * 32 + c] + (bias ? bias[col + c] : 0.f);
      }
    }
  });
}

bool bf16_gemm_supported() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq"); }

// out [M, N] = x [M, K] @ w^T (+ bias); packed as for amx_gemm.
void bf16_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_gemm_supported(), "this CPU has no AVX512-BF16");
  const int64_t group_bytes = split_gemm::check_args(out, x, packed, bias);
  const bool four_bit = packed.scalar_type() == at::kByte;
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), tiles = packed.size(0), groups = packed.size(1);
  if (m == 0) return;
  Split s{std::vector<uint32_t>(3 * m * k / 2), std::vector<float>(m * groups), std::vector<float>(m * groups)};
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) split_row(xp + r * k, k, m, r, s);
  });
  (four_bit ? &gemm<true> : &gemm<false>)(out.data_ptr<float>(), m, n, k, s,
                                          reinterpret_cast<const uint8_t*>(packed.data_ptr()), group_bytes, tiles,
                                          bias ? bias->data_ptr<float>() : nullptr);
}
#else
bool bf16_gemm_supported() { return false; }
void bf16_gemm(at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("bf16_gemm_supported() -> bool", &bf16_gemm_supported);
  m.def("bf16_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) { m.impl("bf16_gemm", &bf16_gemm); }
