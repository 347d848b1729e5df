/* Paged prefill attention for the CPU: a chunk of T new tokens of one sequence, causal over
 * all its keys, read in place from the block-structured KV cache (layout as in
 * paged_attention.c). Token i sits at position num_computed + i and sees keys
 * 0 .. num_computed + i; the chunk's own keys are in the cache already.
 *
 * Flash-attention style (Dao et al., NeurIPS 2022): a work item is one KV head and a tile of
 * QT tokens, i.e. QT * G query rows (grouped-query attention: the G query heads of a KV head
 * share its keys). Keys come in tiles of 16, converted to float32 and transposed to [D][16],
 * so a row's 16 scores are D broadcast FMAs with no horizontal sums; four rows go together,
 * each key vector loaded once for all four. The softmax is online (a running max and sum
 * per row, rescaling the accumulator), so no T x L score matrix exists.
 *
 * AVX-512 and head size 64 only (the bundled model's); elsewhere it returns -1 and the caller
 * uses PyTorch's SDPA. Work items go to PyTorch's OpenMP pool dynamically, the later tiles
 * (more keys) first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16.h"
#include "kernels.h"
#include "fast_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#define D 64
#define KT 16
#define QT 32
#define MAX_G 16
#define MAX_ROWS (QT * MAX_G)

/* exp(x) on 16 lanes, x <= 0: fast_exp.h's reduction and polynomial in AVX-512, with scalef
 * for the 2^n; below -87 it gives exp(-87). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
                                   _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(e, n);
}

static inline __m512 load16(const void *p, int is_bf16) {
    if (is_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps(p);
}

/* Online-softmax state of a work item's rows (token-major, G rows a token; the padding
 * rows up to `padded` repeat the last token): zero output, no max yet, and each row's
 * position, the last key it may see. */
static void reset_rows(float (*acc)[D], float *mx, float *den, int32_t *pos, int64_t rows,
                       int64_t padded, int64_t G, int64_t first_pos) {
    for (int64_t r = 0; r < padded; r++) {
        const int64_t rr = r < rows ? r : rows - 1;
        memset(acc[r], 0, sizeof(acc[r]));
        mx[r] = -INFINITY;
        den[r] = 0.f;
        pos[r] = (int32_t)(first_pos + rr / G);
    }
}

/* Scratch of one thread: query rows, accumulators, the key tile (transposed) and values. */
typedef struct {
    float q[MAX_ROWS][D] __attribute__((aligned(64)));
    float acc[MAX_ROWS][D] __attribute__((aligned(64)));
    float kt[D][KT] __attribute__((aligned(64)));
    float v[KT][D] __attribute__((aligned(64)));
    float p[4][KT] __attribute__((aligned(64)));
    float mx[MAX_ROWS], den[MAX_ROWS];
    int32_t pos[MAX_ROWS];
} scratch_t;

