// Float32-accurate GEMM on AMX bf16 tiles, for weights that are exactly low-bit (exact_quant.py):
// out[M, N] = x[M, K] @ w[N, K]^T (+ bias) with w = d * q + m per group of 32 inputs (d, m float16 values;
// q in 0..15 with m, or -127..127 without).
//
// q is an integer below 256, so exact in bf16, and x splits exactly into three bf16 pieces,
// x = x0 + x1 + x2 (a float32's 24 significant bits; |x1| <= 2^-8 |x|, |x2| <= 2^-16 |x|). Per group the
// tiles compute c = x2 q + x1 q + x0 q (TDPBF16PS: exact products, float32 sums over 32 inputs), and
// AVX-512 adds d * c + m * (the group's sum of x) to float32 accumulators. Each output is then a float32
// sum of exact terms with one rounding at its scale per group rather than per input, so its error
// against float64 is a float32 GEMM's (tests/test_exact_quant.py bounds it by MKL's on the same inputs).
//
// The weight stays 4 or 8 bits (+ float32 d, m): 0.75 / 1.125 bytes a weight streamed per call. Tiles are
// 2 x 2 (two 16-row tiles of x by two 16-column tiles of w), so 8 tile loads feed 12 tile products; on this
// machine a tile load costs about as much as a tile product, so loads are what to save. Per pair of column
// tiles a thread unpacks q to bf16 VNNI tiles once for a chunk of up to 256 rows whose x pieces stay in L2.
// Speed against decode_gemm and MKL: bench/HISTORY.md.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "split_gemm.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define CB_SERVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using split_gemm::kGroup;  // inputs per scale, and per tile product
constexpr int64_t kTileElems = 512;      // bf16 values in a 16 x 32 tile (1 KB)
constexpr int64_t kTileFloats = 256;     // float32 values in a 16 x 16 tile (1 KB)
using split_gemm::kScaleBytes;
constexpr int64_t kMaxInputs = 16384;    // K: a row's group sums fit one 2 KB buffer
constexpr int64_t kChunkBytes = 1 << 20;  // x pieces a thread keeps in L2 per column tile pair
constexpr int64_t kMaxChunkTiles = 16;

#if defined(CB_SERVE_AMX)
// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
using amx_tiles::configure_tiles;
using amx_tiles::split3;

bool amx_init() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return amx_bf16 && amx_tile && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

// x [M, K] -> pieces [3][rows / 16][K / 32][16][32] bf16 (one tile of 16 rows x 32 inputs is 1 KB,
// contiguous; rows M..rows-1 zero) and the group sums [rows][K / 32] float32.
void split_rows(const float* x, int64_t m, int64_t k, int64_t rows, uint16_t* pieces, float* sums) {
  const int64_t groups = k / kGroup, plane = rows * k;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* p0 = pieces + (r / 16) * groups * kTileElems + (r % 16) * kGroup;  // + group * kTileElems
    for (int64_t g = 0; g < groups; ++g) {
      __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
      if (r < m) {
        lo = _mm512_loadu_ps(x + r * k + g * kGroup);
        hi = _mm512_loadu_ps(x + r * k + g * kGroup + 16);
      }
      sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
      uint16_t* p = p0 + g * kTileElems;
      split3(lo, p, p + plane, p + 2 * plane);
      split3(hi, p + 16, p + plane + 16, p + 2 * plane + 16);
    }
  }
}

using split_gemm::nibble_table;
using split_gemm::unpack_q;

