/* Linear layer over block-quantized weights for a few rows: y[M, N] = x[M, K] @ W[N, K]^T
 * (+ bias), W in one of ggml's 32-weight block formats, for decode steps, where a step is
 * bound by streaming W from DRAM and 4-bit weights read ~3.5x fewer bytes than bfloat16.
 *
 * The scheme is ggml's (llama.cpp's CPU backend): each 32-value block of an input row is
 * quantized to int8 with one scale (ggml's quantize_row_q8_0_ref: dx = max|x| / 127 kept as
 * float16, qx = round(x / dx)), each block's dot product is taken in integers (AVX512-VNNI
 * vpdpbusd: u8 x s8 products summed four to an int32 lane), and the scales multiply the
 * integer sums in float32. Formats (the weight's values):
 *
 *   Q8_0  w = d * q,        q int8, packed here as the byte q + 128   8.5 bits a weight
 *   Q4_0  w = d * (q - 8),  q a nibble 0..15                          4.5 bits
 *   Q4_1  w = d * q + m,    q a nibble 0..15                          5 bits
 *
 * Weights are vpdpbusd's unsigned operand, so Q8_0 and Q4_0 carry an offset o (128, 8):
 * sum((u - o) qx) = sum(u qx) - o sx, sx the block's sum of qx. The input side knows sx, so
 * each int32 lane starts at -o times the sum of the four qx it will meet: the offset costs
 * nothing in the loop. Q4_1's m adds m dx sx a block, summed beside the loop. So, per block
 * of a weight row and an input row, exactly as ggml's vec_dot up to float rounding:
 *   y += d dx (sum(u qx) - o sx)            [+ m dx sx for Q4_1]
 *
 * Weight layout (inflight/model/quant.py packs it from GGUF blocks):
 *   qs      Q8_0: uint8 [N, K] (q + 128); Q4_*: uint8 [N, K/2], per block 16 bytes, byte j
 *           holding value j in its low nibble and value j + 16 in its high one (GGUF's order)
 *   scales  float16 [N, K/32] (d);  mins: Q4_1's float16 [N, K/32] (m), else unused
 *   x, y, bias: float32 or bfloat16 (uint16 bits), as skinny_linear; y rounded once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QK 32
#define MAX_M 16
#define CHUNK 64 /* weight rows a thread sums before it writes them out */
enum { Q8_0 = 1, Q4_0 = 2, Q4_1 = 3 };

static int offset_of(int fmt) { return fmt == Q8_0 ? 128 : fmt == Q4_0 ? 8 : 0; }

/* Blocks in one 64-byte load of weights: 4 of Q4 (their nibble halves become two vectors of
 * 64 values, [A..D values 0..15] and [A..D values 16..31]), 2 of Q8_0. Int32 lane l of
 * those vectors sums four products of block l / (16 / group) of the group. */
static int group_of(int fmt) { return fmt == Q8_0 ? 2 : 4; }

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
static float half_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#endif
}
#endif

/* float -> float16 -> float, to nearest even. */
static float round_to_half(float f) {
#ifdef __F16C__
    return _cvtsh_ss(_cvtss_sh(f, 0));
#else
    return (float)(_Float16)f;
#endif
}

/* One input row, quantized and laid out as the weight loop reads it: per group g of
 * blocks, 128 bytes (Q4: the groups' values 0..15 then 16..31, block after block) or 64
 * (Q8_0: blocks whole); a last, partial group is zero-filled. */
typedef struct {
    int8_t *q;     /* [groups * 128] */
    float *dx;     /* [nb] */
    float *dxl;    /* [groups * 16]: dx of each lane's block (0 past the last block) */
    int32_t *corr; /* [groups * 16]: -offset x the qx a lane meets, summed */
    int32_t *sx;   /* [nb] */
    float *c;      /* [nb]: Q4_1's dx sx */
} qrow_t;

