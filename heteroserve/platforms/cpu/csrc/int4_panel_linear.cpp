// y = x W^T for 4-bit weights in our own layout (cpu_int4.py packs it, the same on every CPU), in float32
// arithmetic, for every number of rows. The layout is [N / 64, K, 32] bytes: byte j of input column k holds row j of
// the block in its low nibble and row j + 32 in its high one, so a block of 64 output rows is already laid out
// column by column, as our float32 GEMM's panels are (packed_tile.h).
//
// With w = (q - 8) s + z = q s + z' per group g of inputs (z' = z - 8 s), every output is computed as
//   y = sum over g, in order, of  s_g * P_g  then  z'_g * X_g,   P_g = sum_{k in g} x_k q_k,  X_g = sum_{k in g} x_k,
// each sum taken in order of k from zero in float32 (fused multiply-adds). Both paths below add exactly these
// terms in this order, so a row's result does not depend on how many rows it is multiplied with (a decode row
// gets the bits the same row gets inside a prompt: the batch-invariance tests rely on it):
// - a few rows (decode): straight from the nibbles, a machine vector of weights converted at a time and used by up
//   to 4 rows; one multiply-add per weight and row (the scales come in once per group). With AVX-512 a pass
//   takes a whole block; with AVX2's 16 registers (and NEON, SSE) a share of a block's bytes, both nibbles of
//   them for one or two rows;
// - more rows (prefill): each block's q is expanded once into a thread-local buffer of float panels that stays in
//   L2 and multiplied there on the GEMM's tile shape, a group at a time.
// 8-bit activations (llama.cpp's Q8, integer dot products) changed the default model's answer to the demo question
// when its prompt rows took them, so activations stay float32.

// The library is built allowing reassociation (cpu_kernels.CFLAGS), under which GCC regrouped a sum whose
// accumulators spilled (tiles of 11-12 rows, AVX2's 16 registers): here the order above is the point.
#pragma GCC optimize("no-associative-math")

#include "thread_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "packed_tile.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace {

using namespace heteroserve;

constexpr int64_t kBlock = 64;         // output rows per block of torch's layout
constexpr int64_t kDirectRows = 16;    // below this many rows, no panels: measured in cpu_int4.py
constexpr int kDirectPass = 4;         // rows per pass over a block: 4 x 4 x 2 accumulators in registers
constexpr int64_t kDirectPrefetch = 32;  // columns ahead of the direct path's reads
typedef float f32x16 __attribute__((vector_size(64)));

// The 64 4-bit values of one input column of a block, as floats: rows 0-15, 16-31 (low nibbles), 32-47, 48-63.
inline void unpack_column(const uint8_t* p, f32x16 q[4]) {
#if defined(__AVX512F__)
  for (int half = 0; half < 2; ++half) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * half)));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    std::memcpy(&q[half], &low, sizeof(low));
    std::memcpy(&q[2 + half], &high, sizeof(high));
  }
#elif defined(__AVX2__)
  for (int eighth = 0; eighth < 4; ++eighth) {  // 8 bytes at a time: rows 8e..8e+7 and 32+8e..32+8e+7
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * eighth)));
    const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
    const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    std::memcpy(reinterpret_cast<float*>(q) + 8 * eighth, &low, sizeof(low));
    std::memcpy(reinterpret_cast<float*>(q) + 32 + 8 * eighth, &high, sizeof(high));
  }
#else  // NEON and SSE: GCC's vector extensions widen the bytes in registers
  typedef uint8_t u8x16 __attribute__((vector_size(16)));
  for (int half = 0; half < 2; ++half) {
    u8x16 bytes;
    std::memcpy(&bytes, p + 16 * half, sizeof(bytes));
    q[half] = __builtin_convertvector(bytes & 15, f32x16);
    q[2 + half] = __builtin_convertvector(bytes >> 4, f32x16);
  }
#endif
}

// X_g of every row: [M, groups], each a sum in order of k (one loop, so both paths read the same bits).
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t group) {
  std::vector<float> sums(M * (K / group));
  for (int64_t i = 0; i < M * (K / group); ++i) {
    float total = 0.f;
    for (int64_t k = 0; k < group; ++k) total += x[i * group + k];
    sums[i] = total;
  }
  return sums;
}

// Group g's scale and shifted zero z' = z - 8 s (8 s is exact, so z' is one rounding however it is computed) for
// `lanes` output rows starting at `first` of a block; scale_zero: the block's [groups, 2, 64].
template <typename V>
inline void group_scale(const float* scale_zero, int64_t g, int first, V& s, V& z) {
  std::memcpy(&s, scale_zero + 2 * g * kBlock + first, sizeof(V));
  std::memcpy(&z, scale_zero + (2 * g + 1) * kBlock + first, sizeof(V));
  z -= 8.f * s;
}

