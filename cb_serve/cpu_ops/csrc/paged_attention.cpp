// CPU kernels for the paged KV cache. paged_decode_attention: one query token per sequence, K
// and V read in place from the block cache (no gather into padded tensors), every KV head of a
// cached token read as one contiguous row; the semantics of TorchAttentionBackend's decode path.
// Optional score soft-capping (cap * tanh(s / cap), Gemma 2) and attention sinks (a per-head logit in
// the softmax denominator, gpt-oss) cost one branch per head when off.
// write_kv: the new tokens' K/V into their cache slots (AttentionBackend.write_kv).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// scores[0:span] = cap * tanh(scores / cap), in place; returns their max.
inline float softcap_scores(float* scores, int64_t span, float cap) {
  const float inv = 1.f / cap;
  float max = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(max);
  for (; i + 16 <= span; i += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(scores + i), _mm512_set1_ps(inv));
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(cap), tanh512(x));
    _mm512_storeu_ps(scores + i, y);
    vmax = _mm512_max_ps(vmax, y);
  }
  max = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 vmax = _mm256_set1_ps(max);
  for (; i + 8 <= span; i += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(scores + i), _mm256_set1_ps(inv));
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(cap), tanh256(x));
    _mm256_storeu_ps(scores + i, y);
    vmax = _mm256_max_ps(vmax, y);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (const float lane : lanes) max = std::max(max, lane);
#endif
  for (; i < span; ++i) {
    scores[i] = cap * std::tanh(scores[i] * inv);
    max = std::max(max, scores[i]);
  }
  return max;
}

// One call's operands: decode row n's query is q + n * q_stride_n + h * q_stride_h (head h), its
// output out + (n * num_heads + h) * head_dim, its cached tokens live in the blocks of its row of
// block_table. The cache may hold a narrower type than the queries (a bf16/fp16 KV cache).
template <typename scalar_t, typename cache_t = scalar_t>
struct DecodeProblem {
  scalar_t* out;
  const scalar_t* q;
  const cache_t* k_cache;
  const cache_t* v_cache;
  const int32_t* block_table;
  const int32_t* seq_lens;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  int64_t q_stride_n, q_stride_h, block_stride, table_stride;
  float scale;
  int64_t sliding_window;  // <= 0: none
  float softcap;           // <= 0: none
  const float* sinks;      // [num_heads] logits, or nullptr

  int64_t group() const { return num_heads / num_kv_heads; }

  // Head h's softmax over its `span` scores: soft-caps them in place (when set) and returns their
  // max, the sink's logit included (when set), and that sink's exp(sink - max) term of the denominator.
  std::pair<float, float> softmax_max(float* scores, int64_t span, float max, int64_t h) const {
    if (softcap > 0) max = softcap_scores(scores, span, softcap);
    if (sinks == nullptr) return {max, 0.f};
    max = std::max(max, sinks[h]);
    return {max, std::exp(sinks[h] - max)};
  }

  // Element offsets (into k_cache and v_cache alike) of the [KVH, D] rows of the cached tokens that
  // row n attends to, oldest first: its last sliding_window tokens, or all of them.
  std::vector<int64_t> row_offsets(int64_t n) const {
    const int64_t len = seq_lens[n];
    const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int32_t* table = block_table + n * table_stride;
    std::vector<int64_t> offsets(len - start);
    for (int64_t t = start; t < len; ++t)
      offsets[t - start] = table[t / block_size] * block_stride + (t % block_size) * num_kv_heads * head_dim;
    return offsets;
  }
};

