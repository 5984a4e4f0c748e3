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
  // Tokens by slot, cut into tiles: a tile's tokens share every row of their adapter's A and B while
  // it is in L1 (per token alone, each would stream the whole adapter from L2 again).
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
      for (int64_t j = 0; j < r; ++j)  // shrink: row j of A against every token of the tile
        for (int64_t i = 0; i < m; ++i) h[i * r + j] = dot(xp + tok[i] * k_dim, a + j * k_dim, k_dim);
      for (int64_t j = 0; j < r; ++j)  // expand: row j of B into every token of the tile
        for (int64_t i = 0; i < m; ++i) axpy(op + tok[i] * out_stride, h[i * r + j], b + j * n_dim, n_dim);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("lora_apply(Tensor(a!) out, Tensor x, Tensor a_stack, Tensor b_stack, Tensor token_slots, Tensor ranks) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) { m.impl("lora_apply", &lora_apply); }
