/* Paged prefill attention over an 8-bit KV cache (kv8.h: int8 or fp8 e4m3 rows, one float32
 * scale each), read in place: a chunk of T new tokens of one sequence, causal over all its
 * keys. Token i sits at position num_computed + i and sees keys 0 .. num_computed + i; the
 * chunk's own keys are in the cache already. The same contract as prefill_attention.c, on any
 * x86 and any head size up to KV8_MAX_D.
 *
 * Flash-attention style (Dao et al., NeurIPS 2022): a work item is one KV head and a tile of
 * QT tokens, QT * G query rows (grouped-query attention: the G query heads of a KV head share
 * its keys). Keys and values come in tiles of KT rows, each row decoded to float32 once per
 * work item and used by all its query rows, so the 8-bit blocks are never copied out whole.
 * A row's scale multiplies its score (keys) or its softmax weight (values), not its D values.
 * The softmax is online (a running max and sum per row, rescaling the accumulator), so no
 * T x L score matrix exists.
 *
 * The rows hold H k and H v where D is a power of two (kv8.h's rotation): q.k = (Hq).(Hk) and
 * sum p v = H sum p (Hv), so each query row is rotated once on the way in and each output row
 * once on the way out.
 *
 * Portable GNU C (gcc, clang) without intrinsics: eight-lane vectors of the vector extension,
 * which the compiler maps to AVX, AVX-512 or SSE registers as -march allows. Keys are
 * transposed to [D][KT], so a row's KT scores are D broadcast multiply-adds with no horizontal
 * sums, RB rows at a time so each key vector is loaded once for RB rows, the sums in
 * registers; values are [KT][DP], accumulated VC dims x RB rows at a time. Work items go to
 * PyTorch's OpenMP pool dynamically, the later tiles (more keys) first. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "fast_exp.h"
#include "kernels.h"
#include "kv8.h"

#define KT 16          /* keys per tile */
#define RB 6           /* query rows computed together (<= VL): 12 sums, 2 key vectors and a
                        * broadcast fill AVX2's 16 registers */
#define VC 16          /* output dims accumulated together (DP is a multiple) */
#define MAX_G 16
#define MAX_QT 64      /* tokens per query tile */
#define TILE_ROWS 192  /* query rows a tile aims at (QT = TILE_ROWS / G): each decoded key
                        * serves that many rows, and q and the sums (2 x 192 x D floats) stay
                        * in a 512 KiB L2 at D = 256 */

/* Eight float32 lanes in GNU C's vector extension (gcc, clang): the compiler emits one AVX
 * register per vector, or two SSE ones, and fuses a * b + c into FMAs where the target has
 * them. Written out because at -O3 gcc 12 vectorized these loops across d (the reduction),
 * with shuffles, about seven times slower than the broadcast form below (1.26 s against 0.17 s,
 * a 2048-token prompt on a 2-core AVX2 EPYC). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define VL 8

static inline v8f v8_load(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void v8_store(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline v8f v8_set1(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline v8f v8_select(v8i mask, v8f a, v8f b) {
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

static inline v8f v8_max(v8f a, v8f b) { return v8_select(a > b, a, b); }

#if defined(__clang__) || __GNUC__ >= 12
#define V8_SHUFFLE(v, a, b, c, d, e, f, g, h) __builtin_shufflevector(v, v, a, b, c, d, e, f, g, h)
#else
#define V8_SHUFFLE(v, a, b, c, d, e, f, g, h) __builtin_shuffle(v, (v8i){a, b, c, d, e, f, g, h})
#endif

/* The max of v's lanes, in every lane. */
static inline v8f v8_hmax(v8f v) {
    v = v8_max(v, V8_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = v8_max(v, V8_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5));
    return v8_max(v, V8_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6));
}

/* exp(x) for x <= 0 on eight lanes: fast_exp.h's reduction and polynomial; below -87 it
 * gives exp(-87), and -inf gives that too. */