/* Where value j of block b goes in qrow_t.q. */
static int64_t x_at(int fmt, int64_t b, int j) {
    const int64_t g = b / group_of(fmt), i = b % group_of(fmt);
    if (fmt == Q8_0) return g * 64 + i * QK + j;
    return g * 128 + (j < 16 ? 0 : 64) + i * 16 + j % 16;
}

/* ggml's quantize_row_q8_0_ref to the bit: a true division for d (the attribute keeps
 * -freciprocal-math from turning it into a product), roundf, d kept as float16. */
__attribute__((optimize("no-reciprocal-math")))
static void quantize_row(int fmt, int is_bf16, const void *x, int64_t K, qrow_t *r) {
    const int64_t nb = K / QK, per = group_of(fmt), groups = (nb + per - 1) / per;
    const int off = offset_of(fmt);
    memset(r->q, 0, (size_t)groups * 128);
    memset(r->dxl, 0, (size_t)groups * 16 * sizeof(float));
    for (int64_t b = 0; b < nb; b++) {
        float v[QK], amax = 0.f;
        for (int j = 0; j < QK; j++) {
            v[j] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[b * QK + j])
                           : ((const float *)x)[b * QK + j];
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < QK; j++) {
            const int8_t q = (int8_t)roundf(v[j] * id);
            sum += q;
            r->q[x_at(fmt, b, j)] = q;
        }
        r->dx[b] = round_to_half(d);
        r->sx[b] = sum;
        r->c[b] = r->dx[b] * (float)sum;
        for (int lane = 0; lane < 16; lane++)
            if (lane / (16 / per) == b % per) r->dxl[(b / per) * 16 + lane] = r->dx[b];
    }
    for (int64_t g = 0; g < groups; g++)
        for (int lane = 0; lane < 16; lane++) {
            const int8_t *a = r->q + g * (fmt == Q8_0 ? 64 : 128) + lane * 4;
            int32_t s = a[0] + a[1] + a[2] + a[3];
            if (fmt != Q8_0) s += a[64] + a[65] + a[66] + a[67];
            r->corr[g * 16 + lane] = -off * s;
        }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PF_BYTES 1024 /* prefetch this far ahead in the weight stream */

/* Q4_1's sum_b m_b c_b, 16 blocks a vector. */
static inline __m512 mins_term(const uint16_t *mins, const float *c, int64_t nb) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 k = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mins + b)),
                              _mm512_maskz_loadu_ps(k, c + b), acc);
    }
    return acc;
}

/* MM input rows against RR consecutive weight rows (`wstride` bytes and `nb` scales apart),
 * accumulators in registers: RR independent chains keep the FMA latency hidden. One group
 * of blocks an iteration; the last group's loads are masked to the blocks there are. */
