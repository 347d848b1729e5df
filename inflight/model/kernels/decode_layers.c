/* The whole decoder stack for a decode step of one or two tokens, in one call.
 *
 * At batch 1 a step reads every weight once (269 MB in bfloat16 for the bundled model), and
 * the skinny kernel streams them near DRAM speed; what was left was the Python around them:
 * about 30 module calls, 20 small tensor ops and 7 kernel calls per layer, some 5 ms a step
 * against 9 ms of weight reads (docs/performance.md). This runs the same kernels, in the same
 * order and with the same roundings, from C: the result is bit for bit the per-module path's
 * (tests/model/test_decode_layers.py), so the model only chooses which of two equal paths runs.
 *
 * Per layer, as layers.py's DecoderLayer for every family (model/architecture.py):
 *   h = rms_norm(x); qkv = h @ Wqkv^T (+ b); [RMSNorm over each Q and K head (Qwen3, Gemma)];
 *   RoPE on the Q and K heads (the local base on a windowed layer that has one: Gemma);
 *   K, V into the cache; a = o_proj(paged decode attention, over the layer's window if any);
 *   Llama:            x = x + a;            x = x + down(act_and_mul(gate_up(rms_norm(x))))
 *   sandwich (Gemma): x = x + rms_norm(a);  x = x + rms_norm(down(act_and_mul(gate_up(
 *                                                                     rms_norm(x)))))
 * RoPE and the residual adds round as PyTorch's elementwise ops do (each op's result to the
 * activation dtype): x * cos and rotate_half(x) * sin rounded, then their sum.
 *
 *   x           [M, hidden], float32 or bfloat16 (uint16 bits), updated in place
 *   layers      [num_layers, LAYER_PTRS] int64 addresses (see the enum), weights in x's type,
 *               nn.Linear's [out, in] layout; the KV cache as paged_attention.c's
 *   act         0 SiLU, 1 GELU (tanh), as activation.c; norm_f32: rms_norm.c's scale_f32
 *   cos, sin    [M, D] in x's type (the model's rope_cos_sin rows); cos_local, sin_local the
 *               same with the windowed layers' base, or NULL where there is none
 *   slots [M], tables [M, table_width], seq_lens [M]: int64, as paged_attention.c's
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* Columns of `layers`, in the order of DECODE_LAYER_COLUMNS in __init__.py. A linear layer
 * has six: the weight (dense, or quant_linear.c's packed blocks), its format (0: dense,
 * FMT_PARTS: parts in different formats), the block scales, Q4_1's block minimums, and its
 * LoRA slots' A and B (lora.c; 0: none). POST_NORM is the norm after attention (Llama's
 * post_attention_layernorm, before the MLP unless PRE_FF_NORM is set); Q_NORM, K_NORM,
 * PRE_FF_NORM, POST_FF_NORM are 0 where the family has none; WINDOW is the layer's sliding
 * window in keys (0: none); LOCAL_ROPE 1 where the layer takes cos_local / sin_local. */
enum { IN_NORM, QKV, QKV_FMT, QKV_SCALES, QKV_MINS, QKV_LA, QKV_LB, QKV_BIAS, O_PROJ, O_FMT,
       O_SCALES, O_MINS, O_LA, O_LB, POST_NORM, GATE_UP, GU_FMT, GU_SCALES, GU_MINS, GU_LA,
       GU_LB, DOWN, DOWN_FMT, DOWN_SCALES, DOWN_MINS, DOWN_LA, DOWN_LB, KV_CACHE, Q_NORM,
       K_NORM, PRE_FF_NORM, POST_FF_NORM, WINDOW, LOCAL_ROPE, LAYER_PTRS };

/* A fused layer whose parts the file keeps in different formats (Q4_K_M's Q5_0 queries and
 * keys beside Q8_0 values): its weight column is the address of an int64 array
 * [n, then per part: format, blocks, scales, minimums, rows]. */
#define FMT_PARTS (-1)

/* A step's LoRA rows (lora.c): each row's slot (NULL: no adapter row), the slots, and the
 * largest rank; a layer fusing `parts` projections has slots parts * R wide. */
typedef struct {
    const int64_t *slots;
    int64_t S, R;
} lora_rows;

/* Each part's rows in turn into its columns of out [M, N], as blocks.quant_linear; 0, or -1
 * (out of memory, or a kernel refused). */
