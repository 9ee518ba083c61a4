// y = x W^T for a few rows of x (decode) and 4-bit weights in torch's CPU int4 layout, with integer dot
// products: each row of x is rounded to 8 bits per 32 inputs (a scale per 32, as llama.cpp's Q8 activations),
// and AVX512-VNNI's vpdpbusd multiplies 64 weight nibbles by 4 activation bytes per instruction. Decode is bound
// by reading the weights, and this reads them at 4 bits without expanding them to floats first; torch's int4
// kernel does the same in emulated bfloat16 on CPUs without AVX512-BF16 (SmolLM2's 120 projections at one row,
// 2-core Xeon: see cpu_int4.py). The error is that of 8-bit activations, about bfloat16's.
//
// Layout [N / 64, K, 32] bytes: byte j of input column k holds output row j of the block in its low nibble and
// row j + 32 in its high one. vpdpbusd sums 4 consecutive inputs per 32-bit lane, so four columns are loaded and
// their nibbles regrouped by one vpermt2b (AVX512-VBMI) per 16 output rows. w = (q - 8) s + z per group and
// x ~ xs * xq per chunk, so sum_k w x ~ s xs (sum_k q xq - 8 sum_k xq) + z sum_k x: the 8 is taken off in integers
// (centred weights: the error of rounding x does not grow with q's offset), the last sum from the float x.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define HETEROSERVE_INT4_VNNI 1
#endif

namespace heteroserve {

bool int4_vnni_available() {
#ifdef HETEROSERVE_INT4_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace heteroserve

#ifdef HETEROSERVE_INT4_VNNI
namespace {

constexpr int64_t kBlock = 64;  // output rows per block of torch's layout
constexpr int64_t kChunk = 32;  // inputs per activation scale
constexpr int kMaxRows = 4;     // rows of x per pass over a block: 4 x 4 integer accumulators in registers

// Rows of x rounded to int8 per chunk of 32: q = round(x / s), s = max |x| / 127; per chunk also 8 sum q and
// the float sum of x.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;  // [M, K / 32]
  std::vector<int32_t> offset;    // 8 * sum q: the weights' offset of 8 times this chunk

  QuantizedRows(const float* x, int64_t M, int64_t K)
      : q(M * K), scale(M * K / kChunk), sum(M * K / kChunk), offset(M * K / kChunk) {
    for (int64_t c = 0; c < M * K / kChunk; ++c) {
      const float* v = x + c * kChunk;
      float amax = 0.f, total = 0.f;
      for (int i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(v[i])), total += v[i];
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      int32_t q_total = 0;
      for (int i = 0; i < kChunk; ++i) {
        q[c * kChunk + i] = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
        q_total += q[c * kChunk + i];
      }
      scale[c] = amax / 127.f;
      sum[c] = total;
      offset[c] = 8 * q_total;
    }
  }
};

// vpermt2b indices: from two vectors of 64 nibbles (columns k | k + 1 and k + 2 | k + 3, 32 rows each), the
// 16 rows [16 * half, 16 * half + 16) with their four columns' values in consecutive bytes.
__m512i regroup_indices(int half) {
  alignas(64) uint8_t idx[64];
  for (int d = 0; d < 16; ++d) {
    const int row = 16 * half + d;
    idx[4 * d + 0] = row;
    idx[4 * d + 1] = 32 + row;
    idx[4 * d + 2] = 64 + row;
    idx[4 * d + 3] = 96 + row;
  }
  return _mm512_load_si512(idx);
}

// Rows [0, ROWS) of the quantized x times one block: out[r, 0:64] (row stride N).
template <int ROWS>
void block_rows(const uint8_t* block, int64_t K, const int8_t* xq, const float* xs, const float* xsum,
                const int32_t* offset, const float* scale_zero, int64_t group, float* out, int64_t N) {
  const __m512i nibble = _mm512_set1_epi8(15), low_rows = regroup_indices(0), high_rows = regroup_indices(1);
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < K / kChunk; ++c) {
    __m512i dot[ROWS][4];
    for (int r = 0; r < ROWS; ++r) {
      for (int j = 0; j < 4; ++j) dot[r][j] = _mm512_setzero_si512();
    }
    for (int64_t k = c * kChunk; k < (c + 1) * kChunk; k += 4) {
      _mm_prefetch(reinterpret_cast<const char*>(block + (k + 32) * 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(block + (k + 34) * 32), _MM_HINT_T0);
      const __m512i a = _mm512_loadu_si512(block + k * 32), b = _mm512_loadu_si512(block + (k + 2) * 32);
      const __m512i a_low = _mm512_and_si512(a, nibble), b_low = _mm512_and_si512(b, nibble);
      const __m512i a_high = _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble);
      const __m512i b_high = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
      const __m512i w[4] = {_mm512_permutex2var_epi8(a_low, low_rows, b_low),
                            _mm512_permutex2var_epi8(a_low, high_rows, b_low),
                            _mm512_permutex2var_epi8(a_high, low_rows, b_high),
                            _mm512_permutex2var_epi8(a_high, high_rows, b_high)};
      for (int r = 0; r < ROWS; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + k, sizeof(four));
        const __m512i x4 = _mm512_set1_epi32(four);
        for (int j = 0; j < 4; ++j) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], w[j], x4);
      }
    }
    const int64_t g = c * kChunk / group;
    for (int r = 0; r < ROWS; ++r) {
      const int64_t rc = r * (K / kChunk) + c;
      const __m512 x_scale = _mm512_set1_ps(xs[rc]), x_sum = _mm512_set1_ps(xsum[rc]);
      const __m512i x_offset = _mm512_set1_epi32(offset[rc]);
      for (int j = 0; j < 4; ++j) {
        const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(scale_zero + 2 * g * kBlock + 16 * j), x_scale);
        const __m512 centred = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][j], x_offset));
        acc[r][j] = _mm512_fmadd_ps(_mm512_loadu_ps(scale_zero + (2 * g + 1) * kBlock + 16 * j), x_sum, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(centred, scale, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * N + 16 * j, acc[r][j]);
  }
}

}  // namespace
#endif

