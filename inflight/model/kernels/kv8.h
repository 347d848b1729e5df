/* The 8-bit KV cache's rows (--kv-cache-dtype int8 / fp8; inflight/model/kv_quant.py owns the
 * format and its PyTorch twin, bit for bit):
 *
 *   kv_cache  [2, Hkv, num_blocks, BS, D + 4] bytes: each (token, KV head) row holds D codes,
 *             then its float32 scale in the last 4 bytes (native byte order).
 *   int8 (KV_INT8): code = clamp(round_half_even(x * (1 / s)), -127, 127), s = amax * (1/127)
 *   fp8  (KV_FP8):  code = float8_e4m3fn(clamp(x * (1 / s), -448, 448)), s = amax * (1/448)
 *   value = decode(code) * s; a row of zeros has s = 0 and codes 0.
 *
 * One scale per token and head (vLLM's per-token-head scales; llama.cpp's q8_0 keeps one per
 * 32 values): a row is written once, when its token is, and never rescaled, so the write
 * path needs no read of its block.
 *
 * Where D is a power of two, rows are stored rotated: x' = H x with H the normalized
 * Walsh-Hadamard matrix (orthonormal and its own inverse; QuaRot, Ashkboos et al., 2024). Keys
 * carry a few outlier channels that would set every row's scale; rotated, their energy is
 * spread over all D values, so the scale fits the row (teacher-forced top-1 agreement with a
 * bfloat16 cache 98.7 % -> 99.3 % on the bundled model, int8). Attention needs no
 * un-rotation of the cache: q.k = (Hq).(Hk), and sum p v = H sum p (Hv), so the kernels rotate
 * each query row once and each output row once. */
#ifndef INFLIGHT_KV8_H
#define INFLIGHT_KV8_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KV_PLAIN = 0, KV_INT8 = 1, KV_FP8 = 2 };
#define KV8_SCALE_BYTES 4

/* float8_e4m3fn -> float32 without its scale: the 7 magnitude bits moved to float32's
 * exponent/mantissa position (exponent bias 7 instead of 127) and multiplied by 2^120; e4m3's
 * subnormals land on float32 subnormals, which the multiplication scales exactly. Integer
 * operations only, so loops over a row vectorize. 0x7f/0xff (NaN) are never written. */
static inline float fp8_e4m3_to_f32(uint8_t c) {
    const uint32_t u = ((uint32_t)(c & 0x80) << 24) | ((uint32_t)(c & 0x7f) << 20);
    float f;
    memcpy(&f, &u, 4);
    return f * 0x1p120f;
}

/* float32 in [-448, 448] -> float8_e4m3fn, rounding to nearest even as PyTorch's conversion. */
static inline uint8_t f32_to_fp8_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(x);
    if (a > 448.f) a = 448.f;
    if (a < 0x1p-6f) /* subnormal: units of 2^-9; 8 units is the smallest normal, 0x08 */
        return sign | (uint8_t)nearbyintf(a * 0x1p9f);
    memcpy(&u, &a, 4);
    u += 0x7ffffu + ((u >> 20) & 1u);  /* round the mantissa to 3 bits, ties to even */
    const uint32_t e = (u >> 23) - 127 + 7, m = (u >> 20) & 7u;
    return sign | (uint8_t)((e << 3) | m);
}

#define KV8_MAX_D 256

/* Whether rows of head size D are stored rotated: D a power of two, 2 .. KV8_MAX_D. */
static inline int kv8_rotated(int64_t D) { return D >= 2 && D <= KV8_MAX_D && !(D & (D - 1)); }

/* x <- H x in place, H the normalized Walsh-Hadamard matrix of size D (kv8_rotated(D); else
 * nothing): butterflies of span 1, 2, 4, ..., then one scaling by 1 / sqrt(D). Each output is
 * a fixed sequence of sums, so this and kv_quant.rotate (PyTorch) agree bit for bit. */
static inline void kv8_rotate(float *x, int64_t D) {
    if (!kv8_rotated(D)) return;
    for (int64_t h = 1; h < D; h *= 2)
        for (int64_t i = 0; i < D; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float norm = (float)(1.0 / sqrt((double)D));
    for (int64_t d = 0; d < D; d++) x[d] *= norm;
}

/* A row's D codes decoded to float32 in dst (without the scale, still rotated where
 * kv8_rotated(D)); returns the row's scale. */
static inline float kv8_load_row(int fmt, const uint8_t *row, int64_t D, float *dst) {
    float s;
    memcpy(&s, row + D, 4);
    if (fmt == KV_INT8)
        for (int64_t d = 0; d < D; d++) dst[d] = (float)(int8_t)row[d];
    else
        for (int64_t d = 0; d < D; d++) dst[d] = fp8_e4m3_to_f32(row[d]);
    return s;
}

/* Quantize D float32 values into a row of codes and its scale (the format above; x is
 * rotated on the way, in place). */
static inline void kv8_store_row(int fmt, float *x, int64_t D, uint8_t *row) {
    kv8_rotate(x, D);
    float amax = 0.f;
    for (int64_t d = 0; d < D; d++) {
        const float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    volatile float s_opaque = amax * (fmt == KV_INT8 ? 1.f / 127.f : 1.f / 448.f);
    const float s = s_opaque;
    /* 1 / s correctly rounded, as PyTorch computes it. -freciprocal-math lets the compiler use
     * rcpss plus a Newton step for a float division, and -fassociative-math lets it fold the
     * quotient into x * 127 / amax: last-bit differences, seen to move codes at .5 ties. In
     * double there is no such reciprocal, rounding its quotient to float gives the correctly
     * rounded float quotient (53 >= 2 * 24 + 2 bits), and the volatiles keep s and 1 / s
     * opaque to those rewrites. */
    volatile float inv_opaque = s > 0.f ? (float)(1.0 / (double)s) : 0.f;
    const float inv = inv_opaque;
    if (fmt == KV_INT8)
        for (int64_t d = 0; d < D; d++) {
            float c = nearbyintf(x[d] * inv);
            c = c > 127.f ? 127.f : c < -127.f ? -127.f : c;
            row[d] = (uint8_t)(int8_t)c;
        }
    else
        for (int64_t d = 0; d < D; d++) row[d] = f32_to_fp8_e4m3(x[d] * inv);
    memcpy(row + D, &s, 4);
}
#endif
