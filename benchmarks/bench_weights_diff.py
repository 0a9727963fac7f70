"""`paritykit weights diff` against the reference notebook's method, as whole processes a user runs.

Run: python benchmarks/bench_weights_diff.py   (writes benchmarks/results/weights_diff.txt)

1. Speed. An SD-size fp16 pair (2 x ~0.87 GB, 170 tensors, every second tensor perturbed) is generated into
   benchmarks/_scratch. Each method runs as its own Python process (interpreter start and imports included),
   interleaved, best of N with the page cache warm for all of them:
     cat           cat A B > /dev/null: the I/O floor the diff is measured against
     notebook      load_file(A), load_file(B), then torch.dist(a.float(), b.float()) per common key
     safe_open     safe_open both, get_tensor per key, torch.equal fast path, torch.dist otherwise
     paritykit     paritykit weights diff A B --json --quiet
     keys-only     paritykit weights diff A B --keys-only --json
2. Bounded memory. A second pair, larger than an address-space limit imposed with `prlimit --as`, is diffed
   under that limit; anonymous memory (RssAnon from /proc/PID/status, which excludes page-cache and mapped
   file pages) is sampled every 5 ms. The notebook's method is run under the same limit for contrast.
The scratch files are deleted at the end."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SCRATCH = HERE / "_scratch"
RESULTS = HERE / "results" / "weights_diff.txt"
PARITYKIT = [sys.executable, "-m", "paritykit"]

NOTEBOOK = """
import sys, torch
from safetensors.torch import load_file
a = load_file(sys.argv[1]); b = load_file(sys.argv[2])
kv = {}
for k in set(a) & set(b):
    if a[k].shape == b[k].shape:
        kv[k] = torch.dist(a[k].type(torch.float), b[k].type(torch.float), p=2).numpy().tolist()
print(sum(1 for v in kv.values() if v != 0), "changed")
"""

SAFE_OPEN = """
import sys, torch
from safetensors import safe_open
changed = 0
with safe_open(sys.argv[1], "pt") as fa, safe_open(sys.argv[2], "pt") as fb:
    for k in sorted(set(fa.keys()) & set(fb.keys())):
        ta, tb = fa.get_tensor(k), fb.get_tensor(k)
        if ta.shape != tb.shape or torch.equal(ta, tb):
            continue
        changed += torch.dist(ta.float(), tb.float()).item() != 0
