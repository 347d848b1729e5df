/* Skinny linear layer for the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for a few rows
 * M, as in a decode step at small batch. There each weight is used M times per read, so the
 * step is bound by streaming W from DRAM. oneDNN's GEMM, built for many rows, reached 12-20
 * GB/s on the model's smaller weights (0.6-3.5 MB) where about 30 GB/s can be read
 * (docs/performance.md). This walks W once, row by row, in the layout nn.Linear keeps it,
 * every thread of PyTorch's OpenMP pool streaming its own contiguous run of rows (see
 * paged_attention.c on why the pool is PyTorch's). Prefetches may run past the end of W:
 * they are hints and never fault. Any M is taken: the model sends every generated token's
 * row here whatever the step holds (batch invariance, llama.py), more than a register
 * block of rows going in groups over blocks of W kept in L2 (dot_rows).
 *
 *   x  [M, K]   float32 or bfloat16 (uint16 bits), rows contiguous
 *   W  [N, K]   same element type;  bias [N] or NULL
 *   y  [M, N]   same element type; products accumulated in float32, one rounding at the end
 *               (as oneDNN's bfloat16 GEMM does)
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "team.h"

#define MAX_M 16
#define ROWS 1 /* weight rows per pass; see the AVX-512 section on why one */

/* Dot products of ROWS weight rows with each of the M input rows (xf: float32 copies), in
 * plain C: the portable path, and the tail when N or K is not a multiple of the vector. */
#define DEFINE_ROWS(NAME, T, LOAD)                                                           \
static void NAME(const T *restrict w, const float *restrict xf, int64_t M, int64_t K,       \
                 int64_t nr, float out[MAX_M][ROWS]) {                                      \
    for (int64_t m = 0; m < M; m++)                                                         \
        for (int64_t j = 0; j < nr; j++) {                                                  \
            const T *restrict wj = w + j * K;                                               \
            const float *restrict xm = xf + m * K;                                          \
            float a = 0.f;                                                                  \
            for (int64_t k = 0; k < K; k++) a += LOAD(wj[k]) * xm[k];                       \
            out[m][j] = a;                                                                  \
        }                                                                                   \
}

#define ID(x) (x)
DEFINE_ROWS(rows_f32, float, ID)
DEFINE_ROWS(rows_bf16, uint16_t, bf16_to_f32)

#ifdef __AVX512F__
#include <immintrin.h>
/* Prefetch the row this many ahead, past where the hardware streamer reaches. */
#define PF_ROWS 8
/* ROWS weight rows at once, 16 float32 lanes per step, M * ROWS accumulators. K % 16 == 0.
 * ROWS is 1: W is then read strictly in address order. Four rows side by side (four streams
 * one row apart, for four independent FMA chains) read the model's K = 576 weights at 21-23
 * GB/s; one row at a time, 32-35 GB/s (bf16, 2 threads, weights cycled through 256 MB). The
 * FMA latency is hidden anyway: the next row's chain is independent and runs out of order. */
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#define DEFINE_AVX512(NAME, T, LOADV, MM)                                                    \
static void NAME(const T *restrict w, const float *restrict xf, int64_t K,                   \
                 float out[MAX_M][ROWS]) {                                                  \
    __m512 acc[MM][ROWS];                                                                   \
    for (int m = 0; m < MM; m++)                                                            \
        for (int j = 0; j < ROWS; j++) acc[m][j] = _mm512_setzero_ps();                     \
    for (int64_t k = 0; k < K; k += 16) {                                                   \
        __m512 wv[ROWS];                                                                    \
        for (int j = 0; j < ROWS; j++) {                                                    \
            wv[j] = LOADV(w + j * K + k);                                                   \
            _mm_prefetch((const char *)(w + (j + PF_ROWS) * K + k), _MM_HINT_T0);           \
        }                                                                                   \
        for (int m = 0; m < MM; m++) {                                                      \
            const __m512 xv = _mm512_loadu_ps(xf + m * K + k);                              \
            for (int j = 0; j < ROWS; j++) acc[m][j] = _mm512_fmadd_ps(wv[j], xv, acc[m][j]); \
        }                                                                                   \
    }                                                                                       \
    for (int m = 0; m < MM; m++)                                                            \
        for (int j = 0; j < ROWS; j++) out[m][j] = _mm512_reduce_add_ps(acc[m][j]);         \
}
DEFINE_AVX512(avx_f32_1, float, load16_f32, 1)
DEFINE_AVX512(avx_f32_2, float, load16_f32, 2)
DEFINE_AVX512(avx_f32_3, float, load16_f32, 3)
DEFINE_AVX512(avx_f32_4, float, load16_f32, 4)
DEFINE_AVX512(avx_bf16_1, uint16_t, load16_bf16, 1)
DEFINE_AVX512(avx_bf16_2, uint16_t, load16_bf16, 2)
DEFINE_AVX512(avx_bf16_3, uint16_t, load16_bf16, 3)
DEFINE_AVX512(avx_bf16_4, uint16_t, load16_bf16, 4)
#ifdef __AVX512BF16__
/* bfloat16 pairs straight into float32 sums (vdpbf16ps): 32 weights per instruction, no
 * widening; the input stays bfloat16 (xb). K % 32 == 0. */
