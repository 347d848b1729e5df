"""The engine's memory is bounded by its work, not its history (engine/memory.py).

Each test runs in a fresh interpreter: oneDNN reads its cache capacity once, at the first
GEMM of the process, and this test process has run many GEMMs already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from inflight.engine.memory import PRIMITIVE_CACHE_CAPACITY, bound_primitive_caches

# 160 token counts through oneDNN's GEMM over a prepacked weight (bfloat16, or float32 where
# oneDNN has no bfloat16 GEMM to prepack for (AVX2); the shapes of the bundled model's fused
# projections), RSS read before and after (glibc's free pages handed back first, so only
# what is held counts). The model's own prompt rows take the packed GEMM of kernels/gemm.c,
# which caches nothing; PyTorch's other oneDNN ops still do.
_GEMM_SHAPES_SCRIPT = textwrap.dedent("""
    import ctypes, json, os, sys
    import torch
    if sys.argv[1] == "bounded":
        from inflight.engine.memory import bound_primitive_caches
        bound_primitive_caches()
    from inflight.model.linear import onednn_pack
    torch.manual_seed(0)
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")

    def rss_mib():
        libc.malloc_trim(0)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    dtype = torch.bfloat16
    if onednn_pack(torch.randn(8, 8).to(dtype)) is None:
        dtype = torch.float32
    layers = []
    for n_in, n_out in ((576, 960), (576, 576), (576, 3072), (1536, 576)):
        packed = onednn_pack(torch.randn(n_out, n_in).to(dtype))
        assert packed is not None
        layers.append((n_in, packed))
    def step(rows):
        for n_in, packed in layers:
            torch.ops.mkldnn._linear_pointwise(torch.randn(rows, n_in, dtype=dtype), packed,
                                               None, "none", [], "")
    step(3)
    before = rss_mib()
    for rows in range(4, 164):
        step(rows)
    print(json.dumps({"growth_mib": rss_mib() - before,
                      "env": {k: os.environ.get(k) for k in
                              ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}}))
""")


def _run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", _GEMM_SHAPES_SCRIPT, mode], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc")
def test_new_gemm_shapes_do_not_grow_memory_once_the_caches_are_bounded():
    # Measured: ~2.4 MiB per new token count with oneDNN's defaults (1,024 entries in each
    # of two caches), ~0.05 MiB once bounded at 32.
    unbounded, bounded = _run("default"), _run("bounded")
    assert bounded["env"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(PRIMITIVE_CACHE_CAPACITY),
                              "LRU_CACHE_CAPACITY": str(PRIMITIVE_CACHE_CAPACITY)}
    assert unbounded["growth_mib"] > 150, unbounded
    assert bounded["growth_mib"] < 30, bounded


def test_a_capacity_the_user_set_wins(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert bound_primitive_caches(32) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32",
                                          "LRU_CACHE_CAPACITY": "7"}
    with pytest.raises(ValueError, match="at least 1"):
        bound_primitive_caches(0)