// One group on the tiles for NR (2, or 1 for an odd last) row tiles and two column tiles: tiles 0..3 take
// c for (row tile, column tile) 00, 01, 10, 11 from the x piece in 4 (row tile 0) or 5 (row tile 1) and q
// in 6, 7, smallest piece first; then they are stored to `c` and zeroed.
template <int NR>
inline void group_tiles(const uint16_t* a, int64_t a_piece, int64_t a_row_tile, const uint16_t* q0,
                        const uint16_t* q1, float* c) {
  _tile_loadd(6, q0, 64);
  _tile_loadd(7, q1, 64);
  for (int p = 2; p >= 0; --p) {
    _tile_loadd(4, a + p * a_piece, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (NR == 2) {
      _tile_loadd(5, a + p * a_piece + a_row_tile, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + kTileFloats, 64);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NR == 2) {
    _tile_stored(2, c + 2 * kTileFloats, 64);
    _tile_stored(3, c + 3 * kTileFloats, 64);
    _tile_zero(2);
    _tile_zero(3);
  }
}

// acc_ij[r] += d_j * c_ij[r] (+ m_j * sums[row r of row tile i]).
template <int NR, bool FourBit>
inline void group_scale(const float* c, const uint8_t* scales0, const uint8_t* scales1, const float* sums,
                        int64_t sums_stride, float* acc) {
  const uint8_t* scales[2] = {scales0, scales1};
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j) {
    const __m512 d = _mm512_load_ps((const float*)scales[j]);
    const __m512 m = FourBit ? _mm512_load_ps((const float*)(scales[j] + kScaleBytes)) : _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int i = 0; i < NR; ++i) {
      float* acc_ij = acc + (2 * i + j) * kTileFloats;
      const float* c_ij = c + (2 * i + j) * kTileFloats;
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        __m512 v = _mm512_fmadd_ps(d, _mm512_load_ps(c_ij + 16 * r), _mm512_load_ps(acc_ij + 16 * r));
        if constexpr (FourBit) v = _mm512_fmadd_ps(_mm512_set1_ps(sums[(16 * i + r) * sums_stride]), m, v);
        _mm512_store_ps(acc_ij + 16 * r, v);
      }
    }
  }
}

// All groups of NR row tiles x two column tiles into acc. Each group's scaling runs one group behind its
// tile work, from the other of two c buffers: reading a tile store straight away stalls.
template <int NR, bool FourBit>
void row_tiles(const uint16_t* a, int64_t a_piece, int64_t a_row_tile, const uint16_t* q0, const uint16_t* q1,
               const uint8_t* w0, const uint8_t* w1, int64_t group_bytes, const float* sums, int64_t groups, float* c,
               float* acc) {
  std::memset(acc, 0, 4 * kTileFloats * sizeof(float));
  for (int64_t g = 0; g <= groups; ++g) {
    if (g < groups)
      group_tiles<NR>(a + g * kTileElems, a_piece, a_row_tile, q0 + g * kTileElems, q1 + g * kTileElems,
                      c + (g & 1) * 4 * kTileFloats);
    if (g > 0) {
      const int64_t h = g - 1;
      group_scale<NR, FourBit>(c + (h & 1) * 4 * kTileFloats, w0 + h * group_bytes, w1 + h * group_bytes, sums + h,
                               groups, acc);
    }
  }
}

template <bool FourBit>
void gemm(float* out, int64_t m, int64_t n, const uint16_t* pieces, const float* sums, int64_t groups,
          const uint8_t* packed, int64_t group_bytes, int64_t tiles, const float* bias, float* scratch,
          int64_t scratch_per_thread) {
  const int64_t row_tile_count = (m + 15) / 16, a_row_tile = groups * kTileElems, a_piece = row_tile_count * a_row_tile;
  const int64_t q_offset = (FourBit ? 2 : 1) * kScaleBytes;
  const int64_t chunk = std::clamp<int64_t>(kChunkBytes / (3 * a_row_tile * 2) / 2 * 2, 2, kMaxChunkTiles);
  const __m512i table = nibble_table();
#pragma omp parallel
  {
    configure_tiles();
    float* own = scratch + omp_get_thread_num() * scratch_per_thread;
    uint16_t* q0 = reinterpret_cast<uint16_t*>(own);  // the pair's q tiles, [2][groups][512]
    uint16_t* q1 = q0 + groups * kTileElems;
    float* c = own + groups * kTileElems;  // two buffers of 4 tiles
    float* acc = c + 8 * kTileFloats;      // 4 tiles
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t first = 0; first < row_tile_count; first += chunk) {
      const int64_t last = std::min(row_tile_count, first + chunk);
#pragma omp for schedule(static) nowait
      for (int64_t pair = 0; pair < tiles / 2; ++pair) {
        const uint8_t* w0 = packed + 2 * pair * groups * group_bytes;
        const uint8_t* w1 = w0 + groups * group_bytes;
        for (int64_t g = 0; g < groups; ++g) {
          unpack_q<FourBit>(w0 + g * group_bytes + q_offset, q0 + g * kTileElems, table);
          unpack_q<FourBit>(w1 + g * group_bytes + q_offset, q1 + g * kTileElems, table);
        }
        for (int64_t mt = first; mt < last; mt += 2) {
          const int64_t nr = mt + 1 < last ? 2 : 1;
          (nr == 2 ? &row_tiles<2, FourBit> : &row_tiles<1, FourBit>)(
              pieces + mt * a_row_tile, a_piece, a_row_tile, q0, q1, w0, w1, group_bytes, sums + mt * 16 * groups,
              groups, c, acc);
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t col = (2 * pair + j) * 16, cols = std::min<int64_t>(16, n - col);
            if (cols <= 0) continue;
            const __mmask16 mask = (__mmask16)((1u << cols) - 1);
            const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
            for (int64_t i = 0; i < nr; ++i)
              for (int64_t r = 0; r < std::min<int64_t>(16, m - (mt + i) * 16); ++r)
                _mm512_mask_storeu_ps(out + ((mt + i) * 16 + r) * n + col, mask,
                                      _mm512_add_ps(_mm512_load_ps(acc + (2 * i + j) * kTileFloats + 16 * r), b));
          }
        }
      }
    }
    _tile_release();
  }
}