#define DEFINE_DPBF16(NAME, MM)                                                              \
static void NAME(const uint16_t *restrict w, const uint16_t *restrict xb, int64_t K,         \
                 float out[MAX_M][ROWS]) {                                                  \
    __m512 acc[MM][ROWS];                                                                   \
    for (int m = 0; m < MM; m++)                                                            \
        for (int j = 0; j < ROWS; j++) acc[m][j] = _mm512_setzero_ps();                     \
    for (int64_t k = 0; k < K; k += 32) {                                                   \
        __m512bh wv[ROWS];                                                                  \
        for (int j = 0; j < ROWS; j++) {                                                    \
            wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + j * K + k));            \
            _mm_prefetch((const char *)(w + (j + PF_ROWS) * K + k), _MM_HINT_T0);           \
        }                                                                                   \
        for (int m = 0; m < MM; m++) {                                                      \
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + m * K + k)); \
            for (int j = 0; j < ROWS; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xv); \
        }                                                                                   \
    }                                                                                       \
    for (int m = 0; m < MM; m++)                                                            \
        for (int j = 0; j < ROWS; j++) out[m][j] = _mm512_reduce_add_ps(acc[m][j]);         \
}
DEFINE_DPBF16(dp_bf16_1, 1)
DEFINE_DPBF16(dp_bf16_2, 2)
DEFINE_DPBF16(dp_bf16_3, 3)
DEFINE_DPBF16(dp_bf16_4, 4)
typedef void (*dp_bf16_fn)(const uint16_t *, const uint16_t *, int64_t, float[MAX_M][ROWS]);
static const dp_bf16_fn DP_BF16[5] = {0, dp_bf16_1, dp_bf16_2, dp_bf16_3, dp_bf16_4};
#endif
typedef void (*avx_f32_fn)(const float *, const float *, int64_t, float[MAX_M][ROWS]);
typedef void (*avx_bf16_fn)(const uint16_t *, const float *, int64_t, float[MAX_M][ROWS]);
static const avx_f32_fn AVX_F32[5] = {0, avx_f32_1, avx_f32_2, avx_f32_3, avx_f32_4};
static const avx_bf16_fn AVX_BF16[5] = {0, avx_bf16_1, avx_bf16_2, avx_bf16_3, avx_bf16_4};
#define AVX_MAX_M 4
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2 hosts (no AVX-512): 8 float32 lanes, up to 8 input rows. oneDNN's GEMM there took
 * 45 ms for a 5-row step of the 135M model in float32 where streaming W once takes about
 * 20 (2-core EPYC, docs/performance.md): a verification step of speculative decoding, or
 * a batch of a few decodes, is then priced like one row. */
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define DEFINE_AVX2(NAME, T, LOADV, MM)                                                      \
static void NAME(const T *restrict w, const float *restrict xf, int64_t K,                   \
                 float out[MAX_M][ROWS]) {                                                  \
    __m256 acc[MM];                                                                         \
    for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();                              \
    for (int64_t k = 0; k < K; k += 8) {                                                    \
        const __m256 wv = LOADV(w + k);                                                     \
        for (int m = 0; m < MM; m++)                                                        \
            acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + m * K + k), acc[m]);          \
    }                                                                                       \
    for (int m = 0; m < MM; m++) out[m][0] = hsum8(acc[m]);                                 \
}
DEFINE_AVX2(avx2_f32_1, float, load8_f32, 1)
DEFINE_AVX2(avx2_f32_2, float, load8_f32, 2)
DEFINE_AVX2(avx2_f32_3, float, load8_f32, 3)
DEFINE_AVX2(avx2_f32_4, float, load8_f32, 4)
DEFINE_AVX2(avx2_f32_5, float, load8_f32, 5)
DEFINE_AVX2(avx2_f32_6, float, load8_f32, 6)
DEFINE_AVX2(avx2_f32_7, float, load8_f32, 7)
DEFINE_AVX2(avx2_f32_8, float, load8_f32, 8)
DEFINE_AVX2(avx2_bf16_1, uint16_t, load8_bf16, 1)
DEFINE_AVX2(avx2_bf16_2, uint16_t, load8_bf16, 2)
DEFINE_AVX2(avx2_bf16_3, uint16_t, load8_bf16, 3)
DEFINE_AVX2(avx2_bf16_4, uint16_t, load8_bf16, 4)
DEFINE_AVX2(avx2_bf16_5, uint16_t, load8_bf16, 5)
DEFINE_AVX2(avx2_bf16_6, uint16_t, load8_bf16, 6)
DEFINE_AVX2(avx2_bf16_7, uint16_t, load8_bf16, 7)
DEFINE_AVX2(avx2_bf16_8, uint16_t, load8_bf16, 8)
typedef void (*avx2_f32_fn)(const float *, const float *, int64_t, float[MAX_M][ROWS]);
typedef void (*avx2_bf16_fn)(const uint16_t *, const float *, int64_t, float[MAX_M][ROWS]);
static const avx2_f32_fn AVX2_F32[9] = {0, avx2_f32_1, avx2_f32_2, avx2_f32_3, avx2_f32_4,
                                        avx2_f32_5, avx2_f32_6, avx2_f32_7, avx2_f32_8};