#if defined(__AVX512F__)
constexpr int64_t kPrefetch = 32;  // tokens ahead: far enough to hide memory latency, near enough to stay in L1/L2

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {  // bf16 -> fp32: the 16 bits become the high half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// float32 queries, a head too wide for its queries to live in registers (head_dim = lanes * NV: 256 for
// Gemma 2/3, 512 for Gemma 4's global layers). The query heads of a KV head are taken G at a time, their
// scaled queries in L1. Scores token by token: KC vectors of the key row in registers at a time, each
// loaded once for all G heads (two FMA chains per head). Then the output in slices of C vectors: one
// pass over the V rows per slice, G heads' accumulators in registers; each pass reads its own cache
// lines of every row, so each V line comes from memory once.
template <int NV, int G, typename cache_t>
void decode_sequence_wide(const DecodeProblem<float, cache_t>& p, int64_t n) {
  using V = Simd::V;
  constexpr int64_t L = Simd::kLanes, D = L * NV;
  constexpr int KC = std::min(NV, L == 16 ? 16 : 4);  // key vectors held at once (32 or 16 registers)
  constexpr int C = (L == 16 ? 16 : 8) / G;  // output vectors per pass over V
  static_assert(NV % KC == 0 && KC % 2 == 0 && NV % C == 0, "head_dim and group do not tile");
  const std::vector<int64_t> rows = p.row_offsets(n);
  const int64_t span = static_cast<int64_t>(rows.size());
  std::vector<float> scores(G * span);
  alignas(64) float q[G * D];
  for (int64_t first = 0; first < p.num_heads; first += G) {
    const int64_t head = (first / p.group()) * D;  // the KV head's columns in a cached row
    float m[G];
    for (int g = 0; g < G; ++g) {
      const float* src = p.q + n * p.q_stride_n + (first + g) * p.q_stride_h;
      for (int j = 0; j < NV; ++j) Simd::store(q + g * D + L * j, Simd::mul(Simd::load(src + L * j), Simd::set1(p.scale)));
      m[g] = -std::numeric_limits<float>::infinity();
    }
    for (int64_t i = 0; i < span; ++i) {
      if (i + kPrefetch < span)
        for (int64_t line = 0; line < D * (int64_t)sizeof(cache_t); line += 64)
          _mm_prefetch((const char*)(p.k_cache + rows[i + kPrefetch] + head) + line, _MM_HINT_T0);
      const cache_t* key = p.k_cache + rows[i] + head;
      V even[G], odd[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) even[g] = odd[g] = Simd::zero();
      for (int c = 0; c < NV; c += KC) {
        V kv[KC];
#pragma GCC unroll 16
        for (int j = 0; j < KC; ++j) kv[j] = Simd::load(key + L * (c + j));
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const float* qg = q + g * D + L * c;
#pragma GCC unroll 16
          for (int j = 0; j < KC; j += 2) {
            even[g] = Simd::fmadd(Simd::load(qg + L * j), kv[j], even[g]);
            odd[g] = Simd::fmadd(Simd::load(qg + L * (j + 1)), kv[j + 1], odd[g]);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        const float s = Simd::sum(even[g]) + Simd::sum(odd[g]);
        scores[g * span + i] = s;
        m[g] = std::max(m[g], s);
      }
    }
    V inv_sum[G];
    for (int g = 0; g < G; ++g) {
      const auto [max, sink] = p.softmax_max(scores.data() + g * span, span, m[g], first + g);
      inv_sum[g] = Simd::inv_sum(scores.data() + g * span, span, max, sink);
    }
    for (int c = 0; c < NV; c += C) {
      V acc[G][C];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
        for (int j = 0; j < C; ++j) acc[g][j] = Simd::zero();
      for (int64_t i = 0; i < span; ++i) {
        if (i + kPrefetch < span)
          for (int64_t line = 0; line < C * L * (int64_t)sizeof(cache_t); line += 64)
            _mm_prefetch((const char*)(p.v_cache + rows[i + kPrefetch] + head + L * c) + line, _MM_HINT_T0);
        const cache_t* value = p.v_cache + rows[i] + head + L * c;
        V vv[C];
#pragma GCC unroll 16
        for (int j = 0; j < C; ++j) vv[j] = Simd::load(value + L * j);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const V w = Simd::set1(scores[g * span + i]);
#pragma GCC unroll 16
          for (int j = 0; j < C; ++j) acc[g][j] = Simd::fmadd(w, vv[j], acc[g][j]);
        }
      }
      for (int g = 0; g < G; ++g) {
        float* o = p.out + (n * p.num_heads + first + g) * D + L * c;
        for (int j = 0; j < C; ++j) Simd::store(o + L * j, Simd::mul(acc[g][j], inv_sum[g]));
      }
    }
  }
}

// The wide kernel for head_dim = lanes * NV, G query heads at a time: 4, 2 or 1 as the group divides.
template <int NV, typename cache_t>
auto pick_wide(int64_t group) {
  if (group % 4 == 0) return decode_sequence_wide<NV, 4, cache_t>;
  if (group % 2 == 0) return decode_sequence_wide<NV, 2, cache_t>;
  return decode_sequence_wide<NV, 1, cache_t>;
}
#endif

// Any dtype and head_dim: token rows outer (every KV head of a token read once), float math.
template <typename scalar_t, typename cache_t>
void decode_sequence(const DecodeProblem<scalar_t, cache_t>& p, int64_t n) {
  const int64_t num_heads = p.num_heads, head_dim = p.head_dim, group = p.group();
  const std::vector<int64_t> rows = p.row_offsets(n);
  const int64_t span = static_cast<int64_t>(rows.size());
  std::vector<float> query(num_heads * head_dim);
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d)
      query[h * head_dim + d] = static_cast<float>(p.q[n * p.q_stride_n + h * p.q_stride_h + d]) * p.scale;

  std::vector<float> scores(num_heads * span);  // [head][token]
  for (int64_t i = 0; i < span; ++i) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const cache_t* key = p.k_cache + rows[i] + (h / group) * head_dim;
      const float* qh = query.data() + h * head_dim;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * static_cast<float>(key[d]);
      scores[h * span + i] = s;
    }
  }
  std::vector<float> denom(num_heads);
  for (int64_t h = 0; h < num_heads; ++h) {
    float* sh = scores.data() + h * span;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < span; ++i) m = std::max(m, sh[i]);
    const auto [max, sink] = p.softmax_max(sh, span, m, h);
    float sum = sink;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < span; ++i) {
      sh[i] = std::exp(sh[i] - max);
      sum += sh[i];
    }
    denom[h] = sum;
  }
  std::vector<float> acc(num_heads * head_dim, 0.f);
  for (int64_t i = 0; i < span; ++i) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const cache_t* value = p.v_cache + rows[i] + (h / group) * head_dim;
      const float w = scores[h * span + i];
      float* ah = acc.data() + h * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) ah[d] += w * static_cast<float>(value[d]);
    }
  }
  scalar_t* o = p.out + n * num_heads * head_dim;
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t d = 0; d < head_dim; ++d) o[h * head_dim + d] = static_cast<scalar_t>(acc[h * head_dim + d] / denom[h]);
}