// a * b + c rounded once where the ISA has fused multiply-adds, written out so that both paths get it wherever
// the compiler would contract (GCC leaves group_tile's total + s * P unfused, the total loaded only after the
// first group: a different last bit from the few-row path's).
template <typename V>
inline V fused_multiply_add(V a, V b, V c) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return reinterpret_cast<V>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                                            reinterpret_cast<__m512>(b),
                                                                            reinterpret_cast<__m512>(c)));
#endif
#if defined(__FMA__)
  if constexpr (sizeof(V) == 32) return reinterpret_cast<V>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                                                           reinterpret_cast<__m256>(b),
                                                                           reinterpret_cast<__m256>(c)));
#endif
#if defined(__aarch64__)
  if constexpr (sizeof(V) == 16) {
    return reinterpret_cast<V>(vfmaq_f32(reinterpret_cast<float32x4_t>(c), reinterpret_cast<float32x4_t>(a),
                                         reinterpret_cast<float32x4_t>(b)));
  }
#endif
  return a * b + c;
}

// A group's terms added to an accumulator, in the one order both paths use.
template <typename V>
inline V add_group(V acc, V s, V part, V z, float x_sum) {
  acc = fused_multiply_add(s, part, acc);
  return fused_multiply_add(z, V{} + x_sum, acc);
}

#if defined(__AVX512F__)
// Rows [0, ROWS) of x times block b straight from its nibbles: out[r, 0:64] (row stride N). AVX-512's 32 registers
// hold a pass's 4 x 4 sums, a column's 64 weights and the running totals.
template <int ROWS>
void block_rows(const uint8_t* block, const float* scale_zero, int64_t groups, int64_t K, const float* x,
                const float* x_sums, float* out, int64_t N) {
  const int64_t group = K / groups;
  f32x16 acc[ROWS][4] = {};
  for (int64_t g = 0; g < groups; ++g) {
    f32x16 part[ROWS][4] = {};
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      __builtin_prefetch(block + (k + kDirectPrefetch) * (kBlock / 2));
      f32x16 q[4];
      unpack_column(block + k * (kBlock / 2), q);
      for (int r = 0; r < ROWS; ++r) {
        const float xr = x[r * K + k];
        for (int v = 0; v < 4; ++v) part[r][v] += xr * q[v];
      }
    }
    for (int v = 0; v < 4; ++v) {
      f32x16 s, z;
      group_scale(scale_zero, g, 16 * v, s, z);
      for (int r = 0; r < ROWS; ++r) acc[r][v] = add_group(acc[r][v], s, part[r][v], z, x_sums[r * groups + g]);
    }
  }
  for (int r = 0; r < ROWS; ++r) std::memcpy(out + r * N, acc[r], sizeof(acc[r]));
}
#else
constexpr int kChunkBytes = 2 * kLanes;  // bytes of a column per pass: two machine vectors of rows per nibble

// Bytes [c0, c0 + 2 kLanes) of one input column as floats: q[0..1] the low nibbles (rows c0...), q[2..3] the
// high ones (rows 32 + c0...); only those the pass asks for (LOW, HIGH) are converted.
template <bool LOW, bool HIGH>
inline void unpack_chunk(const uint8_t* bytes, vec q[4]) {
#if defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {
    const __m256i words = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * h)));
    if constexpr (LOW) {
      const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(15)));
      std::memcpy(&q[h], &low, sizeof(low));
    }
    if constexpr (HIGH) {
      const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(words, 4));
      std::memcpy(&q[2 + h], &high, sizeof(high));
    }
  }
#else  // NEON and SSE: GCC's vector extensions widen the bytes in registers
  typedef uint8_t bytes_t __attribute__((vector_size(kLanes)));
  for (int h = 0; h < 2; ++h) {
    bytes_t b;
    std::memcpy(&b, bytes + kLanes * h, sizeof(b));
    if constexpr (LOW) q[h] = __builtin_convertvector(b & 15, vec);
    if constexpr (HIGH) q[2 + h] = __builtin_convertvector(b >> 4, vec);
  }
#endif
}

