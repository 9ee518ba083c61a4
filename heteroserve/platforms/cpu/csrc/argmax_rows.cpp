// The index of each row's largest value, as torch's `max(dim=-1).indices` gives it (the first of equal maxima;
// the first NaN where a row has one), for greedy decoding's one pass over the logits a step, faster than torch's
// reduction (docs/PLATFORMS.md, "CPU kernels"): each row is one vector pass for its maximum and a second, mostly
// from L2, for where it first occurs.

#include "thread_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "vector_math.h"

namespace {

using heteroserve::kLanes, heteroserve::load, heteroserve::vec;
typedef int32_t mask __attribute__((vector_size(kLanes * sizeof(int32_t))));

// T: float or c10::BFloat16 (widened exactly, so the maximum and its place are those of the bfloat16 row).
template <typename T>
int64_t first_index_of(const T* row, int64_t n, float value) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const mask hit = load(row + i) == value;
    for (int lane = 0; lane < kLanes; ++lane) {
      if (hit[lane]) return i + lane;
    }
  }
  for (; i < n; ++i) {
    if (static_cast<float>(row[i]) == value) return i;
  }
  return 0;  // not reached: `value` came from the row
}

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  vec best = vec{} - std::numeric_limits<float>::infinity();
  mask nan = mask{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec v = load(row + i);
    best = v > best ? v : best;
    nan |= v != v;
  }
  float top = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  for (int lane = 0; lane < kLanes; ++lane) {
    top = best[lane] > top ? best[lane] : top;
    has_nan |= nan[lane] != 0;
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    top = v > top ? v : top;
    has_nan |= v != v;
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(static_cast<float>(row[j]))) return j;
    }
  }
  return first_index_of(row, n, top);
}

}  // namespace

namespace heteroserve {

at::Tensor argmax_rows(const at::Tensor& x_in) {
  TORCH_CHECK_NOT_IMPLEMENTED((x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) &&
                                  x_in.dim() == 2,
                              "argmax_rows: float32 or bfloat16 [rows, n] only");
  TORCH_CHECK(x_in.size(1) > 0, "argmax_rows: rows must not be empty");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  auto run = [&](auto zero) {
    const auto* data = x.const_data_ptr<decltype(zero)>();
    heteroserve::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) index[r] = argmax_row(data + r * n, n);
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    run(c10::BFloat16{});
  } else {
    run(float{});
  }
  return out;
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &heteroserve::argmax_rows);
}