static void item(int is_bf16, const char *q, int64_t q_stride, const char *k_base,
                 const char *v_base, const int64_t *table, int64_t num_computed, int64_t i0,
                 int64_t i1, int64_t G, int64_t BS, float scale, char *out, int64_t o_stride,
                 scratch_t *s) {
    const int64_t esz = is_bf16 ? 2 : 4;
    const int64_t rows = (i1 - i0) * G, padded = (rows + 3) & ~(int64_t)3;
    reset_rows(s->acc, s->mx, s->den, s->pos, rows, padded, G, num_computed + i0);
    for (int64_t r = 0; r < padded; r++) {  /* rows token-major; padding repeats the last */
        const int64_t rr = r < rows ? r : rows - 1;
        const char *qr = q + ((i0 + rr / G) * q_stride + (rr % G) * D) * esz;
        for (int c = 0; c < D; c += 16)
            _mm512_store_ps(s->q[r] + c, _mm512_mul_ps(load16(qr + c * esz, is_bf16),
                                                       _mm512_set1_ps(scale)));
    }
    const int64_t last = num_computed + i1 - 1;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j0 = 0; j0 <= last; j0 += KT) {
        const int64_t n = last + 1 - j0 < KT ? last + 1 - j0 : KT;
        for (int64_t jj = 0; jj < KT; jj++) {
            float kr[D] __attribute__((aligned(64)));
            if (jj < n) {
                const int64_t p = j0 + jj, off = (table[p / BS] * BS + p % BS) * D * esz;
                for (int c = 0; c < D; c += 16) {
                    _mm512_store_ps(kr + c, load16(k_base + off + c * esz, is_bf16));
                    _mm512_store_ps(s->v[jj] + c, load16(v_base + off + c * esz, is_bf16));
                }
            } else {
                memset(kr, 0, sizeof(kr));
                memset(s->v[jj], 0, sizeof(s->v[jj]));
            }
            for (int d = 0; d < D; d++) s->kt[d][jj] = kr[d];
        }
        const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32((int32_t)j0), iota);
        for (int64_t r = 0; r < padded; r += 4) {
            if (s->pos[r + 3] < j0) continue;  /* every key of the tile is in these rows' future */
            __m512 a[4], b[4];
            for (int i = 0; i < 4; i++) a[i] = b[i] = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 2) {  /* two partial sums a row: 8 FMA chains */
                const __m512 k0 = _mm512_load_ps(s->kt[d]), k1 = _mm512_load_ps(s->kt[d + 1]);
                for (int i = 0; i < 4; i++) {
                    a[i] = _mm512_fmadd_ps(_mm512_set1_ps(s->q[r + i][d]), k0, a[i]);
                    b[i] = _mm512_fmadd_ps(_mm512_set1_ps(s->q[r + i][d + 1]), k1, b[i]);
                }
            }
            float alpha[4];
            for (int i = 0; i < 4; i++) {
                const __mmask16 seen = _mm512_cmple_epi32_mask(keys,
                                                               _mm512_set1_epi32(s->pos[r + i]));
                const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen,
                                                     _mm512_add_ps(a[i], b[i]));
                const float tile_max = _mm512_reduce_max_ps(sc);
                const float m = tile_max > s->mx[r + i] ? tile_max : s->mx[r + i];
                const __m512 p = exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m)));
                _mm512_store_ps(s->p[i], p);
                alpha[i] = _mm512_cvtss_f32(exp512(_mm512_set1_ps(s->mx[r + i] - m)));
                s->den[r + i] = s->den[r + i] * alpha[i] + _mm512_reduce_add_ps(p);
                s->mx[r + i] = m;
            }
            /* The four rows' accumulators together: 16 independent FMA chains, each value
             * vector loaded once for all four rows. */
            __m512 o[4][D / 16];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < D / 16; c++)
                    o[i][c] = _mm512_mul_ps(_mm512_load_ps(s->acc[r + i] + 16 * c),
                                            _mm512_set1_ps(alpha[i]));
            for (int64_t jj = 0; jj < n; jj++) {
                __m512 vv[D / 16];
                for (int c = 0; c < D / 16; c++) vv[c] = _mm512_load_ps(s->v[jj] + 16 * c);
                for (int i = 0; i < 4; i++) {
                    const __m512 pj = _mm512_set1_ps(s->p[i][jj]);
                    for (int c = 0; c < D / 16; c++) o[i][c] = _mm512_fmadd_ps(pj, vv[c], o[i][c]);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < D / 16; c++) _mm512_store_ps(s->acc[r + i] + 16 * c, o[i][c]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        char *o = out + ((i0 + r / G) * o_stride + (r % G) * D) * esz;
        const float inv = 1.f / s->den[r];
        for (int d = 0; d < D; d++) {
            const float val = s->acc[r][d] * inv;
            if (is_bf16) ((uint16_t *)o)[d] = f32_to_bf16(val);
            else ((float *)o)[d] = val;
        }
    }
}

