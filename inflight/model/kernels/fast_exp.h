/* exp(x) in plain float arithmetic the compiler vectorizes (a scalar libm expf call per
 * element cost more than the dot products around it). Cody-Waite range reduction and
 * Cephes' expf polynomial (Moshier, "Methods and Programs for Mathematical Functions",
 * 1989): within 2 ulp of expf on [-87, 88]. Inputs are clamped to that range, so below -87
 * (a softmax weight under 1e-38 beside the max's 1) it returns exp(-87). */
#ifndef INFLIGHT_FAST_EXP_H
#define INFLIGHT_FAST_EXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float fast_expf(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.f;
    /* 2^n as two factors, so n = 128 (x near 88) stays inside the exponent field */
    const int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
    const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    return e * s1 * s2;
}
#endif
