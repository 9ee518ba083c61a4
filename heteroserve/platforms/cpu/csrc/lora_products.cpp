// The adapters' products of a step, added to a base projection's output in one call: for each segment of rows
// [start, end) under adapter slot s, y[rows] += (x[rows] A_s^T) B_s^T, with A^T [slots, K, R] and B^T [slots, R, N]
// as lora/slots.py stacks them. Punica's SGMV, in two passes over register tiles: the shrink (x A^T, a few columns
// wide) into a float32 scratch, then the expand (scratch B^T) accumulated into y. Each output sums its products in
// k order in one accumulator whatever the tile around it, so a row gets the same bits alone or in any batch.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "packed_tile.h"
#include "thread_pool.h"

namespace {

using heteroserve::kLanes;
using heteroserve::kTileRows;
using heteroserve::vec;

template <typename T>
inline float widen(T value) {
  return static_cast<float>(value);
}

// out[r, 0 : V * kLanes] (+)= sum over k of x[r, k] w[k, 0 : V * kLanes], rows [0, ROWS): x rows `x_stride` apart,
// w rows `w_stride` apart, out rows `out_stride` apart; ACCUMULATE adds to what out holds.
template <int ROWS, int V, bool ACCUMULATE, typename X, typename W, typename O>
inline void product_tile(const X* x, int64_t x_stride, int64_t K, const W* w, int64_t w_stride, O* out,
                         int64_t out_stride) {
  vec acc[ROWS][V];
  for (int r = 0; r < ROWS; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = ACCUMULATE ? heteroserve::load(out + r * out_stride + v * kLanes) : vec{};
  }
  for (int64_t k = 0; k < K; ++k) {
    vec wk[V];
    for (int v = 0; v < V; ++v) wk[v] = heteroserve::load(w + k * w_stride + v * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const float xr = widen(x[r * x_stride + k]);
      for (int v = 0; v < V; ++v) acc[r][v] += xr * wk[v];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int v = 0; v < V; ++v) heteroserve::store(out + r * out_stride + v * kLanes, acc[r][v]);
  }
}

// Columns [c0, c1) of rows [0, rows) of the product above: two-vector tiles, then one vector, then single columns
// (a width that is not a multiple of the vector), each output in the same k order.
template <bool ACCUMULATE, typename X, typename W, typename O>
void columns(int rows, const X* x, int64_t x_stride, int64_t K, const W* w, int64_t w_stride, O* out,
             int64_t out_stride, int64_t c0, int64_t c1) {
  int64_t c = c0;
  heteroserve::with_rows<kTileRows>(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    for (; c + 2 * kLanes <= c1; c += 2 * kLanes) {
      product_tile<R, 2, ACCUMULATE>(x, x_stride, K, w + c, w_stride, out + c, out_stride);
    }
    for (; c + kLanes <= c1; c += kLanes) {
      product_tile<R, 1, ACCUMULATE>(x, x_stride, K, w + c, w_stride, out + c, out_stride);
    }
  });
  for (; c < c1; ++c) {
    for (int r = 0; r < rows; ++r) {
      float sum = ACCUMULATE ? widen(out[r * out_stride + c]) : 0.f;
      for (int64_t k = 0; k < K; ++k) sum += widen(x[r * x_stride + k]) * widen(w[k * w_stride + c]);
      out[r * out_stride + c] = static_cast<O>(sum);
    }
  }
}

// Vector registers of the ISA, and the rows of a shrink tile `V` vectors wide that keep its accumulators, a weight
// vector and a broadcast row value within them.
constexpr int kRegisters = kLanes == 16 ? 32 : 16;
constexpr int kShrinkVectors = 6;  // R up to this many vectors runs in one pass over A^T

template <int V>
constexpr int shrink_rows() {
  return std::max(1, std::min(kTileRows, (kRegisters - V - 1) / V));
}

// low[rows, 0:R] = x[rows] A^T. Where R is a whole number of vectors, at most kShrinkVectors, a tile covers every
// column, so A^T's rows are read whole and in order, once per tile (in column chunks, each pass over A^T would read
// a share of every cache line and leave the rest to the next pass).
template <typename X, typename W>
void shrink(int rows, const X* x, int64_t K, const W* a, int64_t R, float* low) {
  const auto whole = [&](auto vectors) {
    constexpr int V = decltype(vectors)::value, MR = shrink_rows<V>();
    for (int r0 = 0; r0 < rows; r0 += MR) {
      heteroserve::with_rows<MR>(std::min(MR, rows - r0), [&](auto r) {
        product_tile<decltype(r)::value, V, false>(x + r0 * K, K, K, a, R, low + r0 * R, R);
      });
    }
  };
  switch (R % kLanes == 0 ? R / kLanes : 0) {
    case 1: return whole(std::integral_constant<int, 1>{});
    case 2: return whole(std::integral_constant<int, 2>{});
    case 3: return whole(std::integral_constant<int, 3>{});
    case 4: return whole(std::integral_constant<int, 4>{});
    case 5: return whole(std::integral_constant<int, 5>{});
    case kShrinkVectors: return whole(std::integral_constant<int, kShrinkVectors>{});
    default: columns<false>(rows, x, K, K, a, R, low, R, 0, R);
  }
}

// Output columns of the expand per work item: several register tiles, so a step of few rows still splits over
// the threads while each item amortises claiming it.
constexpr int64_t kColumnBlock = 8 * heteroserve::kPanel;

