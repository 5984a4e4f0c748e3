// The exactly-low-bit weight groups decode_gemm reads (cpu_ops/exact_quant.py's packing): their layout,
// their dequantization into float32 tiles, and (AVX-512) a row block that dequantizes them in registers.
#pragma once

#include <cstdint>
#include <cmath>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace lowbit {

constexpr int64_t kCols = 32;  // output columns per tile
// The group layouts (below): 4-bit; 8-bit, one scale per 32 inputs; per 16 (Q6_K); FP8 e4m3 codes; FP4 e2m1 codes
enum Kind : int { kQ4 = 0, kQ8 = 1, kQ8x2 = 2, kF8 = 3, kF4 = 4 };
constexpr int kKinds = 5;
constexpr int64_t scale_vectors(Kind kind) { return kind == kQ4 || kind == kQ8x2 ? 2 : 1; }

// An FP4 e2m1 code's value (MXFP4's elements: bit 3 the sign), by code.
alignas(64) constexpr float kE2M1[16] = {0.f,  .5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                         -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// An FP8 e4m3 code's value (bias 7; subnormals m * 2^-9): exact in float32. (0x7F / 0xFF, NaN, are not weights.)
inline float e4m3_value(uint8_t byte) {
  const int exponent = (byte >> 3) & 0xF, mantissa = byte & 7;
  const float magnitude = exponent ? std::ldexp(static_cast<float>(8 + mantissa), exponent - 10)
                                   : std::ldexp(static_cast<float>(mantissa), -9);
  return byte & 0x80 ? -magnitude : magnitude;
}

#if defined(__AVX512F__)
// 16 FP8 e4m3 codes as float32: sign, exponent and mantissa moved into float16's places, then * 2^8 (exact).
inline __m512 e4m3_16(const uint8_t* codes) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                       _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
}

// Input k's 32 values of a group as float32, columns 0-15 and 16-31.
template <Kind K>
inline void q_row(const uint8_t* q, int64_t k, __m512& q0, __m512& q1) {
  if constexpr (K == kQ4) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16)));
    q0 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
    q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  } else if constexpr (K == kF8) {
    q0 = e4m3_16(q + k * 32);
    q1 = e4m3_16(q + k * 32 + 16);
  } else if constexpr (K == kF4) {  // 4-bit codes as kQ4 lays them out, each looked up in the table
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16)));
    const __m512 table = _mm512_load_ps(kE2M1);
    q0 = _mm512_permutexvar_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)), table);
    q1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    const __m128i* bytes = reinterpret_cast<const __m128i*>(q + k * 32);
    q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes)));
    q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes + 1)));
  }
}
#endif

// Exactly-low-bit weights (cpu_ops/exact_quant.py), per tile and group of 32 inputs: the float32
// scales d[32] of the tile's 32 columns (4-bit: then offsets m[32]; 8-bit with a scale per 16 inputs: then
// the second half's scales d2[32]), then one row per input: 4-bit as 16 bytes, byte j holding column j in
// its low nibble and column j + 16 in its high nibble; 8-bit as 32 signed bytes. d * q is exact for 4 bits,
// so fma(d, q, m) is the float32 weight the packing started from (for 8 bits fma(d, q, 0) is the rounded
// product the weight was checked against) and the GEMM is bit for bit the float32 one. FP8 weights (an FP8
// checkpoint's e4m3 codes with their blocks' float32 scales) are laid out as 8 bits: fma(d, value, 0) is the
// product value * scale that dequantizing the checkpoint rounds once. FP4 weights (MXFP4 experts: e2m1 codes,
// a power-of-two scale per 32 inputs) are laid out as 4 bits without offsets: fma(d, value, 0) is exact.
constexpr int64_t kGroup = 32;
constexpr int64_t kQ4GroupBytes = 2 * kCols * 4 + kGroup * kCols / 2;
constexpr int64_t kQ8GroupBytes = kCols * 4 + kGroup * kCols;
constexpr int64_t kQ8x2GroupBytes = 2 * kCols * 4 + kGroup * kCols;
constexpr int64_t kF4GroupBytes = kCols * 4 + kGroup * kCols / 2;
constexpr int64_t group_bytes(Kind kind) {
  return kind == kQ4     ? kQ4GroupBytes
         : kind == kQ8x2 ? kQ8x2GroupBytes
         : kind == kF4   ? kF4GroupBytes
                         : kQ8GroupBytes;
}

