/* LoRA's low-rank products added to a linear layer's output, each row by its own adapter
 * (multi-LoRA in the flattened batch, as Punica's SGMV and S-LoRA).
 *
 *   x          [M, K]    the layer's input, float32 or bfloat16 (uint16 bits)
 *   y          [M, N]    its output, x's type, updated: y[m] += (x[m] @ A_s) @ B_s
 *   at         [K, S*W]  A transposed, x's type: slot s holds columns s*W .. s*W + W - 1
 *                        (an adapter's ranks first, zeros past them)
 *   b          [S*W, N]  B transposed likewise, the adapter's scaling folded in
 *   row_slots  [M]       int64, each row's slot, -1 for a base-model row (left as it is)
 *
 * Rows of one slot go in groups of up to four, which share each load of A and B; every row's
 * arithmetic is the same whatever its group, the batch or the thread count, so its result is
 * the same bits in any batch (batch invariance, docs/architecture.md): x[m] @ A_s summed over
 * k in order into W float32 accumulators, then those times B's rows summed over j in order
 * into a float32 row, added to y (in bfloat16: the delta rounded once, then the sum, as
 * PyTorch's y + delta.to(bfloat16)). A zero product (a padding column) is skipped: the sum
 * is the same without it.
 */
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"

#define MAX_WIDTH 1024 /* W: parts x rank; wider slots go to PyTorch (returns -1) */
#define GROUP 4        /* rows sharing a load of A and B */
#define N_BLOCK 512    /* output columns per pass over B's rows, kept in L1 */

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float load_bf16(const uint16_t *p, int64_t i) { return bf16_to_f32(p[i]); }
static inline void store_f32(float *y, int64_t n, float d) { y[n] += d; }
static inline void store_bf16(uint16_t *y, int64_t n, float d) {
    y[n] = f32_to_bf16(bf16_to_f32(y[n]) + bf16_to_f32(f32_to_bf16(d)));
}

/* One group of G rows (ids `rows`) of slot s, for element type T. Both products take four
 * terms at a time into a register, in the order of the plain loops (same bits); a row's
 * block of four B rows whose four products are all zero is skipped. */