print(changed, "changed")
"""


def sd_like_shapes(total_elements: int, count: int, seed: int) -> list[tuple[int, ...]]:
    """``count`` 1-D/2-D/4-D shapes whose sizes are log-uniform (like a UNet: many small norms, a few huge
    convs)."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(320), np.log(12e6), count))
    sizes = np.maximum(64, (sizes * total_elements / sizes.sum()).astype(np.int64) // 64 * 64)
    shapes = []
    for i, size in enumerate(sizes):
        size = int(size)
        if i % 3 == 0:
            shapes.append((size // 576, 64, 3, 3) if size >= 576 * 64 else (size,))
        elif i % 3 == 1:
            shapes.append((size // 64, 64))
        else:
            shapes.append((size,))
    return shapes


def write_pair(path_a: Path, path_b: Path, shapes: list[tuple[int, ...]], seed: int) -> int:
    """Write two fp16 safetensors files tensor by tensor (never both whole in memory); odd tensors differ in
    B."""
    rng = np.random.default_rng(seed)
    names = [
        f"model.diffusion_model.blocks.{i}.{'attn1' if i % 4 else 'ff'}.weight" for i in range(len(shapes))
    ]
    header, offset = {}, 0
    for name, shape in zip(names, shapes):
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path_a, "wb") as fa, open(path_b, "wb") as fb:
        for handle in (fa, fb):
            handle.write(len(raw).to_bytes(8, "little") + raw)
        for i, shape in enumerate(shapes):
            values = rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02
            fa.write(values.astype(np.float16).tobytes())
            if i % 2:
                values += rng.standard_normal(values.size, dtype=np.float32) * 1e-4
            fb.write(values.astype(np.float16).tobytes())
    return offset


def run_measured(cmd: list[str], *, limit_bytes: int | None = None) -> dict:
    """Run a process, sampling its RssAnon every 5 ms.

    Returns wall seconds, CPU seconds (user + sys from wait4: the figure other load on the machine disturbs
    least), peak anonymous MB, peak RSS MB (VmHWM: includes mapped file pages), exit code and output.
    """
    if limit_bytes:
        cmd = ["prlimit", f"--as={limit_bytes}", "--", *cmd]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent / "helpers"))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        peak = hwm = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            try:
                with open(f"/proc/{proc.pid}/status") as handle:
                    for line in handle:
                        if line.startswith("RssAnon:"):
                            peak = max(peak, int(line.split()[1]))
                        elif line.startswith("VmHWM:"):
                            hwm = max(hwm, int(line.split()[1]))
            except (FileNotFoundError, ProcessLookupError):
                pass
            time.sleep(0.005)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {
            "seconds": seconds,
            "cpu": usage.ru_utime + usage.ru_stime,
            "peak_anon_mb": peak / 1024,
            # VmHWM of the process itself: ru_maxrss would carry over this parent's RSS across fork + exec
            "peak_rss_mb": hwm / 1024,
            "code": proc.returncode,
            "out": out.read().decode(),
            "err": err.read().decode(errors="replace"),
        }


def warm(*paths: Path) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            while handle.read(64 << 20):
                pass


def speed(repeats: int, lines: list[str]) -> None:
    a, b = SCRATCH / "sd_a.safetensors", SCRATCH / "sd_b.safetensors"
    shapes = sd_like_shapes(435_000_000, 170, seed=0)
    nbytes = write_pair(a, b, shapes, seed=1)
    warm(a, b)
    methods = {
        # the I/O floor: reading both files once from the page cache
        "cat of both files": ["sh", "-c", 'exec cat "$0" "$1" > /dev/null', str(a), str(b)],
        "notebook (load_file + torch.dist)": [sys.executable, "-c", NOTEBOOK, str(a), str(b)],
        "safe_open stream + torch.equal": [sys.executable, "-c", SAFE_OPEN, str(a), str(b)],
        "paritykit weights diff": [*PARITYKIT, "weights", "diff", str(a), str(b), "--json", "--quiet"],
        "paritykit weights diff --keys-only": [
            *PARITYKIT,
            "weights",
            "diff",
            str(a),
            str(b),
            "--keys-only",
            "--json",
        ],
    }
    runs: dict[str, list[dict]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, cmd in methods.items():
            runs[name].append(run_measured(cmd))
    report = json.loads(runs["paritykit weights diff"][0]["out"])
    assert report["identical"] == 85 and len(report["changed"]) == 85, report["identical"]
    base = min(r["seconds"] for r in runs["notebook (load_file + torch.dist)"])
    lines.append(
        f"SD-size fp16 pair: 2 x {nbytes / 1e9:.2f} GB, {len(shapes)} tensors, 85 perturbed; "
        f"page cache warm; best of {repeats}, interleaved; load average at start {os.getloadavg()[0]:.1f}"
    )
    base_cpu = min(r["cpu"] for r in runs["notebook (load_file + torch.dist)"])
    lines.append(
        f"  {'method':36s} {'wall':>7s} {'ratio':>6s} {'cpu':>7s} {'ratio':>6s} {'peak anon':>10s}"
        f" {'peak rss':>9s}"
    )
    for name, results in runs.items():
        best = min(r["seconds"] for r in results)
        cpu = min(r["cpu"] for r in results)
        anon = max(r["peak_anon_mb"] for r in results)
        rss = max(r["peak_rss_mb"] for r in results)
        lines.append(
            f"  {name:36s} {best:6.2f}s {best / base:5.2f}x {cpu:6.2f}s {cpu / base_cpu:5.2f}x "
            f"{anon:7.0f} MB {rss:6.0f} MB"
        )
    floor = min(r["seconds"] for r in runs["cat of both files"])
    ours = min(r["seconds"] for r in runs["paritykit weights diff"])
    ratio = ours / floor
    # the run-by-run ratio too (each paritykit run over the cat run just before it): how far noise moves it
    paired = sorted(
        o["seconds"] / c["seconds"] for o, c in zip(runs["paritykit weights diff"], runs["cat of both files"])
    )
    verdict = "met" if ratio <= 3 else "NOT met"
    lines.append(
        f"  paritykit weights diff / cat of both files: {ratio:.2f}x wall (best over best; run by run: median"
        f" {paired[len(paired) // 2]:.2f}x, worst {paired[-1]:.2f}x); goal <= 3x: {verdict}"
    )
    for path in (a, b):
        path.unlink()


def memory(limit_gb: float, pair_gb: float, lines: list[str]) -> None:
    a, b = SCRATCH / "big_a.safetensors", SCRATCH / "big_b.safetensors"
    total = int(pair_gb * 1e9 / 2 / 2)  # elements per file, fp16
    shapes = [(total // 40 // 64, 64)] * 40
    nbytes = write_pair(a, b, shapes, seed=2)
    limit = int(limit_gb * (1 << 30))
    ours = run_measured(
        [*PARITYKIT, "weights", "diff", str(a), str(b), "--json", "--quiet"], limit_bytes=limit
    )
    assert ours["code"] == 1, ours["err"]
    report = json.loads(ours["out"])
    largest = max(int(np.prod(s)) for s in shapes) * 2 * 2 / 1e6
    lines.append(
        f"Bounded memory: pair of 2 x {nbytes / 1e9:.2f} GB (largest tensor pair {largest:.0f} MB) under "
        f"prlimit --as={limit_gb:g} GiB"
    )
    lines.append(
        f"  paritykit weights diff: exit {ours['code']}, {len(report['changed'])} changed /"
        f" {report['identical']} identical, {ours['seconds']:.1f} s, peak RssAnon {ours['peak_anon_mb']:.0f}"
        f" MB, peak RSS {ours['peak_rss_mb']:.0f} MB"
    )
    nb = run_measured([sys.executable, "-c", NOTEBOOK, str(a), str(b)], limit_bytes=limit)
    reason = (nb["err"].strip().splitlines() or ["?"])[-1][:90]
    outcome = "completed" if nb["code"] == 0 else f"failed, exit {nb['code']}: {reason}"
    lines.append(f"  notebook method, same limit: {outcome}")
    for path in (a, b):
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--limit-gb", type=float, default=1.0, help="address-space limit for the memory run (GiB)"
    )
    parser.add_argument("--pair-gb", type=float, default=6.0, help="total size of the memory-run pair (GB)")
    args = parser.parse_args()
    SCRATCH.mkdir(exist_ok=True)
    # paritykit's bytecode, as a wheel install has it: with PYTHONDONTWRITEBYTECODE set (as on this project's
    # machines) an editable checkout has none, and every timed process would compile paritykit's modules anew
    # (about 50 ms of each run here).
    import compileall

    compileall.compile_dir(HERE.parent / "helpers" / "paritykit", quiet=1)
    lines = [
        f"# benchmarks/bench_weights_diff.py  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        (
            f"# {platform.platform()}, python {platform.python_version()}, {os.cpu_count()} CPUs; paritykit's"
            " bytecode compiled first, as an installed wheel has it"
        ),
    ]
    try:
        speed(args.repeats, lines)
        memory(args.limit_gb, args.pair_gb, lines)
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
