// Float32-accurate GEMM on AMX bf16 tiles, for weights that are exactly low-bit (exact_quant.py):
// out[M, N] = x[M, K] @ w[N, K]^T with w = d * q + m per group of 32 inputs (d, m float16 values).
//
// Every operand is split exactly into bf16 pieces, so that each tile product is an exact product:
//   x = x0 + x1 + x2 (three bf16s hold a float32's 24 significant bits; |x1| <= 2^-8 |x|, |x2| <= 2^-16 |x|)
//   d * q = D0 + D1 (at most 11 + 4 significant bits: two bf16s)
//   the m term, sum_g m_g * (sum of x over group g), as extra input columns: the group sums (float32,
//   split in three) against m (float16, split in two).
// TDPBF16PS multiplies bf16 pairs exactly and accumulates in float32, so each output is a float32 sum of
// exact products. Five of the six piece products are summed, smallest first (block_32x32); the one left
// out, x2 * D1, is below 2^-24 of its term. Measured RMS error against float64: 0.3-0.4x MKL's float32
// GEMM's. Five bf16 passes at the AMX rate beat one float32 pass at the AVX-512 FMA rate: 2048 rows of
// the default model's shapes run at 470-610 GFLOP/s against MKL's 340-390 (1.2-1.6x).
//
// Layout: packed = bf16 [2 pieces, N / 16 tiles, Kx / 32 steps, 16 pairs, 16 columns x 2] (VNNI), Kx = K
// plus the m columns padded to 32. Each thread takes blocks of 32 columns for a chunk of 128 rows
// (the chunk's x pieces stay in L2), and a block accumulates 2 x 2 tiles of 16 x 16 over all passes.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define CB_SERVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kStep = 32;        // inputs per tile step (16 bf16 pairs)
constexpr int64_t kTileCols = 16;    // output columns per tile
constexpr int64_t kTileElems = 512;  // bf16 values per weight tile
constexpr int64_t kChunkRows = 128;  // rows whose x pieces a thread keeps in L2
constexpr int64_t kMaxInputs = 16384;  // K: its group sums fit one 2 KB buffer

#if defined(CB_SERVE_AMX)
// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool amx_init() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return amx_bf16 && amx_tile && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {  // all 8 tiles 16 rows x 64 bytes
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

inline __m512 widen(__m256bh h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

// Three bf16 pieces of 16 floats: v = p0 + p1 + p2 exactly (round to nearest each time).
inline void split3(__m512 v, uint16_t* p0, uint16_t* p1, uint16_t* p2) {
  const __m256bh b0 = _mm512_cvtneps_pbh(v);
  const __m512 r1 = _mm512_sub_ps(v, widen(b0));
  const __m256bh b1 = _mm512_cvtneps_pbh(r1);
  const __m256bh b2 = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, widen(b1)));
  _mm256_storeu_si256((__m256i*)p0, (__m256i)b0);
  _mm256_storeu_si256((__m256i*)p1, (__m256i)b1);
  _mm256_storeu_si256((__m256i*)p2, (__m256i)b2);
}

// x [M, K] -> pieces [3][rows][kx]: x's pieces, then (with_sums) the pieces of its group sums, zeros
// after them and in rows M..rows-1.
void split_rows(const float* x, int64_t m, int64_t k, int64_t rows, int64_t kx, bool with_sums, uint16_t* pieces) {
  const int64_t plane = rows * kx;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* p0 = pieces + r * kx;
    uint16_t* p1 = p0 + plane;
    uint16_t* p2 = p1 + plane;
    if (r >= m) {
      for (uint16_t* p : {p0, p1, p2}) std::memset(p, 0, kx * sizeof(uint16_t));
      continue;
    }
    alignas(64) float sums[kMaxInputs / kStep] = {};
    for (int64_t c = 0; c < k; c += kStep) {
      const __m512 lo = _mm512_loadu_ps(x + r * k + c), hi = _mm512_loadu_ps(x + r * k + c + 16);
      split3(lo, p0 + c, p1 + c, p2 + c);
      split3(hi, p0 + c + 16, p1 + c + 16, p2 + c + 16);
      sums[c / kStep] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
    for (int64_t c = k; c < kx; c += 16) {
      const __m512 v = with_sums ? _mm512_load_ps(sums + (c - k)) : _mm512_setzero_ps();
      split3(v, p0 + c, p1 + c, p2 + c);
    }
  }
}

