// LoRA for a ragged batch of tokens of several adapters (Punica's BGMV, on the CPU): per token t
// with slot s = token_slots[t] >= 0 and rank r = ranks[s],
//     out[t, :] += (A[s, :r, :] @ x[t, :]) @ B[s, :r, :]
// in one call for every adapter of the step (a torch-ops version needs a gather and two GEMMs per
// adapter). Float32; parallel over tiles of one adapter's tokens; dot products and row updates vectorized.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kMaxRankRows = 4096;
constexpr int64_t kTile = 16;  // tokens of one adapter sharing its rows

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* __restrict y, float alpha, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// h[i * r + j] = x[tok[i]] . a[j] for 4 rows j0.. of A and 4 tokens i0..: 16 accumulators, 8 loads
// per 16 multiply-adds (a dot product at a time loads 2 per 1).
inline void shrink_4x4(const float* const* x, const float* a, int64_t k_dim, float* h, int64_t r, int64_t i0,
                       int64_t j0) {
  const float *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
  const float *a0 = a, *a1 = a + k_dim, *a2 = a + 2 * k_dim, *a3 = a + 3 * k_dim;
  float s00 = 0, s01 = 0, s02 = 0, s03 = 0, s10 = 0, s11 = 0, s12 = 0, s13 = 0;
  float s20 = 0, s21 = 0, s22 = 0, s23 = 0, s30 = 0, s31 = 0, s32 = 0, s33 = 0;
#pragma omp simd reduction(+ : s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33)
  for (int64_t k = 0; k < k_dim; ++k) {
    const float v0 = x0[k], v1 = x1[k], v2 = x2[k], v3 = x3[k];
    const float w0 = a0[k], w1 = a1[k], w2 = a2[k], w3 = a3[k];
    s00 += v0 * w0, s01 += v0 * w1, s02 += v0 * w2, s03 += v0 * w3;
    s10 += v1 * w0, s11 += v1 * w1, s12 += v1 * w2, s13 += v1 * w3;
    s20 += v2 * w0, s21 += v2 * w1, s22 += v2 * w2, s23 += v2 * w3;
    s30 += v3 * w0, s31 += v3 * w1, s32 += v3 * w2, s33 += v3 * w3;
  }
  const float s[4][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}, {s20, s21, s22, s23}, {s30, s31, s32, s33}};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) h[(i0 + i) * r + j0 + j] = s[i][j];
}

