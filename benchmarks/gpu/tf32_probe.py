"""The counterfactual for TF32: a correct VAE port (and one with two bugs) bisected on cuda with cuDNN's TF32
left on, then as paritykit runs it (TF32 off). Run from the repo root: python benchmarks/gpu/tf32_probe.py"""

import torch
from paritykit.base.inputs import to_device
from paritykit.bisection.entry import bisect

from tests.gallery.catalogue import BY_ID
from tests.gallery.run import build

RUNS = (("TF32 on (cuDNN's default)", bisect.__wrapped__), ("as paritykit runs (TF32 off)", bisect))

for case in ("vae-clean", "vae-two-bugs"):
    pair = build(BY_ID[case], "distinct")
    ref, port = pair.reference.cuda(), pair.port.cuda()
    inputs = to_device(pair.inputs, "cuda")
    torch.backends.cudnn.allow_tf32 = True
    for name, run in RUNS:
        r = run(ref, port, inputs, port_inputs=pair.port_inputs, select_output=pair.select_output)
        culprit = r.culprit.port if r.culprit else "-"
        print(f"{case:14} {name:30} verdict {r.verdict:8} first culprit {culprit}", flush=True)