namespace heteroserve {

at::Tensor int4_vnni_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_zero) {
  TORCH_CHECK_NOT_IMPLEMENTED(int4_vnni_available(), "int4_vnni_linear: built without AVX512-VNNI and VBMI");
  TORCH_CHECK_NOT_IMPLEMENTED(x_in.scalar_type() == at::kFloat, "int4_vnni_linear: float32 activations only");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 32 && packed.is_contiguous(),
              "int4_vnni_linear: packed must be uint8 [N / 64, K, 32]");
  const int64_t K = packed.size(1), N = packed.size(0) * 64;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K && K % 32 == 0, "int4_vnni_linear: x must be [M, ", K,
              "] with a multiple of 32 columns");
  TORCH_CHECK(scale_zero.scalar_type() == at::kFloat && scale_zero.is_contiguous() && scale_zero.dim() == 4 &&
                  scale_zero.size(0) == N / 64 && scale_zero.size(1) > 0 && K % scale_zero.size(1) == 0 &&
                  (K / scale_zero.size(1)) % 32 == 0 && scale_zero.size(2) == 2 && scale_zero.size(3) == 64,
              "int4_vnni_linear: scale_zero must be contiguous float32 [N / 64, K / group, 2, 64], groups of 32k");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), groups = scale_zero.size(1), group = K / groups;
  at::Tensor out = at::empty({M, N}, x.options());
#ifdef HETEROSERVE_INT4_VNNI
  const QuantizedRows rows(x.const_data_ptr<float>(), M, K);
  const uint8_t* pd = packed.const_data_ptr<uint8_t>();
  const float* szd = scale_zero.const_data_ptr<float>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, N / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int64_t chunks = m * (K / kChunk);
        auto run = [&](auto rows_constant) {
          block_rows<decltype(rows_constant)::value>(pd + b * K * 32, K, rows.q.data() + m * K,
                                                     rows.scale.data() + chunks, rows.sum.data() + chunks,
                                                     rows.offset.data() + chunks, szd + b * groups * 2 * kBlock,
                                                     group, od + m * N + b * kBlock, N);
        };
        switch (std::min<int64_t>(kMaxRows, M - m)) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          default: run(std::integral_constant<int, 4>{}); break;
        }
      }
    }
  });
#endif
  return out;
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("int4_vnni_available() -> bool");
  m.def("int4_vnni_linear(Tensor x, Tensor packed, Tensor scale_zero) -> Tensor");
  m.impl("int4_vnni_available", &heteroserve::int4_vnni_available);
  m.impl("int4_vnni_linear", c10::DispatchKey::CPU, &heteroserve::int4_vnni_linear);
}
