"""Run the instruction-set-sensitive tests (``-m isa``) on the host kinds this one can emulate.

`make test` runs the whole suite on this host's own path, then this: the isa-marked tests
again under each path after it in ``native_lib.ISA_PATHS`` (AMX -> AVX-512 -> AVX2), so a
bound or a property measured on one kind cannot pass here and fail there (issues 29, 50).
Each run sets ``INFLIGHT_CPU_ISA`` (the kernels built for that path, AMX off, an AVX2
host's float32 default) and oneDNN's own cap, ``ONEDNN_MAX_CPU_ISA``:

- ``avx512`` (AMD Zen 4, Xeons before AMX): AVX-512 with VNNI and BF16, no AMX tiles;
- ``avx2`` (AMD Zen 2): the library built for Haswell (AVX2 + FMA + F16C), oneDNN at AVX2.

A path before this host's own cannot be emulated (no AMX on an EPYC): it says which and
passes; that host kind's own run covers it.

Usage: python tests/isa_paths.py [pytest args...]
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    from inflight.model.kernels.native_lib import ISA_PATHS, ONEDNN_CAPS, host_isa

    own = host_isa()
    if own is None:
        print("isa_paths: this CPU takes none of the paths (no AVX2): nothing to emulate")
        return 0
    before, after = ISA_PATHS[:ISA_PATHS.index(own)], ISA_PATHS[ISA_PATHS.index(own) + 1:]
    if before:
        print(f"isa_paths: this host's path is {own}; {', '.join(before)} cannot be emulated "
              f"here (a host that has it runs it)")
    rc = 0
    for path in after:
        env = {"INFLIGHT_CPU_ISA": path, "ONEDNN_MAX_CPU_ISA": ONEDNN_CAPS[path]}
        print(f"isa_paths: the isa-marked tests on the {path} path "
              f"({' '.join(f'{k}={v}' for k, v in env.items())})", flush=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "isa", *argv]
        rc = subprocess.call(cmd, env={**os.environ, **env}) or rc
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