// The greedy head's first pass (greedy_head.py): out ~= bf16(x) @ bf16(w)^T for an 8-bit weight, each weight
// d * q (exact in float32) rounded to bf16 as its group is unpacked, so every group sums on the tiles with no
// per-group scaling: |w~ - w| <= 2^-8 |w|, |x0 - x| <= 2^-8 |x|, float32 sums. x0: piece 0 of split_rows.
// One column tile's d * q for one group (16 VNNI rows: value v of a row is column v / 2's) as bf16 into `rows`.
inline void unpack_scaled(const uint8_t* group, uint16_t* rows) {
  const __m512 d = _mm512_load_ps((const float*)group);
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512 d_lo = _mm512_permutexvar_ps(pairs, d);
  const __m512 d_hi = _mm512_permutexvar_ps(_mm512_add_epi32(pairs, _mm512_set1_epi32(8)), d);
  const int8_t* q = reinterpret_cast<const int8_t*>(group + kScaleBytes);
  for (int r = 0; r < 16; ++r) {
    const __m512i words = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + r * 32)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(words)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(words, 1)));
    _mm512_storeu_si512(rows + r * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, d_hi), _mm512_mul_ps(lo, d_lo)));
  }
}

// NR row tiles x the pair's two column tiles, every group accumulated on tiles 0..3, stored to c.
template <int NR>
inline void approx_tiles(const uint16_t* a, int64_t a_row_tile, const uint16_t* q0, const uint16_t* q1,
                         int64_t groups, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NR == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(6, q0 + g * kTileElems, 64);
    _tile_loadd(7, q1 + g * kTileElems, 64);
    _tile_loadd(4, a + g * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (NR == 2) {
      _tile_loadd(5, a + a_row_tile + g * kTileElems, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + kTileFloats, 64);
  if constexpr (NR == 2) {
    _tile_stored(2, c + 2 * kTileFloats, 64);
    _tile_stored(3, c + 3 * kTileFloats, 64);
  }
}

// pair_max[M, pairs] = per row, the maximum over the pair's columns below `vocab` (the rest -inf).
void gemm_pair_max(float* pair_max, int64_t m, int64_t vocab, const uint16_t* pieces, int64_t groups,
                   const uint8_t* packed, int64_t group_bytes, float* scratch, int64_t scratch_per_thread) {
  const int64_t row_tile_count = (m + 15) / 16, a_row_tile = groups * kTileElems, pairs = (vocab + 31) / 32;
#pragma omp parallel
  {
    configure_tiles();
    float* own = scratch + omp_get_thread_num() * scratch_per_thread;
    uint16_t* q0 = reinterpret_cast<uint16_t*>(own);  // the pair's weight tiles, [2][groups][512]
    uint16_t* q1 = q0 + groups * kTileElems;
    float* c = own + groups * kTileElems;  // 4 tiles
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const uint8_t* w0 = packed + 2 * pair * groups * group_bytes;
      const uint8_t* w1 = w0 + groups * group_bytes;
      for (int64_t g = 0; g < groups; ++g) {
        unpack_scaled(w0 + g * group_bytes, q0 + g * kTileElems);
        unpack_scaled(w1 + g * group_bytes, q1 + g * kTileElems);
      }
      const int64_t cols = std::min<int64_t>(32, vocab - 32 * pair);
      const __mmask16 lo = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
      const __mmask16 hi = cols >= 32 ? (__mmask16)0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
      const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t mt = 0; mt < row_tile_count; mt += 2) {
        const int64_t nr = mt + 1 < row_tile_count ? 2 : 1;
        (nr == 2 ? &approx_tiles<2> : &approx_tiles<1>)(pieces + mt * a_row_tile, a_row_tile, q0, q1, groups, c);
        for (int64_t i = 0; i < nr; ++i)
          for (int64_t r = 0; r < std::min<int64_t>(16, m - (mt + i) * 16); ++r) {
            const __m512 v0 = _mm512_mask_load_ps(none, lo, c + 2 * i * kTileFloats + 16 * r);
            const __m512 v1 = _mm512_mask_load_ps(none, hi, c + (2 * i + 1) * kTileFloats + 16 * r);
            pair_max[((mt + i) * 16 + r) * pairs + pair] = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
          }
      }
    }
    _tile_release();
  }
}

