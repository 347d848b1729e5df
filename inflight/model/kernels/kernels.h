/* The functions the library exports: the ctypes table in __init__.py (_SIGNATURES) binds
 * these, and decode_layers.c calls the others through them. Each defining file includes this
 * header, so the compiler checks every definition against its prototype here. */
#ifndef INFLIGHT_KERNELS_H
#define INFLIGHT_KERNELS_H
#include <stdint.h>

/* paged_attention.c */
/* kv_fmt: 0 the cache in q's (k's) element type, 1 int8, 2 fp8 e4m3 rows (kv8.h) */
int paged_decode_attention(int is_bf16, int kv_fmt, const void *q, const void *kv_cache,
                           const int64_t *tables, const int64_t *seq_lens, void *out,
                           int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t num_blocks,
                           int64_t BS, int64_t M, float scale, int64_t num_threads,
                           int64_t min_keys, int64_t window);
int reshape_and_cache(int is_bf16, int kv_fmt, const void *k, int64_t k_stride, const void *v,
                      int64_t v_stride, void *kv_cache, const int64_t *slots, int64_t T,
                      int64_t Hkv, int64_t D, int64_t num_blocks, int64_t BS);
/* prefill_attention.c */
int paged_prefill_attention(int is_bf16, const void *q, int64_t q_stride, const void *kv_cache,
                            const int64_t *table, int64_t num_computed, int64_t T, void *out,
                            int64_t H, int64_t Hkv, int64_t head_dim, int64_t num_blocks,
                            int64_t BS, float scale, int64_t num_threads);
int64_t paged_prefill_head_dim(void);
/* prefill_attention_kv8.c */
/* kv_fmt: 1 int8, 2 fp8 e4m3 rows (kv8.h); q and out float32 or bf16 (is_bf16) */
int paged_prefill_attention_kv8(int is_bf16, int kv_fmt, const void *q, int64_t q_stride,
                                const void *kv_cache, const int64_t *table,
                                int64_t num_computed, int64_t T, void *out, int64_t H,
                                int64_t Hkv, int64_t D, int64_t num_blocks, int64_t BS,
                                float scale, int64_t num_threads, int64_t window);
/* linear.c */
int skinny_linear(int is_bf16, const void *x, const void *w, const void *bias, void *y,
                  int64_t M, int64_t N, int64_t K, int64_t num_threads);
int64_t skinny_max_rows(void);
/* gemm.c: prompt rows over a packed dense weight, a row the same bits in any batch */
int64_t gemm_packed_size(int is_bf16, int64_t N, int64_t K);
int gemm_pack(int is_bf16, const void *w, void *packed, int64_t N, int64_t K);
int gemm_linear(int is_bf16, const void *x, const void *packed, const void *bias, void *y,
                int64_t M, int64_t N, int64_t K, int64_t num_threads);
/* 3 AMX-BF16, 2 AVX-512, 1 AVX2 + FMA, 0 plain C: the path a call in this dtype takes */
int64_t gemm_path(int is_bf16);
/* path >= 0: no call takes a path above it. Returns the cap in force before the call. */
int64_t gemm_max_path(int64_t path);
/* quant_linear.c */
int quant_linear_vectorized(void);
int quant_linear(int fmt, int is_bf16, const void *x, const void *qs, const void *scales,
                 const void *mins, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                 int64_t num_threads);
/* min_rows > 0: calls of at least that many rows take the AMX tiles. Returns the threshold in
 * force before the call, or 0 where the CPU or OS gives no AMX. */
int64_t quant_linear_amx(int64_t min_rows);
/* Rows ids[0..R) of a packed [N, K] weight dequantized to float32 out[R, K]; 0 or -1. */
int quant_rows(int fmt, const void *qs, const void *scales, const void *mins,
               const int64_t *ids, int64_t R, int64_t N, int64_t K, float *out);
/* rms_norm.c, activation.c */
/* scale_f32: Gemma's rounding (the weight multiplies before the one rounding) */
int rms_norm(int is_bf16, int scale_f32, const void *x, const void *weight, void *y, int64_t T,
             int64_t D, float eps, int64_t num_threads);
/* act 0: SiLU, 1: GELU (tanh) */
void act_and_mul(int act, int is_bf16, const void *x, void *out, int64_t T, int64_t I,
                 int64_t num_threads);
/* lora.c */
int lora_add(int is_bf16, const void *x, void *y, int64_t M, int64_t N, int64_t K,
             const void *at, const void *b, int64_t S, int64_t W, const int64_t *row_slots,
             int64_t num_threads);
/* decode_layers.c */
int decode_layers(int is_bf16, int kv_fmt, void *x, int64_t M, const int64_t *layers,
                  int64_t num_layers, int64_t hidden, int64_t H, int64_t Hkv, int64_t D, int64_t inter, float eps,
                  int64_t act, int64_t norm_f32, const void *cos, const void *sin,
                  const void *cos_local, const void *sin_local, const int64_t *slots, const int64_t *tables,
                  int64_t table_width, const int64_t *seq_lens, int64_t num_blocks, int64_t BS,
                  float scale, int64_t num_threads, int64_t min_keys,
                  const int64_t *lora_slots, int64_t lora_S, int64_t lora_R);
#endif
