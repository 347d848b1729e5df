/* Linear layer over block-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in
 * one of ggml's 32-weight block formats, for decode steps: at a few rows a step is bound by
 * streaming W from DRAM, and 4-bit weights are ~3.5x fewer bytes than bfloat16; at more
 * rows, integer dot products (AVX512-VNNI vpdpbusd, 64 multiply-adds an instruction) do
 * twice the work of bfloat16 ones a cycle.
 *
 * The scheme is ggml's (llama.cpp's CPU backend): each 32-value block of an input row is
 * quantized to int8 with one scale (ggml's quantize_row_q8_0_ref: dx = max|x| / 127 kept as
 * float16, qx = round(x / dx)), each block's dot products are taken in integers, and the
 * scales multiply the integer sums in float32. Formats (the weight's values):
 *
 *   Q8_0  w = d * q,        q int8, packed here as the byte q + 128   8.5 bits a weight
 *   Q4_0  w = d * (q - 8),  q a nibble 0..15                          4.5 bits
 *   Q4_1  w = d * q + m,    q a nibble 0..15                          5 bits
 *
 * Weights are vpdpbusd's unsigned operand, so Q8_0 and Q4_0 carry an offset o (128, 8):
 * sum((u - o) qx) = sum(u qx) - o sx, with sx the input block's sum of qx. Per block of a
 * weight row and an input row, exactly ggml's vec_dot up to float rounding:
 *   y += d dx (sum(u qx) - o sx)            [+ m dx sx for Q4_1]
 *
 * Layout: weight rows in tiles of 16 (N padded to a multiple of 16 with zero rows), so an
 * int32 lane of a 512-bit register is one output row and vpdpbusd adds four products of its
 * row with the same four input bytes, broadcast from memory. Per tile and block
 * (inflight/model/quant.py packs it from GGUF blocks):
 *   qs      Q4_*: 4 registers of 64 bytes; register j, lane l, byte b holds value 8j + b of
 *           row l in its low nibble and value 8j + 4 + b in its high one (256 bytes);
 *           Q8_0: 8 registers; register j, lane l, byte b holds value 4j + b of row l, + 128
 *   scales  16 float16 (each row's d);  mins: Q4_1's 16 float16 (each row's m)
 * i.e. qs [N/16, K/32, 256 or 512] uint8, scales and mins [N/16, K/32, 16] float16.
 *   x, y, bias: float32 or bfloat16 (uint16 bits), rows contiguous; y rounded once.
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
#define TILE 16     /* weight rows a tile */
#define M_CHUNK 16  /* input rows whose sums stay in registers at once */
enum { Q8_0 = 1, Q4_0 = 2, Q4_1 = 3 };

static int offset_of(int fmt) { return fmt == Q8_0 ? 128 : fmt == Q4_0 ? 8 : 0; }
static int64_t tile_bytes(int fmt) { return fmt == Q8_0 ? TILE * QK : TILE * QK / 2; }

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

/* ggml's quantize_row_q8_0_ref to the bit, for one input row of K values: a true division
 * for d (the attribute keeps -freciprocal-math from turning it into a product), roundf, d
 * kept as float16. Also each block's offset correction -o sx and Q4_1's dx sx. */
