"""Native CPU kernels, compiled on first use with the system C compiler and loaded with
ctypes (no torch headers; ``native_lib.py``), and their PyTorch-facing wrappers (here),
each answering None or False where the kernel does not apply. Anything missing (no
compiler, a failed build, an unsupported shape) falls back to the PyTorch path, logged once.

- ``paged_attention.c``: decode attention over the paged cache, in the model's dtype or the
  8-bit formats (``kv8.h``, ``model/kv_quant.py``); ``reshape_and_cache``, which quantizes.
- ``prefill_attention.c``: prefill chunks over the paged cache (AVX-512, head size 64);
  ``prefill_attention_kv8.c``: the same over an 8-bit cache, portable C (GNU vector types).
- ``linear.c``: the skinny linear layer for generated tokens' rows.
- ``gemm.c``: the prompt rows' GEMM over a packed dense weight, a row the same bits in any
  batch (AMX-BF16 tiles, AVX-512, AVX2; wrappers in ``gemm.py``).
- ``quant_linear.c``: the linear layer over block-quantized weights (ggml's legacy formats
  and K-quants; ``--quantization``; ``model/quant.py``): AVX512-VNNI, AVX2, and AMX-INT8
  tiles from 24 rows where the CPU has them; and rows of such a weight dequantized, the
  token embeddings (wrappers in ``blocks.py``).
- ``rms_norm.c``, ``activation.c``: RMSNorm and the gated activations (SiLU, tanh GELU) in one
  pass.
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

import torch

from inflight.model import kv_quant
from inflight.model.kernels.native_lib import (KernelLibrary, native_for, native_library,
                                               thread_count)
# the ops over block-quantized weights, re-exported: their callers import them from here
from inflight.model.kernels.blocks import quant_linear as quant_linear
from inflight.model.kernels.blocks import quant_rows as quant_rows


# Below this many key rows a thread (a sequence's keys once per KV head), decode attention
# stays on the calling thread: starting the team costs a few microseconds a layer.
MIN_KEYS_PER_THREAD = 512


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           num_threads: int | None = None,
                           window: int | None = None) -> torch.Tensor | None:
    """Decode attention over the paged cache with the native kernel.

    Args:
        q: ``[B, num_heads, head_dim]``, float32 or bfloat16, CPU.
        kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` in q's dtype, or an
            8-bit cache (``kv_quant``: rows of ``head_dim + 4``), each row decoded as it is
            read.
        block_tables: ``[B, max_blocks]`` int64; seq_lens: ``[B]`` int64 (>= 1 each).
        scale: softmax scale.
        num_threads: at most this many threads (default ``torch.get_num_threads()``), each
            with a contiguous run of (sequence, KV head) pairs holding about equal keys and
            at least ``MIN_KEYS_PER_THREAD`` key rows. Results do not depend on it.

    Returns:
        ``[B, num_heads, head_dim]`` in q's dtype, or None when the kernel cannot run these
        inputs (then the caller uses the PyTorch path).
    """
    lib = _native_over_cache(q, kv_cache)
    if lib is None:
        return None
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    b, h, d = q.shape
    _, h_kv, num_blocks, block_size, _ = kv_cache.shape
    rc = lib.paged_decode_attention(
        int(q.dtype == torch.bfloat16), kv_quant.format_code(kv_cache), q.data_ptr(),
        kv_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), b, h, h_kv, d, num_blocks, block_size,
        tables.shape[1], scale, thread_count(num_threads), MIN_KEYS_PER_THREAD, window or 0)
    return out if rc == 0 else None


def _native_over_cache(x: torch.Tensor, kv_cache: torch.Tensor) -> KernelLibrary | None:
    """The library where its kernels can take ``x`` with this cache: the cache in x's dtype,
    or an 8-bit one (``kv_quant``), contiguous, on CPU."""
    if not kv_quant.is_8bit(kv_cache.dtype):
        return native_for(x, kv_cache)
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return None
    return native_for(x)


# False: a cache in q's dtype where the AVX-512 kernel does not apply goes to PyTorch's SDPA,
# as before issue 34 (benchmarks/batch_invariance.py); its rows then depend on the chunk.
PORTABLE_PREFILL_PLAIN = True


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            num_computed: int, scale: float,
                            num_threads: int | None = None,
                            window: int | None = None) -> torch.Tensor | None:
    """Causal attention of one sequence's prefill chunk over the paged cache, read in place:
    ``prefill_attention.c`` over a cache in q's dtype (AVX-512, head size 64), else
    ``prefill_attention_kv8.c`` (portable GNU C vectors, any head size up to 256; an 8-bit
    cache's rows decoded once per tile of query rows). Both run each query row over keys in
    tiles from position 0, so a row is the same bits however the prompt was cut (batch
    invariance, issue 34).

    Args:
        q: ``[T, num_heads, head_dim]`` (tokens may be strided; heads and dims contiguous),
            float32 or bfloat16, CPU. Token ``i`` sits at position ``num_computed + i``.
        kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` in q's dtype, or an
            8-bit cache (``kv_quant``: rows of ``head_dim + 4``, contiguous), holding the
            sequence's keys/values for positions ``0 .. num_computed + T - 1``.
        block_table: int64 block ids covering those positions.
        scale: softmax scale. num_threads: at most this many threads of PyTorch's pool
            (default ``torch.get_num_threads()``), over (KV head, query tile) work items.
            Results do not depend on it.
        window: a sliding window: token ``i`` sees keys ``num_computed + i - window + 1 ..
            num_computed + i`` (the portable kernel; tiles still from position 0, so a row
            is the same bits however the prompt was cut); None: all.

    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype (float32 sums, one rounding), or None where
        the kernel does not apply (more than 16 query heads a KV head; a head size over
        256): then the caller uses PyTorch's SDPA.

    Raises:
        ValueError: ``block_table`` covers fewer than ``num_computed + T`` positions (the
            kernel would read past it).
    """
    quantized = kv_quant.is_8bit(kv_cache.dtype)
    lib = _native_over_cache(q, kv_cache)
    if (lib is None or q.dim() != 3 or q.stride(2) != 1 or q.stride(1) != q.shape[2]
            or q.shape[2] != kv_quant.head_dim_of(kv_cache) or not kv_cache.is_contiguous()):
        return None
    # A cache in q's dtype: the AVX-512 kernel where it applies, else the portable one (also
    # for a sliding window, which only the portable one takes).
    portable = quantized or q.shape[2] != lib.prefill_head_dim or window is not None
    if portable and not quantized and not PORTABLE_PREFILL_PLAIN:
        return None
    table = block_table.contiguous()
    t, h, d = q.shape
    _, h_kv, num_blocks, block_size, _ = kv_cache.shape
    if table.numel() * block_size < num_computed + t:
        raise ValueError(f"a block table of {table.numel()} blocks of {block_size} cannot "
                         f"hold {num_computed + t} positions")
    out = torch.empty(t, h, d, dtype=q.dtype)
    args = (q.data_ptr(), q.stride(0), kv_cache.data_ptr(), table.data_ptr(), num_computed, t,
            out.data_ptr(), h, h_kv, d, num_blocks, block_size, scale, thread_count(num_threads))
    is_bf16 = int(q.dtype == torch.bfloat16)
    rc = (lib.paged_prefill_attention_kv8(is_bf16, kv_quant.format_code(kv_cache), *args,
                                          window or 0)
          if portable else lib.paged_prefill_attention(is_bf16, *args))
    return out if rc == 0 else None


# The most input rows the model sends to the skinny kernel where the library is not built:
# with AVX-512, at 4 rows oneDNN's GEMM, which reuses each weight tile across rows, was
# faster on the larger shapes (docs/performance.md). The kernel itself takes up to 16.
SKINNY_MAX_ROWS = 2


def skinny_max_rows() -> int:
    """The most input rows the skinny kernel beats oneDNN's GEMM for on this CPU, as the
    library was built (``skinny_max_rows`` in linear.c: 2 with AVX-512, 8 with AVX2 alone,
    where oneDNN's small-M GEMM is slow); ``SKINNY_MAX_ROWS`` without the library."""
    lib = native_library()
    return SKINNY_MAX_ROWS if lib is None else int(lib.skinny_max_rows())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  num_threads: int | None = None) -> torch.Tensor | None:
    """``x @ weight.T + bias``, each row of ``x`` by the same arithmetic whatever ``M`` is
    (batch invariant: a row's result does not depend on the rows beside it or how many
    there are). Up to 8 rows (4 with AVX-512) stream ``weight`` once; more rows go in
    groups of that many over blocks of ``weight`` kept in L2.

    Args:
        x: ``[M, K]`` float32 or bfloat16, CPU, ``M >= 1``.
        weight: ``[N, K]`` (``nn.Linear``'s layout), x's dtype; bias: ``[N]`` or None.
        num_threads: threads of PyTorch's pool (default ``torch.get_num_threads()``), each
            over its own run of weight rows. Results do not depend on it.

    Returns:
        ``[M, N]`` in x's dtype (float32 accumulation, one rounding), or None when the
        kernel cannot run these inputs (then the caller uses PyTorch).
    """
    lib = native_for(x, weight, *([] if bias is None else [bias]))
    if lib is None or x.dim() != 2 or x.shape[0] < 1 or not weight.is_contiguous():
        return None
    x = x.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    rc = lib.skinny_linear(int(x.dtype == torch.bfloat16), x.data_ptr(), weight.data_ptr(),
                           None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                           thread_count(num_threads))
    return y if rc == 0 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             num_threads: int | None = None, scale_in_float32: bool = False,
             ) -> torch.Tensor | None:
    """RMSNorm with HF's rounding, one pass per row (``rms_norm.c``).

    Args:
        x: ``[T, D]`` float32 or bfloat16, CPU; weight: ``[D]``, x's dtype.
        eps: added to the mean square. num_threads: as ``paged_decode_attention``.
        scale_in_float32: Gemma's rounding, ``(h * weight.float()).to(x.dtype)``, one
            rounding; else Llama's, ``weight * h.to(x.dtype)`` (the same in float32).

    Returns:
        ``[T, D]`` in x's dtype, ``h = x * rsqrt(mean(x^2) + eps)`` computed in float32 and
        scaled as above; or None when the kernel cannot run these inputs.
    """
    lib = native_for(x, weight)
    if lib is None or x.dim() != 2:
        return None
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    lib.rms_norm(int(x.dtype == torch.bfloat16), int(scale_in_float32), x.data_ptr(),
                 weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps,
                 thread_count(num_threads))
    return y


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> bool:
    """Store new keys/values at their cache slots in place (vLLM's ``reshape_and_cache``).

    Args:
        k, v: ``[T, num_kv_heads, head_dim]``, tokens may be strided (heads and dims
            contiguous), float32 or bfloat16, CPU.
        kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` in k's dtype, or an
            8-bit cache (``kv_quant``; each row quantized as ``kv_quant.quantize_rows``
            does, bit for bit), contiguous.
        slot_mapping: ``[T]`` int64 slots (``block * block_size + offset``), each valid.

    Returns:
        True when stored; False where the kernel does not apply (the caller stores them).

    Raises:
        IndexError: a slot outside the cache (nothing is stored).
    """
    lib = _native_over_cache(k, kv_cache) if v.dtype == k.dtype else None
    if (lib is None or not kv_cache.is_contiguous() or k.stride(2) != 1 or k.stride(1) != k.shape[2]
            or v.stride(2) != 1 or v.stride(1) != v.shape[2]):
        return False
    slots = slot_mapping.contiguous()
    _, h_kv, num_blocks, block_size, _ = kv_cache.shape
    rc = lib.reshape_and_cache(int(k.dtype == torch.bfloat16), kv_quant.format_code(kv_cache),
                               k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                               kv_cache.data_ptr(), slots.data_ptr(), k.shape[0], h_kv,
                               k.shape[2], num_blocks, block_size)
    if rc != 0:
        raise IndexError(f"a KV slot lies outside the cache of {num_blocks * block_size} slots")
    return True


