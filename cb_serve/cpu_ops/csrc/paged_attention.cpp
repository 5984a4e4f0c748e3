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

#include "decode_wide.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace paged_decode;

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
    if (head_dim == 96) return pick_wide<12, cache_t>(group);  // Phi-3
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
#if defined(__AVX512F__) || defined(__F16C__)  // (AVX2 CPUs all have F16C; the generic kernel otherwise)
template <>
struct KernelPicker<float, c10::Float8_e4m3fn> : AvxKernelPicker<c10::Float8_e4m3fn> {};
#endif

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
                            (k_cache.scalar_type() == at::kBFloat16 || k_cache.scalar_type() == at::kHalf ||
                             k_cache.scalar_type() == at::kFloat8_e4m3fn);
  TORCH_CHECK((q.scalar_type() == k_cache.scalar_type() || narrow_cache) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "out and q must share a dtype; k_cache and v_cache theirs, or bf16/fp16/fp8 under float32 queries");
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
  } else if (k_cache.scalar_type() == at::kFloat8_e4m3fn && narrow_cache) {
    run(static_cast<float*>(nullptr), static_cast<c10::Float8_e4m3fn*>(nullptr));
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      run(static_cast<scalar_t*>(nullptr), static_cast<scalar_t*>(nullptr));
    });
  }
}

// Copies row i of k and v ([T, KVH, D], head rows contiguous) to slot slot_mapping[i] of
// k_cache / v_cache ([num_blocks, block_size, KVH, D], contiguous blocks), in the cache's dtype (an FP8
// cache's values already quantized by the caller).
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
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, k.scalar_type(), "write_kv", [&] {
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
