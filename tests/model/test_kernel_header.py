"""The ctypes bindings come from kernels.h: every prototype parsed, unknown types refused."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from inflight.model.kernels.header import parse_signatures, read_signatures

HEADER = Path(__file__).resolve().parents[2] / "inflight/model/kernels/kernels.h"


def test_kernels_h_binds_every_exported_function():
    sig = read_signatures(HEADER)
    assert set(sig) == {"paged_decode_attention", "reshape_and_cache", "paged_prefill_attention",
                        "paged_prefill_head_dim", "skinny_linear", "quant_linear",
                        "quant_linear_amx", "rms_norm", "act_and_mul", "decode_layers",
                        "skinny_max_rows", "quant_linear_vectorized",
                        "paged_prefill_attention_kv8", "lora_add", "gemm_packed_size",
                        "gemm_pack", "gemm_linear", "gemm_path", "gemm_max_path", "quant_rows"}
    i, l, f, p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    assert sig["rms_norm"] == (i, [i, i, p, p, p, l, l, f, l])  # is_bf16, scale_f32, ...
    assert sig["act_and_mul"] == (None, [i, i, p, p, l, l, l])  # act, is_bf16, ...
    assert sig["paged_prefill_head_dim"] == (l, [])
    assert len(sig["decode_layers"][1]) == 30  # ..., lora_slots, lora_S, lora_R
    assert sig["lora_add"] == (i, [i, p, p, l, l, l, p, p, l, l, p, l])
    # is_bf16, kv_fmt (0 plain, 1 int8, 2 fp8), k, k_stride, v, v_stride, cache, slots, ...
    assert sig["reshape_and_cache"] == (i, [i, i, p, l, p, l, p, p, l, l, l, l, l])
    assert sig["quant_linear"] == (i, [i, i, p, p, p, p, p, p, l, l, l, l])
    assert sig["quant_linear_amx"] == (l, [l])
    # is_bf16, x, packed, bias, y, M, N, K, num_threads
    assert sig["gemm_linear"] == (i, [i, p, p, p, p, l, l, l, l])
    assert sig["gemm_max_path"] == (l, [l])


def test_unknown_or_unnamed_types_fail_loudly():
    assert parse_signatures("/* c */ int f(const int64_t *x, float y); // note\n#define X 1") == {
        "f": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_float])}
    with pytest.raises(ValueError, match="double"):
        parse_signatures("int g(double x);")
    with pytest.raises(ValueError, match="needs a name"):
        parse_signatures("int h(int);")
