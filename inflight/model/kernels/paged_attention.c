/* Paged decode attention for the CPU: one query token per sequence, keys and values read
 * straight from the block-structured KV cache (PagedAttention, Kwon et al., SOSP 2023),
 * never gathered into a contiguous copy.
 *
 * Layout (see inflight/model/attention.py):
 *   q         [B, H, D]                       float32 or bfloat16 (uint16 bits)
 *   kv_cache  [2, Hkv, num_blocks, BS, D]     same element type as q
 *   tables    [B, M] int64 block ids;  seq_lens [B] int64 (tokens to attend, >= 1)
 *   out       [B, H, D]                       same element type as q
 * Query heads h*G .. h*G+G-1 share KV head h (grouped-query attention), so each key and
 * value row is loaded once for its G queries. Softmax is exact (two passes over the keys:
 * scores, then the weighted sum of values), accumulated in float32.
 *
 * Threads: an OpenMP team splits the (sequence, kv head) pairs into contiguous runs of
 * about equal keys. Loaded after PyTorch, this library binds to the libgomp PyTorch
 * already loaded (same soname), so the team is PyTorch's own pool, whose workers spin
 * right after each PyTorch op: no second pool fights it for the cores.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "kernels.h"
#include "kv8.h"
#include "team.h"

/* Blocks sit anywhere in the pool: while one block's rows are used, fetch the next block's
 * same row, so the jump to a new page does not stall on DRAM latency. */
#define PREFETCH_ROW(ptr, nbytes)                                                          \
    do {                                                                                   \
        const char *p_ = (const char *)(ptr);                                              \
        for (size_t b_ = 0; b_ < (size_t)(nbytes); b_ += 64) __builtin_prefetch(p_ + b_);  \
    } while (0)

#define MAX_D 256
#define MAX_G 16

/* Each of the G rows of `scores` (len each, the first `skip` outside the window and left
 * alone) replaced by exp(score - its max), and denom[g] set to 1 / the row's sum: the
 * softmax, its division left for the output. */
static inline void softmax_rows(float *scores, int64_t G, int64_t skip, int64_t len,
                                const float *mx, float *denom) {
    for (int64_t g = 0; g < G; g++) {
        float sum = 0.f, *sg = scores + g * len;
        for (int64_t t = skip; t < len; t++) {
            sg[t] = fast_expf(sg[t] - mx[g]);
            sum += sg[t];
        }
        denom[g] = 1.f / sum;
    }
}

/* A cache row of n values as float32: a float32 row where it lies (copying it was a
 * memcpy call a row: a quarter of decode attention's time), a bfloat16 one widened into buf. */
static inline const float *row_f32(const float *row, float *buf, int64_t n) {
    (void)buf, (void)n;
    return row;
}

static inline const float *row_bf16(const uint16_t *row, float *buf, int64_t n) {
    for (int64_t d = 0; d < n; d++) buf[d] = bf16_to_f32(row[d]);
    return buf;
}

/* One (sequence, kv head): G query rows against the keys at table's positions skip .. len - 1
 * (skip > 0: a sliding window starts inside the first block). DD is the head size: the
 * runtime D, or a constant (64, 128) so the compiler unrolls the dot products fully.
 * Keys are walked block by block, so no division per key finds its slot. ROW reads a key
 * or value row as float32 (row_f32, row_bf16). */