# activation.c's codes
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def act_and_mul(x: torch.Tensor, activation: str = "silu",
                num_threads: int | None = None) -> torch.Tensor | None:
    """``act(gate) * up`` of ``x = [gate | up]`` in one pass (vLLM's ``silu_and_mul`` and
    ``gelu_tanh_and_mul``).

    Args:
        x: ``[T, 2 * I]`` float32 or bfloat16, CPU.
        activation: ``silu`` or ``gelu_tanh`` (``F.gelu(..., approximate="tanh")``).
        num_threads: as ``paged_decode_attention``.

    Returns:
        ``[T, I]`` in x's dtype (bfloat16 rounded as HF: after the activation, then the
        product), or None where the kernel does not apply.

    Raises:
        KeyError: an activation other than those two.
    """
    code = ACTIVATIONS[activation]
    lib = native_for(x)
    if lib is None or x.dim() != 2 or x.shape[1] % 2:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    lib.act_and_mul(code, int(x.dtype == torch.bfloat16), x.data_ptr(), out.data_ptr(),
                    x.shape[0], x.shape[1] // 2, thread_count(num_threads))
    return out


# Columns of decode_layers' per-layer table (decode_layers.c's enum). Each linear layer has
# six: its weight (dense, packed blocks, or the address of a parts descriptor), format (0
# dense, FMT_PARTS, else quant_linear.c's), block scales and Q4_1's block minimums, its LoRA
# slots' A and B (0 where unused). Then the norms a family may add (0: none), the layer's
# window (0: none) and whether it takes the local RoPE tables.
_LINEAR_COLUMNS = ("", "_fmt", "_scales", "_mins", "_lora_a", "_lora_b")
DECODE_LAYER_COLUMNS = ("input_norm", *("qkv" + c for c in _LINEAR_COLUMNS), "qkv_bias",
                        *("o_proj" + c for c in _LINEAR_COLUMNS), "post_norm",
                        *("gate_up" + c for c in _LINEAR_COLUMNS),
                        *("down" + c for c in _LINEAR_COLUMNS), "kv_cache", "q_norm",
                        "k_norm", "pre_ff_norm", "post_ff_norm", "window", "local_rope")
FMT_PARTS = -1


def decode_layers(x: torch.Tensor, layer_table: torch.Tensor, *, num_heads: int,
                  num_kv_heads: int, head_dim: int, intermediate_size: int, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                  num_blocks: int, scale: float, kv_fmt: int = 0,
                  activation: str = "silu", norm_scale_in_float32: bool = False,
                  local_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                  num_threads: int | None = None,
                  lora: tuple[torch.Tensor, int, int] | None = None) -> bool:
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
        kv_fmt: the caches' format (``kv_quant.format_code``: 0 in x's dtype, else 8-bit).
        activation: the MLP's (``act_and_mul``); norm_scale_in_float32: every RMSNorm's
            rounding (``rms_norm``'s ``scale_in_float32``).
        local_cos_sin: ``cos``, ``sin`` at the windowed layers' RoPE base, for the layers
            whose ``local_rope`` column is 1; None: every layer takes ``cos``, ``sin``.
        lora: the step's LoRA rows (``model.lora``): each row's slot ``[M]`` int64 (-1:
            none), the slots, the largest rank; the table's ``*_lora_a``/``*_lora_b``
            columns give each layer's slot tensors. None: no adapter row.

    Returns:
        True when done; False when the kernels do not take these shapes or inputs (nothing
        changed: the caller runs the modules).

    Raises:
        IndexError: a slot outside the cache. MemoryError: out of memory part way.
    """
    local = local_cos_sin or (None, None)
    lib = native_for(x, cos, sin, *(t for t in local if t is not None))
    if lib is None or not x.is_contiguous() or not all(
            t is None or t.is_contiguous() for t in (cos, sin, *local)):
        return False
    tables, slots, lens = (t.contiguous() for t in (block_tables, slot_mapping, seq_lens))
    rc = lib.decode_layers(
        int(x.dtype == torch.bfloat16), kv_fmt, x.data_ptr(), x.shape[0], layer_table.data_ptr(),
        layer_table.shape[0], x.shape[1], num_heads, num_kv_heads, head_dim, intermediate_size,
        eps, ACTIVATIONS[activation], int(norm_scale_in_float32), cos.data_ptr(),
        sin.data_ptr(), *(None if t is None else t.data_ptr() for t in local),
        slots.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), num_blocks, block_size, scale,
        thread_count(num_threads), MIN_KEYS_PER_THREAD,
        None if lora is None else lora[0].data_ptr(), *((0, 0) if lora is None else lora[1:]))
    if rc == -2:
        raise IndexError(f"a KV slot lies outside the cache of {num_blocks * block_size} slots")
    if rc == -3:
        raise MemoryError("decode_layers: out of memory")
    return int(rc) == 0