struct RowTile {
  int64_t first, rows, slot;
};

template <typename T, typename W>
void add_products(T* y, const T* x, const W* a_t, const W* b_t, int64_t K, int64_t R, int64_t N,
                  const std::vector<RowTile>& tiles, float* low) {
  const auto shrink_tile = [&](const RowTile& rows) {
    shrink(static_cast<int>(rows.rows), x + rows.first * K, K, a_t + rows.slot * K * R, R, low + rows.first * R);
  };
  const auto expand = [&](const RowTile& rows, int64_t c0, int64_t c1) {  // y[rows, c0:c1] += low[rows] B^T
    columns<true>(static_cast<int>(rows.rows), low + rows.first * R, R, R, b_t + rows.slot * R * N, N,
                  y + rows.first * N, N, c0, c1);
  };
  const int64_t count = static_cast<int64_t>(tiles.size());
  // The shrink over tiles, then the expand split over tiles x column blocks (a step of few rows still shares out).
  heteroserve::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) shrink_tile(tiles[t]);
  });
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
  heteroserve::parallel_for(0, count * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c0 = item % blocks * kColumnBlock;
      expand(tiles[item / blocks], c0, std::min(N, c0 + kColumnBlock));
    }
  });
}

}  // namespace

namespace heteroserve {

// y [M, N] (float32 or bfloat16, contiguous) += the adapters' products of x [M, K] (y's dtype); a_t [slots, K, R]
// and b_t [slots, R, N] in float32, bfloat16 or float16 (widened as they are read); segments int64 [S, 3] of
// (first row, end row, slot).
at::Tensor lora_add(at::Tensor y, const at::Tensor& x_in, const at::Tensor& a_t, const at::Tensor& b_t,
                    const at::Tensor& segments) {
  const at::ScalarType dtype = y.scalar_type(), weights = a_t.scalar_type();
  TORCH_CHECK_NOT_IMPLEMENTED(dtype == at::kFloat || dtype == at::kBFloat16,
                              "lora_add: float32 or bfloat16 activations");
  TORCH_CHECK_NOT_IMPLEMENTED(weights == at::kFloat || weights == at::kBFloat16 || weights == at::kHalf,
                              "lora_add: adapters in float32, bfloat16 or float16");
  TORCH_CHECK(x_in.scalar_type() == dtype && b_t.scalar_type() == weights,
              "lora_add: x in y's dtype, A^T and B^T in one dtype");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && x_in.dim() == 2 && a_t.dim() == 3 && b_t.dim() == 3 &&
                  a_t.is_contiguous() && b_t.is_contiguous(),
              "lora_add: y [M, N] and x [M, K] with contiguous A^T [slots, K, R] and B^T [slots, R, N]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = y.size(0), N = y.size(1), K = x.size(1), R = a_t.size(2), slots = a_t.size(0);
  TORCH_CHECK(x.size(0) == M && a_t.size(1) == K && b_t.size(0) == slots && b_t.size(1) == R && b_t.size(2) == N,
              "lora_add: shapes of y, x, A^T and B^T do not agree");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2 && segments.size(1) == 3 &&
                  segments.is_contiguous(),
              "lora_add: segments are int64 [S, 3] of (first row, end row, slot)");
  std::vector<RowTile> tiles;
  const int64_t* segment = segments.const_data_ptr<int64_t>();
  for (int64_t s = 0; s < segments.size(0); ++s) {
    const int64_t first = segment[3 * s], end = segment[3 * s + 1], slot = segment[3 * s + 2];
    TORCH_CHECK(0 <= first && first <= end && end <= M && 0 <= slot && slot < slots,
                "lora_add: segment ", s, " is outside the rows or the slots");
    // Tiles of equal height: 8 rows run as 4 + 4, not 6 + 2, whose short tile spends a load per multiply-add.
    const int64_t count = (end - first + kTileRows - 1) / kTileRows;
    for (int64_t t = 0, row = first; t < count; ++t) {
      const int64_t rows = (end - row + (count - t) - 1) / (count - t);
      tiles.push_back({row, rows, slot});
      row += rows;
    }
  }
  if (tiles.empty()) return y;
  std::vector<float> low(M * R);
  const auto run = [&](auto* yd, const auto* xd) {
    if (weights == at::kFloat) {
      add_products(yd, xd, a_t.const_data_ptr<float>(), b_t.const_data_ptr<float>(), K, R, N, tiles, low.data());
    } else if (weights == at::kBFloat16) {
      add_products(yd, xd, a_t.const_data_ptr<c10::BFloat16>(), b_t.const_data_ptr<c10::BFloat16>(), K, R, N, tiles,
                   low.data());
    } else {
      add_products(yd, xd, a_t.const_data_ptr<c10::Half>(), b_t.const_data_ptr<c10::Half>(), K, R, N, tiles,
                   low.data());
    }
  };
  if (dtype == at::kFloat) {
    run(y.data_ptr<float>(), x.const_data_ptr<float>());
  } else {
    run(y.data_ptr<c10::BFloat16>(), x.const_data_ptr<c10::BFloat16>());
  }
  return y;
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor a_t, Tensor b_t, Tensor segments) -> Tensor(a!)");
  m.impl("lora_add", c10::DispatchKey::CPU, &heteroserve::lora_add);
}
