/* Linear layer over block-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in
 * one of ggml's 32-weight block formats, for decode steps: at a few rows a step is bound by
 * streaming W from DRAM, and 4-bit weights are ~3.5x fewer bytes than bfloat16; at more
 * rows, integer dot products (AVX512-VNNI vpdpbusd, 64 multiply-adds an instruction) do
 * twice the work of bfloat16 ones a cycle, and from 24 rows AMX-INT8 tiles (tdpbsud, where
 * the CPU has them) take the integer products with the same bits (see HAVE_AMX below).
 *
 * The scheme is ggml's (llama.cpp's CPU backend): each 32-value block of an input row is
 * quantized to int8 with one scale (as ggml-cpu's quantize_row_q8_0 does on x86: dx =
 * max|x| / 127 kept as float16, qx = x * 127 / max|x| rounded to nearest even), each block's
 * dot products are taken in integers, and the scales multiply the integer sums in float32.
 * Formats (the weight's values; u an unsigned code, d, m, dmin float16):
 *
 *   Q8_0  w = d * q,                 q int8, packed here as the byte q + 128    8.5 bits a weight
 *   Q4_0  w = d * (u - 8),           u 4 bits                                  4.5 bits
 *   Q4_1  w = d * u + m,             u 4 bits                                  5 bits
 *   Q5_0  w = d * (u - 16),          u 5 bits                                  5.5 bits
 *   Q5_1  w = d * u + m,             u 5 bits                                  6 bits
 *   Q4_K  w = (d sc) u - dmin mn,    u 4 bits, sc mn 6-bit per 32 values       4.625 bits
 *   Q5_K  w = (d sc) u - dmin mn,    u 5 bits, d dmin per 256 values           5.625 bits
 *   Q6_K  w = (d sc) (u - 32),       u 6 bits, sc int8 per 16 values           6.5625 bits
 *
 * (K-quants: llama.cpp's k_quants; d sc and dmin mn are exact in float32, 11 by at most 8
 * significant bits, so they are formed here from the integers the file keeps.) Weights are
 * vpdpbusd's unsigned operand, so the formats without a minimum carry an offset o (128, 8,
 * 16, 32): sum((u - o) qx) = sum(u qx) - o sx, with sx the input block's sum of qx. Per block
 * of a weight row and an input row, exactly ggml's vec_dot up to float rounding:
 *   y += d dx (sum(u qx) - o sx)             [+ m dx sx where the block has a minimum]
 * Q6_K's two 16-value halves have their own integer scales, taken in integers first:
 *   y += d dx (sc0 (sum0(u qx) - 32 sx0) + sc1 (sum1(u qx) - 32 sx1))
 *
 * Layout: weight rows in tiles of 16 (N padded to a multiple of 16 with zero rows), so an
 * int32 lane of a 512-bit register is one output row and vpdpbusd adds four products of its
 * row with the same four input bytes, broadcast from memory. Per tile and block
 * (inflight/model/quant.py packs it from GGUF blocks):
 *   qs      Q8_0: 8 registers of 64 bytes; register j, lane l, byte b holds value 4j + b of
 *           row l, + 128. Others: 4 registers; register j, lane l, byte b holds value 8j + b
 *           of row l in its low nibble and value 8j + 4 + b in its high one (256 bytes);
 *           then 5- and 6-bit codes' bit planes (bit 4, then bit 5), 64 bytes each: 8 words
 *           of 64 bits, word r's bit 4l + b the bit of value 4r + b of row l, so a word is
 *           the byte mask of vpdpbusd register r; then a K-quant's 32 bytes of integer scales
 *           (Q4_K, Q5_K: 16 sc, 16 mn; Q6_K: 16 int8 sc of values 0-15, 16 of 16-31)
 *   scales  16 float16 (each row's d; a K-quant's super-block d, one per 8 blocks)
 *   mins    16 float16 (Q4_1, Q5_1: each row's m; Q4_K, Q5_K: dmin, one per 8 blocks)
 * i.e. qs [N/16, K/32, tile_bytes] uint8, scales and mins [N/16, K/32 or K/256, 16] float16.
 *   x, y, bias: float32 or bfloat16 (uint16 bits), rows contiguous; y rounded once.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "team.h"
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The two SIMD paths, named once: AVX-512 VNNI (with AMX where there is one) and AVX2. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI_PATH 1
#else
#define VNNI_PATH 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AVX2_PATH 1
#else
#define AVX2_PATH 0
#endif

#define QK 32
#define TILE 16     /* weight rows a tile */
#define M_CHUNK 16  /* input rows whose sums stay in registers at once */
#define QK_K 256   /* values a K-quant super-block: 8 blocks */
#define PLANES 256 /* offset of the bit planes in a packed tile block */
enum { Q8_0 = 1, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };

