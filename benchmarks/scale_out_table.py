"""Summarise benchmarks/scale_out.sh results: one row per run, then the mean per
configuration. Usage: python benchmarks/scale_out_table.py OUT_DIR"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
from collections import defaultdict

from inflight.bench.metrics_scrape import prefix_hit_rate


def main(out: str) -> None:
    rows = []
    for path in sorted(pathlib.Path(out).glob("*-r*.json")):
        if path.name.endswith(".stats.json"):
            continue
        tag = path.stem
        d = json.loads(path.read_text())
        c = d.get("server_metrics", {}).get("counter_deltas", {})
        hit = prefix_hit_rate(c)
        hit = float("nan") if hit is None else hit
        stats_path = path.with_name(tag + ".stats.json")
        routed = ""
        if stats_path.exists():
            s = json.loads(stats_path.read_text())
            routed = "/".join(str(r["requests_routed"]) for r in s.get("replicas", []))
        config = tag.rsplit("-r", 1)[0]
        rows.append((config, tag, d["completed"], d["failed"], d["request_throughput"],
                     d["median_ttft_ms"], d["p95_ttft_ms"], d["p95_itl_ms"], hit, routed))
    print("| run | done | failed | req/s | TTFT p50 ms | TTFT p95 ms | ITL p95 ms | prefix hit rate | requests per replica |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[1]} | {r[2]} | {r[3]} | {r[4]:.2f} | {r[5]:.0f} | {r[6]:.0f} | {r[7]:.0f} | "
              f"{r[8]:.1%} | {r[9] or '-'} |")
    by: dict[str, list[tuple]] = defaultdict(list)
    for r in rows:
        by[r[0]].append(r)
    print()
    print("| configuration | runs | TTFT p50 ms | TTFT p95 ms (each run) | ITL p95 ms | prefix hit rate |")
    print("|---|---|---|---|---|---|")
    for config, rs in by.items():
        print(f"| {config} | {len(rs)} | {statistics.mean(r[5] for r in rs):.0f} | "
              f"{' / '.join(f'{r[6]:.0f}' for r in rs)} | {statistics.mean(r[7] for r in rs):.0f} | "
              f"{statistics.mean(r[8] for r in rs):.1%} |")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main(sys.argv[1])
