"""A port module as a repair site (paritykit.bisection.repair.site.Site) for the repair tests: the reference's
outputs on the same inputs are what the site wants."""

from __future__ import annotations

import torch
from paritykit.bisection.repair.site import Site
from paritykit.compare.tensors import compare_tensors
from torch import nn


def worst_leaf(a, b):
    """The worst comparison over two leaf lists paired in order (``None`` when they cannot be)."""
    if b is None or len(a) != len(b):
        return None
    worst = None
    for (_, ta), (_, tb) in zip(a, b):
        cmp = compare_tensors(ta, tb, diagnose=False)
        if worst is None or not cmp.passed:
            worst = cmp
    return worst


def site_of(port: nn.Module, reference, inputs: tuple, **extra) -> Site:
    """The port module as a repair site, the reference's outputs on the same inputs wanted."""
    with torch.no_grad():
        wanted, got = [("output", reference(*inputs))], [("output", port(*inputs))]
    return Site(
        "block",
        "block",
        port,
        lambda: (tuple(t.clone() for t in inputs), {}),
        wanted,
        got,
        worst_leaf,
        **extra,
    )
