// Decode attention that reads the paged KV cache in place: one query token per row, no gathered copy.
//
// Work item = a request's KV heads: all of them when the batch has enough requests to keep every thread busy
// (each block is then read front to back, which the memory system streams best), else one (request, KV head).
// Consecutive rows with the same block table (a speculative step's decode token and drafts, each attending to
// its own prefix through its mask) form one item, so the blocks they share are read once for all of them.
// Each K row is loaded once and dotted with every query head of its group (GQA); softmax is two-pass in
// float32 (scores kept per item); then each V row is loaded once and added to every head's float32
// accumulator. Tokens whose mask entry is false (past the context, outside a sliding window) are never read,
// so padding in the block table costs nothing. The cache may hold float16 or bfloat16 under float32 queries
// (`--kv-cache-dtype`): rows are widened as they are loaded, halving what a step reads.

#include <ATen/Dispatch.h>
#include "thread_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "kernels.h"
#include "vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

struct Shape {
  int64_t max_tokens, block_size, num_kv_heads, group, head_dim;
  int64_t heads_per_item;  // KV heads one work item covers: all of them reads each block front to back
};

// Blocks sit anywhere, so the hardware prefetcher cannot guess where the next rows are: ask for them a few
// tokens early (measured: every row beats only the first row of each block).
constexpr int64_t kPrefetchAhead = 8;

template <typename scalar_t>
inline void prefetch(const scalar_t* row, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(row);
  const int64_t size = count * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t offset = 0; offset < size; offset += 64) __builtin_prefetch(bytes + offset);
}

// One work item: the query rows of one request (several where a step checks speculative drafts: draft j is a
// row attending to its prefix, and all of them read the same blocks, so they share one read of each K/V row)
// and the request's KV heads from first_kv_head on.
template <typename scalar_t>
struct Item {
  const scalar_t* q;  // the first row's first query head of the item, [rows, Hq, D] with rows row_stride apart
  scalar_t* out;      // likewise
  int64_t row_stride, rows;
  const bool* masks;  // [rows, max_tokens]
  const int64_t* block_table;
  int64_t first_kv_head;
};

// Buffers reused across the work items of one thread. Query heads of an item are numbered row by row:
// gq = row * G + g for the G = group * heads_per_item heads of each row.
struct Workspace {
  std::vector<float> query, acc, scores, max_score, inv_sum;  // [R G, D], [R G, D], [R G, L], [R G], [R G]
  std::vector<int64_t> cache_rows;                            // cache row of each attended token
  std::vector<int64_t> token_index;                           // its index in the block table's tokens
  std::vector<heteroserve::vec> vector_acc;                   // attend_vectors' [R G, D / kLanes]
};

// Fills ws.cache_rows with the cache row (first KV head of the item) of each token some row's mask lets through.
template <typename scalar_t>
void gather_rows(const Item<scalar_t>& item, const Shape& s, Workspace& ws) {
  ws.cache_rows.clear();
  ws.token_index.clear();
  for (int64_t j = 0; j < s.max_tokens / s.block_size; ++j) {
    for (int64_t offset = 0; offset < s.block_size; ++offset) {
      const int64_t t = j * s.block_size + offset;
      bool attended = false;
      for (int64_t r = 0; r < item.rows; ++r) attended |= item.masks[r * s.max_tokens + t];
      if (attended) {
        ws.cache_rows.push_back((item.block_table[j] * s.block_size + offset) * s.num_kv_heads + item.first_kv_head);
        if (item.rows > 1) ws.token_index.push_back(t);
      }
    }
  }
}

// Whether query row r attends to the item's i-th gathered token.
template <typename scalar_t>
inline bool attends(const Item<scalar_t>& item, const Shape& s, const Workspace& ws, int64_t r, int64_t i) {
  return item.rows == 1 || item.masks[r * s.max_tokens + ws.token_index[i]];
}

// Stores head g's score for token i (-inf where its row does not attend to the token) and keeps its maximum.
inline void record_score(Workspace& ws, int64_t g, int64_t i, int64_t L, bool attended, float score) {
  ws.scores[g * L + i] = attended ? score : -std::numeric_limits<float>::infinity();
  if (attended) ws.max_score[g] = std::max(ws.max_score[g], score);
}

