"""The native kernel library: compiled on first use with the system C compiler, cached per
machine and source version, and loaded with ctypes (no torch headers), its bindings read
from ``kernels.h`` (``header.py``). Also the switches around it: ``INFLIGHT_NATIVE_KERNELS``
and ``use_native_kernels`` turn it off, ``INFLIGHT_CPU_AMX`` keeps it off AMX tiles,
``INFLIGHT_CPU_ISA`` runs another host kind's path on this one (``isa_path``), and
``onednn_has_amx`` says whether oneDNN's own GEMMs can use the tiles.
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

from inflight.host_cpu import cpu_flags
from inflight.model.kernels.header import read_signatures

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCES = [_DIR / n for n in ("paged_attention.c", "prefill_attention.c",
                               "prefill_attention_kv8.c", "linear.c", "gemm.c", "quant_linear.c",
                               "rms_norm.c", "activation.c", "lora.c", "decode_layers.c")]
_HEADERS = [_DIR / "amx.h", _DIR / "bf16.h", _DIR / "fast_exp.h", _DIR / "kernels.h", _DIR / "kv8.h",
            _DIR / "team.h"]
# Vectorizable float reductions without -ffinite-math-only (the softmax uses -inf).
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
           "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-fPIC"]

# The host kinds whose numerics differ (issue 50), fastest first: Intel Xeon with AMX tiles;
# AVX-512 with VNNI and BF16 but no AMX (AMD Zen 4, older Xeons); AVX2 + FMA + F16C alone
# (AMD Zen 2). A host runs its own and can emulate those after it: ``INFLIGHT_CPU_ISA``
# names one (tests/isa_paths.py sets it with oneDNN's own cap, ``ONEDNN_MAX_CPU_ISA``).
ISA_PATHS = ("amx", "avx512", "avx2")
# oneDNN's cap that matches each emulated path.
ONEDNN_CAPS = {"avx512": "AVX512_CORE_BF16", "avx2": "AVX2"}


def host_isa() -> str | None:
    """This CPU's own path among ``ISA_PATHS`` (None: none of them, or not Linux)."""
    flags = cpu_flags()
    if {"amx_tile", "amx_bf16", "amx_int8"} <= flags:
        return "amx"
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


def isa_path(environ: Mapping[str, str] = os.environ) -> str | None:
    """The path this process's kernels take: ``INFLIGHT_CPU_ISA`` where it names a path this
    CPU can emulate (one after its own in ``ISA_PATHS``), else the host's own.

    Raises:
        ValueError: ``INFLIGHT_CPU_ISA`` names an unknown path, or one this CPU lacks.
    """
    own, asked = host_isa(), environ.get("INFLIGHT_CPU_ISA", "")
    if not asked:
        return own
    if asked not in ISA_PATHS:
        raise ValueError(f"INFLIGHT_CPU_ISA={asked!r}: one of {', '.join(ISA_PATHS)}")
    if own is None or ISA_PATHS.index(asked) < ISA_PATHS.index(own):
        raise ValueError(f"INFLIGHT_CPU_ISA={asked}: this CPU's own path is {own}, and only "
                         f"the paths after it ({', '.join(ISA_PATHS)}) can be emulated")
    return asked


def _march(environ: Mapping[str, str]) -> str:
    """The compiler's target: this CPU, or Haswell's AVX2 + FMA + F16C for the avx2 path."""
    return "-march=haswell" if isa_path(environ) == "avx2" else "-march=native"


class KernelLibrary(ctypes.CDLL):
    """The loaded library: ctypes functions named as in ``kernels.h``, plus what was asked
    of it once at load time."""

    # The head size the prefill kernel was built for (0: not built, no AVX-512).
    prefill_head_dim: int = 0
    # The block-quantized GEMM has a SIMD path (AVX-512 VNNI / AMX, or AVX2); False: scalar C.
    quant_vectorized: bool = False


_lib: KernelLibrary | None = None
_tried = False