static inline int bits_of(int fmt) {
    return fmt == Q8_0 ? 8 : fmt == Q5_0 || fmt == Q5_1 || fmt == Q5_K ? 5 : fmt == Q6_K ? 6 : 4;
}
static inline int is_k(int fmt) { return fmt >= Q4_K; }
static inline int has_min(int fmt) { return fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_K || fmt == Q5_K; }
static inline int offset_of(int fmt) {
    return fmt == Q8_0 ? 128 : fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : fmt == Q6_K ? 32 : 0;
}
static inline int64_t tile_bytes(int fmt) {
    return fmt == Q8_0 ? TILE * QK : PLANES + 64 * (bits_of(fmt) - 4) + (is_k(fmt) ? 32 : 0);
}
/* A K-quant tile block's integer scales: 16 bytes for values 0-31 (Q6_K: 0-15), 16 more */
/* float16 scales (and minimums) a tile holds per row: one a block, a K-quant's one per 8. */
static inline int64_t tile_scales(int fmt, int64_t nb) { return (is_k(fmt) ? nb / 8 : nb) * TILE; }
static inline const uint8_t *sub_scales(int fmt, const uint8_t *t) { return t + tile_bytes(fmt) - 32; }
/* Word r of a tile block's bit plane i (bit 4 + i of the codes). */
static inline uint64_t plane_word(const uint8_t *t, int i, int r) {
    uint64_t w;
    memcpy(&w, t + PLANES + 64 * i + 8 * r, 8);
    return w;
}

static float half_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
#endif
}

/* Code k (0-31) of row l in a packed tile block t, unsigned (Q8_0's with its + 128). */
static int code_at(int fmt, const uint8_t *t, int l, int k) {
    const int r = k / 4, p = 4 * l + k % 4; /* vpdpbusd register r, byte p */
    if (fmt == Q8_0) return t[r * 64 + p];
    int u = (t[(k / 8) * 64 + p] >> ((k % 8) >= 4 ? 4 : 0)) & 0x0f;
    for (int i = 0; i < bits_of(fmt) - 4; i++) u |= (int)((plane_word(t, i, r) >> p) & 1) << (4 + i);
    return u;
}

/* float -> float16 -> float, to nearest even. */
static float round_to_half(float f) {
#ifdef __F16C__
    return _cvtsh_ss(_cvtss_sh(f, 0));
#else
    return (float)(_Float16)f;
#endif
}

/* One input row of K values to int8 blocks, as llama.cpp quantizes activations at run time
 * (ggml-cpu's quantize_row_q8_0 on x86, to the bit): d = amax / 127 (kept as float16),
 * q = round-to-nearest-even(x * (127 / amax)). True divisions: the attribute keeps
 * -freciprocal-math from turning them into products. Also each block's offset correction
 * -o sx, that of its first 16 values (Q6_K's halves; the whole block's for the other formats,
 * whose sums take it in one piece) and dx sx (for minimums). */
__attribute__((optimize("no-reciprocal-math")))
static void quantize_row(int fmt, int is_bf16, const void *x, int64_t K, int64_t M, int8_t *q,
                         float *dx, int32_t *corr, int32_t *corr_lo, float *dxsx) {
    const int off = offset_of(fmt);
    for (int64_t b = 0; b < K / QK; b++) {
        float amax;
        int32_t sum = 0, sum_lo = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 v[2];
        for (int h = 0; h < 2; h++)
            v[h] = is_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                 _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + b * QK + 16 * h))), 16))
                           : _mm512_loadu_ps((const float *)x + b * QK + 16 * h);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        __m512i s = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            /* cvtps rounds to nearest even (MXCSR's default), as ggml's round-then-convert */
            const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(q + b * M * QK + 16 * h), _mm512_cvtsepi32_epi8(qi));
            if (fmt == Q6_K && h == 0) sum_lo = _mm512_reduce_add_epi32(qi);
            s = _mm512_add_epi32(s, qi);
        }
        sum = _mm512_reduce_add_epi32(s);
#elif AVX2_PATH
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int h = 0; h < 4; h++) {
            v[h] = is_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                 _mm_loadu_si128((const __m128i *)((const uint16_t *)x + b * QK + 8 * h))), 16))
                           : _mm256_loadu_ps((const float *)x + b * QK + 8 * h);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v[h], abs_mask));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        __m256i qi[4];
        for (int h = 0; h < 4; h++)  /* cvtps rounds to nearest even, as nearbyintf */
            qi[h] = _mm256_cvtps_epi32(_mm256_mul_ps(v[h], _mm256_set1_ps(id)));
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
        if (fmt == Q6_K) {
            const __m256i lo = _mm256_add_epi32(qi[0], qi[1]);
            __m128i l4 = _mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
            l4 = _mm_add_epi32(l4, _mm_shuffle_epi32(l4, 0x4e));
            sum_lo = _mm_cvtsi128_si32(_mm_add_epi32(l4, _mm_shuffle_epi32(l4, 0xb1)));
        }
        /* packs work within 128-bit lanes: the permute puts the 32 bytes back in order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + b * M * QK),
                            _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
        float v[QK];
        amax = 0.f;
        for (int j = 0; j < QK; j++) {
            v[j] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[b * QK + j])
                           : ((const float *)x)[b * QK + j];
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        for (int j = 0; j < QK; j++) {
            q[b * M * QK + j] = (int8_t)nearbyintf(v[j] * id);
            sum += q[b * M * QK + j];
            if (j < QK / 2) sum_lo += q[b * M * QK + j];
        }
#endif
        dx[b * M] = round_to_half(amax / 127.f);
        corr[b * M] = -off * sum;
        corr_lo[b * M] = -off * (fmt == Q6_K ? sum_lo : sum); /* the rest: corr - corr_lo = 0 */
        dxsx[b * M] = dx[b * M] * (float)sum;
    }
}

/* Rows [0, mm) of one weight tile's float32 results (row m at out + m * 16) into y's rows
 * m0 + m, columns r0 .. r0 + 15 that the layer has, bias added, rounded once. */
