// AMX tile helpers shared by the split-bf16 GEMMs on tiles (amx_gemm.cpp, amx_experts.cpp).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>

namespace amx_tiles {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Not GCC 12's _tile_loadconfig: its asm names only the first 8 bytes of the config as read (an "m"
// operand of pointer type), so the compiler may drop the stores to the rows and column widths.
inline void load_tile_config(const TileConfig& config) {
  __asm__ volatile("ldtilecfg %0" ::"m"(*reinterpret_cast<const unsigned char(*)[64]>(&config)));
}

inline void configure_tiles() {  // all 8 tiles 16 rows x 64 bytes
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  load_tile_config(config);
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

}  // namespace amx_tiles
#endif
