"""A shared-prefix workload for docs/scale_out.md: 16 distinct documents of about 400
tokens (shuffled lines of ../shared/data/vllm_sonnet.txt), each request one of them (seeded
random) plus a short question; vLLM's ``custom`` JSONL (``{"prompt": ...}`` per line).
Usage: python benchmarks/scale_out_prefixes.py OUT.jsonl NUM_REQUESTS"""

from __future__ import annotations

import json
import pathlib
import random
import sys

DATA = pathlib.Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "vllm_sonnet.txt"


def main(out: str, num: int, num_docs: int = 16, doc_chars: int = 1700) -> None:
    lines = [ln.strip() for ln in DATA.read_text(encoding="utf-8").splitlines() if ln.strip()]
    rng = random.Random(0)
    docs = []
    for _ in range(num_docs):
        rng.shuffle(lines)
        text, i = "", 0
        while len(text) < doc_chars:
            text, i = text + lines[i] + "\n", i + 1
        docs.append(text)
    with open(out, "w", encoding="utf-8") as f:
        for j in range(num):
            d = rng.randrange(len(docs))
            q = f"\nQuestion {j}: which line above speaks of {rng.choice(lines).split()[-1]}? Answer:"
            f.write(json.dumps({"prompt": docs[d] + q}) + "\n")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main(sys.argv[1], int(sys.argv[2]))