static void store_tile(int is_bf16, void *y, const float *out, int64_t m0, int64_t mm,
                       int64_t N, int64_t r0, const void *bias) {
    const int64_t rows = N - r0 < TILE ? N - r0 : TILE;
    for (int64_t m = 0; m < mm; m++)
        for (int64_t l = 0; l < rows; l++)
            store_output(is_bf16, y, (m0 + m) * N + r0 + l, out[m * TILE + l], bias, r0 + l);
}

#if VNNI_PATH || AVX2_PATH
#define PF_TILES 4 /* prefetch the weights this many blocks ahead */

/* The packed tile PF_TILES blocks after t (tb bytes a block), so DRAM's latency is hidden. */
static inline void prefetch_ahead(const uint8_t *t, int64_t tb) {
    for (int64_t o = 0; o < tb; o += 64) _mm_prefetch((const char *)(t + PF_TILES * tb + o), _MM_HINT_T0);
}
#endif

#if VNNI_PATH

/* A Q4 register's nibbles as bytes: register j's low nibbles are values 8j + b of its
 * rows, the high ones 8j + 4 + b (the layout above). */
static inline void split_nibbles(__m512i v, __m512i *lo, __m512i *hi) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    *lo = _mm512_and_si512(v, mask);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
}

/* A block's 16 float16 weight scales (or Q4_1's minimums) of a tile, as float32. */
static inline __m512 block_halves(const uint16_t *h, int64_t b) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + b * TILE)));
}

/* A tile block's codes as 8 vpdpbusd registers (register r: values 4r .. 4r + 3 of each
 * row): Q8_0's bytes; else the nibbles split, and each bit plane's word r as the byte mask
 * of register r adding 16 (32). */
static inline __attribute__((always_inline)) void load_codes(int fmt, const uint8_t *t, __m512i *w) {
    if (fmt == Q8_0) {
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(t + 64 * j));
        return;
    }
    for (int j = 0; j < 4; j++)
        split_nibbles(_mm512_loadu_si512((const void *)(t + 64 * j)), &w[2 * j], &w[2 * j + 1]);
    for (int i = 0; i < bits_of(fmt) - 4; i++)
        for (int r = 0; r < 8; r++)
            w[r] = _mm512_mask_add_epi8(w[r], (__mmask64)plane_word(t, i, r), w[r],
                                        _mm512_set1_epi8((char)(16 << i)));
}

/* A tile block's 16 row scales dw and minimums mw in float32 (block b, packed bytes t):
 * d (and m); a K-quant's d sc and -(dmin mn), both exact; Q6_K's super-block d alone (its
 * integer scales go into the sums). */
static inline __attribute__((always_inline)) void
block_scales(int fmt, const uint8_t *t, const uint16_t *d, const uint16_t *mins, int64_t b,
             __m512 *dw, __m512 *mw) {
    *mw = _mm512_setzero_ps();
    if (!is_k(fmt)) {
        *dw = block_halves(d, b);
        if (has_min(fmt)) *mw = block_halves(mins, b);
        return;
    }
    *dw = block_halves(d, b / 8);
    if (fmt == Q6_K) return;
    const uint8_t *sub = sub_scales(fmt, t);
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sub)));
    const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sub + 16))));
    *dw = _mm512_mul_ps(*dw, sc);
    *mw = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(block_halves(mins, b / 8), mn));
}

/* One block's int32 sums of a row: the halves' sums s0 (values 0-15) and s1 (16-31), each
 * with its offset correction in (corr_lo, corr - corr_lo); Q6_K's halves times their
 * integer scales (sc0, sc1). Exact, so every path's are the same. */
static inline __m512i join_halves(int fmt, __m512i s0, __m512i s1, __m512i sc0, __m512i sc1) {
    if (fmt == Q6_K) return _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1));
    return _mm512_add_epi32(s0, s1);
}

/* One block's float32 steps for one input row: acc + (s dx) dw [+ mw dxsx with a minimum],
 * s the row's int32 sums with the offset correction in. The VNNI and AMX paths both call
 * this, so their results are the same bits. */
static inline __m512 scale_sums(int fmt, __m512i s, float dx, float dxsx, __m512 dw, __m512 mw,
                                __m512 acc) {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(dx)), dw, acc);
    if (has_min(fmt)) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(dxsx), acc);
    return acc;
}

/* One tile of 16 weight rows against input rows [0, M) (M <= M_CHUNK), every block: sums
 * into out[m * 16 + lane]. The inputs are block-major (value j of block b of row m at
 * q[(b * xm + m) * 32 + j], its scale at dx[b * xm + m]): a block's rows are side by side. The tile's registers are loaded (and Q4's nibbles split) once a
 * block, then every input row's sums take 8 vpdpbusd with its bytes broadcast. */