template <typename scalar_t, typename cache_t>
struct KernelPicker {
  static auto pick(int64_t /*head_dim*/, int64_t /*group*/) { return decode_sequence<scalar_t, cache_t>; }
};

template <typename cache_t>  // float queries over a float or bf16 cache: the AVX-512 and AVX2 paths
struct AvxKernelPicker {
  using Kernel = void (*)(const DecodeProblem<float, cache_t>&, int64_t);
  static Kernel pick(int64_t head_dim, int64_t group) {
#if defined(__AVX512F__)
    if (head_dim == 64) {  // up to 4 heads' queries and accumulators in registers
      if (group % 4 == 0) return decode_sequence_avx512<4, 4, cache_t>;
      if (group % 3 == 0) return decode_sequence_avx512<4, 3, cache_t>;
      if (group % 2 == 0) return decode_sequence_avx512<4, 2, cache_t>;
      return decode_sequence_avx512<4, 1, cache_t>;
    }
    if (head_dim == 128)
      return group % 2 == 0 ? decode_sequence_avx512<8, 2, cache_t> : decode_sequence_avx512<8, 1, cache_t>;
    if (head_dim == 96)  // Phi-3
      return group % 2 == 0 ? decode_sequence_avx512<6, 2, cache_t> : decode_sequence_avx512<6, 1, cache_t>;
    if (head_dim == 256) return pick_wide<16, cache_t>(group);
    if (head_dim == 512) return pick_wide<32, cache_t>(group);
#elif defined(__AVX2__) && defined(__FMA__)
    if (head_dim == 64) return decode_sequence_avx2<8, cache_t>;
    if (head_dim == 128) return decode_sequence_avx2<16, cache_t>;
    if (head_dim == 256) return pick_wide<32, cache_t>(group);
    if (head_dim == 512) return pick_wide<64, cache_t>(group);
#endif
    return decode_sequence<float, cache_t>;
  }
};
template <>
struct KernelPicker<float, float> : AvxKernelPicker<float> {};
template <>
struct KernelPicker<float, c10::BFloat16> : AvxKernelPicker<c10::BFloat16> {};

