// The model's element-wise operators, each one pass over memory in float32 (the torch reference makes 3-10
// passes and as many dispatches: RMSNorm is pow, mean, add, rsqrt, mul, mul; rotary indexes, slices, negates,
// concatenates, multiplies and adds). Rows are split over torch's OpenMP threads; small inputs (a decode step)
// stay on one thread, where a parallel region would cost more than the work. bfloat16 rows are widened as they
// are read and rounded once when stored.

#include "thread_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "vector_math.h"

namespace {

constexpr int64_t kGrainElements = 1 << 16;  // per thread at least: below this one thread does all rows

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / row_elements); }

void check_float32_or_bfloat16(const at::Tensor& t, const char* name) {
  TORCH_CHECK_NOT_IMPLEMENTED(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                              ": the fused CPU kernel takes float32 or bfloat16 only");
}

// Calls body(T{}) with T the C++ type of `type`, float32 or bfloat16.
template <typename Body>
void dispatch_float32_or_bfloat16(at::ScalarType type, const Body& body) {
  if (type == at::kBFloat16) {
    body(c10::BFloat16{});
  } else {
    body(float{});
  }
}

}  // namespace

namespace heteroserve {

// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension.
// x and weight both float32 or both bfloat16 (summed and scaled in float32, rounded once).
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_float32_or_bfloat16(x_in, "rms_norm");
  TORCH_CHECK(weight_in.scalar_type() == x_in.scalar_type(), "rms_norm: weight and x differ in dtype");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(weight.numel() == H, "rms_norm: weight has ", weight.numel(), " elements for rows of ", H);
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float32_or_bfloat16(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xd = x.const_data_ptr<T>();
    const T* w = weight.const_data_ptr<T>();
    T* od = out.data_ptr<T>();
    heteroserve::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
      heteroserve::OutputRow<T> out_row(H);
      for (int64_t r = begin; r < end; ++r) {
        const T* row = xd + r * H;
        float sum = 0.f;
        for (int64_t i = 0; i < H; ++i) sum += static_cast<float>(row[i]) * static_cast<float>(row[i]);
        const float inv = 1.f / std::sqrt(sum / H + static_cast<float>(eps));
        float* o = out_row.start(od + r * H);
        for (int64_t i = 0; i < H; ++i) o[i] = static_cast<float>(w[i]) * (static_cast<float>(row[i]) * inv);
        out_row.finish();
      }
    });
  });
  return out;
}

// x = [gate | up] on the last dimension -> silu(gate) * up, silu(g) = g * sigmoid(g).
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  check_float32_or_bfloat16(x_in, "silu_and_mul");
  const at::Tensor x = x_in.contiguous();
  const int64_t width = x.size(-1), I = width / 2, rows = x.numel() / width;
  TORCH_CHECK(width % 2 == 0, "silu_and_mul: the last dimension (", width, ") must be even");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  dispatch_float32_or_bfloat16(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* xd = x.const_data_ptr<T>();
    T* od = out.data_ptr<T>();
    heteroserve::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
      heteroserve::OutputRow<T> out_row(I);
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = xd + r * width;
        const T* up = gate + I;
        float* o = out_row.start(od + r * I);
        for (int64_t i = 0; i < I; ++i) {
          const float g = static_cast<float>(gate[i]);
          const float e = heteroserve::exp_nonpositive(-std::fabs(g));  // exp(-|g|), never overflows
          const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
          o[i] = g * sigmoid * static_cast<float>(up[i]);
        }
        out_row.finish();
      }
    });
  });
  return out;
}

// Rotate-half rotary embedding of one [heads, D] token row into a contiguous output, in float32 (a bfloat16 row
// is rounded once, by out_row).
template <typename T>
static void rotate(const T* x, int64_t head_stride, int64_t heads, int64_t D, const float* cos, const float* sin,
                   T* out, heteroserve::OutputRow<T>& out_row) {
  const int64_t half = D / 2;
  float* o = out_row.start(out);
  for (int64_t h = 0; h < heads; ++h) {
    const T* xh = x + h * head_stride;
    float* oh = o + h * D;
    for (int64_t i = 0; i < half; ++i) {
      oh[i] = static_cast<float>(xh[i]) * cos[i] - static_cast<float>(xh[i + half]) * sin[i];
    }
    for (int64_t i = half; i < D; ++i) {
      oh[i] = static_cast<float>(xh[i]) * cos[i] + static_cast<float>(xh[i - half]) * sin[i];
    }
  }
  out_row.finish();
}

// q [T, Hq, D], k [T, Hkv, D] (views of the fused qkv projection are fine: rows and heads may be strided, the
// head dimension must be contiguous), float32 or bfloat16; cos, sin [max_positions, D] float32 tables; token t
// uses row positions[t].
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions_in, const at::Tensor& q_in,
                                          const at::Tensor& k_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_float32_or_bfloat16(q_in, "rotary");
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type(), "rotary: q and k differ in dtype");
  TORCH_CHECK_NOT_IMPLEMENTED(cos_in.scalar_type() == at::kFloat && sin_in.scalar_type() == at::kFloat,
                              "rotary: the cos/sin tables must be float32");
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && q_in.size(0) == k_in.size(0), "rotary: q, k must be [T, H, D]");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(2) == 1 ? k_in : k_in.contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2), max_positions = cos.size(0);
  TORCH_CHECK(D % 2 == 0 && k.size(2) == D && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "rotary: head sizes of q, k and the cos/sin tables differ");
  TORCH_CHECK(positions.numel() == T, "rotary: one position per token");
  at::Tensor q_out = at::empty({T, Hq, D}, q.options()), k_out = at::empty({T, Hkv, D}, k.options());
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "rotary: position ", pos[t], " outside the table");
  }
  const float *cd = cos.const_data_ptr<float>(), *sd = sin.const_data_ptr<float>();
  dispatch_float32_or_bfloat16(q.scalar_type(), [&](auto zero) {
    using S = decltype(zero);
    const S *qd = q.const_data_ptr<S>(), *kd = k.const_data_ptr<S>();
    S *qo = q_out.data_ptr<S>(), *ko = k_out.data_ptr<S>();
    heteroserve::parallel_for(0, T, grain_rows((Hq + Hkv) * D), [&](int64_t begin, int64_t end) {
      heteroserve::OutputRow<S> q_row(Hq * D), k_row(Hkv * D);
      for (int64_t t = begin; t < end; ++t) {
        const float *c = cd + pos[t] * D, *s = sd + pos[t] * D;
        rotate(qd + t * q.stride(0), q.stride(1), Hq, D, c, s, qo + t * Hq * D, q_row);
        rotate(kd + t * k.stride(0), k.stride(1), Hkv, D, c, s, ko + t * Hkv * D, k_row);
      }
    });
  });
  return {q_out, k_out};
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor positions, Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, &heteroserve::rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &heteroserve::silu_and_mul);
  m.impl("rotary", c10::DispatchKey::CPU, &heteroserve::rotary);
}