static inline __attribute__((always_inline)) void
tile_dot(int fmt, const uint8_t *qs, const uint16_t *d, const uint16_t *mins, const int8_t *q,
         const float *dx, const int32_t *corr, const int32_t *corr_lo, const float *dxsx,
         int64_t xm, int64_t M, int64_t K, float *out) {
    const int64_t nb = K / QK, tb = tile_bytes(fmt);
    __m512 acc[M_CHUNK];
    for (int64_t m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *t = qs + b * tb;
        prefetch_ahead(t, tb);
        __m512i w[8], sc0 = _mm512_setzero_si512(), sc1 = sc0;
        __m512 dw, mw;
        load_codes(fmt, t, w);
        block_scales(fmt, t, d, mins, b, &dw, &mw);
        if (fmt == Q6_K) {
            sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sub_scales(fmt, t)));
            sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sub_scales(fmt, t) + 16)));
        }
        for (int64_t m = 0; m < M; m++) {
            const int32_t *xb = (const int32_t *)(q + (b * xm + m) * QK);
            const int64_t i = b * xm + m;
            /* two chains of four (the block's halves): half the latency of one of eight */
            __m512i s0 = _mm512_set1_epi32(corr_lo[i]), s1 = _mm512_set1_epi32(corr[i] - corr_lo[i]);
            for (int j = 0; j < 4; j++) {
                s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(xb[j]));
                s1 = _mm512_dpbusd_epi32(s1, w[j + 4], _mm512_set1_epi32(xb[j + 4]));
            }
            acc[m] = scale_sums(fmt, join_halves(fmt, s0, s1, sc0, sc1), dx[i], dxsx[i], dw, mw,
                                acc[m]);
        }
    }
    for (int64_t m = 0; m < M; m++) _mm512_storeu_ps(out + m * TILE, acc[m]);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX 1
#include "amx.h"

/* AMX-INT8 (Sapphire Rapids and later): one tdpbsud multiplies a block of up to 16 input
 * rows by a tile of 16 weight rows (16 x 16 x 32 multiply-adds, signed inputs by unsigned
 * weights), where the VNNI path spends 8 vpdpbusd per input row. The packed tile is already
 * the B operand's VNNI order (register j, lane l, byte b = value 4j + b of row l; Q4's
 * nibbles split into it first). The per-block scales still need each block's int32 sums in
 * vector registers, so they are stored from the tiles and scaled exactly as tile_dot does;
 * the integer sums are exact either way, so the two paths give the same bits. What limits
 * it is that store-and-scale per 16 x 16 x 32 product (ggml's AMX kernels do the same). */
/* Up to 32 input rows (A tiles tmm4, tmm5: rows 0-15, 16-31) against up to 32 weight rows
 * (two packed tiles, B tiles tmm6, tmm7), one 32-value block at a time: four tile products
 * into tmm0-3 (C[h][g]: input half h, weight tile g), stored as int32 sums and scaled in
 * float32 as tile_dot does. Each A and B tile feeds two products, and a block's scaling
 * runs while the next block's products are in the tile unit. */
/* Block t's weight tile as tdpbsud's B operand: Q8_0's packed bytes as they are; other
 * codes as load_codes makes them, into buf (register r is VNNI row r). */
static inline __attribute__((always_inline)) const void *
weight_operand(int fmt, const uint8_t *t, int64_t tb, uint8_t *buf) {
    prefetch_ahead(t, tb);
    if (fmt == Q8_0) return t;
    __m512i w[8];
    load_codes(fmt, t, w);
    for (int r = 0; r < 8; r++) _mm512_store_si512((void *)(buf + 64 * r), w[r]);
    return buf;
}

/* C = A B over one block, stored as int32 sums to dst (tile numbers must be constants). */
#define PRODUCT(C, A, B, dst)                                                                \
    do {                                                                                     \
        _tile_zero(C);                                                                       \
        _tile_dpbsud(C, A, B);                                                               \
        _tile_stored(C, (dst), 64);                                                          \
    } while (0)

/* tile_dot's float32 steps for block b of one (input half, weight tile; packed tile blocks
 * at qs): 16 sums a row (formats with a minimum have no offset: no correction). Not Q6_K,
 * whose halves' integer scales need the halves' sums apart. */
static inline __attribute__((always_inline)) void
scale_block(int fmt, const int32_t *sums, const uint8_t *qs, const uint16_t *d,
            const uint16_t *mins, int64_t b, const float *dx, const int32_t *corr,
            const float *dxsx, int64_t xm, int64_t M, __m512 *acc) {
    __m512 dw, mw;
    block_scales(fmt, qs + b * tile_bytes(fmt), d, mins, b, &dw, &mw);
    for (int64_t m = 0; m < M; m++) {
        __m512i s = _mm512_load_si512((const void *)(sums + 16 * m));
        if (offset_of(fmt)) s = _mm512_add_epi32(s, _mm512_set1_epi32(corr[b * xm + m]));
        acc[m] = scale_sums(fmt, s, dx[b * xm + m], dxsx[b * xm + m], dw, mw, acc[m]);
    }
}

static inline __attribute__((always_inline)) void
scale_blocks(int fmt, int32_t (*s)[256], const uint8_t *qs0, const uint8_t *qs1,
             const uint16_t *d0, const uint16_t *d1, const uint16_t *mn0, const uint16_t *mn1,
             int64_t b, const float *dx, const int32_t *corr, const float *dxsx, int64_t xm,
             int64_t M0, int64_t M1, int two, __m512 (*acc)[16]) {
    scale_block(fmt, s[0], qs0, d0, mn0, b, dx, corr, dxsx, xm, M0, acc[0]);
    if (two) scale_block(fmt, s[1], qs1, d1, mn1, b, dx, corr, dxsx, xm, M0, acc[1]);
    if (M1) {
        scale_block(fmt, s[2], qs0, d0, mn0, b, dx + 16, corr + 16, dxsx + 16, xm, M1, acc[2]);
        if (two) scale_block(fmt, s[3], qs1, d1, mn1, b, dx + 16, corr + 16, dxsx + 16, xm, M1, acc[3]);
    }
}

