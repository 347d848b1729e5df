"""Native CPU kernels, compiled on first use with the system C compiler and loaded with
ctypes (no torch headers). Anything missing (no compiler, a failed build, an unsupported
shape) falls back to the PyTorch path, logged once.

- ``paged_attention.c``: decode attention over the paged cache; ``reshape_and_cache``.
- ``prefill_attention.c``: prefill chunks over the paged cache (AVX-512, head size 64).
- ``linear.c``: the skinny linear layer for decode at batch 1-2.
- ``quant_linear.c``: the linear layer over 4- and 8-bit block-quantized weights (ggml's
  Q4_0, Q4_1, Q8_0) for decode steps (``--quantization``; ``model/quant.py``): AVX512-VNNI,
  and AMX-INT8 tiles from 24 rows where the CPU has them.
- ``rms_norm.c``, ``activation.c``: RMSNorm and ``silu_and_mul`` in one pass.
- ``kernels.h``: the exported functions, checked against every definition by the compiler;
  the ctypes bindings are read from it (``header.py``).
- ``decode_layers.c``: the decoder stack for a decode step of 1-2 tokens in one call, the
  kernels above in the per-module path's order (bit-identical), without Python between them.

``INFLIGHT_NATIVE_KERNELS=0`` turns them all off (the older ``INFLIGHT_ATTENTION_BACKEND=torch``
too); ``INFLIGHT_KERNEL_CACHE`` sets where built libraries go (default
``~/.cache/inflight/kernels``). A cold build compiles the files in parallel, once per machine
and source version.

Threads: the kernels are built with OpenMP and loaded after PyTorch, so they link to the
libgomp PyTorch already loaded and run on PyTorch's own thread pool, as many threads as
``torch.get_num_threads()``. That pool's workers spin for a while after each PyTorch op, so
a kernel called next starts its team at once. Python threads or a second OpenMP runtime
would find those cores busy (measured: no gain at all; docs/performance.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from inflight.model.kernels.header import read_signatures
from inflight.model.quant import QuantizedWeight

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = [_DIR / n for n in ("paged_attention.c", "prefill_attention.c", "linear.c",
                               "quant_linear.c", "rms_norm.c", "activation.c",
                               "decode_layers.c")]
_HEADERS = [_DIR / "bf16.h", _DIR / "fast_exp.h", _DIR / "kernels.h", _DIR / "team.h"]
# Vectorizable float reductions without -ffinite-math-only (the softmax uses -inf).
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
           "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False


def _compile(cc: str, lib_path: Path) -> str | None:
    """Build ``lib_path``: every source compiled at once, then linked. None, or the error."""
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        objects = [Path(tmp) / (src.stem + ".o") for src in _SOURCES]
        jobs = [subprocess.Popen([cc, *_CFLAGS, "-c", str(src), "-o", str(obj)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for src, obj in zip(_SOURCES, objects)]
        errors = [job.communicate(timeout=120)[1] for job in jobs if job.wait(timeout=120)]
        if errors:
            return "\n".join(errors)
        tmp_lib = Path(tmp) / lib_path.name
        link = subprocess.run([cc, "-shared", "-fopenmp", *map(str, objects), "-o", str(tmp_lib)],
                              capture_output=True, text=True, timeout=120)
        if link.returncode != 0:
            return link.stderr
        os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see half a file
    return None


def _build() -> ctypes.CDLL | None:
    if (os.environ.get("INFLIGHT_NATIVE_KERNELS", "1") == "0"
            or os.environ.get("INFLIGHT_ATTENTION_BACKEND", "").lower() == "torch"):
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.warning("no C compiler found: the model runs on PyTorch's kernels alone")
        return None
    src = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    key = hashlib.sha256(src + " ".join(_CFLAGS).encode() + platform.machine().encode()
                         + platform.node().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("INFLIGHT_KERNEL_CACHE", Path.home() / ".cache/inflight/kernels"))
    lib_path = cache / f"inflight-kernels-{key}.so"
    if not lib_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        error = _compile(cc, lib_path)
        if error is not None:
            logger.warning("building the native kernels failed; using PyTorch alone:\n%s",
                           error[-2000:])
            return None
    lib = ctypes.CDLL(str(lib_path))
    for name, (restype, argtypes) in read_signatures(_DIR / "kernels.h").items():
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes
    # Asked once: the head size the prefill kernel was built for (0: not built, no AVX-512).
    lib.prefill_head_dim = lib.paged_prefill_head_dim()
    apply_amx_setting(lib, os.environ)
    return lib


def onednn_has_amx(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether oneDNN's GEMMs can run on AMX tiles here: the CPU and OS give them
    (``torch.cpu._is_amx_tile_supported``) and ``ONEDNN_MAX_CPU_ISA``, oneDNN's own cap,
    does not rule them out (``ALL`` and the ``*_AMX*`` values leave them on). The model
    sends prompt rows of block-quantized layers to oneDNN only then (llama.py)."""
    cap = environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if cap not in ("ALL", "DEFAULT") and "AMX" not in cap:
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


