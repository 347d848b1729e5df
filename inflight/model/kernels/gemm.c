/* Dense linear layer for prompt rows: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W packed
 * once (gemm_pack), for the hundreds of rows a prompt brings at once.
 *
 * Why not oneDNN's GEMM: with AMX tiles oneDNN picks its kernel and its K-blocking by the row
 * count, so a prompt row's result changed with the rows beside it (16 rows alone against
 * the same rows inside 400, bfloat16 and float32, on a Xeon with AMX; issue 50), and a
 * prompt's tokens then depended on how it was cut into chunks, a prefix-cache hit, or the
 * batch. Here every output element is one chain of products accumulated over k in
 * ascending order, starting from zero, whatever M is, where the row sits among the M, the
 * thread count or the path's register blocking: a row is the same bits in a call of one row
 * or of 4,000 (tests/model/test_batch_invariance.py, on each path this CPU can run).
 *
 * Paths (gemm_path, capped by gemm_max_path: INFLIGHT_CPU_AMX=0 caps at 2):
 *   3  AMX-BF16 (bfloat16 only): tdpbf16ps, 32 x 32 outputs from four tile products a
 *      32-value step of K; each product's sums run in the tile unit in a fixed order
 *   2  AVX-512: float32 by FMA; bfloat16 pairs by vdpbf16ps (AVX512_BF16), else widened
 *   1  AVX2 + FMA: float32 by FMA; bfloat16 widened to float32
 *   0  plain C (fmaf)
 * Paths give different bits from one another (their sums differ in order or rounding) and
 * each gives a row the same bits in any batch.
 *
 * Layout (gemm_pack), panels of NR = 32 weight rows, N padded with zero rows:
 *   float32   [N/32][K][32]:                 panel p, k, lane c  = W[32p + c][k]
 *   bfloat16  [N/32][Kp/32][2][16][16][2]:   panel p, step s, tile g, pair r, lane n, e
 *             = W[32p + 16g + n][32s + 2r + e] (K padded with zeros to Kp, a multiple of
 *             32): tdpbf16ps's B tile, one 64-byte row a pair of k, which is also the
 *             vector paths' operand (a register is a row of 16 lanes of pairs).
 *   x, y, bias: float32 or bfloat16 (uint16 bits), rows contiguous; y rounded once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "team.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NR 32       /* weight rows (output columns) a panel */
#define KSTEP 32    /* bfloat16: values of K a tile step */
#define MB 32       /* input rows an AMX block (two A tiles) */

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

int64_t gemm_packed_size(int is_bf16, int64_t N, int64_t K) {
    return round_up(N, NR) * (is_bf16 ? round_up(K, KSTEP) : K);
}

int gemm_pack(int is_bf16, const void *w, void *packed, int64_t N, int64_t K) {
    if (N < 1 || K < 1) return -1;
    const int64_t panels = round_up(N, NR) / NR;
    if (!is_bf16) {
        const float *wf = w;
        float *out = packed;
        for (int64_t p = 0; p < panels; p++)
            for (int64_t k = 0; k < K; k++)
                for (int64_t c = 0; c < NR; c++) {
                    const int64_t row = p * NR + c;
                    *out++ = row < N ? wf[row * K + k] : 0.f;
                }
        return 0;
    }
    const uint16_t *wb = w;
    uint16_t *out = packed;
    const int64_t steps = round_up(K, KSTEP) / KSTEP;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t s = 0; s < steps; s++)
            for (int64_t g = 0; g < 2; g++)
                for (int64_t r = 0; r < 16; r++)
                    for (int64_t n = 0; n < 16; n++)
                        for (int64_t e = 0; e < 2; e++) {
                            const int64_t row = p * NR + 16 * g + n, k = s * KSTEP + 2 * r + e;
                            *out++ = row < N && k < K ? wb[row * K + k] : 0;
                        }
    return 0;
}

/* ---- Storing results: rows of up to NR float32 sums into y, bias added, rounded once. ---- */

#ifdef __AVX512F__
/* f32_to_bf16 (bf16.h) on 16 lanes, to the bit (NaN quieted the same way). */
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, q));
}

