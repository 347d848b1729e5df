/* SiLU-gated MLP activation (vLLM's silu_and_mul): out = silu(gate) * up, with x = [gate | up]
 * as the fused gate/up projection produces it, in one pass. PyTorch ran silu over the strided
 * gate half and then a multiply, two passes and two dispatches (docs/performance.md).
 *
 *   x    [T, 2 * I]  float32 or bfloat16 (uint16 bits), rows contiguous
 *   out  [T, I]      same element type
 * Rounding as HF in bfloat16: silu(gate) is rounded to bfloat16, then the product.
 * silu(g) = g / (1 + exp(-g)), exp to within 2 ulp (fast_exp.h).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "kernels.h"
#include "fast_exp.h"

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
                const float s = bf16_to_f32(f32_to_bf16(gv / (1.f + fast_expf(-gv))));
                o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)x + t * 2 * I, *u = g + I;
            float *o = (float *)out + t * I;
            for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.f + fast_expf(-g[i])) * u[i];
        }
    }
}
