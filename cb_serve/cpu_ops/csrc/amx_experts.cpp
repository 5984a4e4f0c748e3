// The experts' GEMMs of a mixture-of-experts prefill on AMX tiles, for weights exact in bf16 (a bf16
// checkpoint served in float32): out[rows of e] = x[rows of e] @ w[e]^T (+ bias[e]) for every expert e with
// at least min_rows rows; the others are left to grouped_gemm (decode_gemm.cpp), which reads the same
// packed weight, [G, tiles, K, 32] bf16 (pack_decode_weight's layout per expert).
//
// Accuracy: each weight is exact in bf16 and x splits exactly into three bf16 pieces (amx_tiles::split3),
// so every tile product is exact and each output is a float32 sum of exact terms, as in amx_gemm.cpp: a
// float32 GEMM's error against float64 (tests/kernels/test_fused_moe.py bounds it by MKL's).
//
// Per (expert, tile of 32 columns) a thread interleaves the tile into two bf16 VNNI tiles per group of 32
// inputs once, then runs the expert's rows two 16-row tiles at a time: per group 2 weight-tile loads, 6
// x-tile loads and 12 tile products, accumulated on tiles 0..3 across all groups.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define CB_SERVE_AMX 1
#include <immintrin.h>
#include <omp.h>
#endif

namespace {

constexpr int64_t kCols = 32;         // columns per packed tile (decode_gemm.cpp)
constexpr int64_t kGroup = 32;        // inputs per tile product
constexpr int64_t kTileElems = 512;   // bf16 values in a 16 x 32 tile (1 KB)
constexpr int64_t kTileFloats = 256;  // float32 values in a 16 x 16 tile (1 KB)
constexpr int64_t kSpanRows = 128;    // rows per span: its x pieces (768 KB at K = 1024) stay in L2

#if defined(CB_SERVE_AMX)
// Up to kSpanRows rows of one expert: rows first..first + rows of x, in row tiles tile0.. of the pieces.
struct Span {
  int64_t expert, first, rows, tile0;
};

// x's rows of every span -> pieces [3][row tiles][K / 32][16][32] bf16 (rows past a span's end zero).
void split_spans(const float* x, int64_t k, const std::vector<Span>& spans, int64_t row_tiles, uint16_t* pieces) {
  const int64_t groups = k / kGroup, plane = row_tiles * groups * kTileElems;
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (span, row tile within it)
  for (int64_t s = 0; s < static_cast<int64_t>(spans.size()); ++s)
    for (int64_t j = 0; j * 16 < spans[s].rows; ++j) tiles.emplace_back(s, j);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
    const Span& span = spans[tiles[i].first];
    const int64_t j = tiles[i].second;
    uint16_t* tile = pieces + (span.tile0 + j) * groups * kTileElems;
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t row = j * 16 + r;
      const float* src = x + (span.first + row) * k;
      for (int64_t g = 0; g < groups; ++g) {
        const bool live = row < span.rows;
        const __m512 lo = live ? _mm512_loadu_ps(src + g * kGroup) : _mm512_setzero_ps();
        const __m512 hi = live ? _mm512_loadu_ps(src + g * kGroup + 16) : _mm512_setzero_ps();
        uint16_t* p = tile + g * kTileElems + r * kGroup;
        amx_tiles::split3(lo, p, p + plane, p + 2 * plane);
        amx_tiles::split3(hi, p + 16, p + plane + 16, p + 2 * plane + 16);
      }
    }
  }
}

// One packed tile ([K][32] bf16) -> per group, the VNNI tiles of its columns 0-15 (q0) and 16-31 (q1): row
// r of a group's tile holds inputs 2r and 2r + 1 of each column, interleaved.
void interleave(const uint16_t* tile, int64_t groups, uint16_t* q0, uint16_t* q1) {
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (int c = 0; c < 16; ++c) {
    lo_idx[2 * c] = c, lo_idx[2 * c + 1] = 32 + c;
    hi_idx[2 * c] = 16 + c, hi_idx[2 * c + 1] = 48 + c;
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < 16; ++r) {
      const __m512i even = _mm512_loadu_si512(tile + (g * kGroup + 2 * r) * kCols);
      const __m512i odd = _mm512_loadu_si512(tile + (g * kGroup + 2 * r + 1) * kCols);
      _mm512_storeu_si512(q0 + g * kTileElems + r * 32, _mm512_permutex2var_epi16(even, lo, odd));
      _mm512_storeu_si512(q1 + g * kTileElems + r * 32, _mm512_permutex2var_epi16(even, hi, odd));
    }
}