/* 16 sums (v) into y's row at columns [c0, c0 + 16) that exist (< N). */
static inline void store16(int is_bf16, void *yrow, const float *v, const void *bias, int64_t c0,
                           int64_t N) {
    if (c0 >= N) return;
    const __mmask16 mask = N - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - c0)) - 1);
    __m512 s = _mm512_loadu_ps(v);
    if (is_bf16) {
        if (bias)
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(mask, (const uint16_t *)bias + c0)), 16)));
        _mm256_mask_storeu_epi16((uint16_t *)yrow + c0, mask, bf16x16(s));
    } else {
        if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, (const float *)bias + c0));
        _mm512_mask_storeu_ps((float *)yrow + c0, mask, s);
    }
}
#else
static inline void store16(int is_bf16, void *yrow, const float *v, const void *bias, int64_t c0,
                           int64_t N) {
    for (int64_t c = c0; c < c0 + 16 && c < N; c++) store_output(is_bf16, yrow, c, v[c - c0], bias, c);
}
#endif

/* Rows [0, mm) of out (row m at out + m * NR) into y's rows m0 + m, columns [c0, c0 + NR). */
static void store_rows(int is_bf16, void *y, const float *out, int64_t m0, int64_t mm, int64_t N,
                       int64_t c0, const void *bias) {
    const int64_t elem = is_bf16 ? 2 : 4;
    for (int64_t m = 0; m < mm; m++) {
        char *yrow = (char *)y + (m0 + m) * N * elem;
        store16(is_bf16, yrow, out + m * NR, bias, c0, N);
        store16(is_bf16, yrow, out + m * NR + 16, bias, c0 + 16, N);
    }
}

/* ---- Vector paths: MR input rows x one panel in registers, k ascending. ---- */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

/* A block of MM input rows (a, lda elements apart) against NV vectors of VL columns of one
 * panel from column col, into out[MM][NR] at the same columns. float32: acc += a[m][k] *
 * W[c][k] for k = 0 .. K-1, one FMA each. bfloat16 widened: the same chain over the pairs'
 * two values in k order. bfloat16 by vdpbf16ps: one instruction a pair of k (its own order
 * within the pair, the same for every row). Which routine runs depends on MM, never on a
 * row's neighbours' values, and every MM runs the same chain. */
#define DEFINE_F32_BLOCK(NAME, VEC, VL, NV, LOAD, SET1, FMA, ZERO, STORE, MM)                   \
static void NAME(const float *a, int64_t lda, const float *b, int64_t K, int64_t Kp, int col, \
                 float *out) {                                                              \
    (void)Kp;                                                                               \
    VEC acc[MM][NV];                                                                        \
    for (int m = 0; m < MM; m++)                                                            \
        for (int v = 0; v < NV; v++) acc[m][v] = ZERO();                                    \
    for (int64_t k = 0; k < K; k++) {                                                       \
        VEC bv[NV];                                                                         \
        for (int v = 0; v < NV; v++) bv[v] = LOAD(b + k * NR + col + v * VL);               \
        for (int m = 0; m < MM; m++) {                                                      \
            const VEC av = SET1(a[m * lda + k]);                                            \
            for (int v = 0; v < NV; v++) acc[m][v] = FMA(av, bv[v], acc[m][v]);             \
        }                                                                                   \
    }                                                                                       \
    for (int m = 0; m < MM; m++)                                                            \
        for (int v = 0; v < NV; v++) STORE(out + m * NR + col + v * VL, acc[m][v]);         \
}

/* bfloat16 weights and inputs, each pair of k widened: lanes of a 64-byte row are (k even,
 * k odd) pairs; the even value is the lane shifted left 16 bits, the odd one the lane with
 * its low half cleared. NV vectors of VL lanes from column col (a tile row is 16 lanes). */
#define DEFINE_BF16W_BLOCK(NAME, VEC, IVEC, VL, NV, LOADI, SHL16, HIGH16, SET1, FMA, ZERO, STORE, MM) \
static void NAME(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t K, int64_t Kp,     \
                 int col, float *out) {                                                     \
    (void)K;                                                                                \
    VEC acc[MM][NV];                                                                        \
    for (int m = 0; m < MM; m++)                                                            \
        for (int v = 0; v < NV; v++) acc[m][v] = ZERO();                                    \
    for (int64_t s = 0; s < Kp / KSTEP; s++)                                                \
        for (int r = 0; r < 16; r++) {                                                      \
            VEC lo[NV], hi[NV];                                                             \
            for (int v = 0; v < NV; v++) {                                                  \
                const int c = col + v * VL, g = c / 16;                                     \
                const IVEC u = LOADI(b + ((s * 2 + g) * 16 + r) * 32 + (c % 16) * 2);       \
                lo[v] = SHL16(u);                                                           \
                hi[v] = HIGH16(u);                                                          \
            }                                                                               \
            for (int m = 0; m < MM; m++) {                                                  \
                const int64_t k = s * KSTEP + 2 * r;                                        \
                const VEC a0 = SET1(bf16_to_f32(a[m * lda + k]));                           \
                const VEC a1 = SET1(bf16_to_f32(a[m * lda + k + 1]));                       \
                for (int v = 0; v < NV; v++) acc[m][v] = FMA(a0, lo[v], acc[m][v]);         \
                for (int v = 0; v < NV; v++) acc[m][v] = FMA(a1, hi[v], acc[m][v]);         \
            }                                                                               \
        }                                                                                   \
    for (int m = 0; m < MM; m++)                                                            \
        for (int v = 0; v < NV; v++) STORE(out + m * NR + col + v * VL, acc[m][v]);         \
}