// Sizes the score buffers for the item's query heads; the heads, scaled, go to ws.query.
template <typename scalar_t>
void prepare(const Item<scalar_t>& item, int64_t G, const Shape& s, float scale, Workspace& ws) {
  const int64_t D = s.head_dim, heads = item.rows * G;
  ws.query.resize(heads * D);
  ws.scores.resize(heads * s.max_tokens);
  ws.max_score.assign(heads, -std::numeric_limits<float>::infinity());
  ws.inv_sum.resize(heads);
  for (int64_t r = 0; r < item.rows; ++r) {
    const scalar_t* q = item.q + r * item.row_stride;
    for (int64_t i = 0; i < G * D; ++i) ws.query[r * G * D + i] = static_cast<float>(q[i]) * scale;
  }
}

// The scores of each head become exp(score - max) in place (a row's masked tokens, at -inf, become ~0);
// ws.inv_sum gets 1 / their sum.
void softmax(int64_t heads, int64_t n, int64_t L, Workspace& ws) {
  for (int64_t g = 0; g < heads; ++g) {
    float* sg = ws.scores.data() + g * L;
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = heteroserve::exp_nonpositive(sg[i] - ws.max_score[g]);
      sum += sg[i];
    }
    ws.inv_sum[g] = n > 0 ? 1.f / sum : 0.f;
  }
}

// Any dtype and head size.
template <typename scalar_t, typename cache_t>
void attend(const Item<scalar_t>& item, const cache_t* k_cache, const cache_t* v_cache, const Shape& s, float scale,
            Workspace& ws) {
  const int64_t G = s.group * s.heads_per_item, D = s.head_dim, L = s.max_tokens;  // G: query heads of a row
  prepare(item, G, s, scale, ws);
  gather_rows(item, s, ws);
  const int64_t n = static_cast<int64_t>(ws.cache_rows.size());
  const float* qf = ws.query.data();
  float* scores = ws.scores.data();
  for (int64_t i = 0; i < n; ++i) {
    const cache_t* k_row = k_cache + ws.cache_rows[i] * D;
    if (i + kPrefetchAhead < n) prefetch(k_cache + ws.cache_rows[i + kPrefetchAhead] * D, s.heads_per_item * D);
    for (int64_t r = 0; r < item.rows; ++r) {
      const bool attended = attends(item, s, ws, r, i);
      for (int64_t h = 0; h < s.heads_per_item; ++h) {
        const cache_t* k = k_row + h * D;
        for (int64_t g = r * G + h * s.group; g < r * G + (h + 1) * s.group; ++g) {
          const float* qg = qf + g * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(k[d]);
          record_score(ws, g, i, L, attended, dot);
        }
      }
    }
  }
  softmax(item.rows * G, n, L, ws);
  ws.acc.assign(item.rows * G * D, 0.f);
  float* acc = ws.acc.data();
  for (int64_t i = 0; i < n; ++i) {
    const cache_t* v_row = v_cache + ws.cache_rows[i] * D;
    if (i + kPrefetchAhead < n) prefetch(v_cache + ws.cache_rows[i + kPrefetchAhead] * D, s.heads_per_item * D);
    for (int64_t r = 0; r < item.rows; ++r) {
      for (int64_t h = 0; h < s.heads_per_item; ++h) {
        const cache_t* v = v_row + h * D;
        for (int64_t g = r * G + h * s.group; g < r * G + (h + 1) * s.group; ++g) {
          const float p = scores[g * L + i];
          float* ag = acc + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(v[d]);
        }
      }
    }
  }
  for (int64_t r = 0; r < item.rows; ++r) {
    scalar_t* out = item.out + r * item.row_stride;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t gq = r * G + g;
      for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<scalar_t>(acc[gq * D + d] * ws.inv_sum[gq]);
    }
  }
}

// Calls fn(i, h, row) with the D floats of KV head h of every attended token i, as machine vectors, in order,
// prefetching rows a few tokens ahead.
template <int D, typename cache_t, typename Fn>
void for_each_head_row(const cache_t* cache, const Shape& s, const Workspace& ws, Fn&& fn) {
  constexpr int kVectors = D / heteroserve::kLanes;
  const int64_t n = static_cast<int64_t>(ws.cache_rows.size()), H = s.heads_per_item;
  for (int64_t i = 0; i < n; ++i) {
    const cache_t* row = cache + ws.cache_rows[i] * D;
    if (i + kPrefetchAhead < n) prefetch(cache + ws.cache_rows[i + kPrefetchAhead] * D, H * D);
    for (int64_t h = 0; h < H; ++h) {
      heteroserve::vec vectors[kVectors];
      for (int v = 0; v < kVectors; ++v) vectors[v] = heteroserve::load(row + h * D + v * heteroserve::kLanes);
      fn(i, h, vectors);
    }
  }
}

