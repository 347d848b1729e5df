"""OpenMP parallel regions a decode step opens (issue 51): each is a fork and a join of the
thread team, and where the team's workers sleep between regions, a wake-up each.

Builds a tiny LD_PRELOAD shim over libgomp's ``GOMP_parallel`` (the entry GCC emits for
``#pragma omp parallel``, which PyTorch's ops and the native kernels both go through; nothing
of it is kept), then in a child process runs ``LLM.generate`` in the default mode: 1 and 8
streams of ``--output-len`` greedy tokens after a short prompt, and counts the regions a
step opened, split by the team size they ran with (1 thread: the ``if`` clause or a team
of one; 2+: a real fork). Steps are read from the engine's own count.

    .venv/bin/python benchmarks/omp_regions.py
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
static _Atomic long regions[2]; /* [0]: one thread, [1]: more */
typedef void (*body_fn)(void *);
void GOMP_parallel(body_fn fn, void *data, unsigned num_threads, unsigned flags) {
    static void (*real)(body_fn, void *, unsigned, unsigned);
    if (!real) real = (void (*)(body_fn, void *, unsigned, unsigned))dlsym(RTLD_NEXT, "GOMP_parallel");
    atomic_fetch_add(&regions[num_threads != 1], 1);
    real(fn, data, num_threads, flags);
}
long omp_regions(int many) { return regions[many != 0]; }
"""

CHILD = r"""
import ctypes, json, sys
shim = ctypes.CDLL(sys.argv[1])
shim.omp_regions.restype = ctypes.c_long
from inflight.entrypoints.llm import LLM
from inflight.sampling_params import SamplingParams
llm = LLM(max_num_seqs=32)
out_len = int(sys.argv[2])
rows = []
for streams in (1, 8):
    prompts = [[100 + 7 * i + j for j in range(16)] for i in range(streams)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    steps0 = llm.engine.get_stats().num_steps
    one0, many0 = shim.omp_regions(0), shim.omp_regions(1)
    llm.generate(prompts, params, use_tqdm=False)
    steps = llm.engine.get_stats().num_steps - steps0
    rows.append({"streams": streams, "steps": steps,
                 "regions_one_thread_per_step": (shim.omp_regions(0) - one0) / steps,
                 "regions_forked_per_step": (shim.omp_regions(1) - many0) / steps,
                 "threads": __import__("torch").get_num_threads()})
print(json.dumps(rows))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    repo = pathlib.Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        shim = pathlib.Path(tmp) / "omp_count.so"
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-x", "c", "-", "-o", str(shim), "-ldl"],
                       input=SHIM, text=True, check=True)
        out = subprocess.run([sys.executable, "-c", CHILD, str(shim), str(args.output_len)],
                             env={**os.environ, "LD_PRELOAD": str(shim)}, cwd=repo,
                             capture_output=True, text=True, timeout=600, check=True)
    sys.path.insert(0, str(repo))
    from inflight.bench.machine import describe_machine
    host = describe_machine()
    print(f"{host['cpu']} ({'VM' if host['vm'] else 'bare metal'}), threads {host['threads']}")
    for row in json.loads(out.stdout.strip().splitlines()[-1]):
        print(f"{row['streams']} stream(s), {row['steps']} steps on {row['threads']} threads: "
              f"{row['regions_forked_per_step']:.1f} forked regions a step, "
              f"{row['regions_one_thread_per_step']:.1f} of one thread")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
