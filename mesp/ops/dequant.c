/* mesp's one-sweep dequantizer for MLX affine-quantized weights (see mesp/quant.py).
 *
 * w = q * scale + bias per group of `group` consecutive inputs, with q value k of the row's
 * little-endian bit stream (bits bits*k .. bits*k + bits - 1: at 4 bits byte k/2, low nibble
 * first; at 8 bits byte k; at 5 and 6 bits eight values fill `bits` bytes, a value may straddle
 * two; mesp/quant_pack.py). Each output element is written once, from the packed bytes and its
 * group's scale and bias, instead of torch's unpack / convert / multiply / add passes.
 *
 * Bit-identical to mesp.quant's torch path, which rounds twice (w * scale, then + bias) in the
 * output dtype: built with -ffp-contract=off, so no multiply-add is fused. In bf16 each step is
 * computed in fp32 and rounded to nearest even, as ATen's bf16 ops do. `bf16_math` with an fp32
 * out writes those bf16 values widened to fp32 (exact), for an fp32 GEMM to read directly.
 *
 * No torch headers: a plain C ABI loaded through ctypes (mesp/ops/native.py), so it builds in a
 * second with any C compiler and does not depend on torch's C++ ABI.
 */
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* 5 or 6 bits: a group's `group` values (a multiple of 8) from its bytes, 8 values (`bits`
 * bytes, read as one little-endian integer) at a time */
static inline void unpack_odd(const uint8_t *wg, int group, int bits, uint8_t *vals) {
    const uint64_t mask = (1u << bits) - 1;
    for (int k = 0; k < group; k += 8, wg += bits) {
        uint64_t chunk = 0;
        for (int i = 0; i < bits; i++) chunk |= (uint64_t)wg[i] << (8 * i);
        for (int j = 0; j < 8; j++) vals[k + j] = (uint8_t)((chunk >> (bits * j)) & mask);
    }
}

#ifdef __AVX2__
#include <immintrin.h>

static inline __m256 round_bf16_v(__m256 f) { /* f32_to_bf16, widened back, 8 at a time */
    __m256i u = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

/* values q (8 bytes, low half of v) -> q * sc + bi, stored as fp32 or bf16 */
static inline void put8(__m128i v, __m256 sc, __m256 bi, void *dst, int bf16_math, int out_bf16) {
    __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), sc);
    if (bf16_math) w = round_bf16_v(w);
    w = _mm256_add_ps(w, bi);
    if (bf16_math) w = round_bf16_v(w);
    if (out_bf16) {
        __m256i h = _mm256_srli_epi32(_mm256_castps_si256(w), 16);
        __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i *)dst, p);
    } else {
        _mm256_storeu_ps((float *)dst, w);
    }
}
#endif

/* One row's groups [g0, g1) into dst. The flags are compile-time constants at every call site
 * below, so each combination is its own loop. */
