/* Gated MLP activations (vLLM's silu_and_mul, gelu_tanh_and_mul): out = act(gate) * up, with
 * x = [gate | up] as the fused gate/up projection produces it, in one pass. PyTorch ran the
 * activation over the strided gate half and then a multiply, two passes and two dispatches
 * (docs/performance.md).
 *
 *   act  0: SiLU (Llama, Qwen, Phi-3); 1: GELU, tanh approximation (Gemma's gelu_pytorch_tanh)
 *   x    [T, 2 * I]  float32 or bfloat16 (uint16 bits), rows contiguous
 *   out  [T, I]      same element type
 * Rounding as HF in bfloat16: act(gate) is rounded to bfloat16, then the product.
 * silu(g) = g / (1 + exp(-g)); the tanh GELU 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715
 * g^3), is the same form, g / (1 + exp(-2u)), since 0.5 (1 + tanh(u)) = sigmoid(2u): no
 * cancellation near u = 0 and one exp, to within 2 ulp (fast_exp.h).
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

static inline float activation(int act, float g) {
    const float z = act == 0 ? g : 1.5957691216057308f * (g + 0.044715f * g * g * g);
    return g / (1.f + fast_expf(-z));
}

void act_and_mul(int act, int is_bf16, const void *x, void *out, int64_t T, int64_t I,
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
                const float s = bf16_to_f32(f32_to_bf16(activation(act, bf16_to_f32(g[i]))));
                o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)x + t * 2 * I, *u = g + I;
            float *o = (float *)out + t * I;
            for (int64_t i = 0; i < I; i++) o[i] = activation(act, g[i]) * u[i];
        }
    }
}