typedef void (*f32_block_fn)(const float *, int64_t, const float *, int64_t, int64_t, int, float *);
typedef void (*bf16_block_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, int,
                              float *);

/* A path's routines: up to mr rows (index: rows) over cols columns a call. */
struct vector_path {
    int mr, cols;
    const f32_block_fn *f32;
    const bf16_block_fn *bf16;
};

/* One thread's panels [lo, hi), input rows in blocks of mr (the tail a smaller routine),
 * each block over the panel's columns in runs of the routine's width. */
static void vector_share(int is_bf16, const void *x, int64_t lda, const void *packed,
                         const void *bias, void *y, int64_t M, int64_t N, int64_t K, int64_t Kp,
                         int64_t lo, int64_t hi, const struct vector_path *path) {
    float out[16 * NR];
    const int64_t panel = NR * (is_bf16 ? Kp : K);
    for (int64_t p = lo; p < hi; p++)
        for (int64_t m0 = 0; m0 < M; m0 += path->mr) {
            const int64_t mm = M - m0 < path->mr ? M - m0 : path->mr;
            for (int col = 0; col < NR; col += path->cols) {
                if (is_bf16)
                    path->bf16[mm]((const uint16_t *)x + m0 * lda, lda,
                                   (const uint16_t *)packed + p * panel, K, Kp, col, out);
                else
                    path->f32[mm]((const float *)x + m0 * lda, lda,
                                  (const float *)packed + p * panel, K, Kp, col, out);
            }
            store_rows(is_bf16, y, out, m0, mm, N, p * NR, bias);
        }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define V2_LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define V2_SHL16(u) _mm256_castsi256_ps(_mm256_slli_epi32(u, 16))
#define V2_HIGH16(u) _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)))
/* 16 vector registers: 16 columns (2 vectors) of 6 rows' sums (bfloat16: 4 rows, and the
 * widened pairs' 4), the panel's 2 and a broadcast. */
#define DEF_AVX2_F32(MM) DEFINE_F32_BLOCK(avx2_f32_##MM, __m256, 8, 2, _mm256_loadu_ps,      \
                                          _mm256_set1_ps, _mm256_fmadd_ps, _mm256_setzero_ps, \
                                          _mm256_storeu_ps, MM)
#define DEF_AVX2_BF16(MM) DEFINE_BF16W_BLOCK(avx2_bf16_##MM, __m256, __m256i, 8, 2, V2_LOADI, \
                                             V2_SHL16, V2_HIGH16, _mm256_set1_ps,             \
                                             _mm256_fmadd_ps, _mm256_setzero_ps,              \
                                             _mm256_storeu_ps, MM)
DEF_AVX2_F32(1) DEF_AVX2_F32(2) DEF_AVX2_F32(3) DEF_AVX2_F32(4) DEF_AVX2_F32(5) DEF_AVX2_F32(6)
DEF_AVX2_BF16(1) DEF_AVX2_BF16(2) DEF_AVX2_BF16(3) DEF_AVX2_BF16(4)
static const f32_block_fn AVX2_F32[7] = {0, avx2_f32_1, avx2_f32_2, avx2_f32_3, avx2_f32_4,
                                         avx2_f32_5, avx2_f32_6};
static const bf16_block_fn AVX2_BF16[5] = {0, avx2_bf16_1, avx2_bf16_2, avx2_bf16_3, avx2_bf16_4};
static const struct vector_path AVX2_F32_PATH = {6, 16, AVX2_F32, AVX2_BF16};
static const struct vector_path AVX2_BF16_PATH = {4, 16, AVX2_F32, AVX2_BF16};
#endif

