// Prefill attention in float32: one prompt chunk's queries over its keys (the cached prefix, then the chunk),
// both products run by the GEMM's register tile (packed_tile.h); bfloat16 inputs are widened as they are read and
// each output row is rounded once. torch's flash-attention kernel for CPU runs these head sizes at a
// lower rate than the GEMM's tile (docs/PLATFORMS.md, "CPU kernels").
//
// Each KV head's keys and values are packed once per call into the tile's panel layout: K as
// [keys / NR][D][NR] (the scores q K^T are then the GEMM x W^T with W = K), V as [D / NR][keys][NR]. Work
// item = (query head, kTileRows consecutive queries): their scores over the keys the last of them may see go to
// a row buffer, softmax in two passes as in paged decode attention, then P V with the same tile.

#include "thread_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "packed_tile.h"
#include "vector_math.h"

namespace {

using heteroserve::kPanel;
using heteroserve::kTileRows;

// Row strides that are an odd number of cache lines: rows 4 KB apart would all fall in one L1 set.
int64_t row_stride(int64_t floats) {
  const int64_t lines = (floats + 15) / 16;
  return (lines | 1) * 16;
}

// [ctx, Hkv, D] of T (float or c10::BFloat16) -> float32 K panels [Hkv][ceil(ctx / NR)][D][NR], V panels
// [Hkv][D / NR][row_stride(ctx)][NR], zero past the ctx keys.
template <typename T>
std::pair<at::Tensor, at::Tensor> pack_keys_values(const at::Tensor& keys, const at::Tensor& values) {
  const int64_t ctx = keys.size(0), Hkv = keys.size(1), D = keys.size(2), key_panels = (ctx + kPanel - 1) / kPanel;
  const int64_t v_rows = row_stride(ctx);
  // Filled on the pool, the padding (keys past ctx in the last panel, value rows past ctx) zeroed there too.
  at::Tensor k_packed = at::empty({Hkv, key_panels, D, kPanel}, keys.options().dtype(at::kFloat));
  at::Tensor v_packed = at::empty({Hkv, D / kPanel, v_rows, kPanel}, values.options().dtype(at::kFloat));
  const T* k = keys.const_data_ptr<T>();
  const int64_t k_strides[2] = {keys.stride(0), keys.stride(1)}, v_strides[2] = {values.stride(0), values.stride(1)};
  const T* v = values.const_data_ptr<T>();
  float* kp = k_packed.data_ptr<float>();
  float* vp = v_packed.data_ptr<float>();
  heteroserve::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t j = ctx; j < key_panels * kPanel; ++j) {
        float* k_panel = kp + ((h * key_panels + j / kPanel) * D) * kPanel + j % kPanel;
        for (int64_t d = 0; d < D; ++d) k_panel[d * kPanel] = 0.f;
      }
      for (int64_t p = 0; p < D / kPanel; ++p) {
        float* v_panel = vp + (h * (D / kPanel) + p) * v_rows * kPanel;
        std::fill(v_panel + ctx * kPanel, v_panel + v_rows * kPanel, 0.f);
      }
      for (int64_t j = 0; j < ctx; ++j) {
        const T* k_row = k + j * k_strides[0] + h * k_strides[1];
        float* k_panel = kp + ((h * key_panels + j / kPanel) * D) * kPanel + j % kPanel;
        for (int64_t d = 0; d < D; ++d) k_panel[d * kPanel] = static_cast<float>(k_row[d]);
        const T* v_row = v + j * v_strides[0] + h * v_strides[1];
        for (int64_t p = 0; p < D / kPanel; ++p) {
          std::copy(v_row + p * kPanel, v_row + (p + 1) * kPanel, vp + ((h * (D / kPanel) + p) * v_rows + j) * kPanel);
        }
      }
    }
  });
  return {k_packed, v_packed};
}