static const avx2_bf16_fn AVX2_BF16[9] = {0, avx2_bf16_1, avx2_bf16_2, avx2_bf16_3, avx2_bf16_4,
                                          avx2_bf16_5, avx2_bf16_6, avx2_bf16_7, avx2_bf16_8};
#define AVX2_MAX_M 8
#endif

/* The most rows skinny_linear beats oneDNN's GEMM for on this CPU (measured: 2 with AVX-512,
 * where oneDNN's GEMM is fast from 3 rows; 8 with AVX2 alone, where it is not): the rows
 * decode_layers.c takes in one call for a dense model, and the old count rule's limit. */
int64_t skinny_max_rows(void) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    return AVX2_MAX_M;
#else
    return 2;
#endif
}

/* Input rows per call of a row routine: the most one register-blocked routine takes. */
#if defined(__AVX512F__)
#define GROUP AVX_MAX_M
#elif defined(__AVX2__) && defined(__FMA__)
#define GROUP AVX2_MAX_M
#else
#define GROUP 8
#endif
/* Weight bytes a block of rows may take while every group of input rows passes over it:
 * the block stays in L2 instead of being read from memory once per group. */
#define BLOCK_BYTES 65536

/* Dot products of weight rows [r, r + nr) with input rows [g, g + mm), mm <= GROUP. Which
 * routine computes a row depends on the dtype, K and nr alone, never on M or on the rows
 * beside it, and every routine keeps one accumulator chain per input row: a row's result is
 * the same bits in a call of 1 row or of 4,000 (batch invariance, tests/model/
 * test_linear_kernel.py). */