#ifdef __AVX512F__
#define V5_LOADI(p) _mm512_loadu_si512((const void *)(p))
#define V5_SHL16(u) _mm512_castsi512_ps(_mm512_slli_epi32(u, 16))
#define V5_HIGH16(u) _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)))
/* 32 vector registers: 12 rows x 2 vectors of sums, the panel's 2 and a broadcast. */
#define AVX512_MR 12
#define DEF_AVX512_F32(MM) DEFINE_F32_BLOCK(avx512_f32_##MM, __m512, 16, 2, _mm512_loadu_ps,    \
                                            _mm512_set1_ps, _mm512_fmadd_ps, _mm512_setzero_ps, \
                                            _mm512_storeu_ps, MM)
DEF_AVX512_F32(1) DEF_AVX512_F32(2) DEF_AVX512_F32(3) DEF_AVX512_F32(4) DEF_AVX512_F32(5)
DEF_AVX512_F32(6) DEF_AVX512_F32(7) DEF_AVX512_F32(8) DEF_AVX512_F32(9) DEF_AVX512_F32(10)
DEF_AVX512_F32(11) DEF_AVX512_F32(12)
static const f32_block_fn AVX512_F32[AVX512_MR + 1] = {
    0, avx512_f32_1, avx512_f32_2, avx512_f32_3, avx512_f32_4, avx512_f32_5, avx512_f32_6,
    avx512_f32_7, avx512_f32_8, avx512_f32_9, avx512_f32_10, avx512_f32_11, avx512_f32_12};
#ifdef __AVX512BF16__
/* vdpbf16ps: a lane adds its pair's two products (k odd, then k even: Intel SDM) to its sum. */
#define DEF_DPBF16(MM)                                                                       \
static void avx512_bf16_##MM(const uint16_t *a, int64_t lda, const uint16_t *b, int64_t K,   \
                             int64_t Kp, int col, float *out) {                             \
    (void)K, (void)col;                                                                     \
    __m512 acc[MM][2];                                                                      \
    for (int m = 0; m < MM; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();                \
    for (int64_t s = 0; s < Kp / KSTEP; s++)                                                \
        for (int r = 0; r < 16; r++) {                                                      \
            const __m512bh b0 = (__m512bh)V5_LOADI(b + ((s * 2) * 16 + r) * 32);             \
            const __m512bh b1 = (__m512bh)V5_LOADI(b + ((s * 2 + 1) * 16 + r) * 32);         \
            for (int m = 0; m < MM; m++) {                                                  \
                int32_t pair;                                                               \
                memcpy(&pair, a + m * lda + s * KSTEP + 2 * r, 4);                          \
                const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);                      \
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], b0, av);                            \
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], b1, av);                            \
            }                                                                               \
        }                                                                                   \
    for (int m = 0; m < MM; m++) {                                                          \
        _mm512_storeu_ps(out + m * NR, acc[m][0]);                                          \
        _mm512_storeu_ps(out + m * NR + 16, acc[m][1]);                                     \
    }                                                                                       \
}
#else
#define DEF_DPBF16(MM) DEFINE_BF16W_BLOCK(avx512_bf16_##MM, __m512, __m512i, 16, 2, V5_LOADI,   \
                                          V5_SHL16, V5_HIGH16, _mm512_set1_ps, _mm512_fmadd_ps, \
                                          _mm512_setzero_ps, _mm512_storeu_ps, MM)
#endif
DEF_DPBF16(1) DEF_DPBF16(2) DEF_DPBF16(3) DEF_DPBF16(4) DEF_DPBF16(5) DEF_DPBF16(6)
DEF_DPBF16(7) DEF_DPBF16(8) DEF_DPBF16(9) DEF_DPBF16(10) DEF_DPBF16(11) DEF_DPBF16(12)
static const bf16_block_fn AVX512_BF16[AVX512_MR + 1] = {
    0, avx512_bf16_1, avx512_bf16_2, avx512_bf16_3, avx512_bf16_4, avx512_bf16_5,
    avx512_bf16_6, avx512_bf16_7, avx512_bf16_8, avx512_bf16_9, avx512_bf16_10,
    avx512_bf16_11, avx512_bf16_12};
static const struct vector_path AVX512_PATH = {AVX512_MR, NR, AVX512_F32, AVX512_BF16};
#endif

/* ---- Plain C: each output one fmaf chain over k (the vector paths' order for float32). ---- */