static inline void row(const uint8_t *w, const void *s, const void *b, void *dst, int64_t g0,
                       int64_t g1, int group, int bits, int scale_bf16, int bf16_math,
                       int out_bf16) {
    const int esize = out_bf16 ? 2 : 4;
    for (int64_t g = g0; g < g1; g++) {
        float sc = load(s, g, scale_bf16), bi = load(b, g, scale_bf16);
        if (bf16_math && !scale_bf16) { /* scales.to(bfloat16) first, as the torch path */
            sc = round_bf16(sc);
            bi = round_bf16(bi);
        }
        char *o = (char *)dst + (g - g0) * group * esize;
#ifdef __AVX2__
        __m256 vs = _mm256_set1_ps(sc), vb = _mm256_set1_ps(bi);
        if (bits == 4) { /* 16 bytes = 32 values a step: nibbles split, interleaved in order */
            const uint8_t *wg = w + g * group / 2;
            const __m128i m4 = _mm_set1_epi8(15);
            for (int k = 0; k < group / 2; k += 16) {
                __m128i x = _mm_loadu_si128((const __m128i *)(wg + k));
                __m128i lo = _mm_and_si128(x, m4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), m4);
                __m128i a = _mm_unpacklo_epi8(lo, hi), c = _mm_unpackhi_epi8(lo, hi);
                char *ok = o + 2 * k * esize;
                put8(a, vs, vb, ok, bf16_math, out_bf16);
                put8(_mm_srli_si128(a, 8), vs, vb, ok + 8 * esize, bf16_math, out_bf16);
                put8(c, vs, vb, ok + 16 * esize, bf16_math, out_bf16);
                put8(_mm_srli_si128(c, 8), vs, vb, ok + 24 * esize, bf16_math, out_bf16);
            }
        } else if (bits == 8) {
            const uint8_t *wg = w + g * group;
            for (int k = 0; k < group; k += 8)
                put8(_mm_loadl_epi64((const __m128i *)(wg + k)), vs, vb, o + k * esize,
                     bf16_math, out_bf16);
        } else { /* 5, 6 bits: unpacked to bytes first, then the 8-bit path's arithmetic */
            uint8_t q[128];
            unpack_odd(w + g * group * bits / 8, group, bits, q);
            for (int k = 0; k < group; k += 8)
                put8(_mm_loadl_epi64((const __m128i *)(q + k)), vs, vb, o + k * esize,
                     bf16_math, out_bf16);
        }
#else
        float vals[128];
        if (bits == 4) {
            const uint8_t *wg = w + g * group / 2;
            for (int k = 0; k < group / 2; k++) {
                vals[2 * k] = (float)(wg[k] & 15);
                vals[2 * k + 1] = (float)(wg[k] >> 4);
            }
        } else if (bits != 8) {
            uint8_t q[128];
            unpack_odd(w + g * group * bits / 8, group, bits, q);
            for (int k = 0; k < group; k++) vals[k] = (float)q[k];
        } else {
            const uint8_t *wg = w + g * group;
            for (int k = 0; k < group; k++) vals[k] = (float)wg[k];
        }
        if (out_bf16) {
            uint16_t *ob = (uint16_t *)o;
            for (int k = 0; k < group; k++) ob[k] = f32_to_bf16(round_bf16(vals[k] * sc) + bi);
        } else if (bf16_math) {
            float *of = (float *)o;
            for (int k = 0; k < group; k++) of[k] = round_bf16(round_bf16(vals[k] * sc) + bi);
        } else {
            float *of = (float *)o;
            for (int k = 0; k < group; k++) of[k] = vals[k] * sc + bi;
        }
#endif
    }
}

#define ROWS(SB, BM, OB)                                                                       \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(work >= 65536)")        \
    for (int64_t r = r0; r < r1; r++)                                                          \
        row(wb + r * row_bytes, (const char *)s + r * groups * (SB ? 2 : 4),                   \
            (const char *)b + r * groups * (SB ? 2 : 4),                                       \
            (char *)out + (r - r0) * ld * (OB ? 2 : 4), g0, g1, group, bits, SB, BM, OB)

/* Rows [r0, r1) and groups [g0, g1) of a (rows, groups * group) weight into out, whose rows are
 * `ld` elements apart. Returns 0, or -1 for a combination this kernel does not serve. */
int mesp_dequantize(const uint8_t *wb, const void *s, const void *b, void *out, int64_t r0,
                    int64_t r1, int64_t groups, int64_t g0, int64_t g1, int64_t ld, int group,
                    int bits, int scale_bf16, int bf16_math, int out_bf16, int threads) {
    /* 4 bits: 32-value steps; 8 bits: 8-value steps, so group 16 (GGUF's Q6_K) too; 5 and 6
     * bits: 8-value chunks of `bits` bytes */
    if (bits != 4 && bits != 5 && bits != 6 && bits != 8) return -1;
    if (group > 128 || group % (bits == 4 ? 32 : bits == 8 ? 16 : 8) || group < 16) return -1;
    if (out_bf16 && !bf16_math) return -1;
    int64_t row_bytes = groups * group * bits / 8, work = (r1 - r0) * (g1 - g0) * group;
    if (threads < 1) threads = 1;
    if (scale_bf16) {
        if (out_bf16) ROWS(1, 1, 1);
        else if (bf16_math) ROWS(1, 1, 0);
        else ROWS(1, 0, 0);
    } else {
        if (out_bf16) ROWS(0, 1, 1);
        else if (bf16_math) ROWS(0, 1, 0);
        else ROWS(0, 0, 0);
    }
    return 0;
}

int mesp_dequantize_abi(void) { return 1; }