template <typename scalar_t, typename cache_t>
void run_decode(const DecodeProblem<scalar_t, cache_t>& problem, int64_t num_seqs) {
  const auto kernel = KernelPicker<scalar_t, cache_t>::pick(problem.head_dim, problem.group());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_seqs));
  // Round-robin over sequences: the caller sorts them longest first, so threads get equal work.
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tid = begin; tid < end; ++tid)
      for (int64_t n = tid; n < num_seqs; n += threads) kernel(problem, n);
  });
}

// out [N, H, D] contiguous; q [N, H, D] (head rows contiguous); k_cache / v_cache
// [num_blocks, block_size, KVH, D] with contiguous blocks; block_table int32 [N, max_blocks];
// seq_lens int32 [N] (>= 1). sliding_window <= 0: full attention; softcap <= 0: none; sinks float32 [H].
void paged_decode_attention(
    at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t sliding_window,
    double softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous, shaped like q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [N, H, D] with contiguous head rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3),
              "k_cache must be [num_blocks, block_size, KVH, D] with contiguous blocks");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(), "v_cache like k_cache");
  const bool narrow_cache = q.scalar_type() == at::kFloat &&
                            (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf);
  TORCH_CHECK((q.scalar_type() == k_cache.scalar_type() || narrow_cache) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "out and q must share a dtype; k_cache and v_cache theirs, or bf16/fp16 under float32 queries");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table: int32 rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens: contiguous int32");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(seq_lens.size(0) == num_seqs && block_table.size(0) == num_seqs, "one row per sequence");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == num_heads),
              "sinks: contiguous float32 [H]");

  auto run = [&](auto* q_type, auto* cache_type) {
    using scalar_t = std::remove_pointer_t<decltype(q_type)>;
    using cache_t = std::remove_pointer_t<decltype(cache_type)>;
    const DecodeProblem<scalar_t, cache_t> problem{
        out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k_cache.data_ptr<cache_t>(), v_cache.data_ptr<cache_t>(),
        block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), num_heads, num_kv_heads, head_dim,
        k_cache.size(1), q.stride(0), q.stride(1), k_cache.stride(0), block_table.stride(0),
        static_cast<float>(scale), sliding_window, static_cast<float>(softcap),
        sinks ? sinks->data_ptr<float>() : nullptr};
    run_decode(problem, num_seqs);
  };
  if (k_cache.scalar_type() == at::kBFloat16 && narrow_cache) {
    run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  } else if (k_cache.scalar_type() == at::kHalf && narrow_cache) {
    run(static_cast<float*>(nullptr), static_cast<c10::Half*>(nullptr));
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      run(static_cast<scalar_t*>(nullptr), static_cast<scalar_t*>(nullptr));
    });
  }
}

// Copies row i of k and v ([T, KVH, D], head rows contiguous) to slot slot_mapping[i] of
// k_cache / v_cache ([num_blocks, block_size, KVH, D], contiguous blocks).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.dim() == 3 && v.stride(2) == 1, "k, v: [T, KVH, D] rows");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "shapes");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) == k_cache.size(2) * k_cache.size(3) && v_cache.strides() == k_cache.strides(),
              "caches must have contiguous blocks");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "dtypes");
  const int64_t tokens = k.size(0), heads = k.size(1), head_dim = k.size(2), block_size = k_cache.size(1);
  const int64_t row = heads * head_dim, block_stride = k_cache.stride(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t offset = slots[i] / block_size * block_stride + slots[i] % block_size * row;
        for (int64_t h = 0; h < heads; ++h) {
          std::copy_n(kp + i * k.stride(0) + h * k.stride(1), head_dim, kc + offset + h * head_dim);
          std::copy_n(vp + i * v.stride(0) + h * v.stride(1), head_dim, vc + offset + h * head_dim);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor seq_lens, float scale, int sliding_window, float softcap, Tensor? sinks) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
}