// Rows [0, ROWS) of x times the rows of block b that bytes [c0, c0 + 2 kLanes) hold: rows c0... (LOW) and
// 32 + c0... (HIGH), into out[r, ...] (row stride N). With AVX2's 16 registers a pass keeps its sums for up to 8
// vectors (2 rows of both nibbles, or 4 rows of one) and each group's running totals in registers or L1; the
// block's bytes come from memory for its first pass and from L1 for the others.
template <int ROWS, bool LOW, bool HIGH>
void chunk_rows(const uint8_t* block, const float* scale_zero, int64_t groups, int64_t K, int c0, const float* x,
                const float* x_sums, float* out, int64_t N) {
  const int64_t group = K / groups;
  vec acc[ROWS][4] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vec part[ROWS][4] = {};
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      __builtin_prefetch(block + (k + kDirectPrefetch) * (kBlock / 2) + c0);
      vec q[4];
      unpack_chunk<LOW, HIGH>(block + k * (kBlock / 2) + c0, q);
      for (int r = 0; r < ROWS; ++r) {
        const float xr = x[r * K + k];
        for (int v = 0; v < 4; ++v) {
          if ((v < 2 && LOW) || (v >= 2 && HIGH)) part[r][v] += xr * q[v];
        }
      }
    }
    for (int v = 0; v < 4; ++v) {
      if ((v < 2 && !LOW) || (v >= 2 && !HIGH)) continue;
      vec s, z;
      group_scale(scale_zero, g, (v < 2 ? 0 : kBlock / 2) + c0 + (v % 2) * kLanes, s, z);
      for (int r = 0; r < ROWS; ++r) acc[r][v] = add_group(acc[r][v], s, part[r][v], z, x_sums[r * groups + g]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int v = 0; v < 4; ++v) {
      const int row = (v < 2 ? 0 : kBlock / 2) + c0 + (v % 2) * kLanes;
      if ((v < 2 && LOW) || (v >= 2 && HIGH)) store(out + r * N + row, acc[r][v]);
    }
  }
}
#endif

// Block b's 4-bit values as 64 / kPanel panels [K, kPanel] of floats in `panels`.
void expand_block(const uint8_t* block, int64_t K, float* panels) {
  constexpr int chunk = std::min(16, kPanel);  // floats stored together: one panel's share of 16 rows
  for (int64_t k = 0; k < K; ++k) {
    f32x16 q[4];
    unpack_column(block + k * (kBlock / 2), q);
    for (int v = 0; v < 4; ++v) {
      for (int c = 0; c < 16; c += chunk) {
        const int row = 16 * v + c;
        std::memcpy(panels + ((row / kPanel) * K + k) * kPanel + row % kPanel,
                    reinterpret_cast<const float*>(&q[v]) + c, chunk * sizeof(float));
      }
    }
  }
}

// Rows [0, ROWS) of x times panel p of an expanded block: out[r, 0:kPanel]. The tile of packed_tile.h, with the
// sum restarted per group and the group's terms added as the direct path adds them. The running totals live in
// out (L1) between groups, so the tile is as tall as the float32 GEMM's: a group's 2 x ROWS sums are in registers
// for its inputs, and a total is read and written once per group of them.
template <int ROWS>
void group_tile(const float* x, int64_t K, int64_t groups, const float* x_sums, const float* panel,
                const float* scale_zero, int p, float* out, int64_t N) {
  const int64_t group = K / groups;
  for (int64_t g = 0; g < groups; ++g) {
    vec part[ROWS][2] = {};
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      __builtin_prefetch(panel + (k + kPrefetch) * kPanel);
      __builtin_prefetch(panel + (k + kPrefetch) * kPanel + kLanes);
      const vec w0 = load(panel + k * kPanel), w1 = load(panel + k * kPanel + kLanes);
      for (int r = 0; r < ROWS; ++r) {
        const float xr = x[r * K + k];
        part[r][0] += xr * w0;
        part[r][1] += xr * w1;
      }
    }
    for (int h = 0; h < 2; ++h) {
      vec s, z;
      group_scale(scale_zero, g, p * kPanel + h * kLanes, s, z);
      for (int r = 0; r < ROWS; ++r) {
        float* total = out + r * N + h * kLanes;
        const vec before = g == 0 ? vec{} : load(total);
        store(total, add_group(before, s, part[r][h], z, x_sums[r * groups + g]));
      }
    }
  }
}

// Rows [0, M) (M < kDirectRows) straight from the nibbles, out[M, N]. Work is split over the pool in units smaller
// than a block where the vectors are (a block's share of a column per pass), so that a projection of 9 blocks
// does not leave one thread idle for a ninth of it.
void direct_rows(const uint8_t* packed, const float* scale_zero, int64_t groups, int64_t K, int64_t N, const float* x,
                 const float* x_sums, int64_t M, float* out) {
  const int64_t blocks = N / kBlock;
#if defined(__AVX512F__)
  heteroserve::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m = 0; m < M; m += kDirectPass) {
        with_rows<kDirectPass>(static_cast<int>(std::min<int64_t>(kDirectPass, M - m)), [&](auto rows) {
          block_rows<decltype(rows)::value>(packed + b * K * (kBlock / 2), scale_zero + b * groups * 2 * kBlock,
                                            groups, K, x + m * K, x_sums + m * groups, out + m * N + b * kBlock, N);
        });
      }
    }
  });