static void dot_rows(int is_bf16, const void *x, const float *xf, const void *w, int64_t r,
                     int64_t nr, int64_t g, int64_t mm, int64_t K, float acc[MAX_M][ROWS]) {
    const float *xg = xf + g * K;
#ifdef __AVX512F__
#ifdef __AVX512BF16__
    if (nr == ROWS && K % 32 == 0 && is_bf16) {
        DP_BF16[mm]((const uint16_t *)w + r * K, (const uint16_t *)x + g * K, K, acc);
        return;
    }
#endif
    if (nr == ROWS && K % 16 == 0) {
        if (is_bf16) AVX_BF16[mm]((const uint16_t *)w + r * K, xg, K, acc);
        else AVX_F32[mm]((const float *)w + r * K, xg, K, acc);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (nr == ROWS && K % 8 == 0) {
        if (is_bf16) AVX2_BF16[mm]((const uint16_t *)w + r * K, xg, K, acc);
        else AVX2_F32[mm]((const float *)w + r * K, xg, K, acc);
        return;
    }
#endif
    (void)x;
    if (is_bf16) rows_bf16((const uint16_t *)w + r * K, xg, mm, K, nr, acc);
    else rows_f32((const float *)w + r * K, xg, mm, K, nr, acc);
}

/* Returns 0 on success, -1 on unsupported shapes or no memory (the caller uses PyTorch). */
int skinny_linear(int is_bf16, const void *x, const void *w, const void *bias, void *y,
                  int64_t M, int64_t N, int64_t K, int64_t num_threads) {
    if (M < 1 || N < 1 || K < 1) return -1;
    float *copy = NULL; /* bfloat16 input widened once; float32 input is read in place */
    if (is_bf16) {
        copy = malloc(sizeof(float) * (size_t)(M * K));
        if (!copy) return -1;
        for (int64_t i = 0; i < M * K; i++) copy[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    const float *xf = is_bf16 ? copy : (const float *)x;
    const int64_t groups = (N + ROWS - 1) / ROWS;
    const int64_t elem = is_bf16 ? 2 : 4;
    int64_t block = BLOCK_BYTES / (K * elem) / ROWS * ROWS;
    block = block > ROWS ? block : ROWS;
    int64_t nt = num_threads < groups ? num_threads : groups;
    nt = nt > 1 ? nt : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t t = team_thread(), n = team_size();
        /* Contiguous runs of whole groups: each thread streams its own part of W. */
        const int64_t lo = groups * t / n * ROWS, hi_g = groups * (t + 1) / n * ROWS;
        const int64_t hi = hi_g < N ? hi_g : N;
        float acc[MAX_M][ROWS];
        for (int64_t b = lo; b < hi; b += block) {
            const int64_t b_end = b + block < hi ? b + block : hi;
            for (int64_t g = 0; g < M; g += GROUP) {
                const int64_t mm = M - g < GROUP ? M - g : GROUP;
                for (int64_t r = b; r < b_end; r += ROWS) {
                    const int64_t nr = b_end - r < ROWS ? b_end - r : ROWS;
                    dot_rows(is_bf16, x, xf, w, r, nr, g, mm, K, acc);
                    for (int64_t m = 0; m < mm; m++)
                        for (int64_t j = 0; j < nr; j++)
                            store_output(is_bf16, y, (g + m) * N + r + j, acc[m][j], bias,
                                         r + j);
                }
            }
        }
    }
    free(copy);
    return 0;
}
