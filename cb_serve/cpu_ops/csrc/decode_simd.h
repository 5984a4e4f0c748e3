// paged_decode_attention's vectorized kernels for float32 queries over a float32, bf16 or FP8 (e4m3) cache: AVX-512 at
// head_dim 64, 96 and 128, AVX2 at 64 and 128 (decode_sequence_avx512 / _avx2), and the vector operations the
// wide kernel (decode_wide.h) shares.
#pragma once

#include "decode_problem.h"

namespace paged_decode {

#if defined(__AVX512F__)
constexpr int64_t kPrefetch = 32;  // tokens ahead: far enough to hide memory latency, near enough to stay in L1/L2

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {  // bf16 -> fp32: the 16 bits become the high half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// FP8 e4m3 (bias 7) -> fp16 (bias 15) by moving its sign, exponent and mantissa bits into place (subnormals
// included), then * 2^8 for the biases' difference: exact. (0x7F / 0xFF, e4m3's NaN, read as +-480: writes
// saturate finite values at +-448, so only a NaN key or value, already a broken step, is stored as one.)
inline __m256i e4m3_as_half(__m256i bytes16) {
  return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(bytes16, _mm256_set1_epi16(0x80)), 8),
                         _mm256_slli_epi16(_mm256_and_si256(bytes16, _mm256_set1_epi16(0x7F)), 7));
}
inline __m512 load16(const c10::Float8_e4m3fn* x) {
  const __m256i bytes16 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm512_mul_ps(_mm512_cvtph_ps(e4m3_as_half(bytes16)), _mm512_set1_ps(256.f));
}

// exp(s - max) in place over `scores[0:span]`; returns 1 / (their sum + extra), broadcast.
inline __m512 softmax_numerators(float* scores, int64_t span, float max, float extra) {
  const __m512 vm = _mm512_set1_ps(max);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i = 0; i < span; i += 16) {
    const __mmask16 lanes = span - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (span - i)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + i), vm));
    _mm512_mask_storeu_ps(scores + i, lanes, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(lanes, e));
  }
  return _mm512_set1_ps(1.f / (_mm512_reduce_add_ps(vsum) + extra));
}

struct Simd {  // the vector operations decode_sequence_wide needs, 16 lanes
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  template <typename T>
  static V load(const T* x) { return load16(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static void store(float* x, V v) { _mm512_storeu_ps(x, v); }
  static V inv_sum(float* scores, int64_t span, float max, float extra) {
    return softmax_numerators(scores, span, max, extra);
  }
};

// float32 queries, head_dim = 16 * NV, a float32 or bf16 cache. The query heads of a KV head are
// taken G at a time (G divides the group size), their queries and accumulators in registers: one
// pass over the KV head's K rows and one over its V rows per G heads, every row loaded once for
// all G, so the memory stream carries G heads' arithmetic (with one head per pass, the later heads
// of a group ran from L2 while memory sat idle).
// Each head's arithmetic, and so its result, is the same for every G.
template <int NV, int G, typename cache_t>
void decode_sequence_avx512(const DecodeProblem<float, cache_t>& p, int64_t n) {
  constexpr int64_t D = 16 * NV;
  const std::vector<int64_t> rows = p.row_offsets(n);
  const int64_t span = static_cast<int64_t>(rows.size());
  std::vector<float> scores(G * span);
  for (int64_t first = 0; first < p.num_heads; first += G) {
    const int64_t head = (first / p.group()) * D;  // the KV head's columns in a cached row
    __m512 qv[G][NV];
    float m[G];
    for (int g = 0; g < G; ++g) {
      const float* q = p.q + n * p.q_stride_n + (first + g) * p.q_stride_h;
      for (int j = 0; j < NV; ++j) qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * j), _mm512_set1_ps(p.scale));
      m[g] = -std::numeric_limits<float>::infinity();
    }
    for (int64_t i = 0; i < span; ++i) {
      if (i + kPrefetch < span)
        for (int j = 0; j < NV; ++j) _mm_prefetch((const char*)(p.k_cache + rows[i + kPrefetch] + head + 16 * j), _MM_HINT_T0);
      const cache_t* key = p.k_cache + rows[i] + head;
      __m512 kv[NV];
      for (int j = 0; j < NV; ++j) kv[j] = load16(key + 16 * j);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(qv[g][j], kv[j], acc);
        const float s = _mm512_reduce_add_ps(acc);
        scores[g * span + i] = s;
        m[g] = std::max(m[g], s);
      }
    }
    __m512 inv_sum[G];
    for (int g = 0; g < G; ++g) {
      const auto [max, sink] = p.softmax_max(scores.data() + g * span, span, m[g], first + g);
      inv_sum[g] = softmax_numerators(scores.data() + g * span, span, max, sink);
    }
    __m512 acc[G][NV];
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < span; ++i) {
      if (i + kPrefetch < span)
        for (int j = 0; j < NV; ++j) _mm_prefetch((const char*)(p.v_cache + rows[i + kPrefetch] + head + 16 * j), _MM_HINT_T0);
      const cache_t* value = p.v_cache + rows[i] + head;
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = load16(value + 16 * j);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * span + i]);
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(w, vv[j], acc[g][j]);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* o = p.out + (n * p.num_heads + first + g) * D;
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[g][j], inv_sum[g]));
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kPrefetch = 8;  // rows ahead (a row holds every KV head): further ahead overflows the miss buffers

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Float8_e4m3fn* x) {  // as load16's: e4m3 bits into fp16's places, then * 2^8
  const __m128i bytes16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes16, _mm_set1_epi16(0x80)), 8),
                                    _mm_slli_epi16(_mm_and_si128(bytes16, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.f));
}
#endif

