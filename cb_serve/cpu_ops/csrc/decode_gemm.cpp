// float32 GEMM for decode-sized batches: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), M small.
// The weight is packed once into tiles of 32 output columns, [ceil(N / 32)][K][32], so one tile is
// one contiguous stream, read once from memory and reused from cache by every block of rows.
// - AVX-512: blocks of up to 12 rows, 12 x 2 register accumulators over the whole tile. With more than one
//   row block, the blocks of a tile also prefetch the next tile into L2, so its memory stream overlaps their
//   arithmetic instead of stalling the next tile's first block.
// - AVX2 (and scalar): 16 registers hold only 3 rows x 4 accumulators, so per loaded weight there are 4
//   times fewer FMAs, and a whole tile (up to 196 KB) would stream from L2 for every block. So the tile is
//   walked in chunks of kChunk inputs that stay in L1 for all row blocks, the accumulators kept in memory
//   between chunks; blocks of 6 rows x 16 columns and 2 x 32 (12 and 8 independent chains: enough for two
//   FMAs a cycle).
// Each output is an FMA chain over k in order, so results do not depend on M (batch invariance) and
// need no horizontal sums; the AVX-512, AVX2 (8 lanes) and scalar (std::fma) builds run the same chain
// whatever their blocking, so they agree bit for bit. Built with -DCB_SERVE_ISA_VARIANT=<name> (for tests
// and benchmarks: an AVX2-only or a scalar build on any CPU), the ops are decode_gemm_<name> and
// pack_decode_weight is left to the native build.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "lowbit_groups.h"

#define CB_SERVE_STR2(x) #x
#define CB_SERVE_STR(x) CB_SERVE_STR2(x)
#if defined(CB_SERVE_ISA_VARIANT)
#define CB_SERVE_OP(name) name "_" CB_SERVE_STR(CB_SERVE_ISA_VARIANT)
#else
#define CB_SERVE_OP(name) name
#endif

namespace {

using lowbit::dequantize;
using lowbit::group_bytes;
using lowbit::kCols;  // output columns per tile
using lowbit::kGroup;
using lowbit::Kind;
using lowbit::kQ4;
using lowbit::kQ8;
using lowbit::kQ8x2;
using lowbit::kQ8x2GroupBytes;
#if defined(__AVX512F__)
constexpr int kMaxRows = 12;  // rows per register block: 12 x 2 accumulators
#else
constexpr int64_t kChunk = 64;  // inputs per chunk: 8 KB of tile
#endif

const char* isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

at::Tensor pack_decode_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight: float32 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1), tiles = (n + kCols - 1) / kCols;
  // [N, K] -> zero-padded [tiles * 32, K] -> [tiles, 32, K] -> [tiles, K, 32]
  const at::Tensor padded = at::constant_pad_nd(weight.contiguous(), {0, 0, 0, tiles * kCols - n}).contiguous();
  return padded.view({tiles, kCols, k}).transpose(1, 2).contiguous();
}