// Per query row, the end of the keys it sees (one past the last one the mask lets through).
std::vector<int64_t> visible_ends(int64_t n, int64_t ctx, const bool* mask, bool causal) {
  std::vector<int64_t> ends(n);
  for (int64_t i = 0; i < n; ++i) {
    if (mask == nullptr) {
      ends[i] = causal ? ctx - n + i + 1 : ctx;  // causal: the chunk after the cached prefix
      continue;
    }
    int64_t end = 0;
    for (int64_t j = 0; j < ctx; ++j) end = mask[i * ctx + j] ? j + 1 : end;
    ends[i] = end;
  }
  return ends;
}

// The largest of x[0:n], a machine vector at a time (GCC does not vectorise a float max reduction by itself).
float max_of(const float* x, int64_t n) {
  using heteroserve::kLanes, heteroserve::vec;
  float largest = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if (n >= kLanes) {
    vec best = heteroserve::load(x);
    for (j = kLanes; j + kLanes <= n; j += kLanes) {
      const vec v = heteroserve::load(x + j);
      best = v > best ? v : best;
    }
    for (int i = 0; i < kLanes; ++i) largest = std::max(largest, best[i]);
  }
  for (; j < n; ++j) largest = std::max(largest, x[j]);
  return largest;
}

// Rows r < rows of scores (stride `stride`): exp(score - max) over the keys row r sees, 0 elsewhere, copied to
// probs [rows, width]; returns 1 / sum per row in inv_sum.
void softmax_rows(float* scores, int64_t stride, int rows, int64_t first_row, const std::vector<int64_t>& ends,
                  const bool* mask, int64_t ctx, int64_t width, float* probs, float* inv_sum) {
  for (int r = 0; r < rows; ++r) {
    const int64_t i = first_row + r, end = ends[i];
    float* s = scores + r * stride;
    if (mask != nullptr) {
      for (int64_t j = 0; j < end; ++j) s[j] = mask[i * ctx + j] ? s[j] : -std::numeric_limits<float>::infinity();
    }
    float max_score = max_of(s, end);
    float* p = probs + r * width;
    float sum = 0.f;
    for (int64_t j = 0; j < end; ++j) {
      p[j] = heteroserve::exp_nonpositive(s[j] - max_score);
      sum += p[j];
    }
    std::fill(p + end, p + width, 0.f);
    inv_sum[r] = sum > 0.f ? 1.f / sum : 0.f;
  }
}

}  // namespace

