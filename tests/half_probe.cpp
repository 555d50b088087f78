// runtime/src/half.h's casts on their own, for tests/test_ondevice_half.py: reads f32 bit
// patterns (hex, one per line) on stdin, prints "F16 BF16 F16->F32 BF16->F32" bit patterns.
#include <cstdio>

#include "half.h"

int main() {
  unsigned u;
  while (std::scanf("%x", &u) == 1) {
    float f;
    std::memcpy(&f, &u, 4);
    const uint16_t h = mesp::half_from_float(f), b = mesp::bf16_from_float(f);
    const float hf = mesp::float_from_half(h), bf = mesp::float_from_bf16(b);
    unsigned hu, bu;
    std::memcpy(&hu, &hf, 4);
    std::memcpy(&bu, &bf, 4);
    std::printf("%04x %04x %08x %08x\n", h, b, hu, bu);
  }
  return 0;
}