// A weight stored as bf16 (every float32 weight whose low 16 bits are zero, as a bf16 checkpoint's are)
// widens to the same float32 exactly: the GEMM is bit for bit the float32 one, at half the bytes.
inline float widen_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__)
template <typename W>
inline __m512 load16(const W* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<uint16_t>(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// Per k: this tile's row 16 ahead into L1, and a share of `ahead` (the next tile's first rows) into L2.
template <typename W>
struct Prefetcher {
  const W* tile;
  const W* ahead;
  uint64_t ahead_step;  // rows of `ahead` per k, in 32.32 fixed point
  uint64_t ahead_pos = 0;

  inline void step(int64_t k) {
    _mm_prefetch((const char*)(tile + (k + 16) * kCols), _MM_HINT_T0);
    _mm_prefetch((const char*)(tile + (k + 16) * kCols + 16), _MM_HINT_T0);
    if (ahead) {
      const W* line = ahead + (ahead_pos >> 32) * kCols;
      _mm_prefetch((const char*)line, _MM_HINT_T1);
      _mm_prefetch((const char*)(line + 16), _MM_HINT_T1);
      ahead_pos += ahead_step;
    }
  }
};

// `ahead`, `ahead_rows`: a part of the next tile to prefetch into L2 meanwhile, spread over the k loop, so
// the memory stream of the next tile overlaps this block's arithmetic.
template <int Rows, typename W>
void tile_block(const float* x, int64_t k_dim, const W* tile, float* out, int64_t ld_out, int64_t cols,
                const float* bias, const W* ahead, int64_t ahead_rows) {
  __m512 lo[Rows], hi[Rows];
  for (int r = 0; r < Rows; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  Prefetcher<W> prefetch{tile, ahead, ahead ? ((uint64_t)ahead_rows << 32) / (uint64_t)k_dim : 0};
  for (int64_t k = 0; k < k_dim; ++k) {
    prefetch.step(k);
    const __m512 w0 = load16(tile + k * kCols), w1 = load16(tile + k * kCols + 16);
    for (int r = 0; r < Rows; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k_dim + k]);
      lo[r] = _mm512_fmadd_ps(a, w0, lo[r]);
      hi[r] = _mm512_fmadd_ps(a, w1, hi[r]);
    }
  }
  lowbit::store_rows<Rows>(lo, hi, out, ld_out, cols, bias);
}
#elif defined(__AVX2__) && defined(__FMA__)
// acc [Rows][32]: the rows' chains so far in Vecs * 8 of their columns, advanced over the kc inputs of `chunk`
// ([kc][32] floats, the same columns). The weight vectors are loaded once per k, then one broadcast per row.
// GCC keeps a loop-carried array of vectors in memory unless its loops are unrolled first: hence the pragmas.
template <int Rows, int Vecs>
void chunk_block(const float* x, int64_t ld_x, const float* chunk, int64_t kc, float* acc) {
  __m256 sum[Rows][Vecs];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < Vecs; ++c) sum[r][c] = _mm256_loadu_ps(acc + r * kCols + 8 * c);
  for (int64_t k = 0; k < kc; ++k) {
    __m256 w[Vecs];
#pragma GCC unroll 4
    for (int c = 0; c < Vecs; ++c) w[c] = _mm256_loadu_ps(chunk + k * kCols + 8 * c);
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ld_x + k);
#pragma GCC unroll 4
      for (int c = 0; c < Vecs; ++c) sum[r][c] = _mm256_fmadd_ps(a, w[c], sum[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < Vecs; ++c) _mm256_storeu_ps(acc + r * kCols + 8 * c, sum[r][c]);
}
#else
template <int Rows, int Vecs>
void chunk_block(const float* x, int64_t ld_x, const float* chunk, int64_t kc, float* acc) {
  for (int r = 0; r < Rows; ++r)
    for (int64_t c = 0; c < 8 * Vecs; ++c) {
      float sum = acc[r * kCols + c];
      for (int64_t k = 0; k < kc; ++k) sum = std::fma(x[r * ld_x + k], chunk[k * kCols + c], sum);
      acc[r * kCols + c] = sum;
    }
}
#endif


#if defined(__AVX512F__)
template <typename W>
using BlockFn = void (*)(const float*, int64_t, const W*, float*, int64_t, int64_t, const float*, const W*, int64_t);
template <typename W, int... R>
constexpr std::array<BlockFn<W>, sizeof...(R)> block_table(std::integer_sequence<int, R...>) {
  return {tile_block<R + 1, W>...};
}
template <typename W>
constexpr auto kBlocks = block_table<W>(std::make_integer_sequence<int, kMaxRows>{});

// The row blocks of one tile: out[:, n0:n0 + cols] = x @ tile (+ bias), while prefetching `next`.
template <typename W>
void tile_rows(const float* x, int64_t m_dim, int64_t k_dim, const W* tile, const W* next, float* out,
               int64_t ld_out, int64_t cols, const float* bias) {
  // One row block is bound by the stream of its own tile; prefetching the next one as well slowed it.
  if (m_dim <= kMaxRows) next = nullptr;
  const int64_t blocks = (m_dim + kMaxRows - 1) / kMaxRows, ahead_rows = (k_dim + blocks - 1) / blocks;
  for (int64_t j = 0, m0 = 0; m0 < m_dim; ++j, m0 += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, m_dim - m0);
    const int64_t first = j * ahead_rows, count = std::min<int64_t>(ahead_rows, k_dim - first);
    kBlocks<W>[rows - 1](x + m0 * k_dim, k_dim, tile, out + m0 * ld_out, ld_out, cols, bias,
                      next && count > 0 ? next + first * kCols : nullptr, count);
  }
}

