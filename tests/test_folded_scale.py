"""A scale the research applies to a module's input, folded by the port into that module's weights (round 18,
diffwave 0.1.7: the research divides its sum of skips by sqrt(L) before ``skip_projection``; the port sums
without it and divides the projection's weight at conversion). Replayed on the reference's already-divided
input, the port's projection differs; in the runs its outputs agree. bisect printed it as the culprit with
"fix (verified): multiply its input by 2.449", which breaks the correct port. The research's ``[B, 1, T]``
output against the port's ``[B, T]`` is compared through a view."""

from __future__ import annotations

import math

import pytest
import torch
from paritykit.bisection.entry import bisect
from torch import nn

LAYERS = 6


class SkipRef(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_projection = nn.Conv1d(1, 8, 1)
        self.layers = nn.ModuleList(nn.Conv1d(8, 8, 3, padding=1) for _ in range(LAYERS))
        self.skip_projection = nn.Conv1d(8, 8, 1)
        self.output_projection = nn.Conv1d(8, 1, 1)

    def forward(self, audio):
        x = torch.relu(self.input_projection(audio[:, None]))
        skip = 0
        for layer in self.layers:
            x = torch.tanh(layer(x))
            skip = skip + x
        x = torch.relu(self.skip_projection(skip / math.sqrt(LAYERS)))
        return self.output_projection(x)


class SkipPort(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv1d(1, 8, 1)
        self.blocks = nn.ModuleList(nn.Conv1d(8, 8, 3, padding=1) for _ in range(LAYERS))
        self.skip_proj = nn.Conv1d(8, 8, 1)
        self.conv_out = nn.Conv1d(8, 1, 1)

    def forward(self, audio):
        x = torch.relu(self.conv_in(audio[:, None]))
        skip = 0
        for block in self.blocks:
            x = torch.tanh(block(x))
            skip = skip + x
        return self.conv_out(torch.relu(self.skip_proj(skip))).squeeze(1)


def _converted(reference: SkipRef, bias_too: bool) -> SkipPort:
    names = {"input_projection": "conv_in", "layers": "blocks", "skip_projection": "skip_proj"}
    names["output_projection"] = "conv_out"
    state = {}
    for key, value in reference.state_dict().items():
        head, rest = key.split(".", 1)
        state[f"{names[head]}.{rest}"] = value.clone()
    scale = 1 / math.sqrt(LAYERS)
    state["skip_proj.weight"] *= scale
    if bias_too:
        state["skip_proj.bias"] *= scale
    port = SkipPort().eval()
    port.load_state_dict(state)
    return port


@pytest.mark.parametrize("bias_too", [False, True])
def test_a_scale_folded_into_the_weights_is_no_culprit_where_the_runs_agree(bias_too):
    torch.manual_seed(0)
    reference = SkipRef().eval()
    with torch.no_grad():
        reference.skip_projection.bias.add_(torch.randn(8))
    port = _converted(reference, bias_too)
    report = bisect(reference, port, ((torch.randn(2, 32),), {}))
    text = report.render()
    row = next(t for t in report.tested if t.reference == "skip_projection")
    assert row.port == "skip_proj"
    if bias_too:  # must not fire: the bias folded too makes the runs differ here
        assert report.verdict == "diverge", text
        assert "in the runs this pair's outputs agree" not in (row.note or ""), row.note
        assert row.status == "fail", text
        return
    assert report.verdict == "match" and report.culprit is None, text
    assert row.status == "pass" and "in the runs this pair's outputs agree" in row.note, row.note
    assert not any(line.lstrip().startswith(("fix", "culprit")) for line in text.splitlines()), text
    assert "2.449" not in text


def test_outputs_that_differ_by_a_size_one_dim_are_compared_through_a_view_and_say_so():
    torch.manual_seed(0)
    reference = SkipRef().eval()
    port = _converted(reference, bias_too=False)
    report = bisect(reference, port, ((torch.randn(2, 32),), {}))
    assert report.output.passed and report.output.max_abs < 1e-5
    assert "size-1 dims alone (reference [2, 1, 32], port [2, 32])" in report.render()
    with torch.no_grad():
        port.conv_out.bias.add_(0.1)  # must not fire as a match: the viewed values differ
    report = bisect(reference, port, ((torch.randn(2, 32),), {}))
    assert report.verdict == "diverge" and not report.output.passed
    assert report.culprit is not None and report.culprit.port == "conv_out", report.render()