/* out[h][g][m][16]: input half h, weight tile g (two: the second tile exists). Tiles
 * configured for M0 = min(M, 16) and M1 = M - M0 rows. */
static inline __attribute__((always_inline)) void
quad_dot_amx(int fmt, const uint8_t *qs0, const uint8_t *qs1, const uint16_t *d0,
             const uint16_t *d1, const uint16_t *mn0, const uint16_t *mn1, int two,
             const int8_t *q, const float *dx, const int32_t *corr, const float *dxsx,
             int64_t xm, int64_t M0, int64_t M1, int64_t K, float *out) {
    const int64_t nb = K / QK, tb = tile_bytes(fmt);
    _Alignas(64) uint8_t wbuf[2][2][512];
    _Alignas(64) int32_t sums[2][4][256];
    __m512 acc[4][16];
    for (int u = 0; u < 4; u++)
        for (int m = 0; m < 16; m++) acc[u][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        int32_t (*s)[256] = sums[b & 1];
        _tile_loadd(6, weight_operand(fmt, qs0 + b * tb, tb, wbuf[b & 1][0]), 64);
        _tile_loadd(4, q + b * xm * QK, QK);
        PRODUCT(0, 4, 6, s[0]);
        if (M1) {
            _tile_loadd(5, q + (b * xm + 16) * QK, QK);
            PRODUCT(2, 5, 6, s[2]);
        }
        if (two) {
            _tile_loadd(7, weight_operand(fmt, qs1 + b * tb, tb, wbuf[b & 1][1]), 64);
            PRODUCT(1, 4, 7, s[1]);
            if (M1) PRODUCT(3, 5, 7, s[3]);
        }
        if (b > 0) /* the previous block's, while this one's products run */
            scale_blocks(fmt, sums[(b - 1) & 1], qs0, qs1, d0, d1, mn0, mn1, b - 1, dx, corr,
                         dxsx, xm, M0, M1, two, acc);
    }
    scale_blocks(fmt, sums[(nb - 1) & 1], qs0, qs1, d0, d1, mn0, mn1, nb - 1, dx, corr, dxsx,
                 xm, M0, M1, two, acc);
    for (int u = 0; u < 4; u++)
        for (int m = 0; m < 16; m++) _mm512_storeu_ps(out + (u * 16 + m) * TILE, acc[u][m]);
}

static void configure_tiles(int64_t M0, int64_t M1) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int g = 0; g < 2; g++) {
        c.rows[g] = (uint8_t)M0, c.colsb[g] = 64;      /* tmm0, tmm1: C[0][g] */
        c.rows[2 + g] = (uint8_t)M1, c.colsb[2 + g] = M1 ? 64 : 0; /* tmm2, tmm3: C[1][g] */
        c.rows[6 + g] = 8, c.colsb[6 + g] = 64;        /* tmm6, tmm7: B */
    }
    c.rows[4] = (uint8_t)M0, c.colsb[4] = QK;          /* tmm4, tmm5: A */
    c.rows[5] = (uint8_t)M1, c.colsb[5] = M1 ? QK : 0; /* a tile of no rows has no columns */
    load_tile_config(&c);
}

/* One thread's share: input rows in chunks of 32, its weight tiles [lo, hi) in pairs. */
static void amx_share(int fmt, int is_bf16, const uint8_t *qs, const uint16_t *scales,
                      const uint16_t *mins, const int8_t *q, const float *dx,
                      const int32_t *corr, const float *dxsx, const void *bias, void *y,
                      int64_t M, int64_t N, int64_t K, int64_t lo, int64_t hi) {
    const int64_t nb = K / QK, tb = tile_bytes(fmt);
    float out[4 * 16 * TILE];
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int64_t mm = M - m0 < 32 ? M - m0 : 32, M0 = mm < 16 ? mm : 16, M1 = mm - M0;
        configure_tiles(M0, M1);
        for (int64_t tile = lo; tile < hi; tile += 2) {
            const int two = tile + 1 < hi;
            const int64_t ts = tile_scales(fmt, nb);
            const uint16_t *mn0 = mins ? mins + tile * ts : NULL;
#define QUAD(F) quad_dot_amx(F, qs + tile * nb * tb, qs + (tile + 1) * nb * tb,              \
                             scales + tile * ts, scales + (tile + 1) * ts, mn0,              \
                             mn0 ? mn0 + ts : NULL, two, q + m0 * QK, dx + m0,       \
                             corr + m0, dxsx + m0, M, M0, M1, K, out)
            switch (fmt) { /* the format as a constant: each one's loop has no branches on it */
            case Q8_0: QUAD(Q8_0); break;
            case Q4_0: QUAD(Q4_0); break;
            case Q4_1: QUAD(Q4_1); break;
            case Q5_0: QUAD(Q5_0); break;
            case Q5_1: QUAD(Q5_1); break;
            case Q4_K: QUAD(Q4_K); break;
            default: QUAD(Q5_K); break; /* Q6_K takes the VNNI path */
            }
#undef QUAD
            for (int h = 0; h < (M1 ? 2 : 1); h++)
                for (int g = 0; g <= two; g++)
                    store_tile(is_bf16, y, out + (2 * h + g) * 16 * TILE, m0 + 16 * h,
                               h ? M1 : M0, N, (tile + g) * TILE, bias);
        }
    }
    _tile_release(); /* oneDNN configures its own on its next call */
}
#endif /* AMX */
#elif AVX2_PATH
/* AVX2 (no AVX-512: AMD Zen 1-3, older Intel): the same sums as the VNNI path, 8 weight rows
 * (half a tile, 32 bytes of each 64-byte register) at a time. vpmaddubsw multiplies unsigned
 * by signed bytes and adds pairs into int16, saturating, so each format keeps its sums in
 * range: a pair is at most 2 * 63 * 127 = 16,002; 4-bit codes' 8 registers of a block sum in
 * int16 before one vpmaddwd (8 * 3,810 = 30,480), 5-bit ones' 4 at a time (4 * 7,874),
 * 6-bit ones' 2 (2 * 16,002); Q8_0's bytes are made signed (u - 128) and multiplied as |w|
 * by sign(w) q (<= 32,512 a pair), each register widened to int32 at once, so its offset
 * correction is not needed. Integer sums are exact in all, and the float steps are the VNNI
 * path's per lane in the same order: the same bits as the VNNI path
 * (tests/model/test_quant.py). */