using LowBitFn = void (*)(const float*, int64_t, const uint8_t*, float*, int64_t, int64_t, const float*);
template <Kind K, int... R>
constexpr std::array<LowBitFn, sizeof...(R)> lowbit_table(std::integer_sequence<int, R...>) {
  return {lowbit::lowbit_block<R + 1, K>...};
}
constexpr int kLowBitMaxRows = kMaxRows;
// Up to this many rows, blocks dequantize in registers; more rows share one dequantized tile (its store and
// reloads cost less than a dequantization per block; bench/micro_kernels.py gemm --weights exact).
constexpr int64_t kLowBitAllRows = 2 * kMaxRows;
constexpr std::array<std::array<LowBitFn, kLowBitMaxRows>, lowbit::kKinds> kLowBitBlocks = {
    lowbit_table<kQ4>(std::make_integer_sequence<int, kLowBitMaxRows>{}),
    lowbit_table<kQ8>(std::make_integer_sequence<int, kLowBitMaxRows>{}),
    lowbit_table<kQ8x2>(std::make_integer_sequence<int, kLowBitMaxRows>{}),
    lowbit_table<lowbit::kF8>(std::make_integer_sequence<int, kLowBitMaxRows>{}),
    lowbit_table<lowbit::kF4>(std::make_integer_sequence<int, kLowBitMaxRows>{})};

// One tile (float32, or low-bit: up to kLowBitAllRows rows dequantize it in registers, more dequantize it
// into `scratch` first): out[:, n0:n0 + cols] = x @ tile (+ bias). Both low-bit paths give the same bits.
void gemm_tile(const float* x, int64_t m_dim, int64_t k_dim, const float* tile, const uint8_t* quantized, Kind kind,
               const float* next, float* scratch, float* /*acc*/, float* out, int64_t ld_out, int64_t cols,
               const float* bias) {
  if (quantized && m_dim <= kLowBitAllRows) {
    for (int64_t m0 = 0; m0 < m_dim; m0 += kLowBitMaxRows) {
      const int64_t rows = std::min<int64_t>(kLowBitMaxRows, m_dim - m0);
      kLowBitBlocks[kind][rows - 1](x + m0 * k_dim, k_dim, quantized, out + m0 * ld_out, ld_out, cols, bias);
    }
    return;
  }
  if (quantized) {
    dequantize(kind, quantized, k_dim / kGroup, scratch);
    tile = scratch;
    next = nullptr;
  }
  tile_rows(x, m_dim, k_dim, tile, next, out, ld_out, cols, bias);
}

// One bf16 tile, widened in registers: bit for bit gemm_tile on its float32 copy.
void gemm_tile_bf16(const float* x, int64_t m_dim, int64_t k_dim, const uint16_t* tile, const uint16_t* next,
                    float* /*scratch*/, float* /*acc*/, float* out, int64_t ld_out, int64_t cols, const float* bias) {
  tile_rows(x, m_dim, k_dim, tile, next, out, ld_out, cols, bias);
}
constexpr int64_t kScratchInputs = 0;  // a whole tile: k_dim inputs
#else
// The row blocks over one chunk: 6 rows x 16 columns (12 chains; 2 weight loads and 6 broadcasts per 12
// FMAs) while 6 rows remain, then 2 rows x 32 columns (8 chains), a last single row alone.
void chunk_rows(const float* x, int64_t m_dim, int64_t ld_x, const float* chunk, int64_t kc, float* acc) {
  int64_t m0 = 0;
  for (; m_dim - m0 >= 6; m0 += 6)
    for (int64_t half = 0; half < kCols; half += 16)
      chunk_block<6, 2>(x + m0 * ld_x, ld_x, chunk + half, kc, acc + m0 * kCols + half);
  for (; m_dim - m0 >= 2; m0 += 2) chunk_block<2, 4>(x + m0 * ld_x, ld_x, chunk, kc, acc + m0 * kCols);
  if (m0 < m_dim) chunk_block<1, 4>(x + m0 * ld_x, ld_x, chunk, kc, acc + m0 * kCols);
}

// One tile, chunk by chunk (low-bit chunks dequantized into `scratch`), every row block over each chunk
// while it is in L1; acc [M, 32] holds the chains between chunks.
void gemm_tile(const float* x, int64_t m_dim, int64_t k_dim, const float* tile, const uint8_t* quantized, Kind kind,
               const float* /*next*/, float* scratch, float* acc, float* out, int64_t ld_out, int64_t cols,
               const float* bias) {
  std::fill_n(acc, m_dim * kCols, 0.f);
  for (int64_t k0 = 0; k0 < k_dim; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, k_dim - k0);
    if (quantized) {
      dequantize(kind, quantized + k0 / kGroup * group_bytes(kind), kc / kGroup, scratch);
    }
    chunk_rows(x + k0, m_dim, k_dim, quantized ? scratch : tile + k0 * kCols, kc, acc);
  }
  for (int64_t r = 0; r < m_dim; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ld_out + c] = acc[r * kCols + c] + (bias ? bias[c] : 0.f);
}

