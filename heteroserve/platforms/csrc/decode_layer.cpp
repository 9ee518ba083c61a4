// One decoder layer for a batch of decode tokens in a single call: the same kernels the model's Python path
// calls one by one (RMSNorm, packed GEMM, rotary, KV write, paged decode attention, SiLU-and-multiply), chained
// here. At one token a step the ~20 operator calls of a layer from Python cost ~200 us against ~700 us of
// weight reads, a quarter of the step; chained in C++ they cost a few microseconds.

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

// k, v [T, Hkv, D] (v may be a strided view) into the caches [blocks, block_size, Hkv, D] at `slots`.
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slots) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T, "decode_layer: one int64 slot per token");
  TORCH_CHECK(k.is_contiguous() && v.stride(2) == 1 && v.stride(1) == k.size(2), "decode_layer: k/v layout");
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "decode_layer: slot ", slot[t], " outside the cache");
    std::memcpy(kc + slot[t] * row, k.const_data_ptr<float>() + t * row, row * sizeof(float));
    std::memcpy(vc + slot[t] * row, v.const_data_ptr<float>() + t * v.stride(0), row * sizeof(float));
  }
}

// weights: input norm, qkv (packed), o (packed), post-attention norm, gate_up (packed), down (packed);
// out_features: N of each packed weight in that order.
at::Tensor decode_layer(const at::Tensor& x, at::TensorList weights, at::IntArrayRef out_features,
                        const std::optional<at::Tensor>& qkv_bias, double eps, const at::Tensor& positions,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& mask,
                        int64_t num_heads, double scale) {
  TORCH_CHECK(weights.size() == 6 && out_features.size() == 4, "decode_layer: 6 weights and 4 output sizes");
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_layer: x [T, hidden] and contiguous caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK_NOT_IMPLEMENTED(x.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat,
                              "decode_layer: float32 only");
  const at::Tensor &input_norm = weights[0], &qkv_w = weights[1], &o_w = weights[2];
  const at::Tensor &post_norm = weights[3], &gate_up_w = weights[4], &down_w = weights[5];
  const int64_t T = x.size(0), Hkv = k_cache.size(2), D = k_cache.size(3);
  const int64_t q_size = num_heads * D, kv_size = Hkv * D;
  TORCH_CHECK(out_features[0] == q_size + 2 * kv_size, "decode_layer: qkv has ", out_features[0], " outputs");

  const at::Tensor qkv = heteroserve::packed_linear(heteroserve::rms_norm(x, input_norm, eps), qkv_w,
                                                    out_features[0], qkv_bias);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
  const auto [q_rotated, k_rotated] = heteroserve::rotary(positions, q, k, cos, sin);
  write_kv(k_rotated, v, k_cache, v_cache, slots);
  const at::Tensor attention =
      heteroserve::paged_decode_attention(q_rotated, k_cache, v_cache, block_tables, mask, scale);
  at::Tensor h = at::add(x, heteroserve::packed_linear(attention.view({T, q_size}), o_w, out_features[1], {}));
  const at::Tensor gate_up =
      heteroserve::packed_linear(heteroserve::rms_norm(h, post_norm, eps), gate_up_w, out_features[2], {});
  return h.add_(heteroserve::packed_linear(heteroserve::silu_and_mul(gate_up), down_w, out_features[3], {}));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("decode_layer(Tensor x, Tensor[] weights, int[] out_features, Tensor? qkv_bias, float eps, "
        "Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor block_tables, Tensor mask, int num_heads, float scale) -> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
}
