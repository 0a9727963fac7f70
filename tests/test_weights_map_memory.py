r"""Resident memory of `weights map` on checkpoint files: it streams them instead of holding both.

The pair is two safetensors files of ~537 MB each (bf16, 16 blocks of four 2048x2048 matrices; the
target renames every block, concatenates q, k and v into one tensor and transposes the output matrix). A
child process maps them back with :func:`infer_conversion_map` and reports its peak RSS growth (VmHWM after
the run minus VmRSS before it, the peak reset first). Without giving pages back, every mapped page read
stays resident: the growth was the two files (1099 MB). The bound asserted is a third of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

BLOCKS, WIDTH = 16, 2048

CHILD = Path(__file__).with_name("weights_map_child.py")


def _pair(folder: Path) -> tuple[Path, Path, int]:
    g = torch.Generator().manual_seed(0)
    source, target = {}, {}
    for i in range(BLOCKS):
        q, k, v, o = (torch.randn(WIDTH, WIDTH, generator=g).to(torch.bfloat16) for _ in range(4))
        source.update({f"blocks.{i}.q.weight": q, f"blocks.{i}.k.weight": k, f"blocks.{i}.v.weight": v})
        source[f"blocks.{i}.o.weight"] = o
        target[f"layers.{i}.attn.qkv.weight"] = torch.cat([q, k, v])
        target[f"layers.{i}.attn.out.weight"] = o.t().contiguous()
    save_file(source, folder / "research.safetensors")
    save_file(target, folder / "port.safetensors")
    total = sum(t.numel() * t.element_size() for t in [*source.values(), *target.values()])
    return folder / "research.safetensors", folder / "port.safetensors", total


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_weights_map_of_two_files_keeps_a_third_of_them_resident(tmp_path):
    src, tgt, total = _pair(tmp_path)
    root = str(Path(__file__).resolve().parents[1] / "helpers")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        "MALLOC_MMAP_THRESHOLD_": str(1 << 20),  # freed blocks go back to the system: RSS is what is held
    }
    command = [sys.executable, str(CHILD), str(src), str(tgt)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["unmapped"] == 0 and result["ops"] == ["concat", "transpose"], result
    assert total > 1e9
    assert result["growth"] < total / 3, (result["growth"] / 1e6, total / 1e6)
