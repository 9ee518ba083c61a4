// The machine vector and the math the kernels share, written so that GCC vectorises the loops calling it.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace heteroserve {

// One machine vector of floats (GCC vector extensions: AVX-512, AVX2 or NEON registers without intrinsics).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// kLanes bfloat16 values widened to float32: their bits are the top half of a float's.
inline vec load(const c10::BFloat16* p) {
#if defined(__AVX512F__)  // GCC 12's code for the generic vectors below is slower here (docs/PLATFORMS.md)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  typedef uint16_t halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  halves h;
  std::memcpy(&h, p, sizeof(h));
  const words w = __builtin_convertvector(h, words) << 16;
#endif
  vec v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// kLanes float16 values widened to float32 by the ISA's conversion instruction (GCC 12 converts _Float16
// vectors one lane at a time).
inline vec load(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX__) && defined(__F16C__)
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__ARM_NEON) && !defined(__AVX__)
  const float32x4_t f = vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(p)));
#else
  float f[kLanes];
  for (int i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
#endif
  vec v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

// kLanes floats rounded to bfloat16: to nearest, ties to even, NaN kept NaN, as c10::BFloat16 rounds. AVX512-BF16's
// conversion instruction where the compiler targets it (it also flushes subnormals, below 1.2e-38, to zero), the
// same rounding on the float's bits elsewhere.
inline void store(c10::BFloat16* p, vec v) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  __m512 f;
  std::memcpy(&f, &v, sizeof(f));
  const __m256bh h = _mm512_cvtneps_pbh(f);
#else
  typedef uint32_t words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  typedef uint16_t halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  words w;
  std::memcpy(&w, &v, sizeof(w));
  const words nan = (words)(v != v);
  const words rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  const halves h = __builtin_convertvector((rounded & ~nan) | (nan & 0x7FC0u), halves);
#endif
  std::memcpy(p, &h, sizeof(h));
}

// n floats into a row of float32 (a copy) or bfloat16 (rounded as above), a machine vector at a time.
template <typename T>
inline void store_row(const float* from, int64_t n, T* to) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(to, from, n * sizeof(float));
  } else {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store(to + i, load(from + i));
    for (; i < n; ++i) to[i] = static_cast<T>(from[i]);
  }
}

// Where a kernel computes a row of T outputs in float32: the output row itself when T is float, else a scratch
// row that `finish` rounds into the output once.
template <typename T>
class OutputRow {
 public:
  explicit OutputRow(int64_t n) : scratch_(std::is_same_v<T, float> ? 0 : n) {}

  // The float32 row to write the results of `out` [0, n) into.
  float* start(T* out) {
    out_ = out;
    if constexpr (std::is_same_v<T, float>) {
      return out;
    } else {
      return scratch_.data();
    }
  }

  void finish() {
    if constexpr (!std::is_same_v<T, float>) store_row(scratch_.data(), static_cast<int64_t>(scratch_.size()), out_);
  }

 private:
  std::vector<float> scratch_;
  T* out_ = nullptr;
};

inline float horizontal_sum(vec v) {
  float sum = 0.f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
}

// exp(x) for x <= 0 (a score minus the row's maximum), written so the compiler vectorises the softmax loop
// (std::exp is a scalar call): x = k ln2 + r with |r| <= ln2/2, exp(r) by its degree-7 Taylor polynomial
// (relative error < 1e-8 before rounding), times 2^k built in the exponent bits. Below -87, 2^k would be
// subnormal and the result is flushed to 0: such a weight is below 1e-38 of the largest one.
inline float exp_nonpositive(float x) {
  if (x < -87.f) x = -87.f;
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;  // ln2 split for exact k ln2
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace heteroserve