#if defined(__AVX512BF16__)
/* bfloat16 with AVX512-BF16's vdpbf16ps: each instruction multiplies 16 lanes of bf16 pairs and
 * adds both products to a float32 lane, twice the multiply-adds of a float32 FMA. Both
 * products need their operands in "pair" layout, so the call first packs the sequence's keys
 * and values once per KV head (all query tiles share them), in tiles of PKT keys:
 *   keys:   [PKT/16 halves... ] as [D/2 dim pairs][PKT keys] of 32-bit (two dims of one key):
 *           a row's scores for 16 keys are D/2 vdpbf16ps against a broadcast query dim pair;
 *   values: [PKT/2 key pairs][D dims] of 32-bit (one dim of two keys): a row's output for 16
 *           dims gains two keys per vdpbf16ps against a broadcast pair of probabilities.
 * The probabilities are rounded to bf16 before the value product, as PyTorch's CPU flash
 * attention does for reduced-precision inputs; scores, the running max and the denominator
 * stay float32, and the scale is applied to the float32 scores. */
#define PKT 32                /* keys per packed tile */
#define TILE_WORDS (D / 2 * PKT) /* 32-bit words per packed key (or value) tile */
#define R 4                   /* query rows processed together */

typedef struct {
    uint32_t q[MAX_ROWS][D / 2] __attribute__((aligned(64)));  /* bf16 pairs, unscaled */
    float acc[MAX_ROWS][D] __attribute__((aligned(64)));
    uint16_t p[R][PKT] __attribute__((aligned(64)));
    float mx[MAX_ROWS], den[MAX_ROWS];
    int32_t pos[MAX_ROWS];
} scratch_bf16_t;

/* Packs keys/values [j0, j0 + PKT) of one KV head; keys past `len` are zero. */
static void pack_tile(const uint16_t *k_base, const uint16_t *v_base, const int64_t *table,
                      int64_t BS, int64_t j0, int64_t len, uint32_t *kp, uint32_t *vp) {
    for (int64_t jj = 0; jj < PKT; jj++) {
        const int64_t p = j0 + jj;
        const uint32_t *kr = NULL;
        const uint16_t *vr = NULL;
        if (p < len) {
            const int64_t off = (table[p / BS] * BS + p % BS) * D;
            kr = (const uint32_t *)(k_base + off);
            vr = v_base + off;
        }
        for (int dp = 0; dp < D / 2; dp++) kp[dp * PKT + jj] = kr ? kr[dp] : 0;
        uint16_t *vd = (uint16_t *)(vp + (jj / 2) * D) + (jj & 1);
        for (int d = 0; d < D; d++) vd[2 * d] = vr ? vr[d] : 0;
    }
}