#define DEFINE_ROW_DOT(NAME, MM, RR)                                                         \
static void NAME(int fmt, const uint8_t *wq, int64_t wstride, const uint16_t *d,            \
                 const uint16_t *mins, const qrow_t *r, int64_t nb, float *out,              \
                 int64_t out_stride) {                                                      \
    const int q8 = fmt == Q8_0, per = q8 ? 2 : 4;                                           \
    const int64_t bb = q8 ? QK : QK / 2; /* weight bytes a block */                         \
    const __m512i lo_mask = _mm512_set1_epi8(0x0f);                                         \
    const __m512i idx = q8 ? _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0) \
                           : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); \
    __m512 acc[RR][MM];                                                                     \
    for (int j = 0; j < RR; j++)                                                            \
        for (int m = 0; m < MM; m++)                                                        \
            acc[j][m] = fmt == Q4_1 ? mins_term(mins + j * nb, r[m].c, nb)                  \
                                    : _mm512_setzero_ps();                                  \
    for (int64_t b = 0, g = 0; b < nb; b += per, g++) {                                     \
        const int64_t left = nb - b < per ? nb - b : per;                                   \
        const __mmask64 kw = left == per ? ~(__mmask64)0 : (((__mmask64)1 << (left * bb)) - 1); \
        const __mmask8 kd = (__mmask8)((1u << left) - 1);                                   \
        __m512i wlo[RR], whi[RR];                                                           \
        __m512 dl[RR];                                                                      \
        for (int j = 0; j < RR; j++) {                                                      \
            const uint8_t *src = wq + j * wstride + b * bb;                                 \
            _mm_prefetch((const char *)src + PF_BYTES, _MM_HINT_T0);                        \
            const __m512i v = _mm512_maskz_loadu_epi8(kw, (const void *)src);               \
            wlo[j] = q8 ? v : _mm512_and_si512(v, lo_mask);                                 \
            whi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);                    \
            dl[j] = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_cvtph_ps(         \
                        _mm_maskz_loadu_epi16(kd, (const void *)(d + j * nb + b)))));       \
        }                                                                                   \
        for (int m = 0; m < MM; m++) {                                                      \
            const int8_t *xq = r[m].q + g * (q8 ? 64 : 128);                                \
            const __m512i corr = _mm512_loadu_si512((const void *)(r[m].corr + g * 16));    \
            const __m512i xlo = _mm512_loadu_si512((const void *)xq);                       \
            const __m512 dx = _mm512_loadu_ps(r[m].dxl + g * 16);                           \
            for (int j = 0; j < RR; j++) {                                                  \
                __m512i dot = _mm512_dpbusd_epi32(corr, wlo[j], xlo);                       \
                if (!q8)                                                                    \
                    dot = _mm512_dpbusd_epi32(dot, whi[j],                                  \
                                              _mm512_loadu_si512((const void *)(xq + 64))); \
                acc[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dl[j], dx), \
                                            acc[j][m]);                                     \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    for (int j = 0; j < RR; j++)                                                            \
        for (int m = 0; m < MM; m++) out[m * out_stride + j] = _mm512_reduce_add_ps(acc[j][m]); \
}
DEFINE_ROW_DOT(row_dot_1x1, 1, 1)
DEFINE_ROW_DOT(row_dot_2x1, 2, 1)
DEFINE_ROW_DOT(row_dot_3x1, 3, 1)
DEFINE_ROW_DOT(row_dot_4x1, 4, 1)
DEFINE_ROW_DOT(row_dot_1x2, 1, 2)
DEFINE_ROW_DOT(row_dot_2x2, 2, 2)
DEFINE_ROW_DOT(row_dot_3x2, 3, 2)
DEFINE_ROW_DOT(row_dot_4x2, 4, 2)
typedef void (*row_dot_fn)(int, const uint8_t *, int64_t, const uint16_t *, const uint16_t *,
                           const qrow_t *, int64_t, float *, int64_t);
static const row_dot_fn ROW_DOT[3][5] = {
    {0, 0, 0, 0, 0},
    {0, row_dot_1x1, row_dot_2x1, row_dot_3x1, row_dot_4x1},
    {0, row_dot_1x2, row_dot_2x2, row_dot_3x2, row_dot_4x2}};

/* Weight rows [lo, hi) against every input row into out[m * out_stride + row - lo]. Q4
 * rows two at a time (the loop is bound by its arithmetic: two chains hide its latency);
 * Q8_0 rows one at a time (bound by the weight stream, read in address order); input rows
 * four at a time (a weight row read again comes from L1). */
