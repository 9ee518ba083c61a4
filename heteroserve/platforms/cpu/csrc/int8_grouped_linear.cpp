// y = x W^T for 8-bit weights with a scale (and optionally a zero) per group of input columns, read in place:
// w[n, k] = q[n, k] * scale[n, k / G] + zero[n, k / G]. For the few rows of a decode step, where the product
// is bound by reading the weight: 1 byte a weight instead of float32's 4 (GGUF Q8_0 and the 5/6-bit types kept
// at 8 bits, grouped GPTQ 8-bit, a tied Q8_0 LM head). Output rows are split over torch's OpenMP threads; each
// weight row is dequantised 16 weights at a time in registers and used for up to 4 input rows while it is there.
// Partial sums stay per lane across the row and are added up once per output, in float32. Beyond 16 rows
// (AVX-512 builds) int8_panel_linear feeds the float32 GEMM's tile instead, a panel of 32 rows at a time.

#include "thread_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "packed_tile.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 16;  // input rows per call: beyond this a float GEMM on dequantised slices wins
constexpr int64_t kTile = 4;      // input rows that share one dequantised chunk of a weight row
constexpr int64_t kLanes = 16;    // weights per vector: groups must be a multiple of this

#if defined(__AVX512F__)
// One AVX-512 register (a GCC vector extension).
typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x16 load_i8_as_f32(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
// 16 lanes as 16 / kLanes machine vectors (two AVX2 registers, four NEON or SSE ones): the same 16 partial sums an
// AVX-512 build keeps, each lane computed alike. (A 64-byte GCC vector extension here went through the stack.)
struct f32x16 {
  static constexpr int kParts = kLanes / heteroserve::kLanes;
  heteroserve::vec part[kParts];
  float operator[](int i) const { return part[i / heteroserve::kLanes][i % heteroserve::kLanes]; }
};

inline f32x16 operator*(f32x16 a, float s) {
  for (auto& v : a.part) v *= s;
  return a;
}

inline f32x16 operator+(f32x16 a, float s) {
  for (auto& v : a.part) v += s;
  return a;
}

inline f32x16 operator*(f32x16 a, const f32x16& b) {
  for (int i = 0; i < f32x16::kParts; ++i) a.part[i] *= b.part[i];
  return a;
}

inline f32x16& operator+=(f32x16& a, const f32x16& b) {
  for (int i = 0; i < f32x16::kParts; ++i) a.part[i] += b.part[i];
  return a;
}

inline f32x16 load_f32(const float* p) {
  f32x16 v;
  for (int i = 0; i < f32x16::kParts; ++i) v.part[i] = heteroserve::load(p + i * heteroserve::kLanes);
  return v;
}

inline f32x16 load_i8_as_f32(const int8_t* p) {
  f32x16 v;
#if defined(__AVX2__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  std::memcpy(&v.part[0], &low, sizeof(low));
  std::memcpy(&v.part[1], &high, sizeof(high));
#else  // NEON and SSE: GCC's vector extensions widen the bytes in registers
  typedef int8_t bytes_t __attribute__((vector_size(heteroserve::kLanes)));
  for (int i = 0; i < f32x16::kParts; ++i) {
    bytes_t b;
    std::memcpy(&b, p + i * heteroserve::kLanes, sizeof(b));
    v.part[i] = __builtin_convertvector(b, heteroserve::vec);
  }
#endif
  return v;
}
#endif

inline float sum_lanes(f32x16 v) {
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// The optional per-group zero, contiguous and shaped like scale (undefined when there is none).
at::Tensor checked_zero(const std::optional<at::Tensor>& zero_in, const at::Tensor& scale) {
  if (!zero_in.has_value()) return at::Tensor();
  const at::Tensor zero = zero_in->contiguous();
  TORCH_CHECK(zero.scalar_type() == at::kFloat && zero.sizes() == scale.sizes(), "zero must match scale");
  return zero;
}

// The operands of y = x W^T, checked and made contiguous, and their data (zd: nullptr without zeros).
struct Operands {
  at::Tensor x, q, scale, zero;
  int64_t M, K, N, groups;
  const float* xd;
  const int8_t* qd;
  const float* sd;
  const float* zd;
};

Operands checked_operands(const char* name, const at::Tensor& x_in, const at::Tensor& q_in,
                          const at::Tensor& scale_in, const std::optional<at::Tensor>& zero_in) {
  TORCH_CHECK_NOT_IMPLEMENTED(x_in.scalar_type() == at::kFloat, name, ": float32 activations only");
  TORCH_CHECK(q_in.scalar_type() == at::kChar && scale_in.scalar_type() == at::kFloat, name,
              ": q must be int8 and scale float32");
  TORCH_CHECK(x_in.dim() == 2 && q_in.dim() == 2 && x_in.size(1) == q_in.size(1), name,
              ": x [M, K] and q [N, K] differ");
  const at::Tensor scale = scale_in.contiguous();
  const int64_t K = x_in.size(1), N = q_in.size(0), groups = scale.size(1);
  TORCH_CHECK(scale.size(0) == N && groups > 0 && K % groups == 0 && (K / groups) % kLanes == 0, name,
              ": scale must be [N, K / group] with groups of a multiple of ", kLanes);
  Operands o{x_in.contiguous(), q_in.contiguous(), scale, checked_zero(zero_in, scale), x_in.size(0), K, N, groups};
  o.xd = o.x.const_data_ptr<float>();
  o.qd = o.q.const_data_ptr<int8_t>();
  o.sd = o.scale.const_data_ptr<float>();
  o.zd = o.zero.defined() ? o.zero.const_data_ptr<float>() : nullptr;
  return o;
}

// Output n for input rows [m0, m0 + ROWS): the weight row is read once, 16 weights at a time.
template <int ROWS>
void dot_rows(const float* x, int64_t K, const int8_t* q, const float* scale, const float* zero, int64_t G, float* out,
              int64_t N) {
  f32x16 acc[ROWS] = {};
  for (int64_t g = 0, k = 0; k < K; ++g) {
    const float s = scale[g], z = zero ? zero[g] : 0.f;
    for (const int64_t group_end = k + G; k < group_end; k += kLanes) {
      const f32x16 w = load_i8_as_f32(q + k) * s + z;
      for (int r = 0; r < ROWS; ++r) acc[r] += load_f32(x + r * K + k) * w;
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * N] = sum_lanes(acc[r]);
}

at::Tensor int8_grouped_linear(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scale_in,
                               const std::optional<at::Tensor>& zero_in) {
  const Operands o = checked_operands("int8_grouped_linear", x_in, q_in, scale_in, zero_in);
  const int64_t M = o.M, K = o.K, N = o.N, groups = o.groups, G = K / groups;
  TORCH_CHECK(M <= kMaxRows, "int8_grouped_linear takes at most ", kMaxRows, " rows, got ", M);
  at::Tensor out = at::empty({M, N}, o.x.options());
  float* od = out.data_ptr<float>();
  heteroserve::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* qn = o.qd + n * K;
      const float* sn = o.sd + n * groups;
      const float* zn = o.zd ? o.zd + n * groups : nullptr;
      for (int64_t m = 0; m < M; m += kTile) {
        const float* xm = o.xd + m * K;
        float* om = od + m * N + n;
        switch (std::min(kTile, M - m)) {
          case 1: dot_rows<1>(xm, K, qn, sn, zn, G, om, N); break;
          case 2: dot_rows<2>(xm, K, qn, sn, zn, G, om, N); break;
          case 3: dot_rows<3>(xm, K, qn, sn, zn, G, om, N); break;
          default: dot_rows<4>(xm, K, qn, sn, zn, G, om, N); break;
        }
      }
    }
  });
  return out;
}