static void item_bf16(const uint16_t *q, int64_t q_stride, const uint32_t *kp,
                      const uint32_t *vp, int64_t num_computed, int64_t i0, int64_t i1,
                      int64_t G, float scale, uint16_t *out, int64_t o_stride,
                      scratch_bf16_t *s) {
    const int64_t rows = (i1 - i0) * G, padded = (rows + R - 1) / R * R;
    reset_rows(s->acc, s->mx, s->den, s->pos, rows, padded, G, num_computed + i0);
    for (int64_t r = 0; r < padded; r++) {  /* rows token-major; padding repeats the last */
        const int64_t rr = r < rows ? r : rows - 1;
        memcpy(s->q[r], q + (i0 + rr / G) * q_stride + (rr % G) * D, D * 2);
    }
    const int64_t last = num_computed + i1 - 1;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 <= last; j0 += PKT) {
        const uint32_t *kt = kp + (j0 / PKT) * TILE_WORDS, *vt = vp + (j0 / PKT) * TILE_WORDS;
        const int64_t pairs = ((last + 1 - j0 < PKT ? last + 1 - j0 : PKT) + 1) / 2;
        const __m512i keys0 = _mm512_add_epi32(_mm512_set1_epi32((int32_t)j0), iota);
        const __m512i keys1 = _mm512_add_epi32(keys0, _mm512_set1_epi32(16));
        for (int64_t r = 0; r < padded; r += R) {
            if (s->pos[r + R - 1] < j0) continue;  /* every key of the tile is in the future */
            __m512 a[R][2];
            for (int i = 0; i < R; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
            for (int dp = 0; dp < D / 2; dp++) {
                const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + dp * PKT);
                const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + dp * PKT + 16);
                for (int i = 0; i < R; i++) {
                    const __m512bh qq = (__m512bh)_mm512_set1_epi32((int)s->q[r + i][dp]);
                    a[i][0] = _mm512_dpbf16_ps(a[i][0], qq, k0);
                    a[i][1] = _mm512_dpbf16_ps(a[i][1], qq, k1);
                }
            }
            float alpha[R];
            for (int i = 0; i < R; i++) {
                const __m512i pos = _mm512_set1_epi32(s->pos[r + i]);
                const __m512 ninf = _mm512_set1_ps(-INFINITY);
                const __m512 s0 = _mm512_mask_mul_ps(ninf, _mm512_cmple_epi32_mask(keys0, pos),
                                                     a[i][0], vscale);
                const __m512 s1 = _mm512_mask_mul_ps(ninf, _mm512_cmple_epi32_mask(keys1, pos),
                                                     a[i][1], vscale);
                const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
                const float m = tile_max > s->mx[r + i] ? tile_max : s->mx[r + i];
                const __m512 mm = _mm512_set1_ps(m);
                const __m512 p0 = exp512(_mm512_sub_ps(s0, mm)), p1 = exp512(_mm512_sub_ps(s1, mm));
                _mm512_store_si512(s->p[i], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                alpha[i] = s->mx[r + i] == -INFINITY ? 0.f : fast_expf(s->mx[r + i] - m);
                s->den[r + i] = s->den[r + i] * alpha[i] +
                                _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
                s->mx[r + i] = m;
            }
            __m512 o[R][D / 16];
            for (int i = 0; i < R; i++)
                for (int c = 0; c < D / 16; c++)
                    o[i][c] = _mm512_mul_ps(_mm512_load_ps(s->acc[r + i] + 16 * c),
                                            _mm512_set1_ps(alpha[i]));
            for (int64_t kk = 0; kk < pairs; kk++) {
                __m512bh vv[D / 16];
                for (int c = 0; c < D / 16; c++)
                    vv[c] = (__m512bh)_mm512_load_si512(vt + kk * D + 16 * c);
                for (int i = 0; i < R; i++) {
                    const __m512bh pj = (__m512bh)_mm512_set1_epi32(((const int *)s->p[i])[kk]);
                    for (int c = 0; c < D / 16; c++) o[i][c] = _mm512_dpbf16_ps(o[i][c], pj, vv[c]);
                }
            }
            for (int i = 0; i < R; i++)
                for (int c = 0; c < D / 16; c++) _mm512_store_ps(s->acc[r + i] + 16 * c, o[i][c]);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *o = out + (i0 + r / G) * o_stride + (r % G) * D;
        const float inv = 1.f / s->den[r];
        for (int d = 0; d < D; d++) o[d] = f32_to_bf16(s->acc[r][d] * inv);
    }
}

