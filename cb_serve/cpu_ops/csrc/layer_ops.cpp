// Fused per-token CPU ops of a decoder layer, in HF transformers' op order (float32 math):
//   rms_norm            out = w * (x * rsqrt(mean(x^2) + eps))
//   fused_add_rms_norm  residual += x; x = rms_norm(residual)
//   rotary_embedding    in place on q and k heads: x * cos + rotate_half(x) * sin
//   silu_and_mul        out = silu(x[:, :I]) * x[:, I:]
//   gelu_tanh_and_mul   out = gelu_tanh(x[:, :I]) * x[:, I:]
//   argmax_rows         per float32 row: the first maximum's index (the first NaN's, if any), as torch.max(-1)
//   moe_combine         out[t] = 0 + y[rows[t, 0]] * w[t, 0] + y[rows[t, 1]] * w[t, 1] + ... (a mixture of experts)
// Each replaces 4-8 eager ops (and their temporaries) with one pass over the rows.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // below this many elements a call runs on one thread

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

template <typename scalar_t>
void normalize_row(scalar_t* out, const scalar_t* x, const scalar_t* w, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<scalar_t>(static_cast<float>(w[i]) *
                                   static_cast<float>(static_cast<scalar_t>(static_cast<float>(x[i]) * inv)));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [T, H] with contiguous rows");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.is_contiguous() && weight.size(0) == x.size(1), "shapes");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "dtypes");
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        normalize_row(out.data_ptr<scalar_t>() + r * out.stride(0), x.data_ptr<scalar_t>() + r * x.stride(0),
                      weight.data_ptr<scalar_t>(), n, static_cast<float>(eps));
    });
  });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && weight.is_contiguous() && weight.size(0) == x.size(1), "shapes");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "dtypes");
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = x.data_ptr<scalar_t>() + r * x.stride(0);
        scalar_t* rr = residual.data_ptr<scalar_t>() + r * residual.stride(0);
        for (int64_t i = 0; i < n; ++i) rr[i] = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        normalize_row(xr, rr, weight.data_ptr<scalar_t>(), n, static_cast<float>(eps));
      }
    });
  });
}

// qk [T, heads, D] (the q and k heads of a fused qkv row; head rows contiguous), positions int64 [T],
// cos / sin float32 [max_positions, D].
void rotary_embedding(at::Tensor qk, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be [T, heads, D] with contiguous head rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == qk.size(0),
              "positions: int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous() && cos.size(1) == qk.size(2) && qk.size(2) % 2 == 0,
              "cos / sin: float32 [max_positions, D]");
  const int64_t heads = qk.size(1), dim = qk.size(2), half = dim / 2, max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotary_embedding", [&] {
    at::parallel_for(0, qk.size(0), grain(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range of the RoPE table");
        // HF casts the tables to the activation dtype before multiplying.
        const float* c = cos.data_ptr<float>() + pos[t] * dim;
        const float* s = sin.data_ptr<float>() + pos[t] * dim;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* x = qk.data_ptr<scalar_t>() + t * qk.stride(0) + h * qk.stride(1);
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            const float c1 = static_cast<scalar_t>(c[i]), c2 = static_cast<scalar_t>(c[i + half]);
            const float s1 = static_cast<scalar_t>(s[i]), s2 = static_cast<scalar_t>(s[i + half]);
            const float a = static_cast<scalar_t>(x1 * c1), b = static_cast<scalar_t>(-x2 * s1);
            const float d = static_cast<scalar_t>(x2 * c2), e = static_cast<scalar_t>(x1 * s2);
            x[i] = static_cast<scalar_t>(a + b);
            x[i + half] = static_cast<scalar_t>(d + e);
          }
        }
      }
    });
  });
}

// The gated MLP's activations: SiLU, and GELU with the tanh approximation (torch's approximate="tanh":
// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))), in float math.
enum class Act { kSilu, kGeluTanh };
constexpr float kGeluBeta = 0.7978845608028654f, kGeluKappa = 0.044715f;