#if defined(__AVX512F__)
// row(k, w0, w1) for each input k of one group, in order: its 32 weights fma(d, q, m) (columns 0-15, 16-31),
// with m = 0 for 8 bits and the second half's scales from input 16 on for scales per 16 inputs.
template <Kind K, typename Row>
inline void group_weights(const uint8_t* group, Row&& row) {
  constexpr bool FourBit = K == kQ4, TwoScales = K == kQ8x2;
  const float* d = reinterpret_cast<const float*>(group);
  const float* m = d + kCols;  // 4-bit: offsets; two scales: the second half's scales
  const uint8_t* q = group + scale_vectors(K) * kCols * 4;
  __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16);
  const __m512 m0 = FourBit ? _mm512_loadu_ps(m) : _mm512_setzero_ps();
  const __m512 m1 = FourBit ? _mm512_loadu_ps(m + 16) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kGroup; ++k) {
    if (TwoScales && k == kGroup / 2) {
      d0 = _mm512_loadu_ps(m);
      d1 = _mm512_loadu_ps(m + 16);
    }
    __m512 q0, q1;
    q_row<K>(q, k, q0, q1);
    row(k, _mm512_fmadd_ps(d0, q0, m0), _mm512_fmadd_ps(d1, q1, m1));
  }
}
#endif

// Dequantizes `groups` groups of a tile, starting at `packed`, into `tile` ([groups * 32, 32] float32, the
// layout of pack_decode_weight).
template <Kind K>
void dequantize_groups(const uint8_t* packed, int64_t groups, float* tile) {
  constexpr int64_t bytes = group_bytes(K);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = packed + g * bytes;
    float* rows = tile + g * kGroup * kCols;
#if defined(__AVX512F__)
    _mm_prefetch((const char*)(group + 4 * bytes), _MM_HINT_T0);
    group_weights<K>(group, [rows](int64_t k, __m512 w0, __m512 w1) {
      _mm512_storeu_ps(rows + k * kCols, w0);
      _mm512_storeu_ps(rows + k * kCols + 16, w1);
    });
#else
    constexpr bool FourBit = K == kQ4, TwoScales = K == kQ8x2;
    const float* d = reinterpret_cast<const float*>(group);
    const float* m = d + kCols;  // 4-bit: offsets; two scales: the second half's scales
    const uint8_t* q = group + scale_vectors(K) * kCols * 4;
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t line = 0; line < bytes; line += 64)  // every line of the group 4 ahead
      _mm_prefetch((const char*)(group + 4 * bytes + line), _MM_HINT_T0);
    __m256 dv[4], mv[4];  // in registers: stores to `rows` would otherwise force reloads
    for (int c = 0; c < 4; ++c) {
      dv[c] = _mm256_loadu_ps(d + 8 * c);
      mv[c] = FourBit ? _mm256_loadu_ps(m + 8 * c) : _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < kGroup; ++k) {
      if (TwoScales && k == kGroup / 2)
        for (int c = 0; c < 4; ++c) dv[c] = _mm256_loadu_ps(m + 8 * c);
      __m256 values[4];  // columns 0-7, 8-15, 16-23, 24-31
      if constexpr (K == kF8) {
        for (int c = 0; c < 4; ++c) {
#if defined(__F16C__)
          const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 32 + 8 * c)));
          const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                            _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
          values[c] = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
#else
          alignas(32) float lanes[8];
          for (int j = 0; j < 8; ++j) lanes[j] = e4m3_value(q[k * 32 + 8 * c + j]);
          values[c] = _mm256_load_ps(lanes);
