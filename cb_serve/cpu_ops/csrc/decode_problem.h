// paged_decode_attention's problem (DecodeProblem: one call's operands, the softmax's soft-cap and sinks)
// and its generic kernel (any dtype and head_dim). The vectorized kernels: decode_simd.h, decode_wide.h.
#pragma once

#include <ATen/ATen.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace paged_decode {

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

}  // namespace paged_decode