# Past any batch: the AMX path of quant_linear then never runs.
_AMX_OFF = 1 << 62


def apply_amx_setting(lib: ctypes.CDLL, environ: Mapping[str, str]) -> None:
    """``INFLIGHT_CPU_AMX=0`` keeps generated tokens' int8 products on the AVX-512 VNNI path
    where AMX tiles would take batches of 24+ rows. Both paths give the same bits
    (tests/model/test_quant.py), so this changes only speed: a way round a platform whose
    AMX state misbehaves (llama.cpp's AMX build dies on one, docs/performance.md) and a way
    to measure a host without AMX."""
    if environ.get("INFLIGHT_CPU_AMX", "1") == "0":
        lib.quant_linear_amx(_AMX_OFF)


def native_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be had (built once per process),
    or while ``use_native_kernels(False)`` is in force."""
    global _lib, _tried
    if _disabled:
        return None
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except Exception:  # a broken toolchain must not take the engine down
            logger.exception("loading the native kernels failed; using PyTorch alone")
            _lib = None
    return _lib


_disabled = False


@contextmanager
def use_native_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, every kernel here answers None (``enabled=False``: the callers run
    PyTorch's path, as on a machine without a compiler) or the library as usual. Tests
    compare both paths with it."""
    global _disabled
    before, _disabled = _disabled, not enabled
    try:
        yield
    finally:
        _disabled = before