static inline v8f v8_exp(v8f x) {
    const v8f lo = v8_set1(-87.f);
    x = v8_select(x < lo, lo, x);
    /* n = round(x log2 e) as -trunc(0.5 - x log2 e), the operand >= 0 */
    const v8i ni = -__builtin_convertvector(v8_set1(0.5f) - x * 1.44269504088896341f, v8i);
    const v8f n = __builtin_convertvector(ni, v8f);
    const v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8f p = v8_set1(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v8f e = p * r * r + r + 1.f;
    return e * (v8f)((ni + 127) << 23);  /* n >= -126: 2^n is a normal float */
}

/* What every work item of a call shares. */
typedef struct {
    int is_bf16, fmt;
    const char *q;
    int64_t q_stride, esz;  /* elements between q's tokens; bytes an element */
    const uint8_t *kv;
    int64_t head_bytes, RS; /* bytes of one head's K (or V) blocks; bytes of a row */
    const int64_t *table;
    int64_t num_computed, T, H, Hkv, G, D, DP, BS, QT;
    int64_t window; /* > 0: a row at position p sees keys p - window + 1 .. p */
    float scale;
    char *out;
} job_t;

/* A thread's scratch, carved from one allocation: rows padded to RB, dims to DP. */
typedef struct {
    float *q, *acc;  /* [rows][DP]: query rows (scaled, rotated) and their output sums */
    float *kt;       /* [DP][KT]: the key tile's codes, transposed */
    float *v;        /* [KT][DP]: the value tile's codes */
    float *tmp;      /* [DP]: one decoded key row */
    float ks[KT], vs[KT];  /* the tile's row scales (0 past the last key) */
    float *mx;       /* [rows]: each row's running max */
    float *den;      /* [rows][VL]: each row's running sum, in VL partial sums */
    int64_t *pos;    /* [rows]: the last key each row may see */
} scratch_t;

static void *scratch_alloc(const job_t *j, scratch_t *s) {
    const int64_t rows = (j->QT * j->G + RB - 1) / RB * RB, DP = j->DP;
    const int64_t floats = 2 * rows * DP + DP * KT + KT * DP + DP + rows + rows * VL;
    const size_t bytes = ((size_t)(floats * 4 + rows * 8) + 63) / 64 * 64;
    float *base = aligned_alloc(64, bytes);
    if (!base) return NULL;
    memset(base, 0, bytes);  /* the padding dims stay zero */
    s->q = base;
    s->acc = s->q + rows * DP;
    s->kt = s->acc + rows * DP;
    s->v = s->kt + DP * KT;
    s->tmp = s->v + KT * DP;
    s->mx = s->tmp + DP;
    s->den = s->mx + rows;
    s->pos = (int64_t *)(s->den + rows * VL);
    return base;
}

/* Query rows of tokens [i0, i1) of KV head h, token-major (G rows a token; padding rows up to
 * a multiple of RB repeat the last row): scaled, rotated, and their softmax state reset. */
static void load_queries(const job_t *j, int64_t h, int64_t i0, int64_t rows, int64_t padded,
                         scratch_t *s) {
    const int64_t D = j->D, DP = j->DP, G = j->G;
    for (int64_t r = 0; r < padded; r++) {
        const int64_t rr = r < rows ? r : rows - 1, t = i0 + rr / G;
        const char *src = j->q + (t * j->q_stride + (h * G + rr % G) * D) * j->esz;
        float *dst = s->q + r * DP;
        for (int64_t d = 0; d < D; d++)
            dst[d] = (j->is_bf16 ? bf16_to_f32(((const uint16_t *)src)[d])
                                 : ((const float *)src)[d]) * j->scale;
        if (j->fmt != KV_PLAIN) kv8_rotate(dst, D);
        memset(s->acc + r * DP, 0, (size_t)DP * 4);
        s->mx[r] = -INFINITY;
        memset(s->den + r * VL, 0, VL * 4);
        s->pos[r] = j->num_computed + t;
    }
}

/* One cached row as float32 into dst; returns its scale (1 for a plain row, exact). */
static inline float load_row(const job_t *j, const uint8_t *row, float *dst) {
    if (j->fmt != KV_PLAIN) return kv8_load_row(j->fmt, row, j->D, dst);
    if (j->is_bf16)
        for (int64_t d = 0; d < j->D; d++) dst[d] = bf16_to_f32(((const uint16_t *)row)[d]);
    else
        memcpy(dst, row, (size_t)j->D * 4);
    return 1.f;
}

/* Keys and values [j0, j0 + n) of KV head h decoded into the tile (codes; scales apart);
 * the rest of the tile is zero, scales included. */
static void load_tile(const job_t *j, int64_t h, int64_t j0, int64_t n, scratch_t *s) {
    const int64_t D = j->D, DP = j->DP, BS = j->BS;
    const uint8_t *kb = j->kv + h * j->head_bytes, *vb = j->kv + (j->Hkv + h) * j->head_bytes;
    for (int64_t jj = 0; jj < KT; jj++) {
        float *vr = s->v + jj * DP;
        if (jj < n) {
            const int64_t p = j0 + jj, off = (j->table[p / BS] * BS + p % BS) * j->RS;
            s->ks[jj] = load_row(j, kb + off, s->tmp);
            s->vs[jj] = load_row(j, vb + off, vr);
            for (int64_t d = 0; d < D; d++) s->kt[d * KT + jj] = s->tmp[d];
        } else {
            s->ks[jj] = s->vs[jj] = 0.f;
            memset(vr, 0, (size_t)D * 4);
            for (int64_t d = 0; d < D; d++) s->kt[d * KT + jj] = 0.f;
        }
    }
}

/* RB rows (from r) against the key tile at j0: their KT scores each (a broadcast query
 * value against each key vector, the sums in registers), then the online softmax step. On
 * return pv holds each row's weights times the value scales and alpha the factor its
 * accumulator takes. */
static void softmax_step(const scratch_t *s, int64_t r, int64_t DP, int64_t D, int64_t j0,
                         int64_t window, float pv[RB][KT], float alpha[RB]) {
    v8f a[RB][KT / VL];
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < KT / VL; c++) a[i][c] = v8_set1(0.f);
    const float *q = s->q + r * DP;
    for (int64_t d = 0; d < D; d++) {
        v8f k[KT / VL];
        for (int c = 0; c < KT / VL; c++) k[c] = v8_load(s->kt + d * KT + c * VL);
        for (int i = 0; i < RB; i++) {
            const v8f qv = v8_set1(q[i * DP + d]);
            for (int c = 0; c < KT / VL; c++) a[i][c] += qv * k[c];
        }
    }
    /* In phases over all RB rows, so the rows' exp chains are independent and overlap. */
    v8i vis[RB][KT / VL];
    v8f old = v8_set1(0.f), m = old;  /* lane i: row i's max before and after the tile */
    for (int i = 0; i < RB; i++) {
        const int32_t seen = (int32_t)(s->pos[r + i] - j0);  /* keys jj <= seen are visible */
        /* ... and in a window, keys jj > seen - window (the tile's keys before the row's
         * window weigh nothing: a row's sums start at its first visible key, and a tile it
         * sees none of leaves them as they were, bit for bit) */
        const int32_t before = window > 0 ? (int32_t)(seen - window) : INT32_MIN;
        v8f mi = v8_set1(s->mx[r + i]);
        for (int c = 0; c < KT / VL; c++) {
            const v8i jj = {c * VL, c * VL + 1, c * VL + 2, c * VL + 3, c * VL + 4, c * VL + 5,
                            c * VL + 6, c * VL + 7};
            vis[i][c] = (jj <= seen) & (jj > before);
            a[i][c] = v8_select(vis[i][c], a[i][c] * v8_load(s->ks + c * VL),
                                v8_set1(-INFINITY));
            mi = v8_max(mi, a[i][c]);
        }
        old[i] = s->mx[r + i];
        m[i] = v8_hmax(mi)[0];
    }
    /* alpha 0 at a row's first tile (max -inf), its accumulator holding nothing yet */
    const v8f al = v8_select(old == -INFINITY, v8_set1(0.f), v8_exp(old - m));
    for (int i = 0; i < RB; i++) {
        v8f sum = v8_load(s->den + (r + i) * VL) * al[i];  /* per lane, added up at the end */
        for (int c = 0; c < KT / VL; c++) {
            const v8f p = v8_select(vis[i][c], v8_exp(a[i][c] - m[i]), v8_set1(0.f));
            sum += p;
            v8_store(pv[i] + c * VL, p * v8_load(s->vs + c * VL));
        }
        v8_store(s->den + (r + i) * VL, sum);
        alpha[i] = al[i];
        s->mx[r + i] = m[i];
    }
}