// float32 or bfloat16 queries (widened once, outputs rounded once) with a head size of D, a whole number of machine
// vectors: each K and V row is held in registers and dotted with / added to every query head of its group (of
// every row of the item) without run-time loop bounds, so a decode step reads the cache close to the memory's pace
// (docs/PLATFORMS.md, "CPU kernels", has the figures against `attend`). kOneRow: the item is one row (every step
// without drafts), compiled without the per-row loop and mask test that only draft rows need.
template <int D, bool kOneRow, typename scalar_t, typename cache_t>
void attend_vectors(const Item<scalar_t>& item, const cache_t* k_cache, const cache_t* v_cache, const Shape& s,
                    float scale, Workspace& ws) {
  constexpr int kVectors = D / heteroserve::kLanes;
  using heteroserve::kLanes, heteroserve::load, heteroserve::vec;
  const int64_t rows = kOneRow ? 1 : item.rows;
  const int64_t G = s.group * s.heads_per_item, L = s.max_tokens, heads = rows * G;
  prepare(item, G, s, scale, ws);
  gather_rows(item, s, ws);
  const float* qf = ws.query.data();
  float* scores = ws.scores.data();
  for_each_head_row<D>(k_cache, s, ws, [&](int64_t i, int64_t h, const vec* k) {
    for (int64_t r = 0; r < rows; ++r) {
      const bool attended = kOneRow || attends(item, s, ws, r, i);
      for (int64_t g = r * G + h * s.group; g < r * G + (h + 1) * s.group; ++g) {
        vec dot = load(qf + g * D) * k[0];
        for (int v = 1; v < kVectors; ++v) dot += load(qf + g * D + v * kLanes) * k[v];
        record_score(ws, g, i, L, attended, heteroserve::horizontal_sum(dot));
      }
    }
  });
  softmax(heads, static_cast<int64_t>(ws.cache_rows.size()), L, ws);
  ws.vector_acc.assign(heads * kVectors, vec{});
  vec* acc = ws.vector_acc.data();
  for_each_head_row<D>(v_cache, s, ws, [&](int64_t i, int64_t h, const vec* v_row) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = r * G + h * s.group; g < r * G + (h + 1) * s.group; ++g) {
        for (int v = 0; v < kVectors; ++v) acc[g * kVectors + v] += scores[g * L + i] * v_row[v];
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* out = item.out + r * item.row_stride;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t gq = r * G + g;
      for (int v = 0; v < kVectors; ++v) {  // bfloat16 outputs rounded once here
        heteroserve::store(out + g * D + v * kLanes, acc[gq * kVectors + v] * ws.inv_sum[gq]);
      }
    }
  }
}

// One work item: float32 or bfloat16 queries with head size 64 or 128 (most models) take attend_vectors, the rest
// (float16 queries, other head sizes) attend.
template <typename scalar_t, typename cache_t>
void attend_item(const Item<scalar_t>& item, const cache_t* k_cache, const cache_t* v_cache, const Shape& s,
                 float scale, Workspace& ws) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    if (s.head_dim == 64 && item.rows == 1) return attend_vectors<64, true>(item, k_cache, v_cache, s, scale, ws);
    if (s.head_dim == 64) return attend_vectors<64, false>(item, k_cache, v_cache, s, scale, ws);
    if (s.head_dim == 128 && item.rows == 1) return attend_vectors<128, true>(item, k_cache, v_cache, s, scale, ws);
    if (s.head_dim == 128) return attend_vectors<128, false>(item, k_cache, v_cache, s, scale, ws);
  }
  attend(item, k_cache, v_cache, s, scale, ws);
}

// Consecutive query rows with the same block table (a request's decode token and its drafts), as (first, count).
std::vector<std::pair<int64_t, int64_t>> runs_of_equal_tables(const int64_t* tables, int64_t B, int64_t width) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t b = 0; b < B; ++b) {
    const bool same = b > 0 && std::memcmp(tables + b * width, tables + (b - 1) * width, width * sizeof(int64_t)) == 0;
    if (same) {
      ++runs.back().second;
    } else {
      runs.emplace_back(b, 1);
    }
  }
  return runs;
}

