"""`compare_tensors` against `torch.testing.assert_close` on the same pair of 1 GiB float32 tensors.

Run: python benchmarks/bench_compare.py [--repeats 3] [--gib 1]   (writes benchmarks/results/compare.txt)

Each (method, case) runs in its own Python process, interleaved, so one method's allocations can never hide
under another's peak. Inside the process:
  1. A (2**28 float32 = 1 GiB) is drawn in place, B = A.clone() is perturbed in place, so the process peak so
     far is exactly the two tensors plus the interpreter (checked: "headroom" = peak RSS - current RSS, ~0).
  2. Both methods are warmed up on a 10-element pair (kernels, thread pool), then the measured call runs once.
  3. extra buffers = (peak RSS after - peak RSS before) / 1 GiB, from
     resource.getrusage(RUSAGE_SELF).ru_maxrss;
     wall time from perf_counter, CPU time from getrusage.
Cases: "close" (B = A * (1 + 2**-22), within float32 tolerance: both pass) and "differ" (every 1000th element
+1e-3: both fail; assert_close builds its message, compare_tensors also runs its diagnoses).
torch keeps its default intra-op threads; compare_tensors walks its chunks on one thread by design
(paritykit.compare.tolerances.WALK_THREADS); the "2-thread walk" row measures that choice.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "compare.txt"
REPO = HERE.parent

WORKER = r"""
import json, resource, sys, time
import torch
import paritykit.compare.tolerances
from paritykit.compare import compare_tensors

method, case, gib = sys.argv[1], sys.argv[2], float(sys.argv[3])
if method == "paritykit-2threads":
    paritykit.compare.tolerances.WALK_THREADS = 2
n = int(gib * 2**30) // 4
a = torch.empty(n)
a.normal_(generator=torch.Generator().manual_seed(0))
b = a.clone()
if case == "close":
    b.mul_(1 + 2**-22)
else:
    b[::1000].add_(1e-3)

def run():
    if method == "assert_close":
        try:
            torch.testing.assert_close(a, b)
            return "pass"
        except AssertionError:
            return "fail"
    if method in ("paritykit", "paritykit-2threads"):
        return compare_tensors(a, b).status
    return compare_tensors(a, b, diagnose=False).status

small_a, small_b = a[:10].clone(), b[:10].clone()
torch.testing.assert_close(small_a, small_a)
compare_tensors(small_a, small_b)

def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

before = resource.getrusage(resource.RUSAGE_SELF)
headroom = before.ru_maxrss * 1024 - rss_now()
t0 = time.perf_counter()
status = run()
wall = time.perf_counter() - t0
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "status": status,
    "wall": wall,
    "cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
    "extra": (after.ru_maxrss - before.ru_maxrss) * 1024 / (n * 4),
    "headroom": headroom / (n * 4),
    "threads": torch.get_num_threads(),
}))
"""

METHODS = {
    "paritykit": "paritykit compare_tensors",
    "paritykit-nodiag": "paritykit compare_tensors(diagnose=False)",
    "paritykit-2threads": "paritykit compare_tensors, 2-thread walk",
    "assert_close": "torch.testing.assert_close",
}


def run_worker(method: str, case: str, gib: float) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "helpers"), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", WORKER, method, case, str(gib)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{method}/{case} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0, help="size of each tensor in GiB")
    args = parser.parse_args()

    import torch

    load_start = os.getloadavg()
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for case in ("close", "differ"):
            for method in METHODS:
                if method == "paritykit-2threads" and (repeat or case != "close"):
                    continue  # slow on a busy machine (the point of the row): one run is enough
                result = run_worker(method, case, args.gib)
                runs.setdefault((method, case), []).append(result)
                print(f"[{repeat + 1}/{args.repeats}] {case:6s} {method:17s} {result}", flush=True)
    load_end = os.getloadavg()

    lines = [
        f"# benchmarks/bench_compare.py  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        (
            f"# {platform.platform()}, python {platform.python_version()}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs, torch threads {runs[('assert_close', 'close')][0]['threads']}"
        ),
        (
            f"# two {args.gib:g} GiB float32 tensors; one process per run; median wall/CPU of {args.repeats},"
            f" max extra buffers; load average at start {load_start[0]:.1f}, at end {load_end[0]:.1f}"
        ),
        "",
        (
            f"  {'case':7s} {'method':42s} {'status':7s} {'wall':>8s} {'cpu':>8s}"
            f" {'extra full-size buffers':>24s}"
        ),
    ]
    summary = {}
    for case in ("close", "differ"):
        for method, label in METHODS.items():
            results = runs.get((method, case))
            if not results:
                continue
            wall = statistics.median(r["wall"] for r in results)
            cpu = statistics.median(r["cpu"] for r in results)
            extra = max(r["extra"] for r in results)
            headroom = max(0.0, max(r["headroom"] for r in results))
            summary[(method, case)] = (wall, cpu, extra)
            lines.append(
                f"  {case:7s} {label:42s} {results[0]['status']:7s} {wall:7.2f}s {cpu:7.2f}s "
                f"{extra:10.3f} (headroom {headroom:.3f}){'' if len(results) > 1 else '  [1 run]'}"
            )
    lines.append("")
    for case in ("close", "differ"):
        ours, theirs = summary[("paritykit", case)], summary[("assert_close", case)]
        lines.append(
            f"{case}: compare_tensors / assert_close = {ours[0] / theirs[0]:.2f}x wall, "
            f"{ours[1] / theirs[1]:.2f}x CPU; extra buffers {ours[2]:.2f} vs {theirs[2]:.2f}"
        )
    lines.append("goal: <= 1.0x time with <= 2 extra full-size buffers")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
