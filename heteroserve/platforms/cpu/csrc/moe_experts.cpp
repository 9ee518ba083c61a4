// The routed experts of a mixture-of-experts layer for a step's tokens in one call, and their routing: what
// model/moe.py's MoEBlock does from Python (score the experts of each token, choose its top_k, group the
// (token, expert) pairs by expert, run each chosen expert once over its tokens' rows, add each token's weighted
// expert outputs in ascending expert order), with the same kernels in the same order, so a token gets the bits
// the Python path gives it and the same bits in any batch. At one token a step the Python around each expert's
// three kernels cost more than its products (docs/PLATFORMS.md).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "thread_pool.h"

namespace {

constexpr int64_t kFewRows = 16;  // rows an expert below which its products run whole on one thread (decode)

// to += from * w over a row: the product rounded, then the sum (no fused multiply-add), as the Python path's
// multiply and index_add_ round them.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void add_weighted(float* to, const T* from, float w, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float product = static_cast<float>(from[j]) * w;
    to[j] += product;
  }
}

}  // namespace

namespace heteroserve {

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& h, const at::Tensor& router, int64_t num_experts,
                                             const std::optional<at::Tensor>& router_bias, int64_t top_k,
                                             bool sigmoid, const std::optional<at::Tensor>& correction_bias,
                                             bool renormalize, double routed_scale) {
  TORCH_CHECK(top_k > 0 && top_k <= num_experts, "moe_route: top_k ", top_k, " of ", num_experts, " experts");
  TORCH_CHECK(!correction_bias.has_value() ||
                  (correction_bias->scalar_type() == at::kFloat && correction_bias->numel() == num_experts &&
                   correction_bias->is_contiguous()),
              "moe_route: a contiguous float32 correction bias of one value an expert");
  const at::Tensor logits = packed_linear(h.scalar_type() == at::kFloat ? h : h.to(at::kFloat), router,
                                          num_experts, router_bias);
  const int64_t T = logits.size(0), E = num_experts;
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  const float* logit = logits.const_data_ptr<float>();
  const float* bias = correction_bias.has_value() ? correction_bias->const_data_ptr<float>() : nullptr;
  float* weight = weights.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  std::vector<float> score(E), choice(E);
  std::vector<int64_t> order(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logit + t * E;
    if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) score[e] = 1.f / (1.f + std::exp(-l[e]));
    } else {
      const float top = *std::max_element(l, l + E);
      float total = 0.f;
      for (int64_t e = 0; e < E; ++e) total += score[e] = std::exp(l[e] - top);
      for (int64_t e = 0; e < E; ++e) score[e] /= total;
    }
    for (int64_t e = 0; e < E; ++e) choice[e] = bias ? score[e] + bias[e] : score[e];
    // The best top_k by choice, the lower index first among equals.
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); });
    float chosen = 0.f;
    for (int64_t i = 0; i < top_k; ++i) chosen += score[order[i]];
    const float divisor = renormalize ? std::max(chosen, 1e-20f) : 1.f;
    for (int64_t i = 0; i < top_k; ++i) {
      float w = score[order[i]];
      if (renormalize) w /= divisor;
      if (routed_scale != 1.0) w *= static_cast<float>(routed_scale);
      weight[t * top_k + i] = w;
      id[t * top_k + i] = order[i];
    }
  }
  return {weights, ids};
}

at::Tensor moe_experts(const at::Tensor& h_in, const at::Tensor& ids_in, const at::Tensor& weights_in,
                       at::TensorList gate_up, at::TensorList down, int64_t gate_up_parts, int64_t down_parts,
                       int64_t gate_up_features, int64_t first_expert) {
  TORCH_CHECK(h_in.dim() == 2 && ids_in.dim() == 2 && ids_in.size(0) == h_in.size(0) &&
                  weights_in.sizes() == ids_in.sizes(),
              "moe_experts: h [T, hidden], ids and weights [T, top_k]");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && weights_in.scalar_type() == at::kFloat,
              "moe_experts: int64 ids, float32 weights");
  TORCH_CHECK(h_in.scalar_type() == at::kFloat || h_in.scalar_type() == at::kBFloat16,
              "moe_experts: float32 or bfloat16 activations");
  TORCH_CHECK(gate_up_parts > 0 && down_parts > 0 && gate_up.size() % gate_up_parts == 0,
              "moe_experts: whole projections");
  const int64_t experts = static_cast<int64_t>(gate_up.size()) / gate_up_parts;
  TORCH_CHECK(static_cast<int64_t>(down.size()) == experts * down_parts, "moe_experts: as many down as gate_up");
  const at::Tensor h = h_in.contiguous(), ids = ids_in.contiguous(), weights = weights_in.contiguous();
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

  // Each chosen expert's outputs. With few rows an expert (decode) its products are too short to split over the
  // pool with profit, so the pool takes whole experts instead (a kernel called inside a chunk runs on its caller
  // alone); either way each product gives the same bits.
  std::vector<int64_t> chosen;
  bool few_rows = true;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = count[e + 1] - count[e];
    if (rows > 0) chosen.push_back(e);
    few_rows = few_rows && rows < kFewRows;
  }
  const int64_t row_bytes = hidden * h.element_size();
  const char* h_data = static_cast<const char*>(h.const_data_ptr());
  std::vector<at::Tensor> outputs(experts);
  auto run_expert = [&](int64_t e) {
    const int64_t rows = count[e + 1] - count[e];
    at::Tensor x = at::empty({rows, hidden}, h.options());
    char* x_data = static_cast<char*>(x.data_ptr());
    for (int64_t r = 0; r < rows; ++r) std::memcpy(x_data + r * row_bytes, h_data + token[count[e] + r] * row_bytes, row_bytes);
    const at::Tensor activated =
        silu_and_mul(project(x, gate_up.slice(e * gate_up_parts, gate_up_parts), gate_up_features, {}));
    outputs[e] = project(activated, down.slice(e * down_parts, down_parts), hidden, {});
  };
  if (few_rows && chosen.size() > 1) {
    std::mutex failure_lock;
    std::exception_ptr failure;
    parallel_for(0, static_cast<int64_t>(chosen.size()), 1, [&](int64_t begin, int64_t end) {
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
  // Each token's weighted expert outputs added in ascending expert order, whatever the batch.
  at::Tensor out = at::zeros({T, hidden}, h.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  for (const int64_t e : chosen) {
    const at::Tensor& y = outputs[e];
    for (int64_t r = 0; r < count[e + 1] - count[e]; ++r) {
      const float w = token_weight[count[e] + r];
      float* to = o + token[count[e] + r] * hidden;
      if (y.scalar_type() == at::kBFloat16) {
        add_weighted(to, y.const_data_ptr<at::BFloat16>() + r * hidden, w, hidden);
      } else {
        add_weighted(to, y.const_data_ptr<float>() + r * hidden, w, hidden);
      }
    }
  }
  return out;
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("moe_route(Tensor h, Tensor router, int num_experts, Tensor? router_bias, int top_k, bool sigmoid, "
        "Tensor? correction_bias, bool renormalize, float routed_scale) -> (Tensor, Tensor)");
  m.impl("moe_route", c10::DispatchKey::CPU, &heteroserve::moe_route);
  m.def("moe_experts(Tensor h, Tensor ids, Tensor weights, Tensor[] gate_up, Tensor[] down, int gate_up_parts, "
        "int down_parts, int gate_up_features, int first_expert) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, &heteroserve::moe_experts);
}