// Every work item of the batch, shared out over the threads.
template <typename scalar_t, typename cache_t>
void attend_all(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* tables,
                int64_t table_width, const bool* mask, const std::vector<std::pair<int64_t, int64_t>>& runs,
                const Shape& shape, float scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2), L = shape.max_tokens;
  const int64_t items_per_run = shape.num_kv_heads / shape.heads_per_item;
  const scalar_t* q_data = q.const_data_ptr<scalar_t>();
  const cache_t* k_data = k_cache.const_data_ptr<cache_t>();
  const cache_t* v_data = v_cache.const_data_ptr<cache_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const int64_t num_items = static_cast<int64_t>(runs.size()) * items_per_run;
  heteroserve::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    Workspace workspace;
    for (int64_t index = begin; index < end; ++index) {
      const auto [b, rows] = runs[index / items_per_run];
      const int64_t h = index % items_per_run * shape.heads_per_item;
      const int64_t head = (b * Hq + h * shape.group) * D;  // the group's first query head, first row
      const Item<scalar_t> item{q_data + head, out_data + head, Hq * D, rows, mask + b * L,
                                tables + b * table_width, h};
      attend_item(item, k_data, v_data, shape, scale, workspace);
    }
  });
}

}  // namespace

namespace heteroserve {

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4, "q must be [B, Hq, D] and the caches [N, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(cache_type == v_cache.scalar_type(), "k_cache and v_cache differ in dtype");
  TORCH_CHECK(q_in.scalar_type() == cache_type ||
                  (q_in.scalar_type() == at::kFloat && (cache_type == at::kHalf || cache_type == at::kBFloat16)),
              "q and the caches must have one dtype, or q float32 over a float16 or bfloat16 cache; got q ",
              q_in.scalar_type(), " and caches ", cache_type);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && mask_in.scalar_type() == at::kBool,
              "block_tables must be int64 and mask bool");
  TORCH_CHECK_NOT_IMPLEMENTED(
      q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16 || q_in.scalar_type() == at::kHalf,
      "paged_decode_attention supports float32, bfloat16 and float16, not ", q_in.scalar_type());
  const int64_t B = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "head sizes of q and the caches do not fit");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B, "block_tables must be [B, max_blocks]");
  const int64_t L = block_tables.size(1) * block_size;
  TORCH_CHECK(mask_in.numel() == B * L, "mask must be [B, 1, 1, max_blocks * block_size]");

  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor mask = mask_in.reshape({B, L}).contiguous();
  const int64_t* table_data = tables.data_ptr<int64_t>();
  const bool* mask_data = mask.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {  // every block a request attends to must exist
    for (int64_t t = 0; t < L; t += block_size) {
      bool used = false;
      for (int64_t j = t; j < t + block_size; ++j) used |= mask_data[b * L + j];
      const int64_t id = table_data[b * block_tables.size(1) + t / block_size];
      TORCH_CHECK(!used || (id >= 0 && id < num_blocks), "block id ", id, " out of range [0, ", num_blocks, ")");
    }
  }

  at::Tensor out = at::empty({B, Hq, D}, q.options());
  const int64_t width = block_tables.size(1);
  const auto runs = runs_of_equal_tables(table_data, B, width);
  // Whole requests per item when there are enough of them to share out; otherwise (request, KV head).
  const int64_t heads_per_item = static_cast<int64_t>(runs.size()) >= 4 * heteroserve::num_threads() ? Hkv : 1;
  const Shape shape{L, block_size, Hkv, Hq / Hkv, D, heads_per_item};
  const float s = static_cast<float>(scale);
  if (cache_type == at::kHalf && q.scalar_type() == at::kFloat) {
    attend_all<float, at::Half>(q, k_cache, v_cache, table_data, width, mask_data, runs, shape, s, out);
  } else if (cache_type == at::kBFloat16 && q.scalar_type() == at::kFloat) {
    attend_all<float, at::BFloat16>(q, k_cache, v_cache, table_data, width, mask_data, runs, shape, s, out);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
      attend_all<scalar_t, scalar_t>(q, k_cache, v_cache, table_data, width, mask_data, runs, shape, s, out);
    });
  }
  return out;
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor mask, "
        "float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &heteroserve::paged_decode_attention);
}
