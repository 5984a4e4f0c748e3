// Causal attention of prefill chunks over the paged KV cache (their own new tokens already written
// to it): flash-attention style tiles of 16 queries x 16 keys with an online softmax, float32
// queries and cache, head_dim 64, 128 or 256 (Gemma). One work item is a (sequence, KV head): its K and V rows
// are gathered once and reused by all of the KV head's query heads and 16-query blocks. A block's
// queries are transposed so that one vector holds a key's scores against all 16 queries: the softmax
// runs with the queries as lanes, with no horizontal reductions. Items run longest first under OpenMP's dynamic schedule.
// Optional: scores soft-capped (cap * tanh(s / cap)) per tile, and a per-head sink logit that starts each
// row's online softmax (max = sink, sum = 1) as a column with no value; and per query row the last key it
// sees (`reach`, its own position where causal): an image's tokens see its later tokens too (Gemma 3), and
// spans are contiguous, so "causal or in my image" is "key <= reach" (the window still counts from the row).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 16;

#if defined(__AVX512F__)
struct PrefillProblem {
  float* out;
  const float* q;
  const int32_t* cu_seqlens_q;
  const int32_t* seq_lens;
  const int32_t* block_table;
  int64_t num_heads, num_kv_heads, block_size, q_stride_t, q_stride_h, block_stride, table_stride;
  float scale;
  int64_t sliding_window;  // <= 0: none
  float softcap;           // <= 0: none
  const float* sinks;      // [num_heads] logits, or nullptr
  const int32_t* reach;    // [T]: each query row's last visible key position, or nullptr (causal)
};