template <Act A>
inline float act_scalar(float g) {
  if constexpr (A == Act::kSilu) return g / (1.f + std::exp(-g));
  return 0.5f * g * (1.f + std::tanh(kGeluBeta * (g + kGeluKappa * g * g * g)));
}

#if defined(__AVX512F__)
template <Act A>
inline __m512 act512(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.f);
  if constexpr (A == Act::kSilu) return _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(kGeluBeta), _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(kGeluKappa), cube)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, tanh512(inner)));
}
#elif defined(__AVX2__) && defined(__FMA__)
template <Act A>
inline __m256 act256(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.f);
  if constexpr (A == Act::kSilu) return _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(kGeluBeta), _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), cube)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, tanh256(inner)));
}
#endif

// out = act(x[:, :I]) * x[:, I:].
template <Act A>
void act_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1) && x.scalar_type() == out.scalar_type(),
              "x must be [T, 2I] and out [T, I] of one dtype");
  const int64_t n = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "act_and_mul", [&] {
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = x.data_ptr<scalar_t>() + r * x.stride(0);
        const scalar_t* up = gate + n;
        scalar_t* o = out.data_ptr<scalar_t>() + r * out.stride(0);
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, float>) {
          for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(act512<A>(_mm512_loadu_ps(gate + i)), _mm512_loadu_ps(up + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<scalar_t, float>) {
          for (; i + 8 <= n; i += 8) {
            // (reinterpret_cast: this branch is compiled, though never run, for every dispatched type)
            const __m256 g = _mm256_loadu_ps(reinterpret_cast<const float*>(gate + i));
            _mm256_storeu_ps(reinterpret_cast<float*>(o + i),
                             _mm256_mul_ps(act256<A>(g), _mm256_loadu_ps(reinterpret_cast<const float*>(up + i))));
          }
        }
#endif
        for (; i < n; ++i) {
          const float act = static_cast<scalar_t>(act_scalar<A>(gate[i]));
          o[i] = static_cast<scalar_t>(act * static_cast<float>(up[i]));
        }
      }
    });
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) { act_and_mul<Act::kSilu>(out, x); }
void gelu_tanh_and_mul(at::Tensor out, const at::Tensor& x) { act_and_mul<Act::kGeluTanh>(out, x); }

// A mixture-of-experts layer's combine: each token's expert outputs (rows of y, float32 [P, H]), each times its
// routing weight (rounded, then added: no FMA contraction), summed from zero in the order of rows[t] (int64
// [T, k]: ascending expert, as HF's index_add_ loop adds them; -1: an expert another rank holds, skipped).
void moe_combine(at::Tensor out, const at::Tensor& y, const at::Tensor& rows, const at::Tensor& weights) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat, "y: contiguous float32 [P, H]");
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == at::kLong, "rows: int64 [T, k]");
  TORCH_CHECK(weights.sizes() == rows.sizes() && weights.is_contiguous() && weights.scalar_type() == at::kFloat,
              "weights: float32 [T, k]");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.dim() == 2 &&
                  out.size(0) == rows.size(0) && out.size(1) == y.size(1),
              "out: float32 [T, H]");
  const int64_t tokens = rows.size(0), k = rows.size(1), h = y.size(1), pairs = y.size(0);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens * k; ++i) TORCH_CHECK(row[i] >= -1 && row[i] < pairs, "rows out of range");
  const float* yp = y.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = op + t * h;
      std::fill_n(o, h, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = row[t * k + j];
        if (r < 0) continue;
        const float w = wp[t * k + j];
        const float* src = yp + r * h;
        for (int64_t c = 0; c < h; ++c) o[c] += src[c] * w;
      }
    }
  });
}