// y_i[n0 : n0 + kChunk] += sum_j h[i * r + j] * b[j, n0 : n0 + kChunk] for 4 tokens: each row chunk
// of B loaded once for the 4 of them, the 4 output chunks held in registers over all r rows.
constexpr int64_t kChunk = 32;
inline void expand_4(float* const* y, const float* b, int64_t n_dim, const float* h, int64_t r, int64_t i0,
                     int64_t n0) {
  float acc[4][kChunk];
  for (int i = 0; i < 4; ++i)
    for (int64_t c = 0; c < kChunk; ++c) acc[i][c] = y[i][n0 + c];
  for (int64_t j = 0; j < r; ++j) {
    const float* bj = b + j * n_dim + n0;
    const float h0 = h[i0 * r + j], h1 = h[(i0 + 1) * r + j], h2 = h[(i0 + 2) * r + j], h3 = h[(i0 + 3) * r + j];
#pragma omp simd
    for (int64_t c = 0; c < kChunk; ++c) {
      const float w = bj[c];
      acc[0][c] += h0 * w, acc[1][c] += h1 * w, acc[2][c] += h2 * w, acc[3][c] += h3 * w;
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int64_t c = 0; c < kChunk; ++c) y[i][n0 + c] = acc[i][c];
}

void lora_apply(at::Tensor out, const at::Tensor& x, const at::Tensor& a_stack, const at::Tensor& b_stack,
                const at::Tensor& token_slots, const at::Tensor& ranks) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous float32 [T, K]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat, "out: float32 [T, N] rows");
  TORCH_CHECK(a_stack.dim() == 3 && a_stack.is_contiguous() && a_stack.scalar_type() == at::kFloat, "a: [S, R, K]");
  TORCH_CHECK(b_stack.dim() == 3 && b_stack.is_contiguous() && b_stack.scalar_type() == at::kFloat, "b: [S, R, N]");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous(), "token_slots: int64 [T]");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous(), "ranks: int64 [S]");
  const int64_t t_dim = x.size(0), k_dim = x.size(1), n_dim = out.size(1);
  const int64_t s_dim = a_stack.size(0), r_max = a_stack.size(1);
  TORCH_CHECK(out.size(0) == t_dim && token_slots.numel() == t_dim, "one slot per token");
  TORCH_CHECK(a_stack.size(2) == k_dim && b_stack.size(0) == s_dim && b_stack.size(1) == r_max &&
                  b_stack.size(2) == n_dim && ranks.numel() == s_dim && r_max <= kMaxRankRows,
              "a_stack [S, R, K], b_stack [S, R, N], ranks [S]");
  const float* xp = x.data_ptr<float>();
  const float* ap = a_stack.data_ptr<float>();
  const float* bp = b_stack.data_ptr<float>();
  const int64_t* slots = token_slots.data_ptr<int64_t>();
  const int64_t* rp = ranks.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t out_stride = out.stride(0);
  // Tokens by slot, cut into tiles (the parallel work items); within a tile, 4 tokens at a time share
  // each row of their adapter's A and B as it is loaded (per token alone, each would stream the whole
  // adapter again).
  std::vector<std::vector<int64_t>> by_slot(static_cast<size_t>(s_dim));
  for (int64_t t = 0; t < t_dim; ++t) {
    const int64_t s = slots[t];
    TORCH_CHECK(s < s_dim, "token slot out of range");
    if (s >= 0 && rp[s] > 0) by_slot[s].push_back(t);
  }
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (slot, first index into by_slot[slot])
  for (int64_t s = 0; s < s_dim; ++s)
    for (int64_t i = 0; i < static_cast<int64_t>(by_slot[s].size()); i += kTile) tiles.emplace_back(s, i);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(static_cast<size_t>(kTile * r_max));
    for (int64_t w = begin; w < end; ++w) {
      const auto [s, first] = tiles[w];
      const int64_t* tok = by_slot[s].data() + first;
      const int64_t m = std::min<int64_t>(kTile, static_cast<int64_t>(by_slot[s].size()) - first);
      const int64_t r = std::min(rp[s], r_max);
      const float* a = ap + s * r_max * k_dim;
      const float* b = bp + s * r_max * n_dim;
      const float* x_rows[kTile];
      float* y_rows[kTile];
      for (int64_t i = 0; i < m; ++i) x_rows[i] = xp + tok[i] * k_dim, y_rows[i] = op + tok[i] * out_stride;
      const int64_t m4 = m / 4 * 4, r4 = r / 4 * 4;
      for (int64_t i0 = 0; i0 < m4; i0 += 4) {  // 4 tokens at a time: shrink, then expand
        for (int64_t j0 = 0; j0 < r4; j0 += 4) shrink_4x4(x_rows + i0, a + j0 * k_dim, k_dim, h.data(), r, i0, j0);
        for (int64_t j = r4; j < r; ++j)
          for (int64_t i = i0; i < i0 + 4; ++i) h[i * r + j] = dot(x_rows[i], a + j * k_dim, k_dim);
        const int64_t full = n_dim / kChunk * kChunk;
        for (int64_t n0 = 0; n0 < full; n0 += kChunk) expand_4(y_rows + i0, b, n_dim, h.data(), r, i0, n0);
        for (int64_t i = i0; i < i0 + 4; ++i)  // the columns past the last whole chunk
          for (int64_t j = 0; j < r; ++j) axpy(y_rows[i] + full, h[i * r + j], b + j * n_dim + full, n_dim - full);
      }
      for (int64_t i = m4; i < m; ++i) {  // the rest one by one
        for (int64_t j = 0; j < r; ++j) h[i * r + j] = dot(x_rows[i], a + j * k_dim, k_dim);
        for (int64_t j = 0; j < r; ++j) axpy(y_rows[i], h[i * r + j], b + j * n_dim, n_dim);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("lora_apply(Tensor(a!) out, Tensor x, Tensor a_stack, Tensor b_stack, Tensor token_slots, Tensor ranks) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) { m.impl("lora_apply", &lora_apply); }
