"""Round 22 of the agent A/B (benchmarks/results/agent_ab.md): a time embedding the research feeds ``t`` and
scales by 1000 inside, the port feeds ``1000 t`` (chatterbox's ``SinusoidalPosEmb(scale=1000)`` against
diffusers' ``Timesteps``). In the runs both give the same table up to rounding; replayed on the reference's
``t``, the port's differs. With a real slip elsewhere, bisect named the embedding the culprit ("it fails on
identical inputs")."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.embeddings import Timesteps
from paritykit.bisection.entry import bisect
from torch import nn

WIDTH = 32


class SinusoidRef(nn.Module):
    r"""The research's table: the frequencies from ``exp``, the timestep scaled inside."""

    def __init__(self, dim: int, scale: float = 1000.0):
        super().__init__()
        self.dim, self.scale = dim, scale

    def forward(self, t):
        half = self.dim // 2
        step = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -step)
        angles = self.scale * t[:, None] * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Ref(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.time_embeddings = SinusoidRef(WIDTH)
        self.time_mlp = nn.Linear(WIDTH, 16)
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 16)

    def forward(self, x, t):
        h = self.proj(x) + self.time_mlp(self.time_embeddings(t))[:, None]
        return self.out(self.norm(h))


class Port(nn.Module):
    def __init__(self, reference: Ref, eps: float):
        super().__init__()
        self.time_proj = Timesteps(WIDTH, flip_sin_to_cos=False, downscale_freq_shift=1)
        self.time_embedding = nn.Linear(WIDTH, 16)
        self.proj_in = nn.Linear(16, 16)
        self.norm_out = nn.LayerNorm(16, eps=eps)
        self.proj_out = nn.Linear(16, 16)
        names = {"time_mlp": "time_embedding", "proj": "proj_in", "norm": "norm_out", "out": "proj_out"}
        self.load_state_dict(
            {f"{names[k.split('.')[0]]}.{k.split('.', 1)[1]}": v for k, v in reference.state_dict().items()}
        )

    def forward(self, x, timestep):  # fed 1000 t, as diffusers' loops do
        h = self.proj_in(x) + self.time_embedding(self.time_proj(timestep))[:, None]
        return self.proj_out(self.norm_out(h))


@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_a_time_table_fed_its_timestep_scaled_otherwise_is_no_culprit(eps):
    reference = Ref().eval()
    port = Port(reference, eps).eval()
    torch.manual_seed(1)
    x, t = torch.randn(2, 6, 16), torch.tensor([0.2937, 0.871])
    report = bisect(
        reference,
        port,
        ((x, t), {}),
        port_inputs=lambda args, kwargs: ((args[0], args[1] * 1000), kwargs),
        atol=1e-7,
        rtol=0.0,
    )
    text = report.render()
    row = next(r for r in report.tested if r.reference == "time_embeddings")
    assert row.port == "time_proj", text
    assert "in the runs this pair's outputs agree" in (row.note or ""), text
    assert "within the reference's own rounding error there" in row.note, row.note
    assert report.culprit is None or report.culprit.reference != "time_embeddings", text
    if eps == 0.5:  # the real slip is still found
        assert report.verdict == "diverge" and report.culprit.port == "norm_out", text