static inline __m256 block_halves8(const uint16_t *h, int64_t b, int half) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + b * TILE + 8 * half)));
}

/* 8 bytes of a K-quant's integer scales as 8 int32 (signed for Q6_K). */
static inline __m256i sub_scales8(int fmt, const uint8_t *p) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p);
    return fmt == Q6_K ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
}

/* block_scales for 8 rows (half h of the tile). */
static inline __attribute__((always_inline)) void
block_scales8(int fmt, const uint8_t *t, const uint16_t *d, const uint16_t *mins, int64_t b,
              int h, __m256 *dw, __m256 *mw) {
    *mw = _mm256_setzero_ps();
    if (!is_k(fmt)) {
        *dw = block_halves8(d, b, h);
        if (has_min(fmt)) *mw = block_halves8(mins, b, h);
        return;
    }
    *dw = block_halves8(d, b / 8, h);
    if (fmt == Q6_K) return;
    const uint8_t *sub = sub_scales(fmt, t) + 8 * h;
    *dw = _mm256_mul_ps(*dw, _mm256_cvtepi32_ps(sub_scales8(fmt, sub)));
    *mw = _mm256_sub_ps(_mm256_setzero_ps(),
                        _mm256_mul_ps(block_halves8(mins, b / 8, h),
                                      _mm256_cvtepi32_ps(sub_scales8(fmt, sub + 16))));
}

/* 32 bits of a bit plane as 32 bytes: v where the bit is set, else 0. */
static inline __m256i plane_bytes(uint32_t bits, char v) {
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i x = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), which), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(x, bit), _mm256_set1_epi8(v));
}

/* Half h of a tile block's codes as 8 registers of 32 bytes (load_codes' layout; Q8_0's
 * bytes made signed). */
static inline __attribute__((always_inline)) void
load_codes8(int fmt, const uint8_t *t, int h, __m256i *w) {
    if (fmt == Q8_0) {
        for (int j = 0; j < 8; j++)
            w[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(t + 64 * j + 32 * h)),
                                    _mm256_set1_epi8((char)0x80));
        return;
    }
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(t + 64 * j + 32 * h));
        w[2 * j] = _mm256_and_si256(v, mask);
        w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    }
    for (int i = 0; i < bits_of(fmt) - 4; i++)
        for (int r = 0; r < 8; r++)
            w[r] = _mm256_or_si256(w[r], plane_bytes((uint32_t)(plane_word(t, i, r) >> (32 * h)),
                                                     (char)(16 << i)));
}

/* Registers [j0, j0 + n) of a block's products with one input row's bytes xb, as int32. */
static inline __m256i sums8(int fmt, const __m256i *w, const int32_t *xb, int j0, int n) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int group = fmt == Q8_0 ? 1 : bits_of(fmt) == 4 ? 8 : bits_of(fmt) == 5 ? 4 : 2;
    __m256i s = _mm256_setzero_si256();
    for (int g = j0; g < j0 + n; g += group) {
        __m256i p = _mm256_setzero_si256();
        for (int j = g; j < g + group; j++) {
            const __m256i x = _mm256_set1_epi32(xb[j]);
            /* Q8_0: w[j] holds |w|; sign(x, w) moves w's sign onto the input */
            p = _mm256_add_epi16(p, fmt == Q8_0 ? _mm256_maddubs_epi16(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(x, w[j]))
                                                : _mm256_maddubs_epi16(w[j], x));
        }
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
    }
    return s;
}

/* Inlined where the caller names the format, so each format's loop has no branches on it
 * (4-6 % faster at 32-128 rows on a Zen 2 core). */