def _native_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, if the kernels can take these tensors: all on CPU, all float32 or all
    bfloat16; else None (the caller runs PyTorch)."""
    lib = native_library()
    dtype = tensors[0].dtype
    if lib is None or dtype not in (torch.float32, torch.bfloat16) or any(
            t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return None
    return lib


def _threads(num_threads: int | None) -> int:
    return torch.get_num_threads() if num_threads is None else num_threads


# Below this many keys a thread, decode attention stays on the calling thread: starting the
# team costs a few microseconds a layer.
MIN_KEYS_PER_THREAD = 512


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           num_threads: int | None = None) -> torch.Tensor | None:
    """Decode attention over the paged cache with the native kernel.

    Args:
        q: ``[B, num_heads, head_dim]``, float32 or bfloat16, CPU.
        kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]``, q's dtype.
        block_tables: ``[B, max_blocks]`` int64; seq_lens: ``[B]`` int64 (>= 1 each).
        scale: softmax scale.
        num_threads: at most this many threads (default ``torch.get_num_threads()``), each
            with a contiguous run of (sequence, KV head) pairs holding about equal keys and
            at least ``MIN_KEYS_PER_THREAD``. Results do not depend on it.

    Returns:
        ``[B, num_heads, head_dim]`` in q's dtype, or None when the kernel cannot run these
        inputs (then the caller uses the PyTorch path).
    """
    lib = _native_for(q, kv_cache)
    if lib is None:
        return None
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    b, h, d = q.shape
    _, h_kv, num_blocks, block_size, _ = kv_cache.shape
    rc = lib.paged_decode_attention(
        int(q.dtype == torch.bfloat16), q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), b, h, h_kv, d, num_blocks, block_size,
        tables.shape[1], scale, _threads(num_threads), MIN_KEYS_PER_THREAD)
    return out if rc == 0 else None


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            num_computed: int, scale: float,
                            num_threads: int | None = None) -> torch.Tensor | None:
    """Causal attention of one sequence's prefill chunk over the paged cache, read in place
    (``prefill_attention.c``; AVX-512, head size 64).

    Args:
        q: ``[T, num_heads, head_dim]`` (tokens may be strided; heads and dims contiguous),
            float32 or bfloat16, CPU. Token ``i`` sits at position ``num_computed + i``.
        kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]``, q's dtype, holding
            the sequence's keys/values for positions ``0 .. num_computed + T - 1``.
        block_table: int64 block ids covering those positions.
        scale: softmax scale. num_threads: as ``paged_decode_attention``.

    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype, or None where the kernel does not apply
        (another head size, no AVX-512: then the caller uses PyTorch's SDPA).
    """
    lib = _native_for(q, kv_cache)
    if (lib is None or q.shape[2] != lib.prefill_head_dim or q.stride(2) != 1
            or q.stride(1) != q.shape[2]):
        return None
    table = block_table.contiguous()
    t, h, d = q.shape
    _, h_kv, num_blocks, block_size, _ = kv_cache.shape
    out = torch.empty(t, h, d, dtype=q.dtype)
    rc = lib.paged_prefill_attention(
        int(q.dtype == torch.bfloat16), q.data_ptr(), q.stride(0), kv_cache.data_ptr(),
        table.data_ptr(), num_computed, t, out.data_ptr(), h, h_kv, d, num_blocks, block_size,
        scale, _threads(num_threads))
    return out if rc == 0 else None


# The most input rows the model sends to the skinny kernel: at 4 rows oneDNN's GEMM, which
# reuses each weight tile across rows, was faster on the larger shapes (docs/performance.md).
# The kernel itself takes up to 16.
SKINNY_MAX_ROWS = 2


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  num_threads: int | None = None) -> torch.Tensor | None:
    """``x @ weight.T + bias`` for a few rows of ``x``, streaming ``weight`` once.

    Args:
        x: ``[M, K]`` float32 or bfloat16, CPU, ``1 <= M <= 16``.
        weight: ``[N, K]`` (``nn.Linear``'s layout), x's dtype; bias: ``[N]`` or None.
        num_threads: threads of PyTorch's pool (default ``torch.get_num_threads()``), each
            over its own run of weight rows. Results do not depend on it.

    Returns:
        ``[M, N]`` in x's dtype (float32 accumulation, one rounding), or None when the
        kernel cannot run these inputs (then the caller uses PyTorch).
    """
    lib = _native_for(x, weight, *([] if bias is None else [bias]))
    if lib is None or x.dim() != 2 or not 1 <= x.shape[0] <= 16 or not weight.is_contiguous():
        return None
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    rc = lib.skinny_linear(int(x.dtype == torch.bfloat16), x.data_ptr(), weight.data_ptr(),
                           None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                           _threads(num_threads))
    return y if rc == 0 else None


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 num_threads: int | None = None) -> torch.Tensor | None:
    """``x @ W.T + bias`` with ``W`` in a block format, for a few rows (``quant_linear.c``):
    each 32-value block of ``x`` quantized to int8 (ggml's Q8_0), integer dot products per
    block, both scales applied in float32 (llama.cpp's CPU scheme). The dot products run on
    AVX512-VNNI, or from 24 rows on AMX-INT8 tiles where the CPU has them (the same bits).

    Args:
        x: ``[M, K]`` float32 or bfloat16, CPU, K a multiple of 32.
        weight: ``[N, K]`` packed blocks (``model/quant.QuantizedWeight``).
        bias: ``[N]`` in x's dtype, or None.
        num_threads: as ``skinny_linear``; results do not depend on it.

    Returns:
        ``[M, N]`` in x's dtype (float32 sums, one rounding), or None where the kernel does
        not take these inputs (then the caller multiplies the dequantized weight).
    """
    lib = _native_for(x, *([] if bias is None else [bias]))
    if lib is None or x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != weight.shape[1]:
        return None
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    m, (n, k) = x.shape[0], weight.shape
    y = torch.empty(m, n, dtype=x.dtype)
    rc = lib.quant_linear(int(weight.fmt), int(x.dtype == torch.bfloat16), x.data_ptr(),
                          weight.qs.data_ptr(), weight.scales.data_ptr(),
                          None if weight.mins is None else weight.mins.data_ptr(),
                          None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                          _threads(num_threads))
    return y if rc == 0 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             num_threads: int | None = None) -> torch.Tensor | None:
    """RMSNorm with HF's rounding, one pass per row (``rms_norm.c``).

    Args:
        x: ``[T, D]`` float32 or bfloat16, CPU; weight: ``[D]``, x's dtype.
        eps: added to the mean square. num_threads: as ``paged_decode_attention``.

    Returns:
        ``[T, D]`` in x's dtype: ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``,
        computed in float32; or None when the kernel cannot run these inputs.
    """
    lib = _native_for(x, weight)
    if lib is None or x.dim() != 2:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    lib.rms_norm(int(x.dtype == torch.bfloat16), x.data_ptr(), weight.data_ptr(), y.data_ptr(),
                 x.shape[0], x.shape[1], eps, _threads(num_threads))
    return y


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> bool:
    """Store new keys/values at their cache slots in place (vLLM's ``reshape_and_cache``).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]``, tokens may be strided (heads and dims
            contiguous), the cache's dtype (float32 or bfloat16), CPU.
        kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]``, contiguous.
        slot_mapping: ``[T]`` int64 slots (``block * block_size + offset``), each valid.

    Returns:
        True when stored; False where the kernel does not apply (the caller stores them).

    Raises:
        IndexError: a slot outside the cache (nothing is stored).
    """
    lib = _native_for(kv_cache, k, v)
    if (lib is None or not kv_cache.is_contiguous() or k.stride(2) != 1 or k.stride(1) != k.shape[2]
            or v.stride(2) != 1 or v.stride(1) != v.shape[2]):
        return False
    slots = slot_mapping.contiguous()
    _, h_kv, num_blocks, block_size, d = kv_cache.shape
    rc = lib.reshape_and_cache(kv_cache.element_size(), k.data_ptr(), k.stride(0), v.data_ptr(),
                               v.stride(0), kv_cache.data_ptr(), slots.data_ptr(), k.shape[0],
                               h_kv, d, num_blocks, block_size)
    if rc != 0:
        raise IndexError(f"a KV slot lies outside the cache of {num_blocks * block_size} slots")
    return True


def silu_and_mul(x: torch.Tensor, num_threads: int | None = None) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``x = [gate | up]`` in one pass (vLLM's ``silu_and_mul``).

    Args:
        x: ``[T, 2 * I]`` float32 or bfloat16, CPU. num_threads: as ``paged_decode_attention``.

    Returns:
        ``[T, I]`` in x's dtype (bfloat16 rounded as HF: after the SiLU, then the product),
        or None where the kernel does not apply.
    """
    lib = _native_for(x)
    if lib is None or x.dim() != 2 or x.shape[1] % 2:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    lib.silu_and_mul(int(x.dtype == torch.bfloat16), x.data_ptr(), out.data_ptr(), x.shape[0],
                     x.shape[1] // 2, _threads(num_threads))
    return out


# Columns of decode_layers' per-layer pointer table (decode_layers.c's enum). Each linear
# layer has four: its weight (dense, or packed blocks), format (0 dense, else
# quant_linear.c's), block scales and Q4_1's block minimums (0 where unused).
_LINEAR_COLUMNS = ("", "_fmt", "_scales", "_mins")
DECODE_LAYER_COLUMNS = ("input_norm", *("qkv" + c for c in _LINEAR_COLUMNS), "qkv_bias",
                        *("o_proj" + c for c in _LINEAR_COLUMNS), "post_norm",
                        *("gate_up" + c for c in _LINEAR_COLUMNS),
                        *("down" + c for c in _LINEAR_COLUMNS), "kv_cache")


def decode_layers(x: torch.Tensor, layer_table: torch.Tensor, *, num_heads: int,
                  num_kv_heads: int, head_dim: int, intermediate_size: int, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  num_blocks: int, scale: float, num_threads: int | None = None) -> bool:
    """Run every decoder layer over a decode step's 1-2 tokens in one native call
    (``decode_layers.c``), updating ``x`` in place; bit-identical to the per-module path.

    Args:
        x: ``[M, hidden]`` float32 or bfloat16 on CPU, contiguous (``M <= 16`` unless every
            linear layer is quantized): the embeddings in, the last layer's output out.
        layer_table: ``[num_layers, len(DECODE_LAYER_COLUMNS)]`` int64 addresses of each
            layer's tensors (x's dtype, contiguous; ``qkv_bias`` 0 when there is none; the KV
            cache ``[2, num_kv_heads, num_blocks, block_size, head_dim]``). The caller keeps
            the tensors alive.
        cos, sin: ``[M, 1, head_dim]`` contiguous, x's dtype.
        slot_mapping ``[M]``, block_tables ``[M, width]``, seq_lens ``[M]``: int64, as for
            ``reshape_and_cache`` and ``paged_decode_attention``.

    Returns:
        True when done; False when the kernels do not take these shapes or inputs (nothing
        changed: the caller runs the modules).

    Raises:
        IndexError: a slot outside the cache. MemoryError: out of memory part way.
    """
    lib = _native_for(x, cos, sin)
    if lib is None or not x.is_contiguous():
        return False
    tables, slots, lens = (t.contiguous() for t in (block_tables, slot_mapping, seq_lens))
    rc = lib.decode_layers(
        int(x.dtype == torch.bfloat16), x.data_ptr(), x.shape[0], layer_table.data_ptr(),
        layer_table.shape[0], x.shape[1], num_heads, num_kv_heads, head_dim, intermediate_size,
        eps, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), num_blocks, block_size, scale,
        _threads(num_threads), MIN_KEYS_PER_THREAD)
    if rc == -2:
        raise IndexError(f"a KV slot lies outside the cache of {num_blocks * block_size} slots")
    if rc == -3:
        raise MemoryError("decode_layers: out of memory")
    return rc == 0
