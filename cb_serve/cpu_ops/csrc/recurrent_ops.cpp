// Decode steps of recurrent layers, in place on each sequence's state slot (one pass to read, one to
// update), in HF transformers' op order (float32, no FMA contraction):
//   gated_delta_rule_decode  S = S * decay; kv = S^T k; delta = (v - kv) * beta; S += k delta^T; out = S^T q
//                            (torch_recurrent_gated_delta_rule; its sums over the key dim in torch's cascade
//                            order, so the states and outputs are eager PyTorch's bit for bit)
//   mamba2_decode            S = S * dA + (dt B) x^T; out = S C + D x   (mamba2_selective_state_update; the
//                            output's sum over the state dim in order, where torch's bmm picks its own)
// One task per (sequence, head); q, k (normalized, q scaled) and the gates are prepared by the caller.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLevels = 4;  // torch's cascade_sum (aten/src/ATen/native/cpu/SumKernel.cpp, multi_row_sum)

int64_t ceil_log2(int64_t x) {
  int64_t r = 0;
  while ((int64_t{1} << r) < x) ++r;
  return r;
}

// acc[c0..c1) = sums over `count` rows (row i is `first + i * stride`) of value(row, c), as torch's multi_row_sum
// sums them: blocks of 2^p rows in order, each block's sum cascaded into higher levels.
template <typename Value>
void cascade(float* acc, float* levels, int64_t first, int64_t stride, int64_t count, int64_t c0, int64_t c1,
             Value&& value) {
  const int64_t cols = c1 - c0;
  const int64_t power = std::max<int64_t>(4, ceil_log2(count) / kLevels), step = int64_t{1} << power;
  const int64_t mask = step - 1;
  std::fill(levels, levels + kLevels * cols, 0.f);
  auto add_row = [&](int64_t i) {
    const int64_t r = first + i * stride;
    for (int64_t c = c0; c < c1; ++c) levels[c - c0] += value(r, c);
  };
  int64_t i = 0;
  while (i + step <= count) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int l = 1; l < kLevels; ++l) {
      float* up = levels + l * cols;
      float* down = levels + (l - 1) * cols;
      for (int64_t c = 0; c < cols; ++c) {
        up[c] += down[c];
        down[c] = 0.f;
      }
      if ((i & (mask << (l * power))) != 0) break;
    }
  }
  for (; i < count; ++i) add_row(i);
  for (int64_t c = c0; c < c1; ++c) {
    float sum = levels[c - c0];
    for (int l = 1; l < kLevels; ++l) sum += levels[l * cols + c - c0];
    acc[c] = sum;
  }
}

// out[c] = sum over rows r < rows of value(r, c) for c < cols, in the order torch's sum over a non-innermost dim
// (vectorized_outer_sum) adds them: columns in groups of 4 vectors of `vec` floats by `cascade`, the rest by
// row_sum (4 interleaved partial sums over rows i = k mod 4, the leftover rows into the first, then combined).
// `scratch`: 8 * cols floats.
template <typename Value>
void torch_column_sums(float* out, float* scratch, int64_t rows, int64_t cols, int64_t vec, Value&& value) {
  float *levels = scratch, *partial = scratch + kLevels * cols;
  const int64_t grouped = cols / (4 * vec) * (4 * vec), quarter = rows / 4;
  if (grouped > 0) cascade(out, levels, 0, 1, rows, 0, grouped, value);
  if (grouped == cols) return;
  for (int64_t k = 0; k < 4; ++k) cascade(partial + k * cols, levels, k, 4, quarter, grouped, cols, value);
  for (int64_t r = quarter * 4; r < rows; ++r)
    for (int64_t c = grouped; c < cols; ++c) partial[c] += value(r, c);
  for (int64_t c = grouped; c < cols; ++c)
    out[c] = ((partial[c] + partial[cols + c]) + partial[2 * cols + c]) + partial[3 * cols + c];
}

void check_slots(const at::Tensor& states, const at::Tensor& slots, int64_t n) {
  TORCH_CHECK(states.is_contiguous() && states.scalar_type() == at::kFloat, "states must be contiguous float32");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == n && slots.scalar_type() == at::kLong, "slots: int64 [N]");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(s[i] >= 0 && s[i] < states.size(0), "slot out of range");
}

void check_float(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim && t.is_contiguous() && t.scalar_type() == at::kFloat, name, ": contiguous float32");
}