// exp(s - max) in place over `scores[0:span]`; returns 1 / (their sum + extra).
inline float softmax_numerators(float* scores, int64_t span, float max, float extra) {
  const __m256 vm = _mm256_set1_ps(max);
  __m256 vsum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= span; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vm));
    _mm256_storeu_ps(scores + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (i < span) {
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(span - i)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(scores + i, lanes), vm)),
                                   _mm256_castsi256_ps(lanes));
    _mm256_maskstore_ps(scores + i, lanes, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return 1.f / (reduce_add256(vsum) + extra);
}

struct Simd {  // the vector operations decode_sequence_wide needs, 8 lanes
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  template <typename T>
  static V load(const T* x) { return load8(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static float sum(V v) { return reduce_add256(v); }
  static void store(float* x, V v) { _mm256_storeu_ps(x, v); }
  static V inv_sum(float* scores, int64_t span, float max, float extra) {
    return _mm256_set1_ps(softmax_numerators(scores, span, max, extra));
  }
};

// float32 queries, head_dim = 8 * NV, a float32 or bf16 cache. Scores token by token (each cached row
// read once, whole: every KV head's K vectors loaded once for its group's query heads, the queries read
// from L1); then per query head, one pass over its KV head's V rows with the head's output accumulators in
// registers (16 registers cannot hold a group's). A score sums two FMA chains over the head dimension (the
// chains of successive heads and tokens overlap).
// GCC keeps a loop-carried array of vectors in memory unless its loops are unrolled first: hence the pragmas.
template <int NV, typename cache_t>
void decode_sequence_avx2(const DecodeProblem<float, cache_t>& p, int64_t n) {
  static_assert(NV % 2 == 0, "two chains per score");
  constexpr int64_t D = 8 * NV;
  const int64_t heads = p.num_heads, group = p.group(), row_bytes = p.num_kv_heads * D * sizeof(cache_t);
  const std::vector<int64_t> rows = p.row_offsets(n);
  const int64_t span = static_cast<int64_t>(rows.size());
  std::vector<float> scores(heads * span), queries(heads * D);  // [head][token], [head][D] (scaled)
  std::vector<float> m(heads, -std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < D; ++d) queries[h * D + d] = p.q[n * p.q_stride_n + h * p.q_stride_h + d] * p.scale;
  for (int64_t i = 0; i < span; ++i) {
    if (i + kPrefetch < span)
      for (int64_t line = 0; line < row_bytes; line += 64)
        _mm_prefetch((const char*)(p.k_cache + rows[i + kPrefetch]) + line, _MM_HINT_T0);
    for (int64_t kv = 0; kv < p.num_kv_heads; ++kv) {
      const cache_t* key = p.k_cache + rows[i] + kv * D;
      __m256 kv_vec[NV];
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) kv_vec[j] = load8(key + 8 * j);
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        const float* q = queries.data() + h * D;
        __m256 even = _mm256_mul_ps(_mm256_loadu_ps(q), kv_vec[0]), odd = _mm256_mul_ps(_mm256_loadu_ps(q + 8), kv_vec[1]);
#pragma GCC unroll 16
        for (int j = 2; j < NV; j += 2) {
          even = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j), kv_vec[j], even);
          odd = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j + 8), kv_vec[j + 1], odd);
        }
        const float s = reduce_add256(_mm256_add_ps(even, odd));
        scores[h * span + i] = s;
        m[h] = std::max(m[h], s);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t head = (h / group) * D;  // the KV head's columns in a cached row
    float* sh = scores.data() + h * span;
    const auto [max, sink] = p.softmax_max(sh, span, m[h], h);
    const __m256 inv_sum = _mm256_set1_ps(softmax_numerators(sh, span, max, sink));
    __m256 acc[NV];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < span; ++i) {
      if (i + kPrefetch < span)
        for (int64_t line = 0; line < D * (int64_t)sizeof(cache_t); line += 64)
          _mm_prefetch((const char*)(p.v_cache + rows[i + kPrefetch] + head) + line, _MM_HINT_T0);
      const cache_t* value = p.v_cache + rows[i] + head;
      const __m256 w = _mm256_set1_ps(sh[i]);
#pragma GCC unroll 16
      for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(w, load8(value + 8 * j), acc[j]);
    }
    float* o = p.out + (n * heads + h) * D;
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[j], inv_sum));
  }
}
#endif

}  // namespace paged_decode
