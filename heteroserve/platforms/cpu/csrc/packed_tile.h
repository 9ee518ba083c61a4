// The register tile of our float32 GEMM (packed_linear.cpp, int4_panel_linear.cpp): weights in column panels,
// panel p holding output columns [p * NR, p * NR + NR) as K consecutive runs of NR weights.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vector_math.h"

namespace heteroserve {

// The tile shape that keeps MR x 2 accumulators plus two weight vectors within the register file.
constexpr int kTileRows = kLanes == 16 ? 12 : kLanes == 8 ? 6 : 8;
constexpr int kPanel = 2 * kLanes;           // NR: output columns per panel
constexpr int64_t kPrefetch = 16;             // k steps ahead of the tile's reads
constexpr int64_t kRowBlockBytes = 1 << 19;  // x rows per pass over the panels: their slice stays in L2

// Whether a float32 product of `rows` rows prefetches its panels in software (the tile's next lines, the next
// panel into L2). Up to 16 rows the product is bound by reading its weight, and AVX2 builds leave that stream to
// the hardware prefetchers, which run it faster alone (bench/results/float32-prefetch-amd-epyc-zen3-avx2-*). Beyond,
// and on AVX-512 builds, the prefetches stay; the bfloat16 kernel's widening keeps them too (they pay there).
inline bool software_prefetch(int64_t rows) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  return rows > 16;
#else
  (void)rows;
  return true;
#endif
}

// Rows [0, ROWS) of x times one panel: out[r, 0:columns] (columns < kPanel only in the last panel); PREFETCH: see
// software_prefetch.
template <int ROWS, bool PREFETCH = true>
inline void tile(const float* x, int64_t K, const float* panel, const float* bias, float* out, int64_t N, int columns,
                 const char* ahead, int64_t ahead_lines) {
  vec acc[ROWS][2] = {};
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PREFETCH) {
      __builtin_prefetch(panel + (k + kPrefetch) * kPanel);
      __builtin_prefetch(panel + (k + kPrefetch) * kPanel + kLanes);
    }
    if (PREFETCH && 2 * k < ahead_lines) {
      __builtin_prefetch(ahead + 2 * k * 64, 0, 2);
      __builtin_prefetch(ahead + (2 * k + 1) * 64, 0, 2);
    }
    const vec w0 = load(panel + k * kPanel), w1 = load(panel + k * kPanel + kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const float xr = x[r * K + k];
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
    }
  }
  if (bias != nullptr) {
    vec b[2];
    float padded[kPanel] = {};
    std::memcpy(padded, bias, columns * sizeof(float));
    b[0] = load(padded);
    b[1] = load(padded + kLanes);
    for (int r = 0; r < ROWS; ++r) acc[r][0] += b[0], acc[r][1] += b[1];
  }
  for (int r = 0; r < ROWS; ++r) {
    if (columns == kPanel) {
      store(out + r * N, acc[r][0]);
      store(out + r * N + kLanes, acc[r][1]);
    } else {
      float full[kPanel];
      store(full, acc[r][0]);
      store(full + kLanes, acc[r][1]);
      std::memcpy(out + r * N, full, columns * sizeof(float));
    }
  }
}

// f(std::integral_constant<int, rows>{}) for rows in [1, MAX]: a tile function gets its row count as a constant,
// so its accumulators stay in registers.
template <int MAX, typename F>
inline void with_rows(int rows, F&& f) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return with_rows<MAX - 1>(rows, f);
  }
  f(std::integral_constant<int, MAX>{});
}

// The schedule of rows [m0, m1) over one panel of `panel_bytes`: tiles of equal height (at most MAX_ROWS), each
// run as tile(rows, first_row, ahead, ahead_lines). `next` (the panel to be read after this one, or nullptr) is
// fetched into L2 a share per tile while this one's multiplies run: the tile prefetches its `ahead_lines` cache
// lines from `ahead`.
template <int MAX_ROWS = kTileRows, typename Tile>
inline void tile_schedule(int64_t m0, int64_t m1, int64_t panel_bytes, const void* next, Tile&& tile) {
  const int64_t tiles = (m1 - m0 + MAX_ROWS - 1) / MAX_ROWS;
  const int64_t lines = next ? panel_bytes / 64 : 0, share = (lines + tiles - 1) / tiles;
  for (int64_t t = 0, m = m0; t < tiles; ++t) {
    const int rows = static_cast<int>((m1 - m + (tiles - t) - 1) / (tiles - t));
    const int64_t first = std::min(lines, t * share), count = std::min(lines, first + share) - first;
    tile(rows, m, reinterpret_cast<const char*>(next) + first * 64, count);
    m += rows;
  }
}

// `rows` (at most kTileRows) rows of x times one panel.
template <bool PREFETCH = true>
inline void tile_rows(int rows, const float* x, int64_t K, const float* panel, const float* bias, float* out,
                      int64_t N, int columns, const char* ahead, int64_t ahead_lines) {
  with_rows<kTileRows>(rows, [&](auto r) {
    tile<decltype(r)::value, PREFETCH>(x, K, panel, bias, out, N, columns, ahead, ahead_lines);
  });
}

// Rows [m0, m1) of x times one float32 panel (`next`: see tile_schedule; prefetch: see software_prefetch).
inline void panel_rows(const float* x, int64_t m0, int64_t m1, int64_t K, const float* panel, const float* bias,
                       float* out, int64_t N, int columns, const float* next = nullptr, bool prefetch = true) {
  tile_schedule(m0, m1, K * kPanel * 4, prefetch ? next : nullptr,
                [&](int rows, int64_t m, const char* ahead, int64_t ahead_lines) {
                  if (prefetch) {
                    tile_rows<true>(rows, x + m * K, K, panel, bias, out + m * N, N, columns, ahead, ahead_lines);
                  } else {
                    tile_rows<false>(rows, x + m * K, K, panel, bias, out + m * N, N, columns, ahead, ahead_lines);
                  }
                });
}

// Rows of x per pass over the panels, so that their slice stays in L2 while the panels stream by.
inline int64_t row_block(int64_t K) {
  return std::max<int64_t>(kTileRows, kRowBlockBytes / (K * 4) / kTileRows * kTileRows);
}

}  // namespace heteroserve
