#!/usr/bin/env bash
# paritykit's GPU checks in one call, as run on an H200 for benchmarks/results/gpu_scale.txt and gpu_tests.txt.
# From the repo root on the GPU machine, with the wheels it lacks in .gpu/whl (diffusers==0.42.1,
# importlib_metadata, and the test references, all --no-deps: rotary-embedding-torch==0.9.1,
# taming-transformers-rom1504==0.0.6, diffsynth==2.1.12):  bash benchmarks/gpu/check.sh
# Prints each step's exit code and wall time; its logs go to $OUT (or /tmp).
set -u
O=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl >"$O/install.log" 2>&1 || { echo "wheel install failed (see $O/install.log)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD/helpers:$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi -L
step() { local name=$1 limit=$2; shift 2; echo "=== $(date +%T) $name: $*"; local t0; t0=$(date +%s%N)
  timeout "$limit" "$@" >"$O/$name.txt" 2>&1; local rc=$?
  echo "=== $name rc=$rc wall_ms=$(( ($(date +%s%N) - t0) / 1000000 ))"; }
# the FLUX.1-dev-size run in the background (demo, tiny and dev sizes; wall time, GPU and RSS peaks per step)
( step gpu_scale 420 python3 benchmarks/gpu_scale.py > "$O/gpu_scale_steps.txt" ) &
python3 -m paritykit demo --out /tmp/demo >"$O/demo.txt" 2>&1
step demo_bisect_cuda 120 python3 -m paritykit bisect /tmp/demo/bisect_buggy.py --device cuda
tail -12 "$O/demo_bisect_cuda.txt"
step pytest_cuda 300 python3 -m pytest tests/test_devices.py tests/test_floor.py tests/test_research_pairs.py \
  -m cuda -q -n 8 -p no:cacheprovider -rfE --tb=short
tail -30 "$O/pytest_cuda.txt"
step tf32_probe 150 python3 benchmarks/gpu/tf32_probe.py
cat "$O/tf32_probe.txt"
# `new diffusers-tests` on the GPU, where .gpu/dtests.tar holds diffusers' tests/ and pyproject.toml
# (`git archive HEAD tests pyproject.toml` of its repository) and .gpu/extra the wheels its tests import
# (parameterized, requests_mock, --no-deps): the rendered tests then run with diffusers' torch_device "cuda"
if [ -f .gpu/dtests.tar ]; then
  for m in parameterized requests_mock; do python3 -c "import $m" 2>/dev/null || python3 -m pip install -q \
    --no-index --find-links .gpu/extra --no-deps --target /tmp/site "${m/_/-}" >>"$O/install.log" 2>&1; done
  mkdir -p /tmp/dtests && tar -x -C /tmp/dtests -f .gpu/dtests.tar
  PARITYKIT_DIFFUSERS_REPO=/tmp/dtests step diffusers_tests 400 python3 -m pytest tests/test_diffusers_tests.py \
    -q -p no:cacheprovider -rfEs --tb=short
  tail -30 "$O/diffusers_tests.txt"
fi
wait
cat "$O/gpu_scale_steps.txt" "$O/gpu_scale.txt"
