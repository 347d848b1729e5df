"""Run the instruction-set-sensitive tests (``-m isa``) on the path this host did not take.

`make test` runs the whole suite on the host's own path, then this. On a host whose oneDNN
has AMX tiles, the path of an AMD EPYC or an older Intel part (AVX-512 with bfloat16 and
VNNI, no AMX) is emulated by capping oneDNN (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``) and
keeping the int8 kernel off its tiles (``INFLIGHT_CPU_AMX=0``), so a bound tuned on one
path cannot pass here and fail there (issue 29). A host without AMX cannot emulate the
AMX path: it says so and passes (an AMX host's run covers it).

Usage: python tests/isa_paths.py [pytest args...]
"""

from __future__ import annotations

import os
import subprocess
import sys

NO_AMX = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "INFLIGHT_CPU_AMX": "0"}


def main(argv: list[str]) -> int:
    from inflight.model.kernels.native_lib import onednn_has_amx

    if not onednn_has_amx():
        print("isa_paths: this host's oneDNN has no AMX tiles; the suite just ran the non-AMX path "
              "(the AMX path needs an AMX host)")
        return 0
    print(f"isa_paths: the isa-marked tests again on the non-AMX path ({' '.join(f'{k}={v}' for k, v in NO_AMX.items())})",
          flush=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "isa", *argv]
    return subprocess.call(cmd, env={**os.environ, **NO_AMX})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