// One bf16 tile, each chunk widened into `scratch` (exact) and then gemm_tile's float32 chunk.
void gemm_tile_bf16(const float* x, int64_t m_dim, int64_t k_dim, const uint16_t* tile, const uint16_t* /*next*/,
                    float* scratch, float* acc, float* out, int64_t ld_out, int64_t cols, const float* bias) {
  std::fill_n(acc, m_dim * kCols, 0.f);
  for (int64_t k0 = 0; k0 < k_dim; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, k_dim - k0);
    for (int64_t i = 0; i < kc * kCols; ++i) scratch[i] = widen_bf16(tile[k0 * kCols + i]);
    chunk_rows(x + k0, m_dim, k_dim, scratch, kc, acc);
  }
  for (int64_t r = 0; r < m_dim; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ld_out + c] = acc[r * kCols + c] + (bias ? bias[c] : 0.f);
}
constexpr int64_t kScratchInputs = kChunk;
#endif

// At least `size` floats of `buffer`, 64-byte aligned (a row straddling two cache lines costs every load twice).
float* aligned(std::vector<float>& buffer, int64_t size) {
  if (buffer.size() < static_cast<size_t>(size + 16)) buffer.resize(size + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
}

// The low-bit kind of a packed weight (pack_decode_weight_quantized), by its dtype and bytes per group; false
// for float32 / bf16 tiles.
bool low_bit_kind(const at::Tensor& packed, Kind& kind) {
  const auto dtype = packed.scalar_type();
  const int64_t bytes = packed.dim() > 0 ? packed.size(-1) : 0;
  if (dtype == at::kByte) kind = kQ4;
  else if (dtype == at::kFloat8_e4m3fn) kind = lowbit::kF8;
#if __has_include(<c10/util/Float4_e2m1fn_x2.h>)  // torch 2.8 and later
  else if (dtype == at::kFloat4_e2m1fn_x2) kind = lowbit::kF4;
#endif
  else if (dtype == at::kChar) kind = bytes == kQ8x2GroupBytes ? kQ8x2 : kQ8;
  else return false;
  return true;
}

// out [M, N] contiguous; x [M, K] contiguous float32; packed from pack_decode_weight (float32
// [tiles, K, 32]) or pack_decode_weight_quantized (uint8 [tiles, K / 32, kQ4GroupBytes] or int8
// [tiles, K / 32, kQ8GroupBytes or kQ8x2GroupBytes], float8_e4m3fn [tiles, K / 32, kQ8GroupBytes]: FP8
// codes, float4_e2m1fn_x2 [tiles, K / 32, kF4GroupBytes]: FP4 codes); bias [N] or undefined.
void decode_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous float32 [M, K]");
  const int64_t m_dim = x.size(0), k_dim = x.size(1), n_dim = out.size(1), tiles = packed.size(0);
  Kind kind = kQ4;
  const bool quantized = low_bit_kind(packed, kind);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
                  (quantized ? k_dim % kGroup == 0 && packed.size(1) == k_dim / kGroup &&
                                   packed.size(2) == group_bytes(kind)
                             : packed.scalar_type() == at::kFloat && packed.size(1) == k_dim && packed.size(2) == kCols),
              "packed weight does not match x");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == m_dim && (n_dim + kCols - 1) / kCols == tiles, "out: [M, N]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n_dim, "bias: [N]");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch_buffer, acc_buffer;  // kept between calls
    const int64_t scratch_inputs = kScratchInputs ? std::min(kScratchInputs, k_dim) : k_dim;
    float* scratch = aligned(scratch_buffer, quantized ? scratch_inputs * kCols : 0);
    float* acc = aligned(acc_buffer, kScratchInputs ? m_dim * kCols : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kCols, cols = std::min<int64_t>(kCols, n_dim - n0);
      const float* tile = quantized ? nullptr : packed.data_ptr<float>() + t * k_dim * kCols;
      const float* next = !quantized && t + 1 < end ? tile + k_dim * kCols : nullptr;
      const uint8_t* low_bit = quantized ? static_cast<const uint8_t*>(packed.data_ptr()) + t * packed.stride(0) : nullptr;
      gemm_tile(xp, m_dim, k_dim, tile, low_bit, kind, next, scratch, acc, op + n0, n_dim, cols, b ? b + n0 : nullptr);
    }
  });
}