#define DEFINE_GROUP(SUF, T)                                                                   \
    static void group_##SUF(const T *x, T *y, const int64_t *rows, int64_t G, int64_t N,      \
                            int64_t K, const T *at, const T *b, int64_t S, int64_t W,         \
                            int64_t s) {                                                       \
        float xa[GROUP][MAX_WIDTH + 3], d[GROUP][N_BLOCK];                                     \
        const int64_t W4 = (W + 3) / 4 * 4, stride = S * W;                                    \
        for (int64_t g = 0; g < G; g++)                                                        \
            for (int64_t j = 0; j < W4; j++) xa[g][j] = 0.f;                                   \
        int64_t k = 0;                                                                         \
        for (; k + 4 <= K; k += 4) {                                                           \
            const T *a0 = at + k * stride + s * W, *a1 = a0 + stride, *a2 = a1 + stride,      \
                    *a3 = a2 + stride;                                                         \
            for (int64_t g = 0; g < G; g++) {                                                  \
                const T *xr = x + rows[g] * K + k;                                             \
                const float v0 = load_##SUF(xr, 0), v1 = load_##SUF(xr, 1),                   \
                            v2 = load_##SUF(xr, 2), v3 = load_##SUF(xr, 3);                    \
                for (int64_t j = 0; j < W; j++) {                                              \
                    float t = xa[g][j];                                                        \
                    t += v0 * load_##SUF(a0, j);                                               \
                    t += v1 * load_##SUF(a1, j);                                               \
                    t += v2 * load_##SUF(a2, j);                                               \
                    t += v3 * load_##SUF(a3, j);                                               \
                    xa[g][j] = t;                                                              \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        for (; k < K; k++) {                                                                   \
            const T *a = at + k * stride + s * W;                                              \
            for (int64_t g = 0; g < G; g++) {                                                  \
                const float v = load_##SUF(x + rows[g] * K, k);                                \
                for (int64_t j = 0; j < W; j++) xa[g][j] += v * load_##SUF(a, j);              \
            }                                                                                  \
        }                                                                                      \
        for (int64_t n0 = 0; n0 < N; n0 += N_BLOCK) {                                          \
            const int64_t nn = N - n0 < N_BLOCK ? N - n0 : N_BLOCK;                            \
            for (int64_t g = 0; g < G; g++)                                                    \
                for (int64_t n = 0; n < nn; n++) d[g][n] = 0.f;                                \
            for (int64_t j = 0; j < W4; j += 4) {                                              \
                const int64_t row = s * W + j, tail = W - j; /* B rows past W read as zero */  \
                const T *b0 = b + row * N + n0, *b1 = b0 + N, *b2 = b1 + N, *b3 = b2 + N;      \
                for (int64_t g = 0; g < G; g++) {                                              \
                    const float c0 = xa[g][j], c1 = tail > 1 ? xa[g][j + 1] : 0.f,             \
                                c2 = tail > 2 ? xa[g][j + 2] : 0.f,                            \
                                c3 = tail > 3 ? xa[g][j + 3] : 0.f;                            \
                    if (c0 == 0.f && c1 == 0.f && c2 == 0.f && c3 == 0.f) continue;            \
                    float *dg = d[g];                                                          \
                    if (tail >= 4) {                                                           \
                        for (int64_t n = 0; n < nn; n++) {                                     \
                            float t = dg[n];                                                   \
                            t += c0 * load_##SUF(b0, n);                                       \
                            t += c1 * load_##SUF(b1, n);                                       \
                            t += c2 * load_##SUF(b2, n);                                       \
                            t += c3 * load_##SUF(b3, n);                                       \
                            dg[n] = t;                                                         \
                        }                                                                      \
                    } else {                                                                   \
                        const T *bj[3] = {b0, b1, b2};                                         \
                        const float cj[3] = {c0, c1, c2};                                      \
                        for (int64_t q = 0; q < tail; q++)                                     \
                            for (int64_t n = 0; n < nn; n++) dg[n] += cj[q] * load_##SUF(bj[q], n); \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int64_t g = 0; g < G; g++)                                                    \
                for (int64_t n = 0; n < nn; n++) store_##SUF(y + rows[g] * N + n0, n, d[g][n]); \
        }                                                                                      \
    }
DEFINE_GROUP(f32, float)
DEFINE_GROUP(bf16, uint16_t)

/* Returns 0; -1 for a width over MAX_WIDTH or a slot out of range (nothing changed); -3 out
 * of memory. */
int lora_add(int is_bf16, const void *x, void *y, int64_t M, int64_t N, int64_t K,
             const void *at, const void *b, int64_t S, int64_t W, const int64_t *row_slots,
             int64_t num_threads) {
    if (W < 1 || W > MAX_WIDTH) return -1;
    for (int64_t m = 0; m < M; m++)
        if (row_slots[m] >= S) return -1;
    /* rows by slot (counting sort, stable), then groups of up to GROUP rows of one slot */
    int64_t *order = malloc((size_t)(2 * M + S + 2) * sizeof(int64_t));
    if (!order) return -3;
    int64_t *group_start = order + M, *count = group_start + M + 1; /* [M], [M + 1], [S + 1] */
    for (int64_t s = 0; s <= S; s++) count[s] = 0;
    for (int64_t m = 0; m < M; m++)
        if (row_slots[m] >= 0) count[row_slots[m] + 1]++;
    for (int64_t s = 0; s < S; s++) count[s + 1] += count[s];
    const int64_t n_rows = count[S];
    for (int64_t m = 0; m < M; m++)
        if (row_slots[m] >= 0) order[count[row_slots[m]]++] = m;
    int64_t n_groups = 0;
    for (int64_t i = 0; i < n_rows;) {
        int64_t e = i + 1;
        while (e < n_rows && e - i < GROUP && row_slots[order[e]] == row_slots[order[i]]) e++;
        group_start[n_groups++] = i;
        i = e;
    }
    group_start[n_groups] = n_rows;
    int64_t nt = n_groups / 2 < num_threads ? n_groups / 2 : num_threads;
    nt = nt > 1 ? nt : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t i = 0; i < n_groups; i++) {
        const int64_t *rows = order + group_start[i];
        const int64_t G = group_start[i + 1] - group_start[i], s = row_slots[rows[0]];
        if (is_bf16)
            group_bf16(x, y, rows, G, N, K, at, b, S, W, s);
        else
            group_f32(x, y, rows, G, N, K, at, b, S, W, s);
    }
    free(order);
    return 0;
}
