// y = x W^T + b with bfloat16 weights, W packed once at load: panel p holds output columns [p * 32, p * 32 + 32)
// as K / 2 runs of 32 column pairs (w[k, j], w[k + 1, j]), the operand layout of AVX512-BF16's vdpbf16ps, which
// adds x[k + 1] * w[k + 1, j] then x[k] * w[k, j] into column j's float32 sum (each product exact in float32).
// The layout is the same on every CPU. Where the compiler targets AVX512-BF16 that instruction runs; elsewhere
// (AVX2, NEON, SSE) the pair is widened in registers (a pair's 32 bits: the odd value is its top half as a float,
// the even one its bottom half shifted up) and added in the same order with float32 multiply-adds, so a product
// reads half the bytes of float32 weights on every level and gives the same sums. One weight read feeds a tile
// of rows, the panel streams from memory once per block of rows (packed_tile.h's schedule), and every row's sums
// run in the same order whatever the batch, so a request's outputs do not depend on its neighbours. The products
// run on the kernels' own pool, like the float32 GEMM's, so that with bfloat16 activations one team of threads
// owns the cores (cpu.py `assign_threads`).

#include "thread_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "kernels.h"
#include "packed_tile.h"

namespace heteroserve {

namespace {

constexpr int64_t kBf16Panel = 32;  // 32 float32 sums: two AVX-512 vectors, four AVX2 ones

// The tile's reads ahead at pair kk: the panel kPrefetch pairs on, and its share of the next panel (`ahead`).
inline void prefetch_step(const uint16_t* w, int64_t kk, const char* ahead, int64_t ahead_lines) {
  __builtin_prefetch(w + kPrefetch * 2 * kBf16Panel);
  __builtin_prefetch(w + kPrefetch * 2 * kBf16Panel + 32);
  if (2 * kk < ahead_lines) {
    __builtin_prefetch(ahead + 2 * kk * 64, 0, 2);
    __builtin_prefetch(ahead + (2 * kk + 1) * 64, 0, 2);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr int kBf16TileRows = kTileRows;
// Rows [0, ROWS) of x times one panel; x rows are K bfloat16 apart, K even. out_t: bfloat16 (rounded once) or
// float32 (an LM head's logits).
template <int ROWS, typename out_t>
inline void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* panel, const float* bias, out_t* out, int64_t N,
                      int columns, const char* ahead, int64_t ahead_lines) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const uint16_t* w = panel + kk * 2 * kBf16Panel;
    prefetch_step(w, kk, ahead, ahead_lines);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * K + 2 * kk, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
  }
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    float padded[kBf16Panel] = {};
    std::memcpy(padded, bias, columns * sizeof(float));
    b0 = _mm512_loadu_ps(padded);
    b1 = _mm512_loadu_ps(padded + 16);
  }
  for (int r = 0; r < ROWS; ++r) {
    out_t full[kBf16Panel];
    out_t* row = columns == kBf16Panel ? out + r * N : full;
    if constexpr (std::is_same_v<out_t, float>) {
      _mm512_storeu_ps(row, _mm512_add_ps(acc[r][0], b0));
      _mm512_storeu_ps(row + 16, _mm512_add_ps(acc[r][1], b1));
    } else {
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], b0));
      const __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], b1));
      std::memcpy(row, &lo, sizeof(lo));
      std::memcpy(row + 16, &hi, sizeof(hi));
    }
    if (columns != kBf16Panel) std::memcpy(out + r * N, full, columns * sizeof(out_t));
  }
}

#else
// Rows per tile: its 32 sums a row (32 / kLanes vectors) and a widened pair of weight vectors in registers.
constexpr int kBf16TileRows = kLanes == 4 ? 3 : kLanes == 8 ? 3 : kTileRows;
constexpr int kPanelVectors = kBf16Panel / kLanes;

// Rows [0, ROWS) of x times one panel, the pairs widened in registers (see the top of the file).
template <int ROWS, typename out_t>
inline void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* panel, const float* bias, out_t* out, int64_t N,
                      int columns, const char* ahead, int64_t ahead_lines) {
  typedef uint32_t words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  vec acc[ROWS][kPanelVectors] = {};
  const int64_t pairs = K / 2;
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const uint16_t* w = panel + kk * 2 * kBf16Panel;
    prefetch_step(w, kk, ahead, ahead_lines);
    float x_even[ROWS], x_odd[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      const uint32_t even_bits = static_cast<uint32_t>(x[r * K + 2 * kk]) << 16;
      const uint32_t odd_bits = static_cast<uint32_t>(x[r * K + 2 * kk + 1]) << 16;
      std::memcpy(&x_even[r], &even_bits, sizeof(float));
      std::memcpy(&x_odd[r], &odd_bits, sizeof(float));
    }
    for (int v = 0; v < kPanelVectors; ++v) {
      words pair;
      std::memcpy(&pair, w + 2 * kLanes * v, sizeof(pair));
      const words odd_bits = pair & 0xFFFF0000u, even_bits = pair << 16;
      vec odd, even;
      std::memcpy(&odd, &odd_bits, sizeof(odd));
      std::memcpy(&even, &even_bits, sizeof(even));
      for (int r = 0; r < ROWS; ++r) {
        acc[r][v] += x_odd[r] * odd;
        acc[r][v] += x_even[r] * even;
      }
    }
  }
  float padded[kBf16Panel] = {};
  if (bias != nullptr) std::memcpy(padded, bias, columns * sizeof(float));
  for (int r = 0; r < ROWS; ++r) {
    float sums[kBf16Panel];
    for (int v = 0; v < kPanelVectors; ++v) store(sums + v * kLanes, acc[r][v] + load(padded + v * kLanes));
    out_t full[kBf16Panel];
    store_row(sums, kBf16Panel, full);
    std::memcpy(out + r * N, full, columns * sizeof(out_t));
  }
}
#endif

