// The routed experts of a mixture-of-experts layer for a step's tokens in one call, and their routing: what
// model/moe.py's MoEBlock does from Python (score the experts of each token, choose its top_k, group the
// (token, expert) pairs by expert, run each chosen expert once over its tokens' rows, add each token's weighted
// expert outputs in ascending expert order), with the same kernels in the same order, so a token gets the bits
// the Python path gives it and the same bits in any batch. At one token a step the Python around each expert's
// three kernels cost more than its products (docs/PLATFORMS.md). decode_moe_layer chains a MoE decoder layer of
// a decode-only step: decode_layer.cpp's attention half, then the routing, the experts and shared experts.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
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
#include <utility>
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

// order := the indices of `value` with its best k first, in descending value, the lower index first among equals.
void best_first(std::vector<int64_t>& order, int64_t k, const std::vector<float>& value) {
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return value[a] > value[b] || (value[a] == value[b] && a < b); });
}

}  // namespace

namespace heteroserve {

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& h, const at::Tensor& router, int64_t num_experts,
                                             const std::optional<at::Tensor>& router_bias, int64_t top_k,
                                             bool sigmoid, const std::optional<at::Tensor>& correction_bias,
                                             int64_t num_groups, int64_t top_groups, bool group_by_max,
                                             bool renormalize, double routed_scale) {
  TORCH_CHECK(top_k > 0 && top_k <= num_experts, "moe_route: top_k ", top_k, " of ", num_experts, " experts");
  TORCH_CHECK(num_groups > 0 && num_experts % num_groups == 0 && top_groups > 0 && top_groups <= num_groups,
              "moe_route: the best ", top_groups, " of ", num_groups, " equal groups of ", num_experts, " experts");
  const int64_t group_size = num_experts / num_groups;
  TORCH_CHECK(num_groups == 1 || group_by_max || group_size >= 2,
              "moe_route: a group scored by its two best experts has at least two");
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
  std::vector<float> score(E), choice(E), group_score(num_groups);
  std::vector<int64_t> order(E), group_order(num_groups);
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
    if (num_groups > 1) {
      for (int64_t g = 0; g < num_groups; ++g) {
        const float* c = choice.data() + g * group_size;
        float best = -INFINITY, second = -INFINITY;
        for (int64_t e = 0; e < group_size; ++e) {
          if (c[e] > best) {
            second = best;
            best = c[e];
          } else if (c[e] > second) {
            second = c[e];
          }
        }
        group_score[g] = group_by_max ? best : best + second;
      }
      // The best top_groups groups; the others' experts cannot be chosen.
      best_first(group_order, top_groups, group_score);
      for (int64_t i = top_groups; i < num_groups; ++i) {
        std::fill_n(choice.begin() + group_order[i] * group_size, group_size, -INFINITY);
      }
    }
    best_first(order, top_k, choice);  // the best top_k by choice
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

ExpertWeights::ExpertWeights(std::vector<at::Tensor> gate_up_in, std::vector<at::Tensor> down_in,
                             int64_t gate_up_parts_in, int64_t down_parts_in, int64_t gate_up_features_in,
                             int64_t first_expert_in)
    : gate_up(std::move(gate_up_in)),
      down(std::move(down_in)),
      gate_up_parts(gate_up_parts_in),
      down_parts(down_parts_in),
      gate_up_features(gate_up_features_in),
      first_expert(first_expert_in) {
  TORCH_CHECK(gate_up_parts > 0 && down_parts > 0 && gate_up.size() % gate_up_parts == 0,
              "ExpertWeights: whole projections");
  experts = static_cast<int64_t>(gate_up.size()) / gate_up_parts;
  TORCH_CHECK(static_cast<int64_t>(down.size()) == experts * down_parts, "ExpertWeights: as many down as gate_up");
}

at::Tensor moe_experts(const at::Tensor& h_in, const at::Tensor& ids_in, const at::Tensor& weights_in,
                       const ExpertWeights& w) {
  TORCH_CHECK(h_in.dim() == 2 && ids_in.dim() == 2 && ids_in.size(0) == h_in.size(0) &&
                  weights_in.sizes() == ids_in.sizes(),
              "moe_experts: h [T, hidden], ids and weights [T, top_k]");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && weights_in.scalar_type() == at::kFloat,
              "moe_experts: int64 ids, float32 weights");
  TORCH_CHECK(h_in.scalar_type() == at::kFloat || h_in.scalar_type() == at::kBFloat16,
              "moe_experts: float32 or bfloat16 activations");
  const int64_t experts = w.experts, first_expert = w.first_expert;
  const at::TensorList gate_up(w.gate_up), down(w.down);
  const int64_t gate_up_parts = w.gate_up_parts, down_parts = w.down_parts;
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
        silu_and_mul(project(x, gate_up.slice(e * gate_up_parts, gate_up_parts), w.gate_up_features, {}));
    // Read in place below, row by row.
    outputs[e] = project(activated, down.slice(e * down_parts, down_parts), hidden, {}).contiguous();
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

namespace {

using heteroserve::ExpertWeights;

at::Tensor moe_experts_op(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& weights,
                          const c10::intrusive_ptr<ExpertWeights>& experts) {
  return heteroserve::moe_experts(h, ids, weights, *experts);
}

// A decoder layer whose MLP is a mixture of experts, for decode tokens: the attention half, the routing, the
// routed experts and shared experts (shared_gate_up empty: none), scaled by sigmoid(shared_gate . h) where
// shared_gate is given (Qwen2-MoE) as model/moe.py scales them; out_features: N of qkv and o.
at::Tensor decode_moe_layer(const at::Tensor& x, at::TensorList norms, at::TensorList qkv_w, at::TensorList o_w,
                            at::IntArrayRef out_features, const std::optional<at::Tensor>& qkv_bias, double eps,
                            const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& block_tables, const at::Tensor& mask, int64_t num_heads, double scale,
                            const at::Tensor& router, int64_t num_experts, const std::optional<at::Tensor>& router_bias,
                            int64_t top_k, bool sigmoid, const std::optional<at::Tensor>& correction_bias,
                            int64_t num_groups, int64_t top_groups, bool group_by_max, bool renormalize,
                            double routed_scale, const c10::intrusive_ptr<ExpertWeights>& experts,
                            at::TensorList shared_gate_up, at::TensorList shared_down, int64_t shared_features,
                            const std::optional<at::Tensor>& shared_gate) {
  TORCH_CHECK(out_features.size() == 2, "decode_moe_layer: 2 output sizes");
  at::Tensor h = heteroserve::attention_residual(x, norms, qkv_w, o_w, out_features, qkv_bias, eps, positions, cos,
                                                 sin, k_cache, v_cache, slots, block_tables, mask, num_heads, scale);
  const at::Tensor normed = heteroserve::rms_norm(h, norms[1], eps);
  const auto [weights, ids] = heteroserve::moe_route(normed, router, num_experts, router_bias, top_k, sigmoid,
                                                     correction_bias, num_groups, top_groups, group_by_max,
                                                     renormalize, routed_scale);
  at::Tensor out = heteroserve::moe_experts(normed, ids, weights, *experts);
  TORCH_CHECK(!shared_gate.has_value() || !shared_gate_up.empty(), "decode_moe_layer: a gate without shared experts");
  if (!shared_gate_up.empty()) {
    const at::Tensor gate_up = heteroserve::project(normed, shared_gate_up, shared_features, {});
    at::Tensor shared =
        heteroserve::project(heteroserve::silu_and_mul(gate_up), shared_down, h.size(1), {}).to(at::kFloat);
    if (shared_gate.has_value()) shared.mul_(at::sigmoid(at::linear(normed, *shared_gate)).to(at::kFloat));
    out.add_(shared);
  }
  return h.add_(out.to(h.scalar_type()));
}

}  // namespace

// The class and the operators that take it in one fragment: an operator's schema names the class, which must be
// registered first.
TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.class_<ExpertWeights>("ExpertWeights")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, int64_t, int64_t>());
  m.def("moe_route(Tensor h, Tensor router, int num_experts, Tensor? router_bias, int top_k, bool sigmoid, "
        "Tensor? correction_bias, int num_groups, int top_groups, bool group_by_max, bool renormalize, "
        "float routed_scale) -> (Tensor, Tensor)");
  m.impl("moe_route", c10::DispatchKey::CPU, &heteroserve::moe_route);
  m.def("moe_experts(Tensor h, Tensor ids, Tensor weights, __torch__.torch.classes.heteroserve.ExpertWeights "
        "experts) -> Tensor");
  m.impl("moe_experts", c10::DispatchKey::CPU, &moe_experts_op);
  m.def("decode_moe_layer(Tensor x, Tensor[] norms, Tensor[] qkv, Tensor[] o, int[] out_features, Tensor? qkv_bias, "
        "float eps, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor block_tables, Tensor mask, int num_heads, float scale, Tensor router, int num_experts, "
        "Tensor? router_bias, int top_k, bool sigmoid, Tensor? correction_bias, int num_groups, int top_groups, "
        "bool group_by_max, bool renormalize, float routed_scale, "
        "__torch__.torch.classes.heteroserve.ExpertWeights experts, Tensor[] shared_gate_up, Tensor[] shared_down, "
        "int shared_features, Tensor? shared_gate) -> Tensor");
  m.impl("decode_moe_layer", c10::DispatchKey::CPU, &decode_moe_layer);
}