template <int NV>
void prefill_item(const PrefillProblem& p, const float* k_cache, const float* v_cache, int64_t s, int64_t kv_head,
                  std::vector<float>& keys, std::vector<float>& values) {
  constexpr int64_t D = 16 * NV;
  constexpr int kSlice = NV < 8 ? NV : 8;  // vectors of the head per pass over V
  const int64_t q_start = p.cu_seqlens_q[s], q_len = p.cu_seqlens_q[s + 1] - q_start, k_len = p.seq_lens[s];
  const int64_t first_pos = k_len - q_len, padded = (k_len + kTile - 1) / kTile * kTile;
  keys.assign(padded * D, 0.f);  // [padded][D], this KV head's rows
  values.assign(padded * D, 0.f);
  const int32_t* table = p.block_table + s * p.table_stride;
  for (int64_t t = 0; t < k_len; ++t) {
    const int64_t offset =
        table[t / p.block_size] * p.block_stride + ((t % p.block_size) * p.num_kv_heads + kv_head) * D;
    std::copy_n(k_cache + offset, D, keys.data() + t * D);
    std::copy_n(v_cache + offset, D, values.data() + t * D);
  }
  const int64_t group = p.num_heads / p.num_kv_heads;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float q_t[D][kTile];       // the query block transposed: one vector of 16 rows per d
  alignas(64) float probs[kTile][kTile];  // [key][row]
  alignas(64) float rescale[kTile];
  alignas(64) float acc[kTile][D];
  for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    for (int64_t r0 = 0; r0 < q_len; r0 += kTile) {
      const int64_t rows = std::min(kTile, q_len - r0);
      const __mmask16 real_rows = static_cast<__mmask16>((1u << rows) - 1);
      const float* q0 = p.q + (q_start + r0) * p.q_stride_t + h * p.q_stride_h;
      const __m512i row_offsets = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(p.q_stride_t)));
      for (int64_t d = 0; d < D; ++d) {
        const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real_rows, row_offsets, q0 + d, 4);
        _mm512_store_ps(q_t[d], _mm512_mul_ps(column, _mm512_set1_ps(p.scale)));
      }
      for (int64_t r = 0; r < kTile; ++r) std::fill_n(acc[r], D, 0.f);
      // Per row (lane): running max and sum; row r sits at position first_pos + r0 + r.
      __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), l = _mm512_setzero_ps();
      if (p.sinks != nullptr) {  // the sink column: exp(sink - m) with m = sink
        m = _mm512_set1_ps(p.sinks[h]);
        l = _mm512_set1_ps(1.f);
      }
      const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first_pos + r0)), lane);
      const __m512i reach = p.reach == nullptr ? pos : _mm512_mask_loadu_epi32(pos, real_rows, p.reach + q_start + r0);
      const int64_t last_pos = _mm512_mask_reduce_max_epi32(real_rows, reach);
      const int64_t lo = p.sliding_window > 0 ? std::max<int64_t>(0, first_pos + r0 - p.sliding_window + 1) : 0;
      for (int64_t k0 = lo / kTile * kTile; k0 <= last_pos; k0 += kTile) {
        __m512 scores[kTile];  // scores[j]: key k0 + j against the 16 rows
#pragma GCC unroll 16
        for (int64_t j = 0; j < kTile; ++j) scores[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
          const __m512 qd = _mm512_load_ps(q_t[d]);
#pragma GCC unroll 16
          for (int64_t j = 0; j < kTile; ++j)
            scores[j] = _mm512_fmadd_ps(_mm512_set1_ps(keys[(k0 + j) * D + d]), qd, scores[j]);
        }
        if (p.softcap > 0) {
          const __m512 cap = _mm512_set1_ps(p.softcap), inv = _mm512_set1_ps(1.f / p.softcap);
#pragma GCC unroll 16
          for (int64_t j = 0; j < kTile; ++j) scores[j] = _mm512_mul_ps(cap, tanh512(_mm512_mul_ps(scores[j], inv)));
        }
        __mmask16 valid[kTile];
        __m512 tile_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 16
        for (int64_t j = 0; j < kTile; ++j) {
          const __m512i key = _mm512_set1_epi32(static_cast<int>(k0 + j));
          valid[j] = _mm512_mask_cmple_epi32_mask(real_rows, key, reach);
          if (p.sliding_window > 0)
            valid[j] &= _mm512_cmpgt_epi32_mask(key, _mm512_sub_epi32(pos, _mm512_set1_epi32(static_cast<int>(p.sliding_window))));
          tile_max = _mm512_mask_max_ps(tile_max, valid[j], tile_max, scores[j]);
        }
        const __m512 m_new = _mm512_max_ps(m, tile_max);
        // Rows with no valid key yet keep m = -inf; exp(-inf - -inf) would be NaN, so they rescale by 1.
        const __mmask16 live = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
        const __m512 r = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.f), exp512(_mm512_sub_ps(m, m_new)));
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int64_t j = 0; j < kTile; ++j) {
          const __m512 e = _mm512_maskz_mov_ps(valid[j], exp512(_mm512_sub_ps(scores[j], m_new)));
          _mm512_store_ps(probs[j], e);
          sum = _mm512_add_ps(sum, e);
        }
        l = _mm512_fmadd_ps(l, r, sum);
        m = m_new;
        _mm512_store_ps(rescale, r);
        // 4 rows at a time share each V row's loads (rows past `rows` have zero probabilities), over slices
        // of up to 8 vectors of the head (its accumulators in registers).
        for (int64_t first = 0; first < rows; first += 4) {
          for (int64_t slice = 0; slice < NV; slice += kSlice) {
            __m512 o[4][kSlice];
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i)
#pragma GCC unroll 8
              for (int j = 0; j < kSlice; ++j)
                o[i][j] = _mm512_mul_ps(_mm512_load_ps(acc[first + i] + 16 * (slice + j)),
                                        _mm512_set1_ps(rescale[first + i]));
            for (int64_t t = 0; t < kTile; ++t) {
              const float* v = values.data() + (k0 + t) * D + 16 * slice;
              __m512 vv[kSlice];
#pragma GCC unroll 8
              for (int j = 0; j < kSlice; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
#pragma GCC unroll 4
              for (int i = 0; i < 4; ++i) {
                const __m512 w = _mm512_set1_ps(probs[t][first + i]);
#pragma GCC unroll 8
                for (int j = 0; j < kSlice; ++j) o[i][j] = _mm512_fmadd_ps(w, vv[j], o[i][j]);
              }
            }
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i)
#pragma GCC unroll 8
              for (int j = 0; j < kSlice; ++j) _mm512_store_ps(acc[first + i] + 16 * (slice + j), o[i][j]);
          }
        }
      }
      alignas(64) float inv[kTile];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
      for (int64_t r = 0; r < rows; ++r) {
        float* o = p.out + ((q_start + r0 + r) * p.num_heads + h) * D;
        for (int j = 0; j < NV; ++j)
          _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * j), _mm512_set1_ps(inv[r])));
      }
    }
  }
}