static inline __attribute__((always_inline)) void
tile_dot(int fmt, const uint8_t *qs, const uint16_t *d, const uint16_t *mins, const int8_t *q,
         const float *dx, const int32_t *corr, const int32_t *corr_lo, const float *dxsx,
         int64_t xm, int64_t M, int64_t K, float *out) {
    const int64_t nb = K / QK, tb = tile_bytes(fmt);
    __m256 acc[M_CHUNK][2];
    for (int64_t m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *t = qs + b * tb;
        prefetch_ahead(t, tb);
        for (int h = 0; h < 2; h++) {
            __m256i w[8], sc0 = _mm256_setzero_si256(), sc1 = sc0;
            __m256 dw, mw;
            load_codes8(fmt, t, h, w);
            block_scales8(fmt, t, d, mins, b, h, &dw, &mw);
            if (fmt == Q6_K) {
                sc0 = sub_scales8(fmt, sub_scales(fmt, t) + 8 * h);
                sc1 = sub_scales8(fmt, sub_scales(fmt, t) + 16 + 8 * h);
            }
            for (int64_t m = 0; m < M; m++) {
                const int32_t *xb = (const int32_t *)(q + (b * xm + m) * QK);
                const int64_t i = b * xm + m;
                __m256i s;
                if (fmt == Q6_K) {
                    const __m256i s0 = _mm256_add_epi32(sums8(fmt, w, xb, 0, 4), _mm256_set1_epi32(corr_lo[i]));
                    const __m256i s1 = _mm256_add_epi32(sums8(fmt, w, xb, 4, 4),
                                                        _mm256_set1_epi32(corr[i] - corr_lo[i]));
                    s = _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1));
                } else {
                    s = sums8(fmt, w, xb, 0, 8);
                    /* Q8_0's products are signed already: no offset */
                    if (fmt != Q8_0 && offset_of(fmt))
                        s = _mm256_add_epi32(s, _mm256_set1_epi32(corr[i]));
                }
                acc[m][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dx[i])),
                                            dw, acc[m][h]);
                if (has_min(fmt)) acc[m][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dxsx[i]), acc[m][h]);
            }
        }
    }
    for (int64_t m = 0; m < M; m++) {
        _mm256_storeu_ps(out + m * TILE, acc[m][0]);
        _mm256_storeu_ps(out + m * TILE + 8, acc[m][1]);
    }
}
#else
/* Plain C, where neither AVX512-VNNI nor AVX2 is there: the same sums, value by value. */
static void tile_dot(int fmt, const uint8_t *qs, const uint16_t *d, const uint16_t *mins,
                     const int8_t *q, const float *dx, const int32_t *corr,
                     const int32_t *corr_lo, const float *dxsx, int64_t xm, int64_t M,
                     int64_t K, float *out) {
    const int64_t nb = K / QK, tb = tile_bytes(fmt);
    for (int64_t m = 0; m < M; m++)
        for (int l = 0; l < TILE; l++) {
            float s = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *t = qs + b * tb;
                const int64_t i = b * xm + m;
                int32_t half[2] = {corr_lo[i], corr[i] - corr_lo[i]};
                for (int k = 0; k < QK; k++) half[k / 16] += code_at(fmt, t, l, k) * q[i * QK + k];
                float dw = half_to_f32(d[(is_k(fmt) ? b / 8 : b) * TILE + l]), mw = 0.f;
                int32_t dot = half[0] + half[1];
                if (fmt == Q6_K) {
                    const int8_t *sc = (const int8_t *)sub_scales(fmt, t);
                    dot = sc[l] * half[0] + sc[16 + l] * half[1];
                } else if (is_k(fmt)) {
                    dw *= (float)sub_scales(fmt, t)[l];
                    mw = -(half_to_f32(mins[(b / 8) * TILE + l]) * (float)sub_scales(fmt, t)[16 + l]);
                } else if (has_min(fmt)) {
                    mw = half_to_f32(mins[b * TILE + l]);
                }
                s += dw * dx[i] * (float)dot;
                if (has_min(fmt)) s += mw * dxsx[i];
            }
            out[m * TILE + l] = s;
        }
}
#endif

/* Calls of at least this many input rows take the AMX path where the CPU and OS give one:
 * measured on the bundled model's shapes with weights out of cache, VNNI is faster at 8
 * rows, level at 16 (Q8_0 ahead on AMX, Q4 behind), and AMX 1.2-1.4x faster at 32 and 64
 * (docs/performance.md). */
#ifdef HAVE_AMX
static int64_t amx_min_rows = 24;
#endif

int64_t quant_linear_amx(int64_t min_rows) {
#ifdef HAVE_AMX
    const int64_t before = amx_min_rows;
    if (!amx_permitted()) return 0;
    if (min_rows > 0) amx_min_rows = min_rows;
    return before;
#else
    (void)min_rows;
    return 0;
#endif
}

/* Returns 0; -1 for shapes or formats it does not take, or no memory (the caller then uses
 * the dequantized weights). N: the layer's rows (the packed tiles may pad it to 16). */
/* 1 where the block kernels run on AVX-512 VNNI (or AMX) or AVX2 + FMA + F16C (vpmaddubsw),
 * 0 where they fall back to scalar C (several times slower than oneDNN's dense GEMM, so the
 * loader's quantization "auto" keeps the weights dense there). */
int quant_linear_vectorized(void) {
#if VNNI_PATH || AVX2_PATH
    return 1;
#else
    return 0;
#endif
}