// Rows [m0, m1) times one panel on packed_tile.h's schedule.
template <typename out_t>
void bf16_panel_rows(const uint16_t* x, int64_t m0, int64_t m1, int64_t K, const uint16_t* panel, const float* bias,
                     out_t* out, int64_t N, int columns, const uint16_t* next) {
  tile_schedule<kBf16TileRows>(m0, m1, K * kBf16Panel * 2, next, [&](int rows, int64_t m, const char* ahead, int64_t ahead_lines) {
    with_rows<kBf16TileRows>(rows, [&](auto r) {
      bf16_tile<decltype(r)::value>(x + m * K, K, panel, bias, out + m * N, N, columns, ahead, ahead_lines);
    });
  });
}

}  // namespace

// [N, K] bfloat16 -> [ceil(N / 32), K / 2, 32, 2], the last panel padded with zero columns. K must be even.
at::Tensor pack_bf16_linear_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.scalar_type() == at::kBFloat16 && w_in.dim() == 2 && w_in.size(1) % 2 == 0,
              "pack_bf16_linear_weight: a bfloat16 [N, K] weight with K even");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kBf16Panel - 1) / kBf16Panel;
  at::Tensor packed = at::zeros({panels, K / 2, kBf16Panel, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  heteroserve::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min<int64_t>(kBf16Panel, N - p * kBf16Panel);
      for (int64_t j = 0; j < columns; ++j) {
        const uint16_t* row = src + (p * kBf16Panel + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[((p * (K / 2) + k / 2) * kBf16Panel + j) * 2 + k % 2] = row[k];
      }
    }
  });
  return packed;
}

// float_output: float32 results (an LM head's logits, kept from bfloat16's coarse rounding), else bfloat16.
at::Tensor bf16_packed_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                              const std::optional<at::Tensor>& bias_in, bool float_output) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "bf16_packed_linear: bfloat16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBf16Panel && packed.size(3) == 2 && packed.is_contiguous(),
              "bf16_packed_linear: the weight must come from pack_bf16_linear_weight");
  const int64_t K = packed.size(1) * 2, panels = packed.size(0);
  TORCH_CHECK(x_in.size(-1) == K, "bf16_packed_linear: x has ", x_in.size(-1), " features, the weight ", K);
  TORCH_CHECK(N > (panels - 1) * kBf16Panel && N <= panels * kBf16Panel, "bf16_packed_linear: N does not match");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == N, "bf16_packed_linear: bias must have N values");
  }
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = N;
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_output ? at::kFloat : at::kBFloat16));
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>());
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>());
  const float* bd = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  const int64_t block = std::max<int64_t>(kTileRows, kRowBlockBytes / (K * 2) / kTileRows * kTileRows);
  const int64_t panel_size = K * kBf16Panel;
  auto multiply = [&](auto* od) {
    heteroserve::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < M; m0 += block) {
        for (int64_t p = begin; p < end; ++p) {
          const int columns = static_cast<int>(std::min<int64_t>(kBf16Panel, N - p * kBf16Panel));
          bf16_panel_rows(xd, m0, std::min(M, m0 + block), K, wd + p * panel_size,
                          bd ? bd + p * kBf16Panel : nullptr, od + p * kBf16Panel, N, columns,
                          p + 1 < end ? wd + (p + 1) * panel_size : nullptr);
        }
      }
    });
  };
  if (float_output) {
    multiply(out.data_ptr<float>());
  } else {
    multiply(out.data_ptr<c10::BFloat16>());
  }
  return out.view(out_sizes);
}

bool bf16_dot_product_instruction() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("bf16_dot_product_instruction() -> bool");
  m.impl("bf16_dot_product_instruction", &heteroserve::bf16_dot_product_instruction);
  m.def("pack_bf16_linear_weight(Tensor w) -> Tensor");
  m.def("bf16_packed_linear(Tensor x, Tensor packed, int N, Tensor? bias, bool float_output=False) -> Tensor");
  m.impl("pack_bf16_linear_weight", c10::DispatchKey::CPU, &heteroserve::pack_bf16_linear_weight);
  m.impl("bf16_packed_linear", c10::DispatchKey::CPU, &heteroserve::bf16_packed_linear);
}