__attribute__((optimize("no-reciprocal-math")))
static void quantize_row(int fmt, int is_bf16, const void *x, int64_t K, int8_t *q, float *dx,
                         int32_t *corr, float *dxsx) {
    const int off = offset_of(fmt);
    for (int64_t b = 0; b < K / QK; b++) {
        float v[QK], amax = 0.f;
        for (int j = 0; j < QK; j++) {
            v[j] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[b * QK + j])
                           : ((const float *)x)[b * QK + j];
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < QK; j++) {
            q[b * QK + j] = (int8_t)roundf(v[j] * id);
            sum += q[b * QK + j];
        }
        dx[b] = round_to_half(d);
        corr[b] = -off * sum;
        dxsx[b] = dx[b] * (float)sum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PF_TILES 4 /* prefetch the weights this many blocks ahead */

/* One tile of 16 weight rows against input rows [0, M) (M <= M_CHUNK), every block: sums
 * into out[m * 16 + lane]. The tile's registers are loaded (and Q4's nibbles split) once a
 * block, then every input row's sums take 8 vpdpbusd with its bytes broadcast. */
static void tile_dot(int fmt, const uint8_t *qs, const uint16_t *d, const uint16_t *mins,
                     const int8_t *q, const float *dx, const int32_t *corr, const float *dxsx,
                     int64_t M, int64_t K, float *out) {
    const int64_t nb = K / QK, tb = tile_bytes(fmt);
    const __m512i lo_mask = _mm512_set1_epi8(0x0f);
    __m512 acc[M_CHUNK];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *t = qs + b * tb;
        _mm_prefetch((const char *)(t + PF_TILES * tb), _MM_HINT_T0);
        _mm_prefetch((const char *)(t + PF_TILES * tb + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(t + PF_TILES * tb + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(t + PF_TILES * tb + 192), _MM_HINT_T0);
        __m512i w[8];
        if (fmt == Q8_0) {
            _mm_prefetch((const char *)(t + PF_TILES * tb + 256), _MM_HINT_T0);
            _mm_prefetch((const char *)(t + PF_TILES * tb + 320), _MM_HINT_T0);
            _mm_prefetch((const char *)(t + PF_TILES * tb + 384), _MM_HINT_T0);
            _mm_prefetch((const char *)(t + PF_TILES * tb + 448), _MM_HINT_T0);
            for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(t + 64 * j));
        } else {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(t + 64 * j));
                w[2 * j] = _mm512_and_si512(v, lo_mask);
                w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * TILE)));
        __m512 mw = _mm512_setzero_ps();
        if (fmt == Q4_1)
            mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mins + b * TILE)));
        for (int64_t m = 0; m < M; m++) {
            const int32_t *xb = (const int32_t *)(q + m * K + b * QK);
            /* two chains of four: half the latency of one of eight */
            __m512i s0 = _mm512_set1_epi32(corr[m * nb + b]), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(xb[j]));
                s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(xb[j + 1]));
            }
            const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(dx[m * nb + b])), dw, acc[m]);
            if (fmt == Q4_1)
                acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dxsx[m * nb + b]), acc[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(out + m * TILE, acc[m]);
}
#else
/* Plain C, where AVX512-VNNI is missing: the same sums, value by value. */
static void tile_dot(int fmt, const uint8_t *qs, const uint16_t *d, const uint16_t *mins,
                     const int8_t *q, const float *dx, const int32_t *corr, const float *dxsx,
                     int64_t M, int64_t K, float *out) {
    const int64_t nb = K / QK, tb = tile_bytes(fmt);
    for (int64_t m = 0; m < M; m++)
        for (int l = 0; l < TILE; l++) {
            float s = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *t = qs + b * tb;
                int32_t dot = corr[m * nb + b];
                for (int k = 0; k < QK; k++) {
                    int u;
                    if (fmt == Q8_0) {
                        u = t[(k / 4) * 64 + l * 4 + k % 4];
                    } else {
                        const int j = k / 8, hi = (k % 8) >= 4;
                        u = (t[j * 64 + l * 4 + k % 4] >> (hi ? 4 : 0)) & 0x0f;
                    }
                    dot += u * q[m * K + b * QK + k];
                }
                s += half_to_f32(d[b * TILE + l]) * dx[m * nb + b] * (float)dot;
                if (fmt == Q4_1) s += half_to_f32(mins[b * TILE + l]) * dxsx[m * nb + b];
            }
            out[m * TILE + l] = s;
        }
}
#endif

/* Returns 0; -1 for shapes or formats it does not take, or no memory (the caller then uses
 * the dequantized weights). N: the layer's rows (the packed tiles may pad it to 16). */
int quant_linear(int fmt, int is_bf16, const void *x, const void *qs, const void *scales,
                 const void *mins, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                 int64_t num_threads) {
    if (fmt < Q8_0 || fmt > Q4_1 || M < 1 || N < 1 || K < QK || K % QK
            || (fmt == Q4_1 && mins == NULL))
        return -1;
    const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE, tb = tile_bytes(fmt);
    /* per input row: K int8 values, then dx, corr, dxsx (nb each) */
    char *buf = malloc((size_t)(M * K + 3 * M * nb * 4 + 64));
    if (!buf) return -1;
    int8_t *q = (int8_t *)buf;
    float *dx = (float *)(buf + ((M * K + 63) & ~(int64_t)63));
    int32_t *corr = (int32_t *)(dx + M * nb);
    float *dxsx = (float *)(corr + M * nb);
    for (int64_t m = 0; m < M; m++)
        quantize_row(fmt, is_bf16, (const char *)x + m * K * (is_bf16 ? 2 : 4), K, q + m * K,
                     dx + m * nb, corr + m * nb, dxsx + m * nb);
    int64_t nt = num_threads < tiles ? num_threads : tiles;
    nt = nt > 1 ? nt : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int64_t t = 0, n = 1;
#endif
        float out[M_CHUNK * TILE];
        for (int64_t tile = tiles * t / n; tile < tiles * (t + 1) / n; tile++) {
            const int64_t r0 = tile * TILE, rows = N - r0 < TILE ? N - r0 : TILE;
            for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
                const int64_t mm = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
                tile_dot(fmt, (const uint8_t *)qs + tile * nb * tb,
                         (const uint16_t *)scales + tile * nb * TILE,
                         mins == NULL ? NULL : (const uint16_t *)mins + tile * nb * TILE,
                         q + m0 * K, dx + m0 * nb, corr + m0 * nb, dxsx + m0 * nb, mm, K, out);
                for (int64_t m = 0; m < mm; m++)
                    for (int64_t l = 0; l < rows; l++) {
                        float v = out[m * TILE + l];
                        const int64_t row = r0 + l, at = (m0 + m) * N + row;
                        if (is_bf16) {
                            if (bias) v += bf16_to_f32(((const uint16_t *)bias)[row]);
                            ((uint16_t *)y)[at] = f32_to_bf16(v);
                        } else {
                            if (bias) v += ((const float *)bias)[row];
                            ((float *)y)[at] = v;
                        }
                    }
            }
        }
    }
    free(buf);
    return 0;
}