static int prefill_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kv_cache,
                        const int64_t *table, int64_t num_computed, int64_t T, uint16_t *out,
                        int64_t H, int64_t Hkv, int64_t num_blocks, int64_t BS, float scale,
                        int64_t num_threads) {
    const int64_t G = H / Hkv, tiles = (T + QT - 1) / QT, items = Hkv * tiles;
    const int64_t len = num_computed + T, key_tiles = (len + PKT - 1) / PKT;
    const int64_t head_elems = num_blocks * BS * D;
    /* per KV head: key_tiles packed key tiles, then as many value tiles */
    uint32_t *packed = aligned_alloc(64, (size_t)(Hkv * 2 * key_tiles * TILE_WORDS * 4));
    if (!packed) return -1;
    const int64_t pack_items = Hkv * key_tiles;
    int64_t nt = num_threads < items ? num_threads : items;
    nt = nt > 1 ? nt : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < pack_items; it++) {
            const int64_t h = it / key_tiles, t = it % key_tiles;
            uint32_t *kp = packed + (h * 2 * key_tiles + t) * TILE_WORDS;
            pack_tile(kv_cache + h * head_elems, kv_cache + (Hkv + h) * head_elems, table, BS,
                      t * PKT, len, kp, kp + key_tiles * TILE_WORDS);
        }
        scratch_bf16_t *s = aligned_alloc(64, sizeof(scratch_bf16_t));
        if (!s) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!s) continue;
            const int64_t h = it % Hkv, tile = tiles - 1 - it / Hkv;
            const int64_t i0 = tile * QT, i1 = i0 + QT < T ? i0 + QT : T;
            const uint32_t *kp = packed + h * 2 * key_tiles * TILE_WORDS;
            item_bf16(q + h * G * D, q_stride, kp, kp + key_tiles * TILE_WORDS, num_computed,
                      i0, i1, G, scale, out + h * G * D, H * D, s);
        }
        free(s);
    }
    free(packed);
    return failed ? -1 : 0;
}
#endif

/* q: [T, H, head_dim] with q_stride elements between tokens; out: [T, H, head_dim]
 * contiguous. Returns 0 on success, -1 where the kernel does not apply or memory ran out. */
int paged_prefill_attention(int is_bf16, const void *q, int64_t q_stride, const void *kv_cache,
                            const int64_t *table, int64_t num_computed, int64_t T, void *out,
                            int64_t H, int64_t Hkv, int64_t head_dim, int64_t num_blocks,
                            int64_t BS, float scale, int64_t num_threads) {
    if (head_dim != D || H % Hkv || H / Hkv > MAX_G || T < 1) return -1;
#if defined(__AVX512BF16__)
    if (is_bf16)
        return prefill_bf16(q, q_stride, kv_cache, table, num_computed, T, out, H, Hkv,
                            num_blocks, BS, scale, num_threads);
#endif
    const int64_t G = H / Hkv, tiles = (T + QT - 1) / QT, items = Hkv * tiles;
    const int64_t esz = is_bf16 ? 2 : 4, head_bytes = num_blocks * BS * D * esz;
    int64_t nt = num_threads < items ? num_threads : items;
    nt = nt > 1 ? nt : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
        scratch_t *s = aligned_alloc(64, sizeof(scratch_t));
        if (!s) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!s) continue;
            const int64_t h = it % Hkv, tile = tiles - 1 - it / Hkv;
            const int64_t i0 = tile * QT, i1 = i0 + QT < T ? i0 + QT : T;
            item(is_bf16, (const char *)q + h * G * D * esz, q_stride,
                 (const char *)kv_cache + h * head_bytes,
                 (const char *)kv_cache + (Hkv + h) * head_bytes, table, num_computed, i0, i1,
                 G, BS, scale, (char *)out + h * G * D * esz, H * D, s);
        }
        free(s);
    }
    return failed ? -1 : 0;
}

int64_t paged_prefill_head_dim(void) { return D; }

#else  /* no AVX-512: the caller uses PyTorch */
int64_t paged_prefill_head_dim(void) { return 0; }

int paged_prefill_attention(int is_bf16, const void *q, int64_t q_stride, const void *kv_cache,
                            const int64_t *table, int64_t num_computed, int64_t T, void *out,
                            int64_t H, int64_t Hkv, int64_t head_dim, int64_t num_blocks,
                            int64_t BS, float scale, int64_t num_threads) {
    (void)is_bf16, (void)q, (void)q_stride, (void)kv_cache, (void)table, (void)num_computed;
    (void)T, (void)out, (void)H, (void)Hkv, (void)head_dim, (void)num_blocks, (void)BS;
    (void)scale, (void)num_threads;
    return -1;
}
#endif
