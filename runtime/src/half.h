// f32 <-> IEEE half / bfloat16, round to nearest even: torch's .to(torch.float16 / bfloat16),
// bit for bit (tests/test_ondevice_half.py). Header-only, for the checkpoints and the tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace mesp {

namespace half_detail {
inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace half_detail

// Half: scale the magnitude so that the float adder rounds the mantissa at half's precision
// (to nearest even, subnormals included), then read the exponent and mantissa off the sum.
inline uint16_t half_from_float(float f) {
  const uint32_t w = half_detail::bits(f), twice = w + w, sign = w & 0x80000000u;
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;  // overflow to inf, as half would
  uint32_t bias = twice & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = half_detail::from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = half_detail::bits(base);
  const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (twice > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float float_from_half(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, twice = w + w;
  const float normal = half_detail::from_bits((twice >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = half_detail::from_bits((twice >> 17) | (126u << 23)) - 0.5f;
  return half_detail::from_bits(sign | (twice < (1u << 27) ? half_detail::bits(subnormal) : half_detail::bits(normal)));
}

inline uint16_t bf16_from_float(float f) {
  const uint32_t u = half_detail::bits(f);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float float_from_bf16(uint16_t h) { return half_detail::from_bits(static_cast<uint32_t>(h) << 16); }

}  // namespace mesp