int quant_linear(int fmt, int is_bf16, const void *x, const void *qs, const void *scales,
                 const void *mins, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                 int64_t num_threads) {
    if (fmt < Q8_0 || fmt > Q6_K || M < 1 || N < 1 || K < QK || K % (is_k(fmt) ? QK_K : QK)
            || (has_min(fmt) && mins == NULL))
        return -1;
    const int64_t nb = K / QK, tiles = (N + TILE - 1) / TILE, tb = tile_bytes(fmt);
    /* the input rows' int8 values block-major (block b of row m at (b * M + m) * 32), then
     * dx, corr, corr_lo, dxsx (block-major too) */
    char *buf = malloc((size_t)(M * K + 4 * M * nb * 4 + 64));
    if (!buf) return -1;
    int8_t *q = (int8_t *)buf;
    float *dx = (float *)(buf + ((M * K + 63) & ~(int64_t)63));
    int32_t *corr = (int32_t *)(dx + M * nb);
    int32_t *corr_lo = corr + M * nb;
    float *dxsx = (float *)(corr_lo + M * nb);
    for (int64_t m = 0; m < M; m++)
        quantize_row(fmt, is_bf16, (const char *)x + m * K * (is_bf16 ? 2 : 4), K, M,
                     q + m * QK, dx + m, corr + m, corr_lo + m, dxsx + m);
#ifdef HAVE_AMX
    /* Q6_K's halves have their own integer scales: a tile product sums all 32 values */
    const int use_amx = fmt != Q6_K && M >= amx_min_rows && amx_permitted();
#endif
    int64_t nt = num_threads < tiles ? num_threads : tiles;
    nt = nt > 1 ? nt : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int64_t t = team_thread(), n = team_size();
        const int64_t lo = tiles * t / n, hi = tiles * (t + 1) / n;
#ifdef HAVE_AMX
        if (use_amx)
            amx_share(fmt, is_bf16, qs, scales, mins, q, dx, corr, dxsx, bias, y, M, N, K, lo, hi);
        else
#endif
        {
            float out[M_CHUNK * TILE];
            /* input chunks outside, tiles inside: a chunk's int8 rows stay in L1 while the
             * thread's share of the weights streams from its L2 (tiles outside re-read every
             * input row from L3 once a tile: prompt-sized M then lost to oneDNN) */
            for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
                const int64_t mm = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
                for (int64_t tile = lo; tile < hi; tile++) {
                    const uint8_t *tq = (const uint8_t *)qs + tile * nb * tb;
                    const uint16_t *td = (const uint16_t *)scales + tile * tile_scales(fmt, nb);
                    const uint16_t *tm = mins == NULL ? NULL : (const uint16_t *)mins + tile * tile_scales(fmt, nb);
                    /* the format as a constant: the AVX2 path's loop specialised to it */
#define TILE_DOT(F) tile_dot(F, tq, td, tm, q + m0 * QK, dx + m0, corr + m0, corr_lo + m0, \
                                 dxsx + m0, M, mm, K, out)
                    switch (fmt) {
                    case Q8_0: TILE_DOT(Q8_0); break;
                    case Q4_0: TILE_DOT(Q4_0); break;
                    case Q4_1: TILE_DOT(Q4_1); break;
                    case Q5_0: TILE_DOT(Q5_0); break;
                    case Q5_1: TILE_DOT(Q5_1); break;
                    case Q4_K: TILE_DOT(Q4_K); break;
                    case Q5_K: TILE_DOT(Q5_K); break;
                    default: TILE_DOT(Q6_K); break;
                    }
#undef TILE_DOT
                    store_tile(is_bf16, y, out, m0, mm, N, tile * TILE, bias);
                }
            }
        }
    }
    free(buf);
    return 0;
}

/* Rows ids[0..R) of a packed weight as float32, each value computed as the gguf package's
 * dequantize computes it in numpy: one float32 rounding an operation, in its order, no
 * fused multiply-add (d sc and dmin mn are exact, so their order does not matter). The
 * token embeddings of a model whose embedding matrix is kept as blocks (the tied LM head's)
 * are these rows. Returns 0; -1 for a format it does not take or an id outside [0, N). */
__attribute__((optimize("fp-contract=off")))
int quant_rows(int fmt, const void *qs, const void *scales, const void *mins,
               const int64_t *ids, int64_t R, int64_t N, int64_t K, float *out) {
    if (fmt < Q8_0 || fmt > Q6_K || K % (is_k(fmt) ? QK_K : QK) || (has_min(fmt) && mins == NULL))
        return -1;
    const int64_t nb = K / QK, tb = tile_bytes(fmt), ts = tile_scales(fmt, nb);
    for (int64_t r = 0; r < R; r++)
        if (ids[r] < 0 || ids[r] >= N) return -1;
    for (int64_t r = 0; r < R; r++) {
        const int64_t tile = ids[r] / TILE;
        const int l = (int)(ids[r] % TILE);
        const uint16_t *d = (const uint16_t *)scales + tile * ts;
        const uint16_t *mn = mins == NULL ? NULL : (const uint16_t *)mins + tile * ts;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *t = (const uint8_t *)qs + (tile * nb + b) * tb;
            const int64_t s = (is_k(fmt) ? b / 8 : b) * TILE + l;
            float dw = half_to_f32(d[s]), m = 0.f;
            if (fmt == Q4_K || fmt == Q5_K) {
                m = half_to_f32(mn[s]) * (float)sub_scales(fmt, t)[16 + l];
                dw = dw * (float)sub_scales(fmt, t)[l];
            } else if (has_min(fmt)) {
                m = half_to_f32(mn[s]);
            }
            float *o = out + r * K + b * QK;
            for (int k = 0; k < QK; k++) {
                const int u = code_at(fmt, t, l, k);
                if (fmt == Q6_K) {
                    const int8_t sc = ((const int8_t *)sub_scales(fmt, t))[(k / 16) * 16 + l];
                    o[k] = (dw * (float)sc) * (float)(u - 32);
                } else if (fmt == Q4_K || fmt == Q5_K) {
                    o[k] = dw * (float)u - m;
                } else if (has_min(fmt)) {
                    o[k] = dw * (float)u + m;
                } else {
                    o[k] = dw * (float)(u - offset_of(fmt));
                }
            }
        }
    }
    return 0;
}
