// The dequantizer of mesp's kernel ops (qmatmul.cpp): a frozen matrix W (N, K) as
// mesp.quant.packed_bytes stores it, and its values a block of rows or columns at a time.
//
// Each row is a little-endian bit stream of B-bit codes (B = 4, 5, 6 or 8): eight codes fill
// exactly B bytes from a byte boundary, so they are read as one integer. Scales and biases are
// (N, K/g) fp32, and w = q·scale + bias is rounded twice, as mesp.quant.dequantize_core_aten
// does (the including file is compiled with -ffp-contract=off: no fused multiply-add).
//
// Two forms give the same bits: eight scalar conversions per eight codes (any CPU), and on x86-64
// CPUs with AVX2 eight lanes at once (the codes' shifts are one variable shift of a vector, the
// conversion and the two roundings one instruction each), chosen once at run time. The scalar
// form is what every other target (AArch64 included) compiles.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace mesp_packed {

// eight B-bit codes: the B bytes at p as one little-endian integer (no byte past them is read)
template <int B>
inline __attribute__((always_inline)) uint64_t word_of(const uint8_t* p) {
  uint64_t word = 0;
  for (int j = 0; j < B; ++j) word |= uint64_t(p[j]) << (8 * j);
  return word;
}

// eight codes from p (B bytes) into out (8 floats): out[j] = q_j·sc + bi
template <int B>
inline __attribute__((always_inline)) void eight_scalar(const uint8_t* p, float sc, float bi,
                                                        float* out) {
  const uint64_t word = word_of<B>(p);
  for (int j = 0; j < 8; ++j) {
    const float t = float(uint32_t(word >> (B * j)) & ((1u << B) - 1u)) * sc;
    out[j] = t + bi;  // two roundings, as w = q·scale + bias everywhere
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define MESP_PACKED_AVX2 1
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));

// the same eight values as eight_scalar: codes 0..3 are bits 0..4B of the word, codes 4..7 bits
// 4B..8B, each lane shifted by its code's place (4B <= 32, so a 32-bit lane holds its code)
template <int B>
inline __attribute__((always_inline)) void eight_vector(const uint8_t* p, float sc, float bi,
                                                        float* out) {
  const uint64_t word = word_of<B>(p);
  const uint32_t lo = uint32_t(word), hi = uint32_t(word >> (4 * B));
  u32x8 v = {lo, lo, lo, lo, hi, hi, hi, hi};
  const u32x8 place = {0, B, 2 * B, 3 * B, 0, B, 2 * B, 3 * B};
  v = (v >> place) & ((1u << B) - 1u);
  const f32x8 t = __builtin_convertvector((i32x8)v, f32x8) * sc;
  const f32x8 w = t + bi;
  std::memcpy(out, &w, sizeof w);
}
#endif

// W (N, K) as stored
struct Packed {
  const uint8_t* q;
  const float* s;
  const float* b;
  int64_t n, k, bits, group, row_bytes, groups;

  // values c0:c1 of row r (c0, c1 multiples of 8) into out
  template <int B, bool Vector>
  inline __attribute__((always_inline)) void row(int64_t r, int64_t c0, int64_t c1,
                                                 float* out) const {
    const uint8_t* qr = q + r * row_bytes;
    const float* sr = s + r * groups;
    const float* br = b + r * groups;
    for (int64_t g = c0 / group, c = c0; c < c1; ++g) {
      const float sc = sr[g], bi = br[g];
      const int64_t end = std::min(c1, (g + 1) * group);
      for (const uint8_t* p = qr + c * B / 8; c < end; c += 8, p += B, out += 8) {
#ifdef MESP_PACKED_AVX2
        if constexpr (Vector) {
          eight_vector<B>(p, sc, bi, out);
          continue;
        }
#endif
        eight_scalar<B>(p, sc, bi, out);
      }
    }
  }

  // linear: rows b0:b0+len into buf (len, K); else columns b0:b0+len of every row into buf
  // (N, len)
  template <int B, bool Vector>
  inline __attribute__((always_inline)) void block_of(bool linear, int64_t b0, int64_t len,
                                                      float* buf) const {
    if (linear) {
      for (int64_t r = 0; r < len; ++r) row<B, Vector>(b0 + r, 0, k, buf + r * k);
    } else {
      for (int64_t r = 0; r < n; ++r) row<B, Vector>(r, b0, b0 + len, buf + r * len);
    }
  }

  template <bool Vector>
  inline __attribute__((always_inline)) void block_bits(bool linear, int64_t b0, int64_t len,
                                                        float* buf) const {
    switch (bits) {
      case 4: return block_of<4, Vector>(linear, b0, len, buf);
      case 5: return block_of<5, Vector>(linear, b0, len, buf);
      case 6: return block_of<6, Vector>(linear, b0, len, buf);
      default: return block_of<8, Vector>(linear, b0, len, buf);
    }
  }

  void block_scalar(bool linear, int64_t b0, int64_t len, float* buf) const {
    block_bits<false>(linear, b0, len, buf);
  }

#ifdef MESP_PACKED_AVX2
  static bool has_avx2() {  // this CPU's, asked once
    static const bool avx2 = __builtin_cpu_supports("avx2");
    return avx2;
  }

  __attribute__((target("avx2"))) void block_avx2(bool linear, int64_t b0, int64_t len,
                                                  float* buf) const {
    block_bits<true>(linear, b0, len, buf);
  }
#endif

  // a block of W's values (see block_of), in the fastest form this CPU has
  void block(bool linear, int64_t b0, int64_t len, float* buf) const {
#ifdef MESP_PACKED_AVX2
    if (has_avx2()) return block_avx2(linear, b0, len, buf);
#endif
    block_scalar(linear, b0, len, buf);
  }
};

}  // namespace mesp_packed
