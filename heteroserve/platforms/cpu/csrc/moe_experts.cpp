// The routed experts of a mixture-of-experts layer for a step's tokens in one call: what model/moe.py's
// MoEBlock._routed does from Python (group the (token, expert) pairs by expert, run each chosen expert once over
// its tokens' rows, add each token's weighted expert outputs in ascending expert order), with the same kernels in
// the same order, so a token gets the bits the Python path gives it and the same bits in any batch. At one token
// a step the Python around each expert's three kernels cost more than its products (docs/PLATFORMS.md).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <vector>

#include "kernels.h"
#include "thread_pool.h"

namespace {

constexpr int64_t kFewRows = 16;  // rows an expert below which its products run whole on one thread (decode)

// h [T, hidden] float32 (or bfloat16 with bfloat16 experts); ids [T, top_k] int64 global expert ids; weights
// [T, top_k] float32. gate_up / down: the local experts' projections, `parts` tensors each (projection.cpp's
// forms), expert e of this rank being ids first_expert + e; experts outside them are another rank's.
at::Tensor moe_experts(const at::Tensor& h, const at::Tensor& ids_in, const at::Tensor& weights_in,
                       at::TensorList gate_up, at::TensorList down, int64_t gate_up_parts, int64_t down_parts,
                       int64_t gate_up_features, int64_t first_expert) {
  TORCH_CHECK(h.dim() == 2 && ids_in.dim() == 2 && ids_in.size(0) == h.size(0) &&
                  weights_in.sizes() == ids_in.sizes(),
              "moe_experts: h [T, hidden], ids and weights [T, top_k]");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && weights_in.scalar_type() == at::kFloat,
              "moe_experts: int64 ids, float32 weights");
  TORCH_CHECK(gate_up_parts > 0 && down_parts > 0 && gate_up.size() % gate_up_parts == 0,
              "moe_experts: whole projections");
  const int64_t experts = static_cast<int64_t>(gate_up.size()) / gate_up_parts;
  TORCH_CHECK(static_cast<int64_t>(down.size()) == experts * down_parts, "moe_experts: as many down as gate_up");
  const at::Tensor ids = ids_in.contiguous(), weights = weights_in.contiguous();
  const int64_t T = h.size(0), hidden = h.size(1), top_k = ids.size(1);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const float* weight = weights.const_data_ptr<float>();

  // The pairs of each local expert, tokens ascending (a counting sort).
  std::vector<int64_t> count(experts + 1, 0);
  for (int64_t i = 0; i < T * top_k; ++i) {
    const int64_t e = id[i] - first_expert;
    if (e >= 0 && e < experts) ++count[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) count[e + 1] += count[e];
  std::vector<int64_t> token(count[experts]);
  std::vector<float> token_weight(count[experts]);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t i = 0; i < T * top_k; ++i) {
    const int64_t e = id[i] - first_expert;
    if (e < 0 || e >= experts) continue;
    token[next[e]] = i / top_k;
    token_weight[next[e]++] = weight[i];
  }

  // Each chosen expert's weighted outputs. With few rows an expert (decode) its products are too short to split
  // over the pool with profit, so the pool takes whole experts instead (a kernel called inside a chunk runs on
  // its caller alone); either way each product gives the same bits.
  std::vector<int64_t> chosen;
  bool few_rows = true;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = count[e + 1] - count[e];
    if (rows > 0) chosen.push_back(e);
    few_rows = few_rows && rows < kFewRows;
  }
  std::vector<at::Tensor> weighted(experts);
  auto run_expert = [&](int64_t e) {
    const int64_t rows = count[e + 1] - count[e];
    const at::Tensor tokens = at::from_blob(token.data() + count[e], {rows}, at::kLong);
    const at::Tensor row_weights = at::from_blob(token_weight.data() + count[e], {rows, 1}, at::kFloat);
    const at::Tensor x = at::index_select(h, 0, tokens);
    const at::Tensor activated = heteroserve::silu_and_mul(
        heteroserve::project(x, gate_up.slice(e * gate_up_parts, gate_up_parts), gate_up_features, {}));
    const at::Tensor y = heteroserve::project(activated, down.slice(e * down_parts, down_parts), hidden, {});
    weighted[e] = at::mul(y.to(at::kFloat), row_weights);
  };
  if (few_rows && chosen.size() > 1) {
    std::mutex failure_lock;
    std::exception_ptr failure;
    heteroserve::parallel_for(0, static_cast<int64_t>(chosen.size()), 1, [&](int64_t begin, int64_t end) {
      try {
        for (int64_t i = begin; i < end; ++i) run_expert(chosen[i]);
      } catch (...) {  // raised on the caller, not in a pool thread
        const std::lock_guard<std::mutex> lock(failure_lock);
        if (!failure) failure = std::current_exception();
      }
    });
    if (failure) std::rethrow_exception(failure);
  } else {
    for (const int64_t e : chosen) run_expert(e);
  }
  // Each token's experts added in ascending expert order, whatever the batch.
  at::Tensor out = at::zeros({T, hidden}, h.options().dtype(at::kFloat));
  for (const int64_t e : chosen) {
    const at::Tensor tokens = at::from_blob(token.data() + count[e], {count[e + 1] - count[e]}, at::kLong);
    out.index_add_(0, tokens, weighted[e]);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("moe_experts(Tensor h, Tensor ids, Tensor weights, Tensor[] gate_up, Tensor[] down, int gate_up_parts, "
        "int down_parts, int gate_up_features, int first_expert) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, &moe_experts);
}
