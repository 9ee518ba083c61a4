// The model's element-wise operators, each one pass over memory in float32 (the torch reference makes 3-10
// passes and as many dispatches: RMSNorm is pow, mean, add, rsqrt, mul, mul; rotary indexes, slices, negates,
// concatenates, multiplies and adds). Rows are split over torch's OpenMP threads; small inputs (a decode step)
// stay on one thread, where a parallel region would cost more than the work.

#include <ATen/Parallel.h>
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

void check_float32(const at::Tensor& t, const char* name) {
  TORCH_CHECK_NOT_IMPLEMENTED(t.scalar_type() == at::kFloat, name, ": the fused CPU kernel takes float32 only");
}

}  // namespace

namespace heteroserve {

// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_float32(x_in, "rms_norm");
  check_float32(weight_in, "rms_norm");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / H;
  TORCH_CHECK(weight.numel() == H, "rms_norm: weight has ", weight.numel(), " elements for rows of ", H);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float* xd = x.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xd + r * H;
      float sum = 0.f;
      for (int64_t i = 0; i < H; ++i) sum += row[i] * row[i];
      const float inv = 1.f / std::sqrt(sum / H + static_cast<float>(eps));
      float* o = od + r * H;
      for (int64_t i = 0; i < H; ++i) o[i] = w[i] * (row[i] * inv);
    }
  });
  return out;
}

// x = [gate | up] on the last dimension -> silu(gate) * up, silu(g) = g * sigmoid(g).
at::Tensor silu_and_mul(const at::Tensor& x_in) {
  check_float32(x_in, "silu_and_mul");
  const at::Tensor x = x_in.contiguous();
  const int64_t width = x.size(-1), I = width / 2, rows = x.numel() / width;
  TORCH_CHECK(width % 2 == 0, "silu_and_mul: the last dimension (", width, ") must be even");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  const float* xd = x.const_data_ptr<float>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xd + r * width;
      const float* up = gate + I;
      float* o = od + r * I;
      for (int64_t i = 0; i < I; ++i) {
        const float g = gate[i];
        const float e = heteroserve::exp_nonpositive(-std::fabs(g));  // exp(-|g|), never overflows
        const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
        o[i] = g * sigmoid * up[i];
      }
    }
  });
  return out;
}

// Rotate-half rotary embedding of one [heads, D] token row into a contiguous output.
static void rotate(const float* x, int64_t head_stride, int64_t heads, int64_t D, const float* cos, const float* sin,
                   float* out) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* xh = x + h * head_stride;
    float* oh = out + h * D;
    for (int64_t i = 0; i < half; ++i) oh[i] = xh[i] * cos[i] - xh[i + half] * sin[i];
    for (int64_t i = half; i < D; ++i) oh[i] = xh[i] * cos[i] + xh[i - half] * sin[i];
  }
}

// q [T, Hq, D], k [T, Hkv, D] (views of the fused qkv projection are fine: rows and heads may be strided, the
// head dimension must be contiguous); cos, sin [max_positions, D]; token t uses row positions[t].
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions_in, const at::Tensor& q_in,
                                          const at::Tensor& k_in, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  for (const at::Tensor* t : {&q_in, &k_in, &cos_in, &sin_in}) check_float32(*t, "rotary");
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
  const float *qd = q.const_data_ptr<float>(), *kd = k.const_data_ptr<float>();
  const float *cd = cos.const_data_ptr<float>(), *sd = sin.const_data_ptr<float>();
  float *qo = q_out.data_ptr<float>(), *ko = k_out.data_ptr<float>();
  at::parallel_for(0, T, grain_rows((Hq + Hkv) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *c = cd + pos[t] * D, *s = sd + pos[t] * D;
      rotate(qd + t * q.stride(0), q.stride(1), Hq, D, c, s, qo + t * Hq * D);
      rotate(kd + t * k.stride(0), k.stride(1), Hkv, D, c, s, ko + t * Hkv * D);
    }
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
