// The machine vector and the math the kernels share, written so that GCC vectorises the loops calling it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

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