// One sweep over K: the 2 x 2 output tiles (0..3) += x pieces (tiles 4, 5: row halves) times weight piece
// `d` (tiles 6, 7: column tiles), for each x piece in `xs`; the weight tiles load once per step for all.
template <int NumX>
inline void sweep(const uint16_t* const (&xs)[NumX], int64_t kx, const uint16_t* d, int64_t steps) {
  const int64_t lda = kx * sizeof(uint16_t), half = 16 * kx, next_tile = steps * kTileElems;
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(6, d + s * kTileElems, 64);
    _tile_loadd(7, d + next_tile + s * kTileElems, 64);
#pragma GCC unroll 3
    for (int i = 0; i < NumX; ++i) {
      _tile_loadd(4, xs[i] + s * kStep, lda);
      _tile_loadd(5, xs[i] + half + s * kStep, lda);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// 32 x 32 outputs from the x pieces a0..a2 and weight pieces d0, d1. Three sweeps, smallest products
// first: x0 D1 + x1 D1, then x2 D0 + x1 D0, then x0 D0. While the accumulators are small they round
// finely, so only the last sweep's additions round at the output's scale, once per input as in an fp32
// dot product (an order per step instead gives ~2x MKL's RMS error). 16 tile loads per 20 tile products.
void block_32x32(const uint16_t* a0, const uint16_t* a1, const uint16_t* a2, int64_t kx, const uint16_t* d0,
                 const uint16_t* d1, int64_t steps, float* out, int64_t ld_out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* const small_by_d1[2] = {a0, a1};
  const uint16_t* const small_by_d0[2] = {a2, a1};
  const uint16_t* const large[1] = {a0};
  sweep(small_by_d1, kx, d1, steps);
  sweep(small_by_d0, kx, d0, steps);
  sweep(large, kx, d0, steps);
  const int64_t ldb = ld_out * sizeof(float);
  _tile_stored(0, out, ldb);
  _tile_stored(1, out + 16, ldb);
  _tile_stored(2, out + 16 * ld_out, ldb);
  _tile_stored(3, out + 16 * ld_out + 16, ldb);
}

void amx_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(0) == 2 && packed.size(1) % 2 == 0 && packed.size(3) == 16 && packed.size(4) == 32,
              "packed: bf16 [2, even N / 16, Kx / 32, 16, 32]");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(1), steps = packed.size(2), kx = steps * kStep;
  const int64_t n = out.size(1);
  TORCH_CHECK(k % kStep == 0 && k <= kMaxInputs && kx >= k && kx - k <= kMaxInputs / kStep,
              "packed does not match x's K (a multiple of 32, at most 16384)");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == m && n <= tiles * kTileCols &&
                  n > (tiles - 2) * kTileCols,
              "out: contiguous float32 [M, N] matching packed");
  if (m == 0) return;
  const int64_t rows = (m + 31) / 32 * 32;
  static thread_local at::Tensor pieces_buffer;  // reused: a fresh 10 MB buffer costs its page faults
  if (!pieces_buffer.defined() || pieces_buffer.numel() < 3 * rows * kx)
    pieces_buffer = at::empty({3 * rows * kx}, x.options().dtype(at::kBFloat16));
  uint16_t* pieces = reinterpret_cast<uint16_t*>(pieces_buffer.data_ptr());
  split_rows(x.data_ptr<float>(), m, k, rows, kx, kx > k, pieces);

  const uint16_t* weights = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const int64_t plane = rows * kx, piece_stride = tiles * steps * kTileElems, blocks = tiles / 2;
  float* o = out.data_ptr<float>();
#pragma omp parallel
  {
    configure_tiles();
    alignas(64) float edge[32 * 32];  // a block that sticks out of `out`
    for (int64_t m0 = 0; m0 < rows; m0 += kChunkRows) {
#pragma omp for schedule(static) nowait
      for (int64_t nb = 0; nb < blocks; ++nb) {
        const uint16_t* d0 = weights + 2 * nb * steps * kTileElems;
        for (int64_t r = m0; r < std::min(rows, m0 + kChunkRows); r += 32) {
          const bool inside = r + 32 <= m && (nb + 1) * 32 <= n;
          block_32x32(pieces + r * kx, pieces + plane + r * kx, pieces + 2 * plane + r * kx, kx, d0,
                      d0 + piece_stride, steps, inside ? o + r * n + nb * 32 : edge, inside ? n : 32);
          if (!inside)
            for (int64_t i = 0; i < std::min<int64_t>(32, m - r); ++i)
              std::memcpy(o + (r + i) * n + nb * 32, edge + i * 32, std::min<int64_t>(32, n - nb * 32) * sizeof(float));
        }
      }
    }
    _tile_release();
  }
}
#else
bool amx_init() { return false; }
void amx_gemm(at::Tensor&, const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, "built without AMX"); }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("amx_init() -> bool", &amx_init);
  m.def("amx_gemm(Tensor(a!) out, Tensor x, Tensor packed) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) { m.impl("amx_gemm", &amx_gemm); }