static int linear_parts(int is_bf16, const int64_t *desc, const void *bias, const void *in,
                        void *out, int64_t M, int64_t N, int64_t K, int64_t num_threads) {
    const int64_t es = is_bf16 ? 2 : 4;
    char *tmp = M > 1 ? malloc((size_t)(M * N * es)) : NULL; /* one row: straight into out */
    if (M > 1 && !tmp) return -1;
    int rc = 0;
    for (int64_t p = 0, r0 = 0; p < desc[0] && rc == 0; r0 += desc[1 + 5 * p + 4], p++) {
        const int64_t *d = desc + 1 + 5 * p, rows = d[4];
        char *y = tmp ? tmp : (char *)out + r0 * es;
        rc = quant_linear((int)d[0], is_bf16, in, (const void *)d[1], (const void *)d[2],
                          (const void *)d[3], bias ? (const char *)bias + r0 * es : NULL, y, M,
                          rows, K, num_threads);
        for (int64_t m = 0; tmp && m < M; m++)
            memcpy((char *)out + (m * N + r0) * es, tmp + m * rows * es, (size_t)(rows * es));
    }
    free(tmp);
    return rc;
}

/* The linear layer whose columns start at `col`: skinny_linear or quant_linear, then its
 * adapters' products for the step's LoRA rows, as Linear.forward. */
static int linear(int is_bf16, const int64_t *w, int col, const void *bias, const void *in,
                  void *out, int64_t M, int64_t N, int64_t K, int64_t num_threads,
                  const lora_rows *lora, int64_t parts) {
    const int64_t fmt = w[col + 1];
    int rc;
    if (fmt == 0)
        rc = skinny_linear(is_bf16, in, (const void *)w[col], bias, out, M, N, K, num_threads);
    else if (fmt == FMT_PARTS)
        rc = linear_parts(is_bf16, (const int64_t *)w[col], bias, in, out, M, N, K, num_threads);
    else
        rc = quant_linear((int)fmt, is_bf16, in, (const void *)w[col], (const void *)w[col + 2],
                          (const void *)w[col + 3], bias, out, M, N, K, num_threads);
    if (rc != 0 || lora->slots == NULL || w[col + 4] == 0) return rc;
    return lora_add(is_bf16, in, out, M, N, K, (const void *)w[col + 4], (const void *)w[col + 5],
                    lora->S, parts * lora->R, lora->slots, num_threads);
}

#define MAX_DENSE_ROWS 16 /* skinny_linear's limit; quant_linear has none */

/* float32 products kept apart from the sum: with -ffp-contract the compiler would fuse
 * x * c + r * s into one FMA, one rounding fewer than PyTorch's mul, mul, add. */
static float mul_f32(float a, float b) {
    volatile float p = a * b;
    return p;
}

/* RoPE (Su et al., 2021) in HF's rotate_half form over n heads of size D, in place. */
static void rope(int is_bf16, void *heads, int64_t n, int64_t D, const void *cos,
                 const void *sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < n; h++) {
        if (is_bf16) {
            uint16_t *x = (uint16_t *)heads + h * D, r[256];
            const uint16_t *c = cos, *s = sin;
            for (int64_t d = 0; d < D; d++) {
                const float rot = d < half ? -bf16_to_f32(x[d + half]) : bf16_to_f32(x[d - half]);
                const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[d]) * bf16_to_f32(c[d])));
                const float b = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(s[d])));
                r[d] = f32_to_bf16(a + b);
            }
            memcpy(x, r, (size_t)D * 2);
        } else {
            float *x = (float *)heads + h * D, r[256];
            const float *c = cos, *s = sin;
            for (int64_t d = 0; d < D; d++) {
                const float rot = d < half ? -x[d + half] : x[d - half];
                r[d] = mul_f32(x[d], c[d]) + mul_f32(rot, s[d]);
            }
            memcpy(x, r, (size_t)D * 4);
        }
    }
}