#if defined(__AVX512F__)
// rows[t]: 16 int8 of row t; cols[c] becomes column c's 16 int8, rows in order (four rounds of interleaving).
inline void transpose_16x16(const __m128i rows[16], __m128i cols[16]) {
  __m128i a[16], b[16], c[16];
  for (int p = 0; p < 8; ++p) {  // a[8h + p]: columns 8h..8h+7, 16-bit units of rows 2p, 2p+1
    a[p] = _mm_unpacklo_epi8(rows[2 * p], rows[2 * p + 1]);
    a[8 + p] = _mm_unpackhi_epi8(rows[2 * p], rows[2 * p + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // b[8h + 4s + q]: columns 8h+4s..+3, 32-bit units of rows 4q..4q+3
    for (int q = 0; q < 4; ++q) {
      b[8 * h + q] = _mm_unpacklo_epi16(a[8 * h + 2 * q], a[8 * h + 2 * q + 1]);
      b[8 * h + 4 + q] = _mm_unpackhi_epi16(a[8 * h + 2 * q], a[8 * h + 2 * q + 1]);
    }
  }
  for (int base = 0; base < 16; base += 4) {  // c[base + 2t + o]: columns of b's group base, 64-bit units of octet o
    for (int o = 0; o < 2; ++o) {
      c[base + o] = _mm_unpacklo_epi32(b[base + 2 * o], b[base + 2 * o + 1]);
      c[base + 2 + o] = _mm_unpackhi_epi32(b[base + 2 * o], b[base + 2 * o + 1]);
    }
  }
  for (int i = 0; i < 8; ++i) {  // c[2i], c[2i + 1]: rows 0-7 and 8-15 of columns 2i' and 2i'+1 (same order)
    cols[2 * i] = _mm_unpacklo_epi64(c[2 * i], c[2 * i + 1]);
    cols[2 * i + 1] = _mm_unpackhi_epi64(c[2 * i], c[2 * i + 1]);
  }
}

// Output rows [n0, n0 + kPanel) into one panel of the float32 GEMM (packed_tile.h): [K, kPanel], column j holding
// row n0 + j; 16 rows x 16 inputs at a time are transposed in registers, then widened and scaled 16 rows at once.
void dequantise_panel(const int8_t* q, const float* scale, const float* zero, int64_t K, int64_t groups,
                      float* panel) {
  constexpr int64_t kPanelWidth = heteroserve::kPanel;
  const int64_t G = K / groups;
  for (int64_t j0 = 0; j0 < kPanelWidth; j0 += 16) {
    for (int64_t g = 0; g < groups; ++g) {
      alignas(64) float s[16], z[16];
      for (int t = 0; t < 16; ++t) {
        s[t] = scale[(j0 + t) * groups + g];
        z[t] = zero ? zero[(j0 + t) * groups + g] : 0.f;
      }
      const __m512 sv = _mm512_load_ps(s), zv = _mm512_load_ps(z);
      for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
        __m128i rows[16], cols[16];
        for (int t = 0; t < 16; ++t) {
          rows[t] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j0 + t) * K + k));
        }
        transpose_16x16(rows, cols);
        for (int c = 0; c < 16; ++c) {
          const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(cols[c])), sv, zv);
          _mm512_storeu_ps(panel + (k + c) * kPanelWidth + j0, w);
        }
      }
    }
  }
}