// Grammar bitmask (llguidance/xgrammar layout: bit j of int32 word k allows token 32k + j): the
// blocked tokens of logits row rows[i] become -inf, per the bitmask's row i; other rows untouched.
void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat,
              "logits must be float32 [N, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "bitmask must be contiguous int32 [R, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
              rows.size(0) <= bitmask.size(0), "rows must be int64 [n <= R]");
  const int64_t vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "the bitmask is narrower than the vocabulary");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < logits.size(0), "row out of range");
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* out = logits.data_ptr<float>() + row[i] * logits.stride(0);
      const uint32_t* allowed = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>()) + i * words;
      for (int64_t k = 0; k * 32 < vocab; ++k) {
        const int64_t base = k * 32;
        uint32_t blocked = ~allowed[k];
        if (vocab - base < 32) blocked &= (1u << (vocab - base)) - 1;  // no write past the vocabulary
#if defined(__AVX512F__)
        const __m512 fill = _mm512_set1_ps(neg_inf);
        _mm512_mask_storeu_ps(out + base, static_cast<__mmask16>(blocked & 0xffff), fill);
        _mm512_mask_storeu_ps(out + base + 16, static_cast<__mmask16>(blocked >> 16), fill);
#else
        for (; blocked; blocked &= blocked - 1) out[base + __builtin_ctz(blocked)] = neg_inf;
#endif
      }
    }
  });
}

// argmax_rows: a row is read once, in blocks: each block's max (and whether it holds a NaN) in
// registers; only the first block reaching the running max (strictly greater: ties keep the earlier)
// is scanned again for the first element equal to it. A NaN ends the row at its first NaN (torch's).
constexpr int64_t kArgmaxBlock = 1024;

struct RowMax {
  float value;
  int64_t index;
  bool nan;
};

// The max of x[0, kArgmaxBlock) in *m; true where the block holds a NaN (*m is then meaningless).
inline bool block_max(const float* x, float* m) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 a0 = _mm512_set1_ps(neg_inf), a1 = a0, a2 = a0, a3 = a0;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < kArgmaxBlock; i += 64) {
    const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
    const __m512 v2 = _mm512_loadu_ps(x + i + 32), v3 = _mm512_loadu_ps(x + i + 48);
    nan |= _mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v2, v3, _CMP_UNORD_Q);  // either NaN
    a0 = _mm512_max_ps(a0, v0), a1 = _mm512_max_ps(a1, v1), a2 = _mm512_max_ps(a2, v2), a3 = _mm512_max_ps(a3, v3);
  }
  *m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3)));
  return nan != 0;
#elif defined(__AVX2__)
  __m256 a0 = _mm256_set1_ps(neg_inf), a1 = a0, a2 = a0, a3 = a0, nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < kArgmaxBlock; i += 32) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q), _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q)));
    a0 = _mm256_max_ps(a0, v0), a1 = _mm256_max_ps(a1, v1), a2 = _mm256_max_ps(a2, v2), a3 = _mm256_max_ps(a3, v3);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3)));
  *m = *std::max_element(lanes, lanes + 8);
  return _mm256_movemask_ps(nan) != 0;
#else
  float best = neg_inf;
  bool nan = false;
  for (int64_t i = 0; i < kArgmaxBlock; ++i) {
    best = x[i] > best ? x[i] : best;
    nan |= std::isnan(x[i]);
  }
  *m = best;
  return nan;
#endif
}

// The first maximum of x[begin, end), or its first NaN.
RowMax first_max(const float* x, int64_t begin, int64_t end) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_block = -1, i = begin;
  for (; i + kArgmaxBlock <= end; i += kArgmaxBlock) {
    float m;
    if (block_max(x + i, &m)) {
      while (!std::isnan(x[i])) ++i;
      return {x[i], i, true};
    }
    if (m > best) best = m, best_block = i;
  }
  int64_t index = begin;  // every element so far -inf: the first
  if (best_block >= 0)
    for (index = best_block; x[index] != best; ++index) {
    }
  for (; i < end; ++i) {
    if (std::isnan(x[i])) return {x[i], i, true};
    if (x[i] > best) best = x[i], index = i;
  }
  return {best, index, false};
}

// logits: contiguous float32 [N, V]; int64 [N]. Rows in parallel; a row is never split across threads (a
// one-row call would wait on a second core that another process holds).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "logits must be contiguous float32 [N, V]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "argmax_rows of an empty row");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, rows, grain(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = first_max(x + r * vocab, 0, vocab).index;
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) qk, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("moe_combine(Tensor(a!) out, Tensor y, Tensor rows, Tensor weights) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("moe_combine", &moe_combine);
}
