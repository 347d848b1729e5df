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
 * Single-threaded on purpose: PyTorch's own OpenMP pool spins between its kernels, and a
 * second pool here fought it for the two cores (steps several times slower, erratically).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MAX_D 256
#define MAX_G 16

/* One (sequence, kv head): G query rows against seq_len keys. */
#define DEFINE_HEAD(NAME, T, LOAD, STORE)                                                  \
static void NAME(const T *q, const T *k_base, const T *v_base, const int64_t *table,      \
                 int64_t len, int64_t G, int64_t D, int64_t BS, float scale,                \
                 float *scores, T *out) {                                                  \
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D];                                             \
    for (int64_t g = 0; g < G; g++)                                                        \
        for (int64_t d = 0; d < D; d++) { qf[g][d] = LOAD(q[g * D + d]) * scale; acc[g][d] = 0.f; } \
    float mx[MAX_G];                                                                       \
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;                                     \
    for (int64_t t = 0; t < len; t++) {                                                    \
        const T *k = k_base + (table[t / BS] * BS + t % BS) * D;                           \
        float kf[MAX_D];                                                                   \
        for (int64_t d = 0; d < D; d++) kf[d] = LOAD(k[d]);                                \
        for (int64_t g = 0; g < G; g++) {                                                  \
            float s = 0.f;                                                                 \
            for (int64_t d = 0; d < D; d++) s += qf[g][d] * kf[d];                         \
            scores[g * len + t] = s;                                                       \
            if (s > mx[g]) mx[g] = s;                                                      \
        }                                                                                  \
    }                                                                                      \
    float denom[MAX_G];                                                                    \
    for (int64_t g = 0; g < G; g++) {                                                      \
        float sum = 0.f;                                                                   \
        for (int64_t t = 0; t < len; t++) {                                                \
            float e = expf(scores[g * len + t] - mx[g]);                                   \
            scores[g * len + t] = e;                                                       \
            sum += e;                                                                      \
        }                                                                                  \
        denom[g] = 1.f / sum;                                                              \
    }                                                                                      \
    for (int64_t t = 0; t < len; t++) {                                                    \
        const T *v = v_base + (table[t / BS] * BS + t % BS) * D;                           \
        float vf[MAX_D];                                                                   \
        for (int64_t d = 0; d < D; d++) vf[d] = LOAD(v[d]);                                \
        for (int64_t g = 0; g < G; g++) {                                                  \
            float p = scores[g * len + t];                                                 \
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * vf[d];                        \
        }                                                                                  \
    }                                                                                      \
    for (int64_t g = 0; g < G; g++)                                                        \
        for (int64_t d = 0; d < D; d++) out[g * D + d] = STORE(acc[g][d] * denom[g]);      \
}

#define ID(x) (x)
DEFINE_HEAD(head_f32, float, ID, ID)
DEFINE_HEAD(head_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Returns 0 on success, -1 on unsupported shapes (the caller falls back to PyTorch). */
int paged_decode_attention(int is_bf16, const void *q, const void *kv_cache,
                           const int64_t *tables, const int64_t *seq_lens, void *out,
                           int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t num_blocks,
                           int64_t BS, int64_t M, float scale) {
    if (D > MAX_D || H % Hkv || H / Hkv > MAX_G) return -1;
    int64_t G = H / Hkv, max_len = 0;
    for (int64_t b = 0; b < B; b++) if (seq_lens[b] > max_len) max_len = seq_lens[b];
    const int64_t head_elems = num_blocks * BS * D;      /* one KV head of K (or V) */
    const int64_t v_offset = Hkv * head_elems;
    float *scores = malloc(sizeof(float) * (size_t)(G * (max_len > 0 ? max_len : 1)));
    if (!scores) return -1;
    {
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < Hkv; h++) {
                int64_t len = seq_lens[b];
                int64_t qo = (b * H + h * G) * D;
                if (is_bf16) {
                    const uint16_t *kv = kv_cache;
                    head_bf16((const uint16_t *)q + qo, kv + h * head_elems,
                              kv + v_offset + h * head_elems, tables + b * M, len, G, D, BS,
                              scale, scores, (uint16_t *)out + qo);
                } else {
                    const float *kv = kv_cache;
                    head_f32((const float *)q + qo, kv + h * head_elems,
                             kv + v_offset + h * head_elems, tables + b * M, len, G, D, BS,
                             scale, scores, (float *)out + qo);
                }
            }
        }
    }
    free(scores);
    return 0;
}