// y = x W^T beyond kMaxRows rows: each block of kPanel output rows is dequantised once per slice of x into a
// thread-local panel that stays in L2 and multiplied there on the float32 GEMM's tile, so the weight crosses
// memory at 8 bits and the multiplies run at the GEMM's pace. N must be a whole number of blocks (cpu_int8.py
// sends other shapes to the slices below).
at::Tensor int8_panel_linear(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scale_in,
                             const std::optional<at::Tensor>& zero_in) {
  const Operands o = checked_operands("int8_panel_linear", x_in, q_in, scale_in, zero_in);
  const int64_t M = o.M, K = o.K, N = o.N, groups = o.groups;
  constexpr int64_t kPanelWidth = heteroserve::kPanel;
  TORCH_CHECK(N % kPanelWidth == 0, "int8_panel_linear: N must be a multiple of ", kPanelWidth);
  at::Tensor out = at::empty({M, N}, o.x.options());
  float* od = out.data_ptr<float>();
  const int64_t slice = heteroserve::row_block(K);
  heteroserve::parallel_for(0, N / kPanelWidth, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(K * kPanelWidth);
    for (int64_t m0 = 0; m0 < M; m0 += slice) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * kPanelWidth;
        const float* zero = o.zd ? o.zd + n0 * groups : nullptr;
        dequantise_panel(o.qd + n0 * K, o.sd + n0 * groups, zero, K, groups, buffer.data());
        heteroserve::panel_rows(o.xd, m0, std::min(M, m0 + slice), K, buffer.data(), nullptr, od + n0, N,
                                static_cast<int>(kPanelWidth));
      }
    }
  });
  return out;
}
#endif