def _compile(cc: str, lib_path: Path) -> str | None:
    """Build ``lib_path``: every source compiled at once, then linked. None, or the error."""
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        objects = [Path(tmp) / (src.stem + ".o") for src in _SOURCES]
        jobs = [subprocess.Popen([cc, _march(os.environ), *_CFLAGS, "-c", str(src), "-o", str(obj)],
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


def _build() -> KernelLibrary | None:
    if (os.environ.get("INFLIGHT_NATIVE_KERNELS", "1") == "0"
            or os.environ.get("INFLIGHT_ATTENTION_BACKEND", "").lower() == "torch"):
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.warning("no C compiler found: the model runs on PyTorch's kernels alone")
        return None
    src = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    key = hashlib.sha256(src + " ".join([_march(os.environ), *_CFLAGS]).encode()
                         + platform.machine().encode()
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
    lib = KernelLibrary(str(lib_path))
    for name, (restype, argtypes) in read_signatures(_DIR / "kernels.h").items():
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = argtypes
    lib.prefill_head_dim = int(lib.paged_prefill_head_dim())
    lib.quant_vectorized = bool(lib.quant_linear_vectorized())
    apply_amx_setting(lib, os.environ)
    return lib


def quantized_kernels_vectorized() -> bool:
    """Whether the block-quantized kernels (``quant_linear``, the quantized decode path)
    have a SIMD path on this CPU: AVX-512 VNNI (``vpdpbusd``) or AVX2 + FMA + F16C
    (``vpmaddubsw``). Without either they run scalar C: measured on an AVX2-only EPYC
    before its AVX2 path, 9 tok/s for one stream against 50 with dense float32 weights on
    oneDNN (docs/performance.md), so ``--quantization auto`` keeps weights dense there."""
    lib = native_library()
    return lib is not None and lib.quant_vectorized


def onednn_has_amx(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether oneDNN's GEMMs can run on AMX tiles here: the CPU and OS give them
    (``torch.cpu._is_amx_tile_supported``) and ``ONEDNN_MAX_CPU_ISA``, oneDNN's own cap,
    does not rule them out (``ALL`` and the ``*_AMX*`` values leave them on), and no
    emulated path without them is in force (``isa_path``). It concerns PyTorch's own ops:
    the model's linear layers run the library's kernels (``kernels/gemm.c``)."""
    cap = environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if cap not in ("ALL", "DEFAULT") and "AMX" not in cap:
        return False
    if isa_path(environ) not in ("amx", None):
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


# Past any batch: the AMX path of quant_linear then never runs.
_AMX_OFF = 1 << 62


def apply_amx_setting(lib: ctypes.CDLL, environ: Mapping[str, str]) -> None:
    """``INFLIGHT_CPU_AMX=0`` keeps the library off AMX tiles: generated tokens' int8
    products stay on the AVX-512 VNNI path where tiles would take batches of 24+ rows (the
    same bits: tests/model/test_quant.py), and prompt rows' bfloat16 GEMM on AVX-512
    (``gemm.c``'s path 2; other bits, each a row's in any batch). A way round a platform
    whose AMX state misbehaves (llama.cpp's AMX build dies on one, docs/performance.md) and
    the way an AMX host runs the path of a host without AMX (tests/isa_paths.py)."""
    if environ.get("INFLIGHT_CPU_AMX", "1") == "0" or isa_path(environ) != host_isa():
        lib.quant_linear_amx(_AMX_OFF)
        lib.gemm_max_path(2)


def native_library() -> KernelLibrary | None:
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


def native_for(*tensors: torch.Tensor) -> KernelLibrary | None:
    """The library, if the kernels can take these tensors: all on CPU, all float32 or all
    bfloat16; else None (the caller runs PyTorch)."""
    lib = native_library()
    dtype = tensors[0].dtype
    if lib is None or dtype not in (torch.float32, torch.bfloat16) or any(
            t.device.type != "cpu" or t.dtype != dtype for t in tensors):
        return None
    return lib


def thread_count(num_threads: int | None) -> int:
    """``num_threads``, or by default as many as PyTorch's pool has."""
    return torch.get_num_threads() if num_threads is None else num_threads