#define DEFINE_HEAD(NAME, T, LOAD, ROW, STORE, DD)                                         \
static void NAME(const T *q, const T *k_base, const T *v_base, const int64_t *table,      \
                 int64_t skip, int64_t len, int64_t G, int64_t D, int64_t BS, float scale,  \
                 float *scores, T *out) {                                                  \
    (void)D;                                                                               \
    float qf[MAX_G][MAX_D] __attribute__((aligned(64)));                                   \
    float acc[MAX_G][MAX_D] __attribute__((aligned(64)));                                  \
    float kf[MAX_D] __attribute__((aligned(64)));                                          \
    float mx[MAX_G], denom[MAX_G];                                                         \
    for (int64_t g = 0; g < G; g++) {                                                      \
        for (int64_t d = 0; d < DD; d++) {                                                 \
            qf[g][d] = LOAD(q[g * DD + d]) * scale;                                        \
            acc[g][d] = 0.f;                                                               \
        }                                                                                  \
        mx[g] = -INFINITY;                                                                 \
    }                                                                                      \
    const int64_t num_blocks = (len + BS - 1) / BS;                                        \
    for (int64_t j = 0; j < num_blocks; j++) {                                             \
        const T *kb = k_base + table[j] * BS * DD;                                         \
        const T *kn = k_base + table[j + 1 < num_blocks ? j + 1 : j] * BS * DD;            \
        const int64_t n = j == num_blocks - 1 ? len - j * BS : BS;                         \
        for (int64_t o = j ? 0 : skip; o < n; o++) {                                       \
            const float *kr = ROW(kb + o * DD, kf, DD);                                     \
            PREFETCH_ROW(kn + o * DD, DD * sizeof(T));                                     \
            for (int64_t g = 0; g < G; g++) {                                              \
                float s = 0.f;                                                             \
                for (int64_t d = 0; d < DD; d++) s += qf[g][d] * kr[d];                    \
                scores[g * len + j * BS + o] = s;                                          \
                mx[g] = s > mx[g] ? s : mx[g];                                             \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    softmax_rows(scores, G, skip, len, mx, denom);                                         \
    for (int64_t j = 0; j < num_blocks; j++) {                                             \
        const T *vb = v_base + table[j] * BS * DD;                                         \
        const T *vn = v_base + table[j + 1 < num_blocks ? j + 1 : j] * BS * DD;            \
        const int64_t n = j == num_blocks - 1 ? len - j * BS : BS;                         \
        for (int64_t o = j ? 0 : skip; o < n; o++) {                                       \
            const float *vr = ROW(vb + o * DD, kf, DD);                                     \
            PREFETCH_ROW(vn + o * DD, DD * sizeof(T));                                     \
            for (int64_t g = 0; g < G; g++) {                                              \
                const float p = scores[g * len + j * BS + o];                              \
                for (int64_t d = 0; d < DD; d++) acc[g][d] += p * vr[d];                   \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    for (int64_t g = 0; g < G; g++)                                                        \
        for (int64_t d = 0; d < DD; d++) out[g * DD + d] = STORE(acc[g][d] * denom[g]);    \
}

#define ID(x) (x)
DEFINE_HEAD(head_f32, float, ID, row_f32, ID, D)
DEFINE_HEAD(head_bf16, uint16_t, bf16_to_f32, row_bf16, f32_to_bf16, D)
DEFINE_HEAD(head_f32_64, float, ID, row_f32, ID, 64)
DEFINE_HEAD(head_bf16_64, uint16_t, bf16_to_f32, row_bf16, f32_to_bf16, 64)
DEFINE_HEAD(head_f32_128, float, ID, row_f32, ID, 128)
DEFINE_HEAD(head_bf16_128, uint16_t, bf16_to_f32, row_bf16, f32_to_bf16, 128)

/* The same over an 8-bit cache (kv8.h): each key or value row decoded once into float32 and
 * its scale applied to the score (keys) or to the softmax weight (values), so no dequantized
 * copy of a block exists; the queries are rotated into the rows' space and the output back. */
#define DEFINE_HEAD_KV8(NAME, T, LOAD, STORE, DD)                                          \
static inline __attribute__((always_inline)) void NAME##_body(                             \
        const int fmt, const T *q, const uint8_t *k_base, const uint8_t *v_base,           \
        const int64_t *table, int64_t skip, int64_t len, int64_t G, int64_t D, int64_t BS, \
        float scale, float *scores, T *out) {                                              \
    (void)D;                                                                               \
    const int64_t RS = DD + KV8_SCALE_BYTES;                                               \
    float qf[MAX_G][MAX_D] __attribute__((aligned(64)));                                   \
    float acc[MAX_G][MAX_D] __attribute__((aligned(64)));                                  \
    float kf[MAX_D] __attribute__((aligned(64)));                                          \
    float mx[MAX_G], denom[MAX_G];                                                         \
    for (int64_t g = 0; g < G; g++) {                                                      \
        for (int64_t d = 0; d < DD; d++) {                                                 \
            qf[g][d] = LOAD(q[g * DD + d]) * scale;                                        \
            acc[g][d] = 0.f;                                                               \
        }                                                                                  \
        kv8_rotate(qf[g], DD); /* into the rows' rotated space */                          \
        mx[g] = -INFINITY;                                                                 \
    }                                                                                      \
    const int64_t num_blocks = (len + BS - 1) / BS;                                        \
    for (int64_t j = 0; j < num_blocks; j++) {                                             \
        const uint8_t *kb = k_base + table[j] * BS * RS;                                   \
        const uint8_t *kn = k_base + table[j + 1 < num_blocks ? j + 1 : j] * BS * RS;      \
        const int64_t n = j == num_blocks - 1 ? len - j * BS : BS;                         \
        for (int64_t o = j ? 0 : skip; o < n; o++) {                                       \
            PREFETCH_ROW(kn + o * RS, RS);                                                 \
            const float ks = kv8_load_row(fmt, kb + o * RS, DD, kf);                       \
            for (int64_t g = 0; g < G; g++) {                                              \
                float s = 0.f;                                                             \
                for (int64_t d = 0; d < DD; d++) s += qf[g][d] * kf[d];                    \
                s *= ks;                                                                   \
                scores[g * len + j * BS + o] = s;                                          \
                mx[g] = s > mx[g] ? s : mx[g];                                             \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    softmax_rows(scores, G, skip, len, mx, denom);                                         \
    for (int64_t j = 0; j < num_blocks; j++) {                                             \
        const uint8_t *vb = v_base + table[j] * BS * RS;                                   \
        const uint8_t *vn = v_base + table[j + 1 < num_blocks ? j + 1 : j] * BS * RS;      \
        const int64_t n = j == num_blocks - 1 ? len - j * BS : BS;                         \
        for (int64_t o = j ? 0 : skip; o < n; o++) {                                       \
            PREFETCH_ROW(vn + o * RS, RS);                                                 \
            const float vs = kv8_load_row(fmt, vb + o * RS, DD, kf);                       \
            for (int64_t g = 0; g < G; g++) {                                              \
                const float p = scores[g * len + j * BS + o] * vs;                         \
                for (int64_t d = 0; d < DD; d++) acc[g][d] += p * kf[d];                   \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    for (int64_t g = 0; g < G; g++) {                                                      \
        kv8_rotate(acc[g], DD); /* back from the rotated space (H is its own inverse) */   \
        for (int64_t d = 0; d < DD; d++) out[g * DD + d] = STORE(acc[g][d] * denom[g]);    \
    }                                                                                      \
}                                                                                          \
/* one copy per format, so the row decoding has no branch and unrolls */                   \
static void NAME(int fmt, const T *q, const uint8_t *k_base, const uint8_t *v_base,       \
                 const int64_t *table, int64_t skip, int64_t len, int64_t G, int64_t D,     \
                 int64_t BS, float scale, float *scores, T *out) {                          \
    if (fmt == KV_INT8)                                                                    \
        NAME##_body(KV_INT8, q, k_base, v_base, table, skip, len, G, D, BS, scale, scores, \
                    out);                                                                  \
    else                                                                                   \
        NAME##_body(KV_FP8, q, k_base, v_base, table, skip, len, G, D, BS, scale, scores,  \
                    out);                                                                  \
}

DEFINE_HEAD_KV8(head_kv8_f32, float, ID, ID, D)
DEFINE_HEAD_KV8(head_kv8_bf16, uint16_t, bf16_to_f32, f32_to_bf16, D)
DEFINE_HEAD_KV8(head_kv8_f32_64, float, ID, ID, 64)
DEFINE_HEAD_KV8(head_kv8_bf16_64, uint16_t, bf16_to_f32, f32_to_bf16, 64)
DEFINE_HEAD_KV8(head_kv8_f32_128, float, ID, ID, 128)
DEFINE_HEAD_KV8(head_kv8_bf16_128, uint16_t, bf16_to_f32, f32_to_bf16, 128)

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* bfloat16, head size 64, with AVX512-BF16's vdpbf16ps (16 lanes, each adding the products of
 * a bf16 pair to a float32): half the instructions of converting to float32 and using FMAs.
 *   scores: 16 keys at a time; a key's 64-dim dot is two vdpbf16ps into one vector of 16
 *           partial sums, and the 16 keys' vectors are reduced together by a transpose-and-add
 *           tree (45 shuffles and adds in place of 16 horizontal sums);
 *   values: two keys at a time; their rows are interleaved (unpack) into dim pairs, each
 *           vdpbf16ps adding both keys' weighted values for 16 dims. The interleave permutes
 *           the dims inside each vector; the output undoes it once.
 * As PyTorch's CPU flash attention does for reduced-precision inputs, the softmax weights are
 * rounded to bf16 for the value product; scores, max and denominator stay float32, and the
 * scale is applied to the float32 scores. `scores` must hold 2 * G * (len + 2) floats. */
static inline __m512 sum16(__m512 v[16]) {
    __m512 s2[8], s4[4], s8[2];
    for (int i = 0; i < 8; i++)  /* lanes alternate keys 2i, 2i+1 */
        s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                              _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* each 128-bit lane: keys 4i .. 4i+3 */
        s4[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  /* 128-bit lanes: keys 8i..8i+3 twice, then 8i+4..8i+7 twice */
        s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s8[0], s8[1], 0x88),
                         _mm512_shuffle_f32x4(s8[0], s8[1], 0xDD));
}

static void head_bf16_64_dp(const uint16_t *q, const uint16_t *k_base, const uint16_t *v_base,
                            const int64_t *table, int64_t skip, int64_t len, int64_t G,
                            int64_t D, int64_t BS, float scale, float *scores, uint16_t *out) {
    enum { DD = 64, GR = 4 };  /* GR: query rows per pass over the values */
    (void)D, (void)skip; /* windowed layers take head_bf16_64 (the dispatch below) */
    uint16_t *pb = (uint16_t *)(scores + G * len);  /* weights in bf16, rows of len + 2 */
    const int64_t pstride = (len + 2) & ~(int64_t)1;
    float mx[MAX_G];
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
    const __m512 vscale = _mm512_set1_ps(scale);
    /* pass 1: scores. Each key's row of the next block is prefetched as in the kernels
     * above, so the jump to a scattered block does not wait on DRAM. */
    const int64_t nblocks = (len + BS - 1) / BS;
    int64_t j = 0, o = 0;  /* block index and offset of key t */
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const uint16_t *kr[16];
        for (int64_t i = 0; i < 16; i++) {
            if (i < n) {
                kr[i] = k_base + (table[j] * BS + o) * DD;
                PREFETCH_ROW(k_base + (table[j + 1 < nblocks ? j + 1 : j] * BS + o) * DD, DD * 2);
                if (++o == BS) o = 0, j++;
            } else {
                kr[i] = kr[0];  /* padding: computed, never stored */
            }
        }
        const __mmask16 keep = (__mmask16)((1u << n) - 1);
        for (int64_t g = 0; g < G; g++) {
            const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q + g * DD);
            const __m512bh q1 = (__m512bh)_mm512_loadu_si512(q + g * DD + 32);
            __m512 v[16];
            for (int i = 0; i < 16; i++) {
                v[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0,
                                        (__m512bh)_mm512_loadu_si512(kr[i]));
                v[i] = _mm512_dpbf16_ps(v[i], q1, (__m512bh)_mm512_loadu_si512(kr[i] + 32));
            }
            const __m512 sc = _mm512_mul_ps(sum16(v), vscale);
            _mm512_mask_storeu_ps(scores + g * len + t0, keep, sc);
            const float m = _mm512_mask_reduce_max_ps(keep, sc);
            mx[g] = m > mx[g] ? m : mx[g];
        }
    }
    /* pass 2: softmax weights, float32 sum, bf16 copy (zero-padded to an even count) */
    float inv[MAX_G];
    for (int64_t g = 0; g < G; g++) {
        float sum = 0.f, *sg = scores + g * len;
        uint16_t *pg = pb + g * pstride;
        for (int64_t t = 0; t < len; t++) {
            sg[t] = fast_expf(sg[t] - mx[g]);
            sum += sg[t];
        }
        int64_t t = 0;
        for (; t + 16 <= len; t += 16)
            _mm256_storeu_si256((__m256i *)(pg + t),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sg + t)));
        for (; t < len; t++) pg[t] = f32_to_bf16(sg[t]);
        pg[len] = pg[len + 1] = 0;
        inv[g] = 1.f / sum;
    }
    /* pass 3: weighted values, GR query rows per walk over the keys */
    for (int64_t g0 = 0; g0 < G; g0 += GR) {
        const int64_t gn = G - g0 < GR ? G - g0 : GR;
        __m512 acc[GR][4];
        for (int i = 0; i < GR; i++)
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
        j = 0, o = 0;
        for (int64_t t = 0; t < len; t += 2) {
            const uint16_t *va = v_base + (table[j] * BS + o) * DD, *vb = va;
            PREFETCH_ROW(v_base + (table[j + 1 < nblocks ? j + 1 : j] * BS + o) * DD, DD * 2);
            if (++o == BS) o = 0, j++;
            if (t + 1 < len) {  /* else the partner's weight is the padding zero */
                vb = v_base + (table[j] * BS + o) * DD;
                PREFETCH_ROW(v_base + (table[j + 1 < nblocks ? j + 1 : j] * BS + o) * DD, DD * 2);
                if (++o == BS) o = 0, j++;
            }
            const __m512i a0 = _mm512_loadu_si512(va), a1 = _mm512_loadu_si512(va + 32);
            const __m512i b0 = _mm512_loadu_si512(vb), b1 = _mm512_loadu_si512(vb + 32);
            const __m512bh u[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0),
                                   (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                                   (__m512bh)_mm512_unpacklo_epi16(a1, b1),
                                   (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
            for (int i = 0; i < GR; i++) {
                if (i >= gn) break;
                const __m512bh p = (__m512bh)_mm512_set1_epi32(
                    *(const int32_t *)(pb + (g0 + i) * pstride + t));
                for (int c = 0; c < 4; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], p, u[c]);
            }
        }
        /* acc[c] word 4L+i holds dim 32*(c/2) + 8L + 4*(c%2) + i (unpack works per 128 bits) */
        for (int64_t i = 0; i < gn; i++) {
            float w[4][16] __attribute__((aligned(64)));
            for (int c = 0; c < 4; c++) _mm512_store_ps(w[c], acc[i][c]);
            uint16_t *og = out + (g0 + i) * DD;
            const float f = inv[g0 + i];
            for (int c = 0; c < 4; c++)
                for (int L = 0; L < 4; L++)
                    for (int e = 0; e < 4; e++)
                        og[32 * (c / 2) + 8 * L + 4 * (c % 2) + e] = f32_to_bf16(w[c][4 * L + e] * f);
        }
    }
}
#endif

typedef void (*head_f32_fn)(const float *, const float *, const float *, const int64_t *,
                            int64_t, int64_t, int64_t, int64_t, int64_t, float, float *, float *);
typedef void (*head_bf16_fn)(const uint16_t *, const uint16_t *, const uint16_t *,
                             const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                             float *, uint16_t *);
typedef void (*head_kv8_f32_fn)(int, const float *, const uint8_t *, const uint8_t *,
                                const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                float, float *, float *);
typedef void (*head_kv8_bf16_fn)(int, const uint16_t *, const uint8_t *, const uint8_t *,
                                 const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                 float *, uint16_t *);

/* Returns 0 on success, -1 on unsupported shapes or no memory (the caller falls back to
 * PyTorch). kv_fmt: KV_PLAIN (the cache in q's element type) or an 8-bit format (kv8.h).
 * window > 0: a sliding window, each query sees its sequence's last `window` keys (the table
 * read from the block holding the first of them, the keys before it inside that block
 * skipped); 0: all keys. Up to num_threads threads, fewer so that each has at least
 * min_keys key rows (a sequence's keys once per KV head; a fork costs microseconds, so tiny
 * batches run on the caller's thread). */
int paged_decode_attention(int is_bf16, int kv_fmt, const void *q, const void *kv_cache,
                           const int64_t *tables, const int64_t *seq_lens, void *out,
                           int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t num_blocks,
                           int64_t BS, int64_t M, float scale, int64_t num_threads,
                           int64_t min_keys, int64_t window) {
    if (D > MAX_D || H % Hkv || H / Hkv > MAX_G) return -1;
    int64_t G = H / Hkv, max_len = 1, total = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = window > 0 && seq_lens[b] > window + BS ? window + BS : seq_lens[b];
        if (len > max_len) max_len = len;
        total += len;
    }
    const int64_t head_elems = num_blocks * BS * D;      /* one KV head of K (or V) */
    const int64_t v_offset = Hkv * head_elems;
    /* An 8-bit cache: bytes, rows of D codes and a scale */
    const int64_t head_bytes = num_blocks * BS * (D + KV8_SCALE_BYTES);
    head_f32_fn hf32 = D == 64 ? head_f32_64 : D == 128 ? head_f32_128 : head_f32;
    head_bf16_fn hbf16 = D == 64 ? head_bf16_64 : D == 128 ? head_bf16_128 : head_bf16;
    head_kv8_f32_fn k8f32 = D == 64 ? head_kv8_f32_64 : D == 128 ? head_kv8_f32_128 : head_kv8_f32;
    head_kv8_bf16_fn k8bf16 =
        D == 64 ? head_kv8_bf16_64 : D == 128 ? head_kv8_bf16_128 : head_kv8_bf16;
#if defined(__AVX512BF16__)
    if (D == 64 && window <= 0) hbf16 = head_bf16_64_dp; /* it reads keys from position 0 */
#endif
    const int64_t work = total * Hkv; /* key rows: each (sequence, KV head) pair reads len */
    int64_t nt = min_keys > 0 ? work / min_keys : num_threads;
    nt = nt < num_threads ? nt : num_threads;
    nt = nt < B * Hkv ? nt : B * Hkv;
    nt = nt > 1 ? nt : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
        const int64_t t = team_thread(), n = team_size();
        float *scores = malloc(sizeof(float) * (size_t)(2 * G * (max_len + 2)));
        if (!scores) failed = 1;
        /* Pair i (sequence i / Hkv) belongs to the thread whose share of the keys holds the
         * keys before it: contiguous runs, about work / n keys each. */
        int64_t before = 0;
        for (int64_t i = 0; scores && i < B * Hkv; i++) {
            const int64_t b = i / Hkv, h = i % Hkv;
            /* the window's first key: its block starts the table read, the rest skipped */
            const int64_t first = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
            const int64_t j0 = first / BS, skip = first - j0 * BS, len = seq_lens[b] - j0 * BS;
            const int64_t *table = tables + b * M + j0;
            const int64_t owner = before * n / work;
            before += len;
            if (owner != t) continue;
            const int64_t qo = (b * H + h * G) * D;
            if (kv_fmt != KV_PLAIN) {
                const uint8_t *kv = kv_cache;
                if (is_bf16)
                    k8bf16(kv_fmt, (const uint16_t *)q + qo, kv + h * head_bytes,
                           kv + Hkv * head_bytes + h * head_bytes, table, skip, len, G, D,
                           BS, scale, scores, (uint16_t *)out + qo);
                else
                    k8f32(kv_fmt, (const float *)q + qo, kv + h * head_bytes,
                          kv + Hkv * head_bytes + h * head_bytes, table, skip, len, G, D, BS,
                          scale, scores, (float *)out + qo);
            } else if (is_bf16) {
                const uint16_t *kv = kv_cache;
                hbf16((const uint16_t *)q + qo, kv + h * head_elems,
                      kv + v_offset + h * head_elems, table, skip, len, G, D, BS, scale,
                      scores, (uint16_t *)out + qo);
            } else {
                const float *kv = kv_cache;
                hf32((const float *)q + qo, kv + h * head_elems,
                     kv + v_offset + h * head_elems, table, skip, len, G, D, BS, scale,
                     scores, (float *)out + qo);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}


/* Store a step's new keys and values at their cache slots (vLLM's reshape_and_cache):
 *   k, v     [T, Hkv, D], k_stride / v_stride elements between tokens, heads contiguous,
 *            float32 or bfloat16 (is_bf16)
 *   slots    [T] int64: token t goes to block slots[t] / BS, offset slots[t] % BS
 * kv_fmt KV_PLAIN: the cache holds k/v's own element type, rows copied; an 8-bit format: each
 * (token, head) row quantized into D codes and its scale (kv8.h). PyTorch's index_copy_ along
 * the cache's token dimension took up to a millisecond a layer for this. Returns -1, storing
 * nothing, if a slot lies outside the cache. */
int reshape_and_cache(int is_bf16, int kv_fmt, const void *k, int64_t k_stride, const void *v,
                      int64_t v_stride, void *kv_cache, const int64_t *slots, int64_t T,
                      int64_t Hkv, int64_t D, int64_t num_blocks, int64_t BS) {
    const int64_t esz = is_bf16 ? 2 : 4;
    const int64_t row = kv_fmt == KV_PLAIN ? D * esz : D + KV8_SCALE_BYTES;  /* bytes */
    const int64_t head = num_blocks * BS * row;  /* bytes of one KV head of K (or V) */
    char *kc = kv_cache, *vc = (char *)kv_cache + Hkv * head;
    if (D > MAX_D) return -1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_blocks * BS) return -1;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t dst = h * head + slots[t] * row;
            const char *ks = (const char *)k + (t * k_stride + h * D) * esz;
            const char *vs = (const char *)v + (t * v_stride + h * D) * esz;
            if (kv_fmt == KV_PLAIN) {
                memcpy(kc + dst, ks, (size_t)row);
                memcpy(vc + dst, vs, (size_t)row);
                continue;
            }
            float x[MAX_D];
            for (int pass = 0; pass < 2; pass++) {
                const char *src = pass ? vs : ks;
                for (int64_t d = 0; d < D; d++)
                    x[d] = is_bf16 ? bf16_to_f32(((const uint16_t *)src)[d])
                                   : ((const float *)src)[d];
                kv8_store_row(kv_fmt, x, D, (uint8_t *)(pass ? vc : kc) + dst);
            }
        }
    return 0;
}