namespace heteroserve {

bool prefill_attention_supports(int64_t head_dim) { return head_dim % kPanel == 0; }

// q [n, Hq, D] over keys/values [ctx, Hkv, D]; mask [n, ctx] (true = attend) or none: causal over the chunk,
// which then holds every key (ctx == n), or with causal false every query sees every key (an encoder).
// All float32, or all bfloat16: widened as they are read, each output row rounded once.
at::Tensor prefill_attention(const at::Tensor& q_in, const at::Tensor& keys_in, const at::Tensor& values_in,
                             const std::optional<at::Tensor>& mask_in, double scale, bool causal) {
  const at::ScalarType dtype = q_in.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && keys_in.scalar_type() == dtype &&
                  values_in.scalar_type() == dtype,
              "prefill_attention: q, keys and values all float32 or all bfloat16");
  TORCH_CHECK(q_in.dim() == 3 && keys_in.dim() == 3 && keys_in.sizes() == values_in.sizes(),
              "prefill_attention: q [n, Hq, D], keys and values [ctx, Hkv, D]");
  const int64_t n = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2), ctx = keys_in.size(0), Hkv = keys_in.size(1);
  TORCH_CHECK(keys_in.size(2) == D && Hq % Hkv == 0 && prefill_attention_supports(D),
              "prefill_attention: head size ", D, " must match and be a multiple of ", kPanel);
  at::Tensor mask;
  if (mask_in.has_value()) {
    mask = mask_in->contiguous();
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.numel() == n * ctx, "prefill_attention: mask [n, ctx]");
  } else if (causal) {
    TORCH_CHECK(ctx == n, "prefill_attention: without a mask the chunk must be all the keys");
  }
  // Heads may be views of the fused qkv projection: only each head's D values need to be consecutive.
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k_heads = keys_in.stride(2) == 1 ? keys_in : keys_in.contiguous();
  const at::Tensor v_heads = values_in.stride(2) == 1 ? values_in : values_in.contiguous();
  const bool* mask_data = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  const std::vector<int64_t> ends = visible_ends(n, ctx, mask_data, causal);
  at::Tensor out = at::empty({n, Hq, D}, q.options());
  auto attend = [&](auto zero) {
    using T = decltype(zero);
    const std::pair<at::Tensor, at::Tensor> packed = pack_keys_values<T>(k_heads, v_heads);
    const at::Tensor &k_packed = packed.first, &v_packed = packed.second;
    const T* qd = q.const_data_ptr<T>();
    const int64_t q_strides[2] = {q.stride(0), q.stride(1)};
    const float* kp = k_packed.const_data_ptr<float>();
    const float* vp = v_packed.const_data_ptr<float>();
    T* od = out.data_ptr<T>();
    const int64_t blocks = (n + kTileRows - 1) / kTileRows, key_panels = k_packed.size(1), group = Hq / Hkv;
    const int64_t v_rows = v_packed.size(2);
    const float fscale = static_cast<float>(scale);

    // Head-major: threads share the heads.
    heteroserve::parallel_for(0, Hq * blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> query(kTileRows * D), scores(kTileRows * row_stride(key_panels * kPanel));
      std::vector<float> probs(kTileRows * row_stride(ctx));
      // P V's rows: in place in a float32 output (stride Hq * D), else here (stride D) until rounded into it.
      std::vector<float> result(std::is_same_v<T, float> ? 0 : kTileRows * D);
      const int64_t result_stride = std::is_same_v<T, float> ? Hq * D : D;
      float inv_sum[kTileRows];
      for (int64_t item = begin; item < end; ++item) {
        const int64_t head = item / blocks, i0 = item % blocks * kTileRows, kv_head = head / group;
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, n - i0));
        const int64_t width = *std::max_element(ends.begin() + i0, ends.begin() + i0 + rows);
        for (int r = 0; r < rows; ++r) {
          const T* q_row = qd + (i0 + r) * q_strides[0] + head * q_strides[1];
          for (int64_t d = 0; d < D; ++d) query[r * D + d] = static_cast<float>(q_row[d]) * fscale;
        }
        const int64_t panels = (width + kPanel - 1) / kPanel, stride = row_stride(panels * kPanel);
        const int64_t keys = row_stride(width);  // P's row stride, V's rows past width are zero
        for (int64_t p = 0; p < panels; ++p) {
          tile_rows(rows, query.data(), D, kp + ((kv_head * key_panels + p) * D) * kPanel, nullptr,
                    scores.data() + p * kPanel, stride, kPanel, nullptr, 0);
        }
        softmax_rows(scores.data(), stride, rows, i0, ends, mask_data, ctx, keys, probs.data(), inv_sum);
        T* out_rows = od + (i0 * Hq + head) * D;
        float* o;
        if constexpr (std::is_same_v<T, float>) {
          o = out_rows;
        } else {
          o = result.data();
        }
        for (int64_t p = 0; p < D / kPanel; ++p) {
          const float* v_panel = vp + ((kv_head * (D / kPanel) + p) * v_rows) * kPanel;
          tile_rows(rows, probs.data(), keys, v_panel, nullptr, o + p * kPanel, result_stride, kPanel, nullptr, 0);
        }
        for (int r = 0; r < rows; ++r) {
          for (int64_t d = 0; d < D; ++d) o[r * result_stride + d] *= inv_sum[r];
          if constexpr (!std::is_same_v<T, float>) heteroserve::store_row(o + r * D, D, out_rows + r * Hq * D);
        }
      }
    });
  };
  if (dtype == at::kBFloat16) {
    attend(c10::BFloat16{});
  } else {
    attend(float{});
  }
  return out;
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("prefill_attention_supports(int head_dim) -> bool");
  m.def("prefill_attention(Tensor q, Tensor keys, Tensor values, Tensor? mask, float scale, bool causal=True) -> Tensor");
  m.impl("prefill_attention_supports", &heteroserve::prefill_attention_supports);
  m.impl("prefill_attention", c10::DispatchKey::CPU, &heteroserve::prefill_attention);
}