/* acc[r .. r + RB) <- alpha * acc + pv . V over the tile's first n values, VC dims at a time
 * in registers. */
static void accumulate(scratch_t *s, int64_t r, int64_t DP, int64_t n, const float pv[RB][KT],
                       const float alpha[RB]) {
    for (int64_t c = 0; c < DP; c += VC) {
        v8f o[RB][VC / VL];
        for (int i = 0; i < RB; i++)
            for (int u = 0; u < VC / VL; u++)
                o[i][u] = v8_load(s->acc + (r + i) * DP + c + u * VL) * v8_set1(alpha[i]);
        for (int64_t jj = 0; jj < n; jj++) {
            v8f v[VC / VL];
            for (int u = 0; u < VC / VL; u++) v[u] = v8_load(s->v + jj * DP + c + u * VL);
            for (int i = 0; i < RB; i++) {
                const v8f p = v8_set1(pv[i][jj]);
                for (int u = 0; u < VC / VL; u++) o[i][u] += p * v[u];
            }
        }
        for (int i = 0; i < RB; i++)
            for (int u = 0; u < VC / VL; u++) v8_store(s->acc + (r + i) * DP + c + u * VL, o[i][u]);
    }
}

/* One work item: KV head h, tokens [i0, i1). */
static void item(const job_t *j, int64_t h, int64_t i0, int64_t i1, scratch_t *s) {
    const int64_t rows = (i1 - i0) * j->G, padded = (rows + RB - 1) / RB * RB;
    const int64_t D = j->D, DP = j->DP, last = j->num_computed + i1 - 1;
    load_queries(j, h, i0, rows, padded, s);
    /* from the tile holding the first row's first visible key: the tiles before it are
     * outside every row's window (tiles still start at multiples of KT from position 0) */
    const int64_t first = j->window > 0 ? j->num_computed + i0 - j->window + 1 : 0;
    for (int64_t j0 = first > 0 ? first / KT * KT : 0; j0 <= last; j0 += KT) {
        const int64_t n = last + 1 - j0 < KT ? last + 1 - j0 : KT;
        load_tile(j, h, j0, n, s);
        for (int64_t r = 0; r < padded; r += RB) {
            if (s->pos[r + RB - 1] < j0) continue;  /* rows token-major: all in the future */
            float pv[RB][KT], alpha[RB];
            softmax_step(s, r, DP, D, j0, j->window, pv, alpha);
            accumulate(s, r, DP, n, pv, alpha);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *acc = s->acc + r * DP;
        if (j->fmt != KV_PLAIN) kv8_rotate(acc, D);  /* back from the rotated space (H = H^-1) */
        float den = 0.f;
        for (int l = 0; l < VL; l++) den += s->den[r * VL + l];
        const float inv = 1.f / den;
        char *o = j->out + ((i0 + r / j->G) * j->H + h * j->G + r % j->G) * D * j->esz;
        for (int64_t d = 0; d < D; d++) {
            if (j->is_bf16) ((uint16_t *)o)[d] = f32_to_bf16(acc[d] * inv);
            else ((float *)o)[d] = acc[d] * inv;
        }
    }
}

/* Tokens per query tile: TILE_ROWS query rows, fewer where that leaves threads idle, never
 * under RB rows. */
static int64_t tile_tokens(int64_t T, int64_t G, int64_t Hkv, int64_t num_threads) {
    int64_t qt = TILE_ROWS / G, min_qt = (RB + G - 1) / G;
    qt = qt > MAX_QT ? MAX_QT : qt < 1 ? 1 : qt;
    qt = qt > T ? T : qt;
    while (qt / 2 >= min_qt && Hkv * ((T + qt - 1) / qt) < num_threads) qt /= 2;
    return qt;
}

/* q: [T, H, D] float32 or bf16 (is_bf16) with q_stride elements between tokens; kv_cache:
 * [2, Hkv, num_blocks, BS, D + 4] rows of format kv_fmt (KV_INT8, KV_FP8), or KV_PLAIN:
 * [2, Hkv, num_blocks, BS, D] in q's type (where prefill_attention.c does not apply: no
 * AVX-512, another head size; a query row's sums then run over keys in tiles of KT from
 * position 0 whatever the chunk, so a prompt's rows are the same bits however it was cut);
 * table: the
 * sequence's block ids; out: [T, H, D] contiguous in q's type; window > 0: a sliding window
 * (a row at position p sees keys p - window + 1 .. p), 0: none. Returns 0, or -1 on an
 * unsupported shape or format, or when memory ran out. */
int paged_prefill_attention_kv8(int is_bf16, int kv_fmt, const void *q, int64_t q_stride,
                                const void *kv_cache, const int64_t *table,
                                int64_t num_computed, int64_t T, void *out, int64_t H,
                                int64_t Hkv, int64_t D, int64_t num_blocks, int64_t BS,
                                float scale, int64_t num_threads, int64_t window) {
    if ((kv_fmt != KV_PLAIN && kv_fmt != KV_INT8 && kv_fmt != KV_FP8) || T < 1 || num_computed < 0 || Hkv < 1
        || H % Hkv || H / Hkv > MAX_G || D < 1 || D > KV8_MAX_D || BS < 1 || num_blocks < 1)
        return -1;
    const int64_t nt0 = num_threads > 1 ? num_threads : 1;
    job_t j = {.is_bf16 = is_bf16, .fmt = kv_fmt, .q = q, .q_stride = q_stride,
               .esz = is_bf16 ? 2 : 4, .kv = kv_cache,
               .RS = kv_fmt == KV_PLAIN ? D * (is_bf16 ? 2 : 4) : D + KV8_SCALE_BYTES,
               .table = table, .num_computed = num_computed, .T = T, .H = H, .Hkv = Hkv,
               .G = H / Hkv, .D = D, .DP = (D + VC - 1) / VC * VC, .BS = BS,
               .window = window, .scale = scale, .out = out};
    j.head_bytes = num_blocks * BS * j.RS;
    j.QT = tile_tokens(T, j.G, Hkv, nt0);
    const int64_t tiles = (T + j.QT - 1) / j.QT, items = Hkv * tiles;
    const int64_t nt = nt0 < items ? nt0 : items;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
        scratch_t s = {0};
        void *mem = scratch_alloc(&j, &s);
        if (!mem) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!mem) continue;
            const int64_t h = it % Hkv, tile = tiles - 1 - it / Hkv;
            const int64_t i0 = tile * j.QT, i1 = i0 + j.QT < T ? i0 + j.QT : T;
            item(&j, h, i0, i1, &s);
        }
        free(mem);
    }
    return failed ? -1 : 0;
}
