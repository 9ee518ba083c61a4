// y = x W^T for 4-bit weights in torch's CPU int4 layout, in float32 arithmetic, for batches of more than a few
// rows. The layout is [N / 64, K, 32] bytes: byte j of input column k holds row j of the block in its low nibble
// and row j + 32 in its high one, so a block of 64 output rows is already laid out column by column, as our
// float32 GEMM's panels are (packed_tile.h). Each block is dequantised once, w = (q - 8) * scale + zero, into a
// thread-local buffer of panels that stays in L2, and multiplied there by every row of x: the weight crosses
// memory at 4 bits, and the multiplies run at the float32 GEMM's pace. torch's int4 kernel rounds activations
// to bfloat16 and, on a CPU without AVX512-BF16, took 1.6x the float32 GEMM's time for scenario B.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "packed_tile.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace heteroserve;

constexpr int64_t kBlock = 64;  // output rows per block of torch's layout
typedef float f32x16 __attribute__((vector_size(64)));

// The 64 weights of one input column of a block, as floats: rows 0-15, 16-31 (low nibbles), 32-47, 48-63.
inline void unpack_column(const uint8_t* p, f32x16 q[4]) {
#if defined(__AVX512F__)
  for (int half = 0; half < 2; ++half) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * half)));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    std::memcpy(&q[half], &low, sizeof(low));
    std::memcpy(&q[2 + half], &high, sizeof(high));
  }
#else
  for (int i = 0; i < 32; ++i) {
    q[i / 16][i % 16] = static_cast<float>(p[i] & 15);
    q[2 + i / 16][i % 16] = static_cast<float>(p[i] >> 4);
  }
#endif
}

// Block b's 64 rows as 64 / kPanel panels [K, kPanel] in `panels`. scale_zero: the block's float32
// [groups, 2, 64] (per group its 64 rows' scales, then their zeros).
void dequantise_block(const uint8_t* block, const float* scale_zero, int64_t groups, int64_t K,
                      float* panels) {
  const int64_t group = K / groups;
  constexpr int chunk = std::min(16, kPanel);  // floats stored together: one panel's share of 16 rows
  for (int64_t g = 0; g < groups; ++g) {
    f32x16 s[4], z[4];
    for (int j = 0; j < kBlock; ++j) {
      const float scale = scale_zero[2 * g * kBlock + j], zero = scale_zero[(2 * g + 1) * kBlock + j];
      s[j / 16][j % 16] = scale;
      z[j / 16][j % 16] = zero - 8.f * scale;  // (q - 8) s + z = q s + (z - 8 s)
    }
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      f32x16 q[4];
      unpack_column(block + k * (kBlock / 2), q);
      for (int v = 0; v < 4; ++v) {
        const f32x16 w = q[v] * s[v] + z[v];
        for (int c = 0; c < 16; c += chunk) {
          const int row = 16 * v + c;
          std::memcpy(panels + ((row / kPanel) * K + k) * kPanel + row % kPanel,
                      reinterpret_cast<const float*>(&w) + c, chunk * sizeof(float));
        }
      }
    }
  }
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
  const int64_t M = x.size(0), groups = scale_zero.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xd = x.const_data_ptr<float>();
  const uint8_t* pd = packed.const_data_ptr<uint8_t>();
  const float* szd = scale_zero.const_data_ptr<float>();
  float* od = out.data_ptr<float>();
  // Rows in slices that stay in L2 (a prefill's x would otherwise stream from L3 once per block); each block is
  // dequantised again per slice, which costs little beside the slice's multiplies.
  const int64_t slice = row_block(K);
  at::parallel_for(0, N / kBlock, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panels(kBlock * K);
    for (int64_t m0 = 0; m0 < M; m0 += slice) {
      for (int64_t b = begin; b < end; ++b) {
        dequantise_block(pd + b * K * (kBlock / 2), szd + b * groups * 2 * kBlock, groups, K, panels.data());
        for (int p = 0; p < kBlock / kPanel; ++p) {
          panel_rows(xd, m0, std::min(M, m0 + slice), K, panels.data() + p * K * kPanel, nullptr,
                     od + b * kBlock + p * kPanel, N, kPanel);
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
