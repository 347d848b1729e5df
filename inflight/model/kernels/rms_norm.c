/* RMSNorm (Zhang and Sennrich, 2019) with HF transformers' rounding:
 *   h = float32(x) * rsqrt(mean(float32(x)^2) + eps)
 *   scale_f32 0 (LlamaRMSNorm): y = weight * h.to(x.dtype), so in bfloat16 h is rounded once
 *                               and the product with the bfloat16 weight once more;
 *   scale_f32 1 (Gemma3RMSNorm): y = (h * float32(weight)).to(x.dtype), one rounding.
 * (In float32 the two agree.)
 *
 *   x, y    [T, D]  float32 or bfloat16 (uint16 bits), rows contiguous
 *   weight  [D]     same element type
 *
 * One pass per row, rows spread over PyTorch's OpenMP pool (see paged_attention.c). PyTorch's
 * own F.rms_norm runs as separate pow / mean / add / rsqrt / mul kernels here, several passes
 * over the activations and a dispatch each.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define LOAD(p, i) (is_bf16 ? bf16_to_f32(((const uint16_t *)(p))[i]) : ((const float *)(p))[i])

/* Returns 0 (no input is refused). */
int rms_norm(int is_bf16, int scale_f32, const void *x, const void *weight, void *y, int64_t T,
             int64_t D, float eps, int64_t num_threads) {
    /* A thread per at least 64K elements: below that the fork costs more than it saves. */
    int64_t nt = T * D / 65536;
    nt = nt < num_threads ? nt : num_threads;
    nt = nt > 1 ? nt : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *xr = (const char *)x + t * D * (is_bf16 ? 2 : 4);
        float ss = 0.f;
        for (int64_t d = 0; d < D; d++) {
            const float v = LOAD(xr, d);
            ss += v * v;
        }
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        if (is_bf16) {
            uint16_t *yr = (uint16_t *)y + t * D;
            if (scale_f32)
                for (int64_t d = 0; d < D; d++) yr[d] = f32_to_bf16(LOAD(xr, d) * r * LOAD(weight, d));
            else
                for (int64_t d = 0; d < D; d++) {
                    const float h = bf16_to_f32(f32_to_bf16(LOAD(xr, d) * r));
                    yr[d] = f32_to_bf16(LOAD(weight, d) * h);
                }
        } else {
            float *yr = (float *)y + t * D;
            for (int64_t d = 0; d < D; d++) yr[d] = LOAD(xr, d) * r * LOAD(weight, d);
        }
    }
    return 0;
}