// The experts of a mixture-of-experts layer at once: rows offsets[g]:offsets[g + 1] of x times group g's
// weight. out [P, N], x [P, K] contiguous float32; offsets [G + 1] int64; packed [G, tiles, K, 32] float32
// (each group's weight as pack_decode_weight lays it out) or bf16 (the same, for weights exact in bf16), or
// [G, tiles, K / 32, group bytes] low-bit (each group's as pack_decode_weight_quantized lays it out: MXFP4
// experts' FP4 codes); bias [G, N] or undefined. Groups of more than max_rows rows (max_rows >= 0) are left to another kernel
// (amx_grouped_gemm). One parallel loop over (non-empty group, tile): each tile is streamed once for all
// of its group's rows, and each output is the same FMA chain over k as decode_gemm's.
void grouped_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous float32 [P, K]");
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  Kind kind = kQ4;
  const bool quantized = low_bit_kind(packed, kind);
  const int64_t groups = packed.size(0), tiles = packed.size(1), k_dim = x.size(1), n_dim = out.size(1);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() &&
                  (quantized ? k_dim % kGroup == 0 && packed.size(2) == k_dim / kGroup &&
                                   packed.size(3) == group_bytes(kind)
                             : (bf16 || packed.scalar_type() == at::kFloat) && packed.size(2) == k_dim &&
                                   packed.size(3) == kCols),
              "packed: float32 or bf16 [G, tiles, K, 32], or low-bit [G, tiles, K / 32, group bytes]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.is_contiguous() && offsets.scalar_type() == at::kLong &&
                  offsets.size(0) == groups + 1,
              "offsets: int64 [G + 1]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && (n_dim + kCols - 1) / kCols == tiles, "out: [P, N]");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[groups] <= x.size(0), "offsets outside x");
  std::vector<int64_t> active;
  int64_t most_rows = 0;
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(off[g + 1] >= off[g], "offsets must not decrease");
    const int64_t rows = off[g + 1] - off[g];
    if (rows > 0 && (max_rows < 0 || rows <= max_rows)) active.push_back(g);
    most_rows = std::max(most_rows, rows);
  }
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == groups * n_dim, "bias: [G, N]");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t items = static_cast<int64_t>(active.size()) * tiles, tile_size = k_dim * kCols;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> acc_buffer, scratch_buffer;
    float* acc = aligned(acc_buffer, kScratchInputs ? most_rows * kCols : 0);
    const int64_t scratch_inputs = quantized ? (kScratchInputs ? std::min(kScratchInputs, k_dim) : k_dim)
                                             : bf16 ? kScratchInputs : 0;
    float* scratch = aligned(scratch_buffer, scratch_inputs * kCols);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = active[i / tiles], t = i % tiles, n0 = t * kCols, cols = std::min<int64_t>(kCols, n_dim - n0);
      const bool prefetch = i + 1 < end && t + 1 < tiles;
      const float* xg = xp + off[g] * k_dim;
      float* og = op + off[g] * n_dim + n0;
      const float* bg = b ? b + g * n_dim + n0 : nullptr;
      if (quantized) {
        const uint8_t* tile = static_cast<const uint8_t*>(packed.data_ptr()) + (g * tiles + t) * packed.stride(1);
        gemm_tile(xg, off[g + 1] - off[g], k_dim, nullptr, tile, kind, nullptr, scratch, acc, og, n_dim, cols, bg);
      } else if (bf16) {
        const uint16_t* tile = reinterpret_cast<const uint16_t*>(packed.data_ptr()) + (g * tiles + t) * tile_size;
        gemm_tile_bf16(xg, off[g + 1] - off[g], k_dim, tile, prefetch ? tile + tile_size : nullptr, scratch, acc, og,
                       n_dim, cols, bg);
      } else {
        const float* tile = packed.data_ptr<float>() + (g * tiles + t) * tile_size;
        gemm_tile(xg, off[g + 1] - off[g], k_dim, tile, nullptr, kQ4, prefetch ? tile + tile_size : nullptr, nullptr,
                  acc, og, n_dim, cols, bg);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
#if !defined(CB_SERVE_ISA_VARIANT)
  m.def("pack_decode_weight(Tensor weight) -> Tensor");
#endif
  m.def(CB_SERVE_OP("decode_gemm_isa") "() -> str", [] { return std::string(isa()); });
  m.def(CB_SERVE_OP("decode_gemm") "(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def(CB_SERVE_OP("grouped_gemm") "(Tensor(a!) out, Tensor x, Tensor offsets, Tensor packed, Tensor? bias, "
                                    "int max_rows=-1) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) {
#if !defined(CB_SERVE_ISA_VARIANT)
  m.impl("pack_decode_weight", &pack_decode_weight);
#endif
  m.impl(CB_SERVE_OP("decode_gemm"), &decode_gemm);
  m.impl(CB_SERVE_OP("grouped_gemm"), &grouped_gemm);
}