static void add_in_place(int is_bf16, void *x, const void *y, int64_t n) {
    if (is_bf16) {
        uint16_t *a = x;
        const uint16_t *b = y;
        for (int64_t i = 0; i < n; i++) a[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
    } else {
        float *a = x;
        const float *b = y;
        for (int64_t i = 0; i < n; i++) a[i] += b[i];
    }
}

/* Returns 0; -1 where the kernels do not take these shapes (M, D, grouping: checked before
 * anything is changed); -2 if a slot lies outside the cache (the caller raises IndexError, as
 * for reshape_and_cache); -3 if memory ran out part way (the caller raises MemoryError). */
int decode_layers(int is_bf16, int kv_fmt, void *x, int64_t M, const int64_t *layers, int64_t num_layers,
                  int64_t hidden, int64_t H, int64_t Hkv, int64_t D, int64_t inter, float eps,
                  int64_t act, int64_t norm_f32, const void *cos, const void *sin,
                  const void *cos_local, const void *sin_local, const int64_t *slots, const int64_t *tables,
                  int64_t table_width, const int64_t *seq_lens, int64_t num_blocks, int64_t BS,
                  float scale, int64_t num_threads, int64_t min_keys,
                  const int64_t *lora_slots, int64_t lora_S, int64_t lora_R) {
    const lora_rows lora = {lora_slots, lora_S, lora_R};
    const int nf = (int)norm_f32;
    /* the limits of skinny_linear (rows), the decode kernel (head size, grouping), rope */
    if (M < 1 || D > 256 || D % 2 || Hkv < 1 || H % Hkv || H / Hkv > 16) return -1;
    for (int64_t l = 0; l < num_layers && M > MAX_DENSE_ROWS; l++) {
        const int64_t *w = layers + l * LAYER_PTRS;
        if (w[QKV_FMT] == 0 || w[O_FMT] == 0 || w[GU_FMT] == 0 || w[DOWN_FMT] == 0) return -1;
    }
    const int64_t es = is_bf16 ? 2 : 4, qkv_n = (H + 2 * Hkv) * D;
    char *buf = malloc((size_t)(M * (hidden + qkv_n + 2 * H * D + hidden + 3 * inter) * es));
    if (!buf) return -1;
    char *h = buf, *qkv = h + M * hidden * es, *q = qkv + M * qkv_n * es;
    char *attn = q + M * H * D * es, *o = attn + M * H * D * es, *gu = o + M * hidden * es;
    char *gated = gu + M * 2 * inter * es;
    int rc = 0;
#define CHECK(call, code) \
    if ((call) != 0) {    \
        rc = (code);      \
        break;            \
    }
#define NORM(in, col, out, rows, size) \
    rms_norm(is_bf16, nf, in, (const void *)w[col], out, rows, size, eps, num_threads)
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *w = layers + l * LAYER_PTRS;
        void *kv = (void *)w[KV_CACHE];
        const int local = w[LOCAL_ROPE] != 0 && cos_local != NULL;
        const char *c = local ? cos_local : cos, *s = local ? sin_local : sin;
        NORM(x, IN_NORM, h, M, hidden);
        CHECK(linear(is_bf16, w, QKV, (const void *)w[QKV_BIAS], h, qkv, M, qkv_n, hidden,
                     num_threads, &lora, 3), -3);
        for (int64_t m = 0; m < M; m++) {
            char *row = qkv + m * qkv_n * es;
            if (w[Q_NORM] != 0) { /* in place: each row is read before it is written */
                NORM(row, Q_NORM, row, H, D);
                NORM(row + H * D * es, K_NORM, row + H * D * es, Hkv, D);
            }
            rope(is_bf16, row, H + Hkv, D, c + m * D * es, s + m * D * es);
            memcpy(q + m * H * D * es, row, (size_t)(H * D * es));
        }
        CHECK(reshape_and_cache(is_bf16, kv_fmt, qkv + H * D * es, qkv_n, qkv + (H + Hkv) * D * es, qkv_n,
                                kv, slots, M, Hkv, D, num_blocks, BS), -2);
        CHECK(paged_decode_attention(is_bf16, kv_fmt, q, kv, tables, seq_lens, attn, M, H, Hkv, D,
                                     num_blocks, BS, table_width, scale, num_threads, min_keys,
                                     w[WINDOW]),
              -3);
        CHECK(linear(is_bf16, w, O_PROJ, NULL, attn, o, M, hidden, H * D, num_threads, &lora, 1),
              -3);
        if (w[PRE_FF_NORM] != 0) { /* sandwich norms: the attention's output normed, then added */
            NORM(o, POST_NORM, o, M, hidden);
            add_in_place(is_bf16, x, o, M * hidden);
            NORM(x, PRE_FF_NORM, h, M, hidden);
        } else {
            add_in_place(is_bf16, x, o, M * hidden);
            NORM(x, POST_NORM, h, M, hidden);
        }
        CHECK(linear(is_bf16, w, GATE_UP, NULL, h, gu, M, 2 * inter, hidden, num_threads, &lora,
                     2), -3);
        act_and_mul((int)act, is_bf16, gu, gated, M, inter, num_threads);
        CHECK(linear(is_bf16, w, DOWN, NULL, gated, o, M, hidden, inter, num_threads, &lora, 1),
              -3);
        if (w[POST_FF_NORM] != 0) NORM(o, POST_FF_NORM, o, M, hidden);
        add_in_place(is_bf16, x, o, M * hidden);
    }
#undef NORM
#undef CHECK
    free(buf);
    return rc;
}