// NR row tiles (from `a`; the next one a_row_tile further) x the two column tiles over every group and
// piece (smallest first), accumulated on tiles 0..3, then stored to c.
template <int NR>
void row_tiles(const uint16_t* a, int64_t a_row_tile, int64_t plane, const uint16_t* q0, const uint16_t* q1,
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
    for (int p = 2; p >= 0; --p) {
      _tile_loadd(4, a + p * plane + g * kTileElems, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (NR == 2) {
        _tile_loadd(5, a + a_row_tile + p * plane + g * kTileElems, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + kTileFloats, 64);
  if constexpr (NR == 2) {
    _tile_stored(2, c + 2 * kTileFloats, 64);
    _tile_stored(3, c + 3 * kTileFloats, 64);
  }
}

// One span's rows of one packed tile into out (columns n0..n0 + cols), with the bias.
void span_tile(const Span& span, const uint16_t* pieces, int64_t groups, int64_t plane, const uint16_t* q0,
               const uint16_t* q1, float* c, float* out, int64_t n_dim, int64_t n0, int64_t cols, const float* bias) {
  const int64_t a_row_tile = groups * kTileElems, count = (span.rows + 15) / 16;
  const __mmask16 m0 = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? (__mmask16)0xFFFF : cols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (cols - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += 2) {
    const int64_t nr = j + 1 < count ? 2 : 1;
    const uint16_t* a = pieces + (span.tile0 + j) * a_row_tile;
    (nr == 2 ? &row_tiles<2> : &row_tiles<1>)(a, a_row_tile, plane, q0, q1, groups, c);
    for (int64_t i = 0; i < nr; ++i)
      for (int64_t r = 0; r < std::min<int64_t>(16, span.rows - (j + i) * 16); ++r) {
        float* o = out + (span.first + (j + i) * 16 + r) * n_dim + n0;
        _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_load_ps(c + 2 * i * kTileFloats + 16 * r), b0));
        _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(_mm512_load_ps(c + (2 * i + 1) * kTileFloats + 16 * r), b1));
      }
  }
}

void amx_grouped_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous float32 [P, K]");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == x.size(1) && packed.size(3) == kCols && x.size(1) % kGroup == 0,
              "packed: bf16 [G, tiles, K, 32], K a multiple of 32");
  const int64_t groups_e = packed.size(0), tiles = packed.size(1), k = x.size(1), n_dim = out.size(1);
  TORCH_CHECK(offsets.dim() == 1 && offsets.is_contiguous() && offsets.scalar_type() == at::kLong &&
                  offsets.size(0) == groups_e + 1,
              "offsets: int64 [G + 1]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && (n_dim + kCols - 1) / kCols == tiles, "out: [P, N]");
  TORCH_CHECK(min_rows >= 1, "min_rows: at least 1");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[groups_e] <= x.size(0), "offsets outside x");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == groups_e * n_dim, "bias: [G, N]");
    b = bias->data_ptr<float>();
  }
  std::vector<Span> spans;
  int64_t row_tiles_total = 0;
  for (int64_t e = 0; e < groups_e; ++e) {
    TORCH_CHECK(off[e + 1] >= off[e], "offsets must not decrease");
    const int64_t rows = off[e + 1] - off[e];
    if (rows < min_rows) continue;
    for (int64_t first = 0; first < rows; first += kSpanRows) {  // x pieces a thread keeps in L2 per span
      const int64_t count = std::min(kSpanRows, rows - first);
      spans.push_back({e, off[e] + first, count, row_tiles_total});
      row_tiles_total += (count + 15) / 16;
    }
  }
  if (spans.empty()) return;
  const int64_t groups = k / kGroup, plane = row_tiles_total * groups * kTileElems;
  static thread_local at::Tensor buffer;  // kept from call to call (page faults of a fresh one cost)
  const int64_t per_thread = 2 * groups * kTileElems / 2 + 4 * kTileFloats;  // in floats: q0, q1, c
  const int64_t floats = 3 * plane / 2 + omp_get_max_threads() * per_thread + 16;
  if (!buffer.defined() || buffer.numel() < floats) buffer = at::empty({floats}, x.options());
  uint16_t* pieces = reinterpret_cast<uint16_t*>(buffer.data_ptr<float>());
  float* scratch = buffer.data_ptr<float>() + 3 * plane / 2;
  split_spans(x.data_ptr<float>(), k, spans, row_tiles_total, pieces);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t items = static_cast<int64_t>(spans.size()) * tiles;
#pragma omp parallel
  {
    amx_tiles::configure_tiles();
    float* own = scratch + omp_get_thread_num() * per_thread;
    uint16_t* q0 = reinterpret_cast<uint16_t*>(own);
    uint16_t* q1 = q0 + groups * kTileElems;
    float* c = own + groups * kTileElems;  // 4 tiles, 64-byte aligned (per_thread and groups * 1 KB are)
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < items; ++i) {
      const Span& span = spans[i / tiles];
      const int64_t t = i % tiles, n0 = t * kCols;
      interleave(wp + (span.expert * tiles + t) * k * kCols, groups, q0, q1);
      span_tile(span, pieces, groups, plane, q0, q1, c, op, n_dim, n0, std::min<int64_t>(kCols, n_dim - n0),
                b ? b + span.expert * n_dim + n0 : nullptr);
    }
    _tile_release();
  }
}
#else
void amx_grouped_gemm(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const c10::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "built without AMX");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(cb_serve, m) {
  m.def("amx_grouped_gemm(Tensor(a!) out, Tensor x, Tensor offsets, Tensor packed, Tensor? bias, int min_rows) -> ()");
}

TORCH_LIBRARY_IMPL(cb_serve, CPU, m) { m.impl("amx_grouped_gemm", &amx_grouped_gemm); }