static void scalar_share(int is_bf16, const void *x, int64_t lda, const void *packed,
                         const void *bias, void *y, int64_t M, int64_t N, int64_t K, int64_t Kp,
                         int64_t lo, int64_t hi) {
    float out[NR];
    for (int64_t p = lo; p < hi; p++)
        for (int64_t m = 0; m < M; m++) {
            for (int64_t c = 0; c < NR; c++) {
                float acc = 0.f;
                if (is_bf16) {
                    const uint16_t *b = (const uint16_t *)packed + p * NR * Kp;
                    const uint16_t *a = (const uint16_t *)x + m * lda;
                    const int64_t g = c / 16, n = c % 16;
                    for (int64_t k = 0; k < Kp; k++)
                        acc = fmaf(bf16_to_f32(a[k]),
                                   bf16_to_f32(b[((k / KSTEP * 2 + g) * 16 + k % KSTEP / 2) * 32 + 2 * n + k % 2]),
                                   acc);
                } else {
                    const float *b = (const float *)packed + p * NR * K;
                    for (int64_t k = 0; k < K; k++)
                        acc = fmaf(((const float *)x)[m * lda + k], b[k * NR + c], acc);
                }
                out[c] = acc;
            }
            store_rows(is_bf16, y, out, m, 1, N, p * NR, bias);
        }
}

/* ---- AMX-BF16 ---- */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX_BF16 1
#include "amx.h"

/* tmm0-3: C[h][g] (input half h, weight tile g), 16 rows of 16 float32; tmm4, tmm5: A, 16
 * rows of 32 bfloat16; tmm6, tmm7: B, 16 pairs of 16 lanes. Rows of a short block's last
 * tile come from a zero-padded copy, so the configuration never changes within a call. */
static void configure_tiles(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    load_tile_config(&c);
}

/* Weight bytes of a group of panels that every block of input rows passes over, kept in L2
 * while a block's A tiles stay in L1 (half a 2 MB L2: the rest holds the input rows). */
#define GROUP_BYTES (1 << 20)

/* A block's four C tiles as stored, waiting to be rounded into y (mm = 0: none). */
struct c_block {
    _Alignas(64) float out[4][16 * 16];
    int64_t mm, m0, c0;
};

/* Rows [from, to) of a stored block into y: bias added, rounded once. */
static inline void store_block_rows(const struct c_block *c, int64_t from, int64_t to,
                                    const void *bias, void *y, int64_t N) {
    to = to < c->mm ? to : c->mm;
    for (int64_t m = from; m < to; m++) {
        char *yrow = (char *)y + (c->m0 + m) * N * 2;
        store16(1, yrow, c->out[2 * (m / 16)] + (m % 16) * 16, bias, c->c0, N);
        store16(1, yrow, c->out[2 * (m / 16) + 1] + (m % 16) * 16, bias, c->c0 + 16, N);
    }
}

/* One block of up to 32 input rows (a: ld elements apart) against one panel's 2 x Kp/32
 * tiles (bp), stored into cur. The previous block's rows are rounded into y a few a step
 * while this block's products run in the tile unit (the vector units are free then): the
 * rounding costs about a third of a block at K = 576 when it runs alone. */
static inline void amx_block(const uint16_t *a, int64_t ld, const uint16_t *bp, int64_t steps,
                             int64_t mm, const struct c_block *prev, struct c_block *cur,
                             const void *bias, void *y, int64_t N) {
    const int two = mm > 16;
    const int64_t chunk = (prev->mm + steps - 1) / steps;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        _tile_loadd(6, bp + s * 1024, 64);
        _tile_loadd(7, bp + s * 1024 + 512, 64);
        _tile_loadd(4, a + s * KSTEP, ld * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a + 16 * ld + s * KSTEP, ld * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        store_block_rows(prev, s * chunk, (s + 1) * chunk, bias, y, N);
    }
    _tile_stored(0, cur->out[0], 64);
    _tile_stored(1, cur->out[1], 64);
    if (two) {
        _tile_stored(2, cur->out[2], 64);
        _tile_stored(3, cur->out[3], 64);
    }
    cur->mm = mm;
}

/* One thread's panels [lo, hi), in groups of GROUP_BYTES: for each group, every block of 32
 * input rows (rows m0 .. of x, lda elements apart; the last short block from tail) against
 * each of the group's panels. */
