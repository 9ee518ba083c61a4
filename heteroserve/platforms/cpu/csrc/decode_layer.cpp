// One decoder layer for a batch of decode tokens in a single call: the same kernels the model's Python path
// calls one by one (RMSNorm, the float32, bfloat16 or 4-bit GEMMs, rotary, KV write, paged decode attention,
// SiLU-and-multiply, or a mixture of experts' routing and experts), chained here. At one token a step the ~20
// operator calls a layer makes from Python are a share of the step worth removing (docs/PLATFORMS.md, "The fused
// decode layer", has the figures); chained in C++ they cost a few microseconds.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "kernels.h"

namespace {

// `row` activations (float32 or bfloat16) into the cache's dtype (float32, float16 or bfloat16).
template <typename act_t, typename cache_t>
void store_row(const act_t* from, int64_t row, cache_t* to) {
  if constexpr (std::is_same_v<cache_t, act_t>) {
    std::memcpy(to, from, row * sizeof(act_t));
  } else {
    for (int64_t i = 0; i < row; ++i) to[i] = static_cast<cache_t>(static_cast<float>(from[i]));
  }
}

// k, v [T, Hkv, D] (v may be a strided view) into the caches [blocks, block_size, Hkv, D] at `slots`.
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slots) {
  const int64_t T = k.size(0), row = k.size(1) * k.size(2);
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T, "decode_layer: one int64 slot per token");
  TORCH_CHECK(k.is_contiguous() && v.stride(2) == 1 && v.stride(1) == k.size(2), "decode_layer: k/v layout");
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "decode_layer: slot ", slot[t], " outside the cache");
  }
  auto write = [&](const auto* kd, const auto* vd) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode_layer write_kv", [&] {
      scalar_t* kc = k_cache.data_ptr<scalar_t>();
      scalar_t* vc = v_cache.data_ptr<scalar_t>();
      for (int64_t t = 0; t < T; ++t) {
        store_row(kd + t * row, row, kc + slot[t] * row);
        store_row(vd + t * v.stride(0), row, vc + slot[t] * row);
      }
    });
  };
  if (k.scalar_type() == at::kBFloat16) {
    write(k.const_data_ptr<at::BFloat16>(), v.const_data_ptr<at::BFloat16>());
  } else {
    write(k.const_data_ptr<float>(), v.const_data_ptr<float>());
  }
}

// y, a projection of x, plus (where the step has adapter rows) their products for fused product `target` (0 qkv,
// 1 o, 2 gate_up, 3 down: lora holds A^T, B^T of each in that order), as the model's Python path adds them.
at::Tensor with_adapters(at::Tensor y, const at::Tensor& x, at::TensorList lora,
                         const std::optional<at::Tensor>& lora_segments, int target) {
  if (lora.empty()) return y;
  return heteroserve::lora_add(y, x, lora[2 * target], lora[2 * target + 1], *lora_segments);
}

// A layer with a dense SwiGLU MLP; out_features: N of qkv, o, gate_up and down; lora: see with_adapters.
at::Tensor decode_layer(const at::Tensor& x, at::TensorList norms, at::TensorList qkv_w, at::TensorList o_w,
                        at::TensorList gate_up_w, at::TensorList down_w, at::IntArrayRef out_features,
                        const std::optional<at::Tensor>& qkv_bias, double eps, const at::Tensor& positions,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& mask, int64_t num_heads, double scale, at::TensorList lora,
                        const std::optional<at::Tensor>& lora_segments) {
  TORCH_CHECK(out_features.size() == 4, "decode_layer: 4 output sizes");
  TORCH_CHECK(lora.empty() || (lora.size() == 8 && lora_segments.has_value()),
              "decode_layer: adapters are A^T, B^T of qkv, o, gate_up and down, with their segments");
  at::Tensor h = heteroserve::attention_residual(x, norms, qkv_w, o_w, out_features, qkv_bias, eps, positions, cos,
                                                 sin, k_cache, v_cache, slots, block_tables, mask, num_heads, scale,
                                                 lora, lora_segments);
  const auto linear = heteroserve::project;
  const at::Tensor normed = heteroserve::rms_norm(h, norms[1], eps);
  const at::Tensor gate_up = with_adapters(linear(normed, gate_up_w, out_features[2], {}), normed, lora,
                                           lora_segments, 2);
  const at::Tensor act = heteroserve::silu_and_mul(gate_up);
  return h.add_(with_adapters(linear(act, down_w, out_features[3], {}), act, lora, lora_segments, 3));
}

}  // namespace

namespace heteroserve {

// The attention half of a layer for decode tokens. norms: input and post-attention RMSNorm weights, then the
// per-head q and k norms where the model has them (Qwen3); out_features: N of qkv and o (then the MLP's).
at::Tensor attention_residual(const at::Tensor& x, at::TensorList norms, at::TensorList qkv_w, at::TensorList o_w,
                              at::IntArrayRef out_features, const std::optional<at::Tensor>& qkv_bias, double eps,
                              const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                              const at::Tensor& block_tables, const at::Tensor& mask, int64_t num_heads,
                              double scale, at::TensorList lora, const std::optional<at::Tensor>& lora_segments) {
  TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "decode_layer: 2 or 4 norms");
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_layer: x [T, hidden] and contiguous caches [blocks, block_size, Hkv, D]");
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK_NOT_IMPLEMENTED(
      (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
          (cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16) &&
          v_cache.scalar_type() == cache_type,
      "decode_layer: float32 or bfloat16 activations over a float32, float16 or bfloat16 cache");
  const int64_t T = x.size(0), Hkv = k_cache.size(2), D = k_cache.size(3);
  const int64_t q_size = num_heads * D, kv_size = Hkv * D;
  TORCH_CHECK(out_features[0] == q_size + 2 * kv_size, "decode_layer: qkv has ", out_features[0], " outputs");

  const auto linear = heteroserve::project;
  const at::Tensor normed = heteroserve::rms_norm(x, norms[0], eps);
  const at::Tensor qkv =
      with_adapters(linear(normed, qkv_w, out_features[0], qkv_bias), normed, lora, lora_segments, 0);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, D});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, Hkv, D});
  if (norms.size() == 4) {
    q = heteroserve::rms_norm(q, norms[2], eps);
    k = heteroserve::rms_norm(k, norms[3], eps);
  }
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
  const auto [q_rotated, k_rotated] = heteroserve::rotary(positions, q, k, cos, sin);
  write_kv(k_rotated, v, k_cache, v_cache, slots);
  const at::Tensor attention =
      heteroserve::paged_decode_attention(q_rotated, k_cache, v_cache, block_tables, mask, scale);
  const at::Tensor heads = attention.view({T, q_size});
  return at::add(x, with_adapters(linear(heads, o_w, out_features[1], {}), heads, lora, lora_segments, 1));
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("decode_layer(Tensor x, Tensor[] norms, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, "
        "int[] out_features, Tensor? qkv_bias, float eps, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor block_tables, Tensor mask, int num_heads, "
        "float scale, Tensor[] lora, Tensor? lora_segments) -> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
}
