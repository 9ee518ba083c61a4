// Math the kernels share, written so that GCC vectorises the loops calling it (std::exp is a scalar call).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace heteroserve {

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