#endif
        }
      } else if constexpr (K == kF4) {  // the table's positive half by the low 3 bits, then bit 3 as the sign
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16));
        const __m256i low = _mm256_cvtepu8_epi32(bytes), high = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
        const __m256i codes[4] = {_mm256_and_si256(low, _mm256_set1_epi32(0xF)),
                                  _mm256_and_si256(high, _mm256_set1_epi32(0xF)), _mm256_srli_epi32(low, 4),
                                  _mm256_srli_epi32(high, 4)};
        const __m256 positive = _mm256_load_ps(kE2M1);
        for (int c = 0; c < 4; ++c) {
          const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes[c], _mm256_set1_epi32(8)), 28);
          values[c] = _mm256_xor_ps(_mm256_permutevar8x32_ps(positive, codes[c]), _mm256_castsi256_ps(sign));
        }
      } else if constexpr (FourBit) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16));
        const __m256i low = _mm256_cvtepu8_epi32(bytes), high = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
        values[0] = _mm256_cvtepi32_ps(_mm256_and_si256(low, _mm256_set1_epi32(0xF)));
        values[1] = _mm256_cvtepi32_ps(_mm256_and_si256(high, _mm256_set1_epi32(0xF)));
        values[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(low, 4));
        values[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(high, 4));
      } else {
        for (int c = 0; c < 4; ++c)
          values[c] = _mm256_cvtepi32_ps(
              _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 32 + 8 * c))));
      }
      for (int c = 0; c < 4; ++c)
        _mm256_storeu_ps(rows + k * kCols + 8 * c, _mm256_fmadd_ps(dv[c], values[c], mv[c]));
    }
#else
    for (int64_t k = 0; k < kGroup; ++k) {
      const float* dk = TwoScales && k >= kGroup / 2 ? m : d;
      for (int64_t c = 0; c < kCols; ++c) {
        float value;
        if constexpr (FourBit) {
          const uint8_t byte = q[k * 16 + c % 16];
          value = static_cast<float>(c < 16 ? byte & 0xF : byte >> 4);
        } else if constexpr (K == kF8) {
          value = e4m3_value(q[k * 32 + c]);
        } else if constexpr (K == kF4) {
          const uint8_t byte = q[k * 16 + c % 16];
          value = kE2M1[c < 16 ? byte & 0xF : byte >> 4];
        } else {
          value = static_cast<float>(static_cast<int8_t>(q[k * 32 + c]));
        }
        rows[k * kCols + c] = std::fma(dk[c], value, FourBit ? m[c] : 0.f);
      }
    }
#endif  // AVX2
#endif  // AVX-512
  }
}

void dequantize(Kind kind, const uint8_t* packed, int64_t groups, float* tile) {
  switch (kind) {
    case kQ4: return dequantize_groups<kQ4>(packed, groups, tile);
    case kQ8: return dequantize_groups<kQ8>(packed, groups, tile);
    case kQ8x2: return dequantize_groups<kQ8x2>(packed, groups, tile);
    case kF8: return dequantize_groups<kF8>(packed, groups, tile);
    case kF4: return dequantize_groups<kF4>(packed, groups, tile);
  }
}

#if defined(__AVX512F__)
// out[r, 0:cols] = the rows' accumulators (+ bias), columns past `cols` left alone.
template <int Rows>
inline void store_rows(const __m512* lo, const __m512* hi, float* out, int64_t ld_out, int64_t cols, const float* bias) {
  const __mmask16 m0 = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? (__mmask16)0xFFFF : cols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < Rows; ++r) {
    _mm512_mask_storeu_ps(out + r * ld_out, m0, _mm512_add_ps(lo[r], b0));
    _mm512_mask_storeu_ps(out + r * ld_out + 16, m1, _mm512_add_ps(hi[r], b1));
  }
}

// Rows rows over one low-bit tile (`packed`: its k_dim / 32 groups), dequantized in registers: each input's
// 32 weights are fma(d, q, m), dequantize_groups' values, and each output the FMA chain over k in order
// that decode_gemm runs over the dequantized tile: the same bits, without the tile's round trip through
// memory (what bounds one decode row).
template <int Rows, Kind K>
void lowbit_block(const float* x, int64_t k_dim, const uint8_t* packed, float* out, int64_t ld_out, int64_t cols,
                  const float* bias) {
  constexpr int64_t bytes = group_bytes(K);
  __m512 lo[Rows], hi[Rows];
  for (int r = 0; r < Rows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < k_dim / kGroup; ++g) {
    const uint8_t* group = packed + g * bytes;
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char*)(group + 8 * bytes + line), _MM_HINT_T0);
    const float* xg = x + g * kGroup;
    group_weights<K>(group, [&](int64_t k, __m512 w0, __m512 w1) {
      for (int r = 0; r < Rows; ++r) {
        const __m512 a = _mm512_set1_ps(xg[r * k_dim + k]);
        lo[r] = _mm512_fmadd_ps(a, w0, lo[r]);
        hi[r] = _mm512_fmadd_ps(a, w1, hi[r]);
      }
    });
  }
  store_rows<Rows>(lo, hi, out, ld_out, cols, bias);
}
#endif

}  // namespace lowbit
