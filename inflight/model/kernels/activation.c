/* SiLU-gated MLP activation (vLLM's silu_and_mul): out = silu(gate) * up, with x = [gate | up]
 * as the fused gate/up projection produces it, in one pass. PyTorch ran silu over the strided
 * gate half and then a multiply, two passes and two dispatches (docs/performance.md).
 *
 *   x    [T, 2 * I]  float32 or bfloat16 (uint16 bits), rows contiguous
 *   out  [T, I]      same element type
 * Rounding as HF in bfloat16: silu(gate) is rounded to bfloat16, then the product.
 * silu(g) = g / (1 + exp(-g)), exp to within 2 ulp (Cephes, as in paged_attention.c).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"

/* exp(x), x clamped to [-87, 88]: Cody-Waite reduction and Cephes' expf polynomial. */
static inline float exp_approx(float x) {
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
    /* 2^n in two halves, so n = 128 (x near 88) does not overflow the exponent field */
    const int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
    const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    return e * s1 * s2;
}

void silu_and_mul(int is_bf16, const void *x, void *out, int64_t T, int64_t I,
                  int64_t num_threads) {
    int64_t nt = T * I / 65536;  /* a thread per at least 64K outputs */
    nt = nt < num_threads ? nt : num_threads;
    nt = nt > 1 ? nt : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        if (is_bf16) {
            const uint16_t *g = (const uint16_t *)x + t * 2 * I, *u = g + I;
            uint16_t *o = (uint16_t *)out + t * I;
            for (int64_t i = 0; i < I; i++) {
                const float gv = bf16_to_f32(g[i]);
                const float s = bf16_to_f32(f32_to_bf16(gv / (1.f + exp_approx(-gv))));
                o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)x + t * 2 * I, *u = g + I;
            float *o = (float *)out + t * I;
            for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
        }
    }
}
