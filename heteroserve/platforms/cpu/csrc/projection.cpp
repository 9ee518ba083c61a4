// A projection in whichever form the CPU platform's linear op prepared it, on the kernel that linear op uses for
// the same form and row count, so a row multiplied here (the fused decode layer, the fused experts) gets the bits
// it gets from the model's Python path.

#include <ATen/core/Tensor.h>

#include <optional>

#include "kernels.h"

namespace heteroserve {

// weight: [panels] float32 (cpu/packed.py) or bfloat16 (bfloat16 activations, bfloat16 results); [packed,
// scale_zero] 4-bit in our layout (cpu/int4.py); [q, scale] or [q, scale, zero] grouped 8-bit (cpu/int8.py).
at::Tensor project(const at::Tensor& x, at::TensorList weight, int64_t N, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(!weight.empty() && weight.size() <= 3, "project: a weight is 1 to 3 tensors");
  if (weight.size() == 1 && weight[0].scalar_type() == at::kBFloat16) {
    return bf16_packed_linear(x, weight[0], N, bias, false);
  }
  if (weight.size() == 1) return packed_linear(x, weight[0], N, bias);
  at::Tensor out;
  if (weight[0].scalar_type() == at::kByte) {
    TORCH_CHECK(weight.size() == 2, "project: 4-bit weights are [packed, scale_zero]");
    out = int4_panel_linear(x, weight[0], weight[1]);
  } else {
    TORCH_CHECK(weight[0].scalar_type() == at::kChar, "project: 8-bit weights are int8 [q, scale(, zero)]");
    const std::optional<at::Tensor> zero = weight.size() == 3 ? std::optional<at::Tensor>(weight[2]) : std::nullopt;
    out = int8_grouped_product(x, weight[0], weight[1], zero);
  }
  return bias.has_value() ? out.add_(*bias) : out;
}

}  // namespace heteroserve