static void amx_share(const uint16_t *x, int64_t lda, const uint16_t *tail, int64_t full_rows,
                      const uint16_t *packed, const void *bias, void *y, int64_t M, int64_t N,
                      int64_t Kp, int64_t lo, int64_t hi) {
    const int64_t steps = Kp / KSTEP;
    int64_t group = GROUP_BYTES / (NR * Kp * 2);
    group = group > 1 ? group : 1;
    struct c_block blocks[2];
    int cur = 0;
    blocks[1].mm = 0;
    configure_tiles();
    for (int64_t g0 = lo; g0 < hi; g0 += group) {
        const int64_t g1 = g0 + group < hi ? g0 + group : hi;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t mm = M - m0 < MB ? M - m0 : MB;
            const int64_t ld = m0 < full_rows ? lda : Kp; /* elements between rows */
            const uint16_t *a = m0 < full_rows ? x + m0 * lda : tail;
            for (int64_t p = g0; p < g1; p++) {
                blocks[cur].m0 = m0, blocks[cur].c0 = p * NR;
                amx_block(a, ld, packed + p * NR * Kp, steps, mm, &blocks[1 - cur], &blocks[cur],
                          bias, y, N);
                cur = 1 - cur;
            }
        }
    }
    store_block_rows(&blocks[1 - cur], 0, MB, bias, y, N);
    _tile_release(); /* oneDNN configures its own on its next call */
}
#endif

/* ---- Entry points ---- */

static int64_t max_path = 3;

int64_t gemm_max_path(int64_t path) {
    const int64_t before = max_path;
    if (path >= 0) max_path = path;
    return before;
}

int64_t gemm_path(int is_bf16) {
    int64_t p = 0;
#if defined(__AVX2__) && defined(__FMA__)
    p = 1;
#endif
#ifdef __AVX512F__
    p = 2;
#endif
#ifdef HAVE_AMX_BF16
    if (is_bf16 && amx_permitted()) p = 3;
#else
    (void)is_bf16;
#endif
    return p < max_path ? p : max_path;
}

/* Returns 0; -1 for empty shapes or no memory (the caller then uses PyTorch). */
int gemm_linear(int is_bf16, const void *x, const void *packed, const void *bias, void *y,
                int64_t M, int64_t N, int64_t K, int64_t num_threads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    const int64_t path = gemm_path(is_bf16), panels = round_up(N, NR) / NR;
    const int64_t Kp = is_bf16 ? round_up(K, KSTEP) : K;
    /* bfloat16 rows read whole steps of K: a K that is not a multiple of 32 reads a padded
     * copy of x. AMX reads 32 rows a block: a short last block reads a padded copy. */
    const int64_t full_rows = path == 3 ? M / MB * MB : M;
    uint16_t *pad = NULL, *tail = NULL; /* tail: read by the AMX path alone */
    const void *a = x;
    int64_t lda = K;
    if (is_bf16 && (Kp != K || full_rows < M)) {
        const int64_t copied = Kp != K ? M : M - full_rows;
        const int64_t first = M - copied;
        pad = calloc((size_t)(round_up(copied, MB) * Kp), 2);
        if (!pad) return -1;
        for (int64_t m = 0; m < copied; m++)
            memcpy(pad + m * Kp, (const uint16_t *)x + (first + m) * K, (size_t)K * 2);
        if (Kp != K) a = pad, lda = Kp;
        tail = pad + (full_rows - first) * Kp;
    }
    int64_t nt = num_threads < panels ? num_threads : panels;
    nt = nt > 1 ? nt : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t t = team_thread(), n = team_size();
        const int64_t lo = panels * t / n, hi = panels * (t + 1) / n;
        switch (path) {
#ifdef HAVE_AMX_BF16
        case 3:
            amx_share(a, lda, tail, full_rows, packed, bias, y, M, N, Kp, lo, hi);
            break;
#endif
#ifdef __AVX512F__
        case 2:
            vector_share(is_bf16, a, lda, packed, bias, y, M, N, K, Kp, lo, hi, &AVX512_PATH);
            break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
        case 1:
            vector_share(is_bf16, a, lda, packed, bias, y, M, N, K, Kp, lo, hi,
                         is_bf16 ? &AVX2_BF16_PATH : &AVX2_F32_PATH);
            break;
#endif
        default:
            scalar_share(is_bf16, a, lda, packed, bias, y, M, N, K, Kp, lo, hi);
        }
    }
    (void)tail;
    free(pad);
    return 0;
}
