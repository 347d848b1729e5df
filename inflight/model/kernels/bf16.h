/* bfloat16 <-> float32, bit for bit as PyTorch converts (round to nearest even, NaN kept). */
#ifndef INFLIGHT_BF16_H
#define INFLIGHT_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A linear layer's output y[at] = v + bias[col] (bias may be NULL), y and bias float32 or
 * bfloat16: the sum in float32, one rounding. */
static inline void store_output(int is_bf16, void *y, int64_t at, float v, const void *bias,
                                int64_t col) {
    if (is_bf16) {
        if (bias) v += bf16_to_f32(((const uint16_t *)bias)[col]);
        ((uint16_t *)y)[at] = f32_to_bf16(v);
    } else {
        if (bias) v += ((const float *)bias)[col];
        ((float *)y)[at] = v;
    }
}
#endif