static void rows_dot(int fmt, const uint8_t *qs, int64_t row_bytes, const uint16_t *scales,
                     const uint16_t *mins, const qrow_t *r, int64_t M, int64_t nb, int64_t lo,
                     int64_t hi, float *out, int64_t out_stride) {
    const int64_t step = fmt == Q8_0 ? 1 : 2;
    for (int64_t row = lo; row < hi; row += step) {
        const int rr = hi - row >= step ? (int)step : 1;
        for (int64_t m = 0; m < M; m += 4)
            ROW_DOT[rr][M - m < 4 ? M - m : 4](
                fmt, qs + row * row_bytes, row_bytes, scales + row * nb,
                mins == NULL ? NULL : mins + row * nb, r + m, nb,
                out + m * out_stride + (row - lo), out_stride);
    }
}
#else
/* Plain C, where AVX512-VNNI is missing: the same sums, block by block. */
static void rows_dot(int fmt, const uint8_t *qs, int64_t row_bytes, const uint16_t *scales,
                     const uint16_t *mins, const qrow_t *r, int64_t M, int64_t nb, int64_t lo,
                     int64_t hi, float *out, int64_t out_stride) {
    const int off = offset_of(fmt);
    for (int64_t row = lo; row < hi; row++)
        for (int64_t m = 0; m < M; m++) {
            const uint8_t *w = qs + row * row_bytes;
            float s = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t dot = 0;
                for (int j = 0; j < QK; j++) {
                    const int u = fmt == Q8_0 ? w[b * QK + j]
                                              : (w[b * 16 + j % 16] >> (j < 16 ? 0 : 4)) & 0x0f;
                    dot += u * r[m].q[x_at(fmt, b, j)];
                }
                dot -= off * r[m].sx[b];
                s += half_to_f32(scales[row * nb + b]) * r[m].dx[b] * (float)dot;
                if (fmt == Q4_1) s += half_to_f32(mins[row * nb + b]) * r[m].c[b];
            }
            out[m * out_stride + (row - lo)] = s;
        }
}
#endif

/* Returns 0; -1 for shapes or formats it does not take, or no memory (the caller then uses
 * the dequantized weights). */
int quant_linear(int fmt, int is_bf16, const void *x, const void *qs, const void *scales,
                 const void *mins, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                 int64_t num_threads) {
    if (fmt < Q8_0 || fmt > Q4_1 || M < 1 || M > MAX_M || N < 1 || K < QK || K % QK
            || (fmt == Q4_1 && mins == NULL))
        return -1;
    const int64_t nb = K / QK, per = group_of(fmt), groups = (nb + per - 1) / per;
    const int64_t row_bytes = fmt == Q8_0 ? K : K / 2;
    /* per input row, in 4-byte words: dx, c, sx (nb each), dxl, corr (groups x 16 each);
     * then the rows' quantized values, groups x 128 bytes each (64-byte aligned) */
    const int64_t words = 3 * nb + 2 * groups * 16;
    const size_t head = ((size_t)(M * words * 4) + 63) & ~(size_t)63;
    char *buf = aligned_alloc(64, head + (size_t)(M * groups * 128));
    if (!buf) return -1;
    qrow_t r[MAX_M];
    for (int64_t m = 0; m < M; m++) {
        float *f = (float *)buf + m * words;
        r[m].dx = f;
        r[m].c = f + nb;
        r[m].sx = (int32_t *)(f + 2 * nb);
        r[m].dxl = f + 3 * nb;
        r[m].corr = (int32_t *)(f + 3 * nb + groups * 16);
        r[m].q = (int8_t *)(buf + head) + m * groups * 128;
        quantize_row(fmt, is_bf16, (const char *)x + m * K * (is_bf16 ? 2 : 4), K, &r[m]);
    }
    int64_t nt = num_threads < N ? num_threads : N;
    nt = nt > 1 ? nt : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int64_t t = 0, n = 1;
#endif
        /* whole runs of CHUNK rows, so the sums of a run sit in one small buffer */
        const int64_t lo = N * t / n, hi = N * (t + 1) / n;
        float out[MAX_M * CHUNK];
        for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
            const int64_t c1 = hi - c0 < CHUNK ? hi : c0 + CHUNK;
            rows_dot(fmt, (const uint8_t *)qs, row_bytes, (const uint16_t *)scales,
                     (const uint16_t *)mins, r, M, nb, c0, c1, out, CHUNK);
            for (int64_t m = 0; m < M; m++)
                for (int64_t row = c0; row < c1; row++) {
                    float v = out[m * CHUNK + row - c0];
                    if (is_bf16) {
                        if (bias) v += bf16_to_f32(((const uint16_t *)bias)[row]);
                        ((uint16_t *)y)[m * N + row] = f32_to_bf16(v);
                    } else {
                        if (bias) v += ((const float *)bias)[row];
                        ((float *)y)[m * N + row] = v;
                    }
                }
        }
    }
    free(buf);
    return 0;
}