// states [slots, Hv, Dk, Dv]; out, v [N, Hv, Dv]; q, k [N, Hk, Dk] (value head h reads key head h / (Hv / Hk));
// decay (exp(g)), beta [N, Hv]; vec: the floats per vector of torch's sum kernel (its AVX2 build's 8 on x86).
void gated_delta_rule_decode(at::Tensor states, at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& decay, const at::Tensor& beta,
                             const at::Tensor& slots, int64_t vec) {
  const int64_t n = v.size(0), hv = states.size(1), dk = states.size(2), dv = states.size(3);
  check_slots(states, slots, n);
  check_float(out, 3, "out");
  check_float(v, 3, "v");
  check_float(q, 3, "q");
  check_float(k, 3, "k");
  check_float(decay, 2, "decay");
  check_float(beta, 2, "beta");
  const int64_t hk = q.size(1);
  TORCH_CHECK(v.size(1) == hv && v.size(2) == dv && out.sizes() == v.sizes() && q.size(2) == dk &&
                  k.sizes() == q.sizes() && hv % hk == 0 && decay.size(1) == hv && beta.sizes() == decay.sizes(),
              "shapes");
  const int64_t ratio = hv / hk;
  float* S = states.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::parallel_for(0, n * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(8 * dv), kv(dv), delta(dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / hv, h = task % hv;
      float* s = S + (sp[i] * hv + h) * dk * dv;
      const float* kh = kp + (i * hk + h / ratio) * dk;
      const float* qh = qp + (i * hk + h / ratio) * dk;
      const float d = dp[i * hv + h], b = bp[i * hv + h];
      torch_column_sums(kv.data(), scratch.data(), dk, dv, vec, [&](int64_t r, int64_t c) {
        return (s[r * dv + c] * d) * kh[r];
      });
      const float* vh = vp + (i * hv + h) * dv;
      for (int64_t c = 0; c < dv; ++c) delta[c] = (vh[c] - kv[c]) * b;
      for (int64_t r = 0; r < dk; ++r)
        for (int64_t c = 0; c < dv; ++c) s[r * dv + c] = s[r * dv + c] * d + kh[r] * delta[c];
      torch_column_sums(o + (i * hv + h) * dv, scratch.data(), dk, dv, vec,
                        [&](int64_t r, int64_t c) { return s[r * dv + c] * qh[r]; });
    }
  });
}

// states [slots, H, P, N]; out, x [B, H, P]; dt (after softplus), dA (exp(dt A)), D [B, H] / [H];
// b, c [B, G, N] (head h reads group h / (H / G)).
void mamba2_decode(at::Tensor states, at::Tensor out, const at::Tensor& x, const at::Tensor& dt,
                   const at::Tensor& da, const at::Tensor& b, const at::Tensor& c, const at::Tensor& d,
                   const at::Tensor& slots) {
  const int64_t batch = x.size(0), heads = states.size(1), p = states.size(2), ns = states.size(3);
  check_slots(states, slots, batch);
  check_float(out, 3, "out");
  check_float(x, 3, "x");
  check_float(dt, 2, "dt");
  check_float(da, 2, "dA");
  check_float(b, 3, "B");
  check_float(c, 3, "C");
  check_float(d, 1, "D");
  const int64_t groups = b.size(1);
  TORCH_CHECK(x.size(1) == heads && x.size(2) == p && out.sizes() == x.sizes() && heads % groups == 0 &&
                  b.size(2) == ns && c.sizes() == b.sizes() && d.size(0) == heads,
              "shapes");
  const int64_t per = heads / groups;
  float* S = states.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *dap = da.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *cp = c.data_ptr<float>(), *Dp = d.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> db(ns);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / heads, h = task % heads, g = h / per;
      float* s = S + (sp[i] * heads + h) * p * ns;
      const float step = dtp[i * heads + h], decay = dap[i * heads + h];
      const float* bg = bp + (i * groups + g) * ns;
      const float* cg = cp + (i * groups + g) * ns;
      const float* xh = xp + (i * heads + h) * p;
      for (int64_t j = 0; j < ns; ++j) db[j] = step * bg[j];
      for (int64_t r = 0; r < p; ++r) {
        float* row = s + r * ns;
        float acc = 0.f;
        for (int64_t j = 0; j < ns; ++j) {
          row[j] = row[j] * decay + db[j] * xh[r];
          acc += row[j] * cg[j];
        }
        o[(i * heads + h) * p + r] = acc + xh[r] * Dp[h];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def(
      "gated_delta_rule_decode(Tensor(a!) states, Tensor(b!) out, Tensor q, Tensor k, Tensor v, Tensor decay, "
      "Tensor beta, Tensor slots, int vec) -> ()");
  m.def(
      "mamba2_decode(Tensor(a!) states, Tensor(b!) out, Tensor x, Tensor dt, Tensor dA, Tensor B, Tensor C, "
      "Tensor D, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) {
  m.impl("gated_delta_rule_decode", &gated_delta_rule_decode);
  m.impl("mamba2_decode", &mamba2_decode);
}