#else
  // One or two rows: a pass takes both nibbles of its bytes (one load and widening for two sets of rows); more:
  // a pass per nibble, four rows at a time.
  const bool both = M <= 2;
  const int64_t chunks = (kBlock / 2) / kChunkBytes, units = chunks * (both ? 1 : 2);
  heteroserve::parallel_for(0, blocks * units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t b = u / units, unit = u % units;
      const int c0 = static_cast<int>(unit % chunks) * kChunkBytes;
      const bool high = unit >= chunks;
      const uint8_t* block = packed + b * K * (kBlock / 2);
      const float* sz = scale_zero + b * groups * 2 * kBlock;
      if (both) {
        with_rows<2>(static_cast<int>(M), [&](auto rows) {
          chunk_rows<decltype(rows)::value, true, true>(block, sz, groups, K, c0, x, x_sums, out + b * kBlock, N);
        });
        continue;
      }
      for (int64_t m = 0; m < M; m += kDirectPass) {
        with_rows<kDirectPass>(static_cast<int>(std::min<int64_t>(kDirectPass, M - m)), [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          float* o = out + m * N + b * kBlock;
          if (high) {
            chunk_rows<R, false, true>(block, sz, groups, K, c0, x + m * K, x_sums + m * groups, o, N);
          } else {
            chunk_rows<R, true, false>(block, sz, groups, K, c0, x + m * K, x_sums + m * groups, o, N);
          }
        });
      }
    }
  });
#endif
}

}  // namespace

namespace heteroserve {

at::Tensor int4_panel_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_zero) {
  TORCH_CHECK_NOT_IMPLEMENTED(x_in.scalar_type() == at::kFloat, "int4_panel_linear: float32 activations only");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBlock / 2 &&
                  packed.is_contiguous(),
              "int4_panel_linear: packed must be uint8 [N / 64, K, 32]");
  const int64_t K = packed.size(1), N = packed.size(0) * kBlock;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "int4_panel_linear: x must be [M, ", K, "]");
  TORCH_CHECK(scale_zero.scalar_type() == at::kFloat && scale_zero.is_contiguous() && scale_zero.dim() == 4 &&
                  scale_zero.size(0) == N / kBlock && scale_zero.size(1) > 0 && K % scale_zero.size(1) == 0 &&
                  scale_zero.size(2) == 2 && scale_zero.size(3) == kBlock,
              "int4_panel_linear: scale_zero must be contiguous float32 [N / 64, K / group, 2, 64]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), groups = scale_zero.size(1), group = K / groups;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xd = x.const_data_ptr<float>();
  const uint8_t* pd = packed.const_data_ptr<uint8_t>();
  const float* szd = scale_zero.const_data_ptr<float>();
  float* od = out.data_ptr<float>();
  const std::vector<float> x_sums = group_sums(xd, M, K, group);
  if (M < kDirectRows) {
    direct_rows(pd, szd, groups, K, N, xd, x_sums.data(), M, od);
    return out;
  }
  // Rows in slices that stay in L2 (a prefill's x would otherwise stream from L3 once per block); each block is
  // expanded again per slice, which costs little beside the slice's multiplies.
  const int64_t slice = row_block(K);
  heteroserve::parallel_for(0, N / kBlock, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panels(kBlock * K);
    for (int64_t m0 = 0; m0 < M; m0 += slice) {
      const int64_t m1 = std::min(M, m0 + slice);
      for (int64_t b = begin; b < end; ++b) {
        expand_block(pd + b * K * (kBlock / 2), K, panels.data());
        for (int p = 0; p < kBlock / kPanel; ++p) {
          // The expanded panel is already in L2: no next panel to fetch.
          tile_schedule(m0, m1, 0, nullptr, [&](int rows, int64_t m, const char*, int64_t) {
            with_rows<kTileRows>(rows, [&](auto r) {
              group_tile<decltype(r)::value>(xd + m * K, K, groups, x_sums.data() + m * groups,
                                             panels.data() + p * K * kPanel, szd + b * groups * 2 * kBlock, p,
                                             od + m * N + b * kBlock + p * kPanel, N);
            });
          });
        }
      }
    }
  });
  return out;
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("int4_panel_linear(Tensor x, Tensor packed, Tensor scale_zero) -> Tensor");
  m.impl("int4_panel_linear", c10::DispatchKey::CPU, &heteroserve::int4_panel_linear);
}
