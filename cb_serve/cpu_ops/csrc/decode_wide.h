// paged_decode_attention's kernel for heads too wide for registers (head_dim 256 and 512; 96 on AVX2), on
// AVX-512 or AVX2.
#pragma once

#include "decode_simd.h"

namespace paged_decode {

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
  constexpr int C = L == 16 ? 16 / G : (G == 4 ? 2 : 4);  // output vectors per pass over V (16 or 32 registers)
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

}  // namespace paged_decode
