// y = x W^T + b in float32 with W packed once at load into column panels: panel p holds output columns
// [p * NR, p * NR + NR) as K consecutive runs of NR weights, so every product reads the whole weight as one
// sequential stream. One kernel serves every batch size: a single decode row is bound by reading the weight
// (the stream keeps the hardware prefetchers busy, where oneDNN's packed layout reads below the memory's pace at
// one row: docs/PLATFORMS.md, "CPU kernels"), 64+ rows are bound by multiplies (a tile of MR rows by NR columns
// is kept in registers, the panel in L2, the rows' slice of x in L1/L2).

#include "thread_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "kernels.h"
#include "packed_tile.h"

namespace heteroserve {

// [N, K] -> [ceil(N / NR), K, NR], the last panel padded with zero columns.
at::Tensor pack_linear_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.scalar_type() == at::kFloat && w_in.dim() == 2, "pack_linear_weight: a float32 [N, K] weight");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, K, kPanel}, w.options());
  const float* src = w.const_data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  heteroserve::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min<int64_t>(kPanel, N - p * kPanel);
      for (int64_t j = 0; j < columns; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = row[k];
      }
    }
  });
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "packed_linear: float32 only");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_linear: the weight must come from pack_linear_weight on this machine");
  const int64_t K = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(x_in.size(-1) == K, "packed_linear: x has ", x_in.size(-1), " features, the weight ", K);
  TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, "packed_linear: N does not match the panels");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == N, "packed_linear: bias must be float32 [N]");
  }
  auto out_sizes = x_in.sizes().vec();
  out_sizes.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xd = x.const_data_ptr<float>();
  const float* wd = packed.const_data_ptr<float>();
  const float* bd = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  float* od = out.data_ptr<float>();
  const int64_t block = row_block(K);
  const bool prefetch = software_prefetch(M);
  heteroserve::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      for (int64_t p = begin; p < end; ++p) {
        const int columns = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
        panel_rows(xd, m0, std::min(M, m0 + block), K, wd + p * K * kPanel, bd ? bd + p * kPanel : nullptr,
                   od + p * kPanel, N, columns, p + 1 < end ? wd + (p + 1) * K * kPanel : nullptr, prefetch);
      }
    }
  });
  return out.view(out_sizes);
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &heteroserve::pack_linear_weight);
  m.impl("packed_linear", c10::DispatchKey::CPU, &heteroserve::packed_linear);
}