// x's pieces and group sums (split_rows), and per thread room for the q tiles and c / acc buffers, in one
// buffer kept from call to call: a fresh buffer of several MB would pay its page faults on every call.
struct SplitX {
  uint16_t* pieces;
  float* sums;
  float* scratch;
  int64_t per_thread;
};

SplitX split_x(const at::Tensor& x, int64_t groups) {
  const int64_t m = x.size(0), k = x.size(1), rows = (m + 15) / 16 * 16;
  const int64_t per_thread = groups * kTileElems + 12 * kTileFloats;
  const int64_t floats = 3 * rows * k / 2 + (rows * groups + 15) / 16 * 16 + omp_get_max_threads() * per_thread;
  static thread_local at::Tensor buffer;
  if (!buffer.defined() || buffer.numel() < floats) buffer = at::empty({floats}, x.options());
  uint16_t* pieces = reinterpret_cast<uint16_t*>(buffer.data_ptr<float>());
  float* sums = buffer.data_ptr<float>() + 3 * rows * k / 2;
  split_rows(x.data_ptr<float>(), m, k, rows, pieces, sums);
  return {pieces, sums, sums + (rows * groups + 15) / 16 * 16, per_thread};
}

// out [M, N] = x [M, K] @ w^T (+ bias); packed from exact_quant.pack_amx_weight: uint8 [N / 16, K / 32,
// 384] (4-bit) or int8 [N / 16, K / 32, 576] (8-bit), N / 16 even.
void amx_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const int64_t group_bytes = split_gemm::check_args(out, x, packed, bias);
  const bool four_bit = packed.scalar_type() == at::kByte;
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), tiles = packed.size(0), groups = packed.size(1);
  TORCH_CHECK(k <= kMaxInputs, "K: at most 16384");
  if (m == 0) return;
  const SplitX split = split_x(x, groups);
  (four_bit ? &gemm<true> : &gemm<false>)(out.data_ptr<float>(), m, n, split.pieces, split.sums, groups,
                                          reinterpret_cast<const uint8_t*>(packed.data_ptr()), group_bytes, tiles,
                                          bias ? bias->data_ptr<float>() : nullptr, split.scratch, split.per_thread);
}

// pair_max [M, ceil(vocab / 32)]: per row of x [M, K] and pair of column tiles (32 columns below vocab), the
// maximum of bf16(x) @ bf16(w)^T (gemm_pair_max); packed: an 8-bit pack_amx_weight [N / 16, K / 32, 576].
void amx_pair_max(at::Tensor& pair_max, const at::Tensor& x, const at::Tensor& packed, int64_t vocab) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(2) == kScaleBytes + 512 && packed.size(0) % 2 == 0,
              "packed: int8 [N / 16, K / 32, 576], N / 16 even");
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(1);
  TORCH_CHECK(k == groups * kGroup && k <= kMaxInputs, "packed does not match x's K (at most 16384)");
  TORCH_CHECK(0 < vocab && vocab <= packed.size(0) * 16, "vocab: 1 to N");
  TORCH_CHECK(pair_max.scalar_type() == at::kFloat && pair_max.is_contiguous() && pair_max.dim() == 2 &&
                  pair_max.size(0) == m && pair_max.size(1) == (vocab + 31) / 32,
              "pair_max: contiguous float32 [M, ceil(vocab / 32)]");
  if (m == 0) return;
  const SplitX split = split_x(x, groups);
  gemm_pair_max(pair_max.data_ptr<float>(), m, vocab, split.pieces, groups,
                reinterpret_cast<const uint8_t*>(packed.data_ptr()), kScaleBytes + 512, split.scratch, split.per_thread);
}
#else
bool amx_init() { return false; }
void amx_gemm(at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "built without AMX");
}
void amx_pair_max(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) { TORCH_CHECK(false, "built without AMX"); }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("amx_init() -> bool", &amx_init);
  m.def("amx_gemm(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("amx_pair_max(Tensor(a!) pair_max, Tensor x, Tensor packed, int vocab) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) {
  m.impl("amx_gemm", &amx_gemm);
  m.impl("amx_pair_max", &amx_pair_max);
}
