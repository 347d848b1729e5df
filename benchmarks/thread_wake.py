"""How long this host takes to wake a sleeping thread, and what an OpenMP parallel region costs
with libgomp's spin bounded or not (issue 51): the numbers behind the thread team's choice.

Compiles a small C program with the system gcc (nothing of it is kept) and runs it twice,
under ``GOMP_SPINCOUNT=300`` (the CLI's bound before issue 51) and libgomp's default
(300,000), each also in a busy-neighbour mode where it can pin a pure-Python loop on the
second core. It reports, median and 90th percentile over ``--samples``:

- ``futex wake``: one thread sleeps on a futex; another stores, wakes it and stamps the
  time; the sleeper stamps when it runs. After ``--gap-us`` of idleness, so the sleeper's
  CPU has gone idle (on a KVM guest an idle vCPU halts, and waking it is a trip through the
  host).
- ``empty region``: ``#pragma omp parallel`` with one atomic add in it, on all threads, after
  ``--gap-us`` of work on the calling thread: the fork and join of a region whose workers
  slept (bounded spin) or spun (default) since the last.

    .venv/bin/python benchmarks/thread_wake.py --samples 2000
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inflight.bench.machine import describe_machine  # noqa: E402

PROGRAM = r"""
#define _GNU_SOURCE
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static void busy_us(double us) { double end = now_us() + us; while (now_us() < end) {} }
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static void report(const char *what, double *v, int n) {
    qsort(v, n, sizeof *v, cmp);
    printf("{\"what\": \"%s\", \"median_us\": %.2f, \"p90_us\": %.2f, \"n\": %d}\n", what,
           v[n / 2], v[n * 9 / 10], n);
}

static _Atomic int word, arrivals;
static _Atomic double stamp;
static double *lat;
static int samples, gap_us;

static void *sleeper(void *arg) {
    (void)arg;
    for (int i = 0; i < samples; i++) {
        while (atomic_load(&word) == 0)
            syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
        lat[i] = now_us() - atomic_load(&stamp);
        atomic_store(&word, 0);
    }
    return NULL;
}

int main(int argc, char **argv) {
    samples = atoi(argv[1]);
    gap_us = atoi(argv[2]);
    lat = malloc(sizeof(double) * samples);
    pthread_t t;
    pthread_create(&t, NULL, sleeper, NULL);
    for (int i = 0; i < samples; i++) {
        usleep(gap_us);
        while (atomic_load(&word) != 0) {}
        atomic_store(&stamp, now_us());
        atomic_store(&word, 1);
        syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
    pthread_join(t, NULL);
    report("futex wake", lat, samples);
    for (int i = 0; i < samples; i++) {
        busy_us(gap_us);
        double t0 = now_us();
#pragma omp parallel
        atomic_fetch_add(&arrivals, 1);
        lat[i] = now_us() - t0;
    }
    report("empty region", lat, samples);
    if (atomic_load(&arrivals) < samples * 2) return 1; /* the team had 2 threads each time */
    return 0;
}
"""

BUSY_LOOP = ("import os, sys, time\nos.sched_setaffinity(0, {1})\nend = time.monotonic() + "
             "float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--gap-us", type=int, default=500)
    ap.add_argument("--busy", action="store_true", help="also with a busy loop pinned on core 1")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    host = describe_machine()
    print(f"{host['cpu']}, {host.get('vm')}, load average {host['loadavg']}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = pathlib.Path(tmp) / "wake.c", pathlib.Path(tmp) / "wake"
        src.write_text(PROGRAM)
        subprocess.run(["gcc", "-O2", "-fopenmp", str(src), "-o", str(exe)], check=True)
        for busy in ([False, True] if args.busy else [False]):
            for spin in ("300", "300000"):
                loop = (subprocess.Popen([sys.executable, "-c", BUSY_LOOP, "60"])
                        if busy else None)
                try:
                    out = subprocess.run([str(exe), str(args.samples), str(args.gap_us)],
                                         capture_output=True, text=True, timeout=300, check=True,
                                         env={**os.environ, "GOMP_SPINCOUNT": spin,
                                              "OMP_NUM_THREADS": str(os.cpu_count())})
                finally:
                    if loop is not None:
                        loop.kill()
                for line in out.stdout.splitlines():
                    row = {**json.loads(line), "GOMP_SPINCOUNT": spin, "busy_core1": busy}
                    results.append(row)
                    print(f"GOMP_SPINCOUNT={spin:>6s} {'core 1 busy' if busy else 'idle':11s} "
                          f"{row['what']:12s} median {row['median_us']:8.2f} us, "
                          f"p90 {row['p90_us']:8.2f} us ({row['n']} samples, gap {args.gap_us} us)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host, "gap_us": args.gap_us, "results": results}, f, indent=1)


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