template <int NV>
void run_prefill(const PrefillProblem& p, const float* k_cache, const float* v_cache, int64_t first_seq,
                 int64_t num_seqs) {
  std::vector<std::pair<int64_t, int64_t>> items;  // (sequence, KV head), most work first
  for (int64_t s = first_seq; s < num_seqs; ++s)
    for (int64_t kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) items.emplace_back(s, kv_head);
  auto work = [&](int64_t s) {
    const int64_t q_len = p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s];
    return q_len * static_cast<int64_t>(p.seq_lens[s]);
  };
  std::stable_sort(items.begin(), items.end(), [&](auto a, auto b) { return work(a.first) > work(b.first); });
#pragma omp parallel
  {
    thread_local std::vector<float> keys, values;  // kept between calls: no page faults per layer
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i)
      prefill_item<NV>(p, k_cache, v_cache, items[i].first, items[i].second, keys, values);
  }
}
#endif

// out, q [T, H, D] (float32; out contiguous, q head rows contiguous); k_cache / v_cache
// [num_blocks, block_size, KVH, D] float32 with contiguous blocks; sequences first_seq..B-1
// of cu_seqlens_q (int32 [B + 1]), seq_lens (int32 [B], keys per sequence, the new ones last) and
// block_table (int32 [B, max_blocks]) are computed; other rows of out are left alone. softcap <= 0: none;
// sinks: float32 [H] or none; reach: int32 [T] (each query row's last visible key position) or none (causal).
bool paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_table,
                             int64_t first_seq, double scale, int64_t sliding_window, double softcap,
                             const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& reach) {
#if defined(__AVX512F__)
  const int64_t head_dim = q.size(2);
  // A narrower (bf16/fp16) cache stays with the PyTorch path, which attends over the new tokens'
  // unrounded K/V as the reference does.
  if (q.scalar_type() != at::kFloat || k_cache.scalar_type() != at::kFloat ||
      (head_dim != 64 && head_dim != 128 && head_dim != 256))
    return false;
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == at::kFloat, "out like q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with contiguous head rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == head_dim && k_cache.stride(3) == 1 &&
                  k_cache.stride(2) == head_dim && k_cache.stride(1) == k_cache.size(2) * head_dim &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache / v_cache must be [num_blocks, block_size, KVH, D] with contiguous blocks");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "cu_seqlens_q, seq_lens, block_table: int32");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(cu_seqlens_q.size(0) == num_seqs + 1 && block_table.size(0) == num_seqs && q.size(1) % k_cache.size(2) == 0,
              "one row per sequence");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1)),
              "sinks: contiguous float32 [H]");
  TORCH_CHECK(!reach || (reach->scalar_type() == at::kInt && reach->is_contiguous() && reach->numel() == q.size(0)),
              "reach: contiguous int32 [T]");
  const PrefillProblem problem{out.data_ptr<float>(), q.data_ptr<float>(), cu_seqlens_q.data_ptr<int32_t>(),
                               seq_lens.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(), q.size(1),
                               k_cache.size(2), k_cache.size(1), q.stride(0), q.stride(1), k_cache.stride(0),
                               block_table.stride(0), static_cast<float>(scale), sliding_window,
                               static_cast<float>(softcap), sinks ? sinks->data_ptr<float>() : nullptr,
                               reach ? reach->data_ptr<int32_t>() : nullptr};
  const float* k = k_cache.data_ptr<float>();
  const float* v = v_cache.data_ptr<float>();
  if (head_dim == 64) {
    run_prefill<4>(problem, k, v, first_seq, num_seqs);
  } else if (head_dim == 128) {
    run_prefill<8>(problem, k, v, first_seq, num_seqs);
  } else {
    run_prefill<16>(problem, k, v, first_seq, num_seqs);
  }
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, "
      "Tensor seq_lens, Tensor block_table, int first_seq, float scale, int sliding_window, float softcap, "
      "Tensor? sinks, Tensor? reach=None) -> bool");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
