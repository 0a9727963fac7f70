"""Outputs that differ only by size-1 dims: research code that runs 2-D convolutions as 3-D ones over one
frame (x-unet's ``[B, C, 1, H, W]``) against a port's 2-D ``[B, C, H, W]`` (round 16). Compared through a view
where the sizes tell the dims apart, never where a channels-last layout has the same shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paritykit.bisection.entry import bisect
from paritykit.bisection.leaves import Viewed, pair_layouts
from torch import nn


class OneFrame(nn.Module):
    def __init__(self, channels: int = 6):
        super().__init__()
        self.a = nn.Conv3d(3, channels, (1, 3, 3), padding=(0, 1, 1))
        self.b = nn.Conv3d(channels, channels, (1, 3, 3), padding=(0, 1, 1))

    def forward(self, x):
        return self.b(F.silu(self.a(x.unsqueeze(2)))).squeeze(2)


class Flat(nn.Module):
    def __init__(self, channels: int = 6):
        super().__init__()
        self.a = nn.Conv2d(3, channels, 3, padding=1)
        self.b = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.b(F.silu(self.a(x)))


def _pair(bias_slip: float = 0.0):
    torch.manual_seed(0)
    reference, port = OneFrame().eval(), Flat().eval()
    state = {k: v[:, :, 0] if v.ndim == 5 else v for k, v in reference.state_dict().items()}
    state["b.bias"] = state["b.bias"] + bias_slip
    port.load_state_dict(state)
    return reference, port, ((torch.randn(2, 3, 5, 7),), {})


@pytest.mark.parametrize("slip", [0.0, 0.1], ids=["correct", "bias-slip"])
def test_one_frame_convolutions_are_compared_through_a_view(slip):
    reference, port, inputs = _pair(slip)
    report = bisect(reference, port, inputs)
    rows = {t.reference: t for t in report.tested}
    assert rows["a"].test == "replay" and rows["a"].status == "pass", report.render()
    assert "output viewed as [2, 6, 1, 5, 7]" in rows["a"].note
    if slip:
        assert report.culprit is not None and report.culprit.port == "b", report.render()
    else:  # must not fire: the port is the reference's convolutions in 2-D
        assert report.verdict == "match" and report.culprit is None, report.render()


def test_a_view_is_taken_only_where_the_sizes_tell_the_dims_apart():
    ref = [("output", torch.randn(2, 6, 1, 5, 7))]
    found = pair_layouts(ref, [("output", torch.randn(2, 6, 5, 7))])
    assert found is not None and found[2] == {"output": Viewed((2, 6, 1, 5, 7))}
    assert pair_layouts(ref[:1], [("output", torch.randn(2, 6, 7, 5))]) is None  # another layout: no view
    # C = H = W: a channels-last port tensor has the shape of the viewed channels-first one; never paired
    same = [("output", torch.randn(2, 8, 1, 8, 8))]
    assert pair_layouts(same, [("output", torch.randn(2, 8, 8, 8))]) is None