bool int8_panel_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// out[n, k] = q[n, k] * scale[n, k / G] (+ zero[n, k / G]) in float32, for the rows of q given: without the panel
// kernel (int8_panel_available), larger batches multiply such slices in cache (cpu_int8.py). torch's mul with type
// promotion reads the table twice (an int8 -> float copy, then the multiply); this is one pass.
void int8_grouped_dequantize(const at::Tensor& q_in, const at::Tensor& scale_in,
                             const std::optional<at::Tensor>& zero_in, at::Tensor& out) {
  TORCH_CHECK(q_in.scalar_type() == at::kChar && scale_in.scalar_type() == at::kFloat && q_in.dim() == 2,
              "int8_grouped_dequantize: q must be int8 [n, K] and scale float32");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == q_in.sizes(),
              "int8_grouped_dequantize: out must be a contiguous float32 tensor shaped like q");
  const at::Tensor q = q_in.contiguous(), scale = scale_in.contiguous();
  const int64_t N = q.size(0), K = q.size(1), groups = scale.size(1);
  TORCH_CHECK(scale.size(0) == N && groups > 0 && K % groups == 0 && (K / groups) % kLanes == 0,
              "int8_grouped_dequantize: scale must be [n, K / group] with groups of a multiple of ", kLanes);
  const at::Tensor zero = checked_zero(zero_in, scale);
  const int64_t G = K / groups;
  const int8_t* qd = q.const_data_ptr<int8_t>();
  const float* sd = scale.const_data_ptr<float>();
  const float* zd = zero.defined() ? zero.const_data_ptr<float>() : nullptr;
  float* od = out.data_ptr<float>();
  heteroserve::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < groups; ++g) {
        const float s = sd[n * groups + g], z = zd ? zd[n * groups + g] : 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; k += kLanes) {
          const f32x16 w = load_i8_as_f32(qd + n * K + k) * s + z;
          std::memcpy(od + n * K + k, &w, sizeof(w));
        }
      }
    }
  });
}

}  // namespace

namespace heteroserve {

// y = x W^T for grouped 8-bit weights at any number of rows, on the kernel each row count takes: in place up to
// kMaxRows rows (decode), the panel GEMM beyond where the build has it and N is a whole number of panels, else
// slices of kSliceRows output rows dequantised exactly into a buffer that stays in cache and multiplied by torch's
// mm. Groups must be a multiple of kLanes. The result is contiguous on every path.
at::Tensor int8_grouped_product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                                const std::optional<at::Tensor>& zero) {
  if (x.size(0) <= kMaxRows) return int8_grouped_linear(x, q, scale, zero);
#if defined(__AVX512F__)
  if (q.size(0) % heteroserve::kPanel == 0) return int8_panel_linear(x, q, scale, zero);
#endif
  constexpr int64_t kSliceRows = 1024;  // a 2.4 MB buffer at K = 576
  const int64_t N = q.size(0), K = q.size(1);
  const at::Tensor x_t = x.t();
  at::Tensor out_t = at::empty({N, x.size(0)}, x.options());  // slices of output rows are contiguous here
  at::Tensor buffer = at::empty({std::min(kSliceRows, N), K}, x.options());
  for (int64_t start = 0; start < N; start += kSliceRows) {
    const int64_t count = std::min(kSliceRows, N - start);
    at::Tensor slice = buffer.narrow(0, 0, count);
    const std::optional<at::Tensor> zero_rows =
        zero.has_value() ? std::optional<at::Tensor>(zero->narrow(0, start, count)) : std::nullopt;
    int8_grouped_dequantize(q.narrow(0, start, count), scale.narrow(0, start, count), zero_rows, slice);
    at::Tensor rows = out_t.narrow(0, start, count);
    at::mm_out(rows, slice, x_t);
  }
  return out_t.t().contiguous();  // callers (the fused experts among them) read [M, N] rows in place
}

}  // namespace heteroserve

TORCH_LIBRARY_FRAGMENT(heteroserve, m) {
  m.def("int8_grouped_linear(Tensor x, Tensor q, Tensor scale, Tensor? zero) -> Tensor");
  m.def("int8_grouped_dequantize(Tensor q, Tensor scale, Tensor? zero, Tensor(a!) out) -> ()");
  m.def("int8_panel_available() -> bool");
  m.def("int8_grouped_product(Tensor x, Tensor q, Tensor scale, Tensor? zero) -> Tensor");
  m.impl("int8_grouped_product", c10::DispatchKey::CPU, &heteroserve::int8_grouped_product);
  m.impl("int8_panel_available", &int8_panel_available);
#if defined(__AVX512F__)
  m.def("int8_panel_linear(Tensor x, Tensor q, Tensor scale, Tensor? zero) -> Tensor");
  m.impl("int8_panel_linear", c10::DispatchKey::CPU, &int8_panel_linear);
#endif
  m.impl("int8_grouped_linear", c10::DispatchKey::CPU, &int8_grouped_linear);
  m.impl("int8_grouped_dequantize", c10::DispatchKey::CPU, &int8_grouped_dequantize);
}
