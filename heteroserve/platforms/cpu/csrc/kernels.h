// The C++ kernels other kernels call directly (decode_layer.cpp chains them without a Python round trip).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <optional>
#include <tuple>
#include <vector>

namespace heteroserve {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias);
at::Tensor bf16_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const std::optional<at::Tensor>& bias, bool float_output);
at::Tensor int4_panel_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_zero);
at::Tensor int8_grouped_product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                const std::optional<at::Tensor>& zero);
// A projection as the platform's linear op prepared it (projection.cpp): [panels] of float32 or bfloat16, 4-bit
// [packed, scale_zero], grouped 8-bit [q, scale] or [q, scale, zero]; on the kernel the linear op uses.
at::Tensor project(const at::Tensor& x, at::TensorList weight, int64_t N, const std::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin);
// A MoE layer's routed experts as the platform's linear op prepared them, held once (moe_experts.cpp): a call
// then passes one object instead of every expert's tensors. Expert e of this rank is gate_up[e * gate_up_parts,
// +gate_up_parts) and down[e * down_parts, +down_parts) (projection.cpp's forms), its id first_expert + e.
struct ExpertWeights : torch::CustomClassHolder {
  ExpertWeights(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t gate_up_parts,
                int64_t down_parts, int64_t gate_up_features, int64_t first_expert);
  std::vector<at::Tensor> gate_up, down;
  int64_t gate_up_parts, down_parts, gate_up_features, first_expert, experts;
};
// A MoE layer's routing (weights, ids [T, top_k]) from its float32 router panels, and its chosen experts'
// weighted sum [T, hidden] in float32 (moe_experts.cpp). num_groups > 1: only the experts of the top_groups best
// groups compete, a group scored by its best choice (group_by_max) or the sum of its two best.
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& h, const at::Tensor& router, int64_t num_experts,
                                             const std::optional<at::Tensor>& router_bias, int64_t top_k,
                                             bool sigmoid, const std::optional<at::Tensor>& correction_bias,
                                             int64_t num_groups, int64_t top_groups, bool group_by_max,
                                             bool renormalize, double routed_scale);
at::Tensor moe_experts(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& weights,
                       const ExpertWeights& experts);
// The attention half of a decoder layer for decode tokens, x + o(attention(rms_norm(x))) (decode_layer.cpp);
// lora: A^T and B^T of every adapter slot for qkv then o (or none), added on the rows of lora_segments.
at::Tensor attention_residual(const at::Tensor& x, at::TensorList norms, at::TensorList qkv_w, at::TensorList o_w,
                              at::IntArrayRef out_features, const std::optional<at::Tensor>& qkv_bias, double eps,
                              const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                              const at::Tensor& block_tables, const at::Tensor& mask, int64_t num_heads,
                              double scale, at::TensorList lora = {},
                              const std::optional<at::Tensor>& lora_segments = std::nullopt);
// y += the adapters' products of x on the rows of segments [S, 3] (first row, end row, slot) (lora_products.cpp).
at::Tensor lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& a_t, const at::Tensor& b_t,
                    const at::Tensor& segments);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& mask, double scale);

}  // namespace heteroserve
