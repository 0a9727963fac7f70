"""paritykit.bisection.rotary: rotary tables read back into layout, bands, θ and position scale from their
values; references written from the research code (Llama's precompute_freqs_cis, per-axis tables as video DiTs
keep them), diffusers' own tables as the port side."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed
from paritykit.bisection.rotary import read_rotary, rotary_difference, rotary_from_rotation, rotary_tables
from torch import nn


def freqs_cis(dim: int, end: int, theta: float = 10000.0, scale: float = 1.0) -> torch.Tensor:
    """Llama's precompute_freqs_cis (facebookresearch/llama, model.py), positions scaled by ``scale``."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end).float() * scale
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def test_a_research_table_reads_back_its_theta_and_scale():
    form = read_rotary(freqs_cis(16, 32))
    assert form.layout == "complex" and len(form.bands) == 1
    (band,) = form.bands
    assert (band.first, band.last, band.theta, band.scale) == (0, 7, 10000.0, 1.0)
    assert read_rotary(freqs_cis(16, 32, theta=1e6)).bands[0].theta == 1e6
    assert read_rotary(freqs_cis(16, 32, scale=0.5)).bands[0].scale == 0.5


@pytest.mark.parametrize(("interleave", "layout"), [(True, "interleaved"), (False, "halves")])
def test_diffusers_cos_sin_tables_read_with_their_pairing(interleave, layout):
    cos, sin = get_1d_rotary_pos_embed(16, 32, use_real=True, repeat_interleave_real=interleave)
    form = read_rotary(torch.stack([cos, sin]))
    assert form.layout == layout and form.bands[0].theta == 10000.0
    research = read_rotary(freqs_cis(16, 32))
    differs = rotary_difference(research, form)
    # a complex table multiplies interleaved pairs: only the halves layout is another one
    assert differs == ([] if interleave else ["layout: complex in the reference, halves in the port"])


def test_per_axis_bands_and_what_differs_between_them():
    video = torch.cat([freqs_cis(8, 32), freqs_cis(4, 32), freqs_cis(4, 32)], dim=1)
    form = read_rotary(video)
    assert [(b.first, b.last) for b in form.bands] == [(0, 3), (4, 5), (6, 7)]
    other = read_rotary(torch.cat([freqs_cis(4, 32), freqs_cis(6, 32), freqs_cis(6, 32)], dim=1))
    assert "band 0 owns frequencies 0–1 in the port, 0–3 in the reference" in rotary_difference(form, other)
    theta = read_rotary(
        torch.cat([freqs_cis(8, 32, 500.0), freqs_cis(4, 32, 500.0), freqs_cis(4, 32, 500.0)], 1)
    )
    assert rotary_difference(form, theta) == ["θ 1.00e+04 (reference) vs 500 (port) in all 3 bands"]


def test_tables_are_found_on_modules_as_buffers_attributes_and_cos_sin_pairs():
    class Research(nn.Module):
        def __init__(self):
            super().__init__()
            self.freqs = (freqs_cis(8, 32), freqs_cis(4, 32))  # per-axis tuple, a plain attribute

    class Port(nn.Module):
        def __init__(self):
            super().__init__()
            cos, sin = get_1d_rotary_pos_embed(8, 32, use_real=True, repeat_interleave_real=True)
            self.register_buffer("freqs_cos", cos)
            self.register_buffer("freqs_sin", sin)

    ((name, form),) = rotary_tables(Research())
    assert name == "freqs" and len(form.bands) == 2
    ((name, form),) = rotary_tables(Port())
    assert name == "freqs" and form.layout == "interleaved"


def test_non_rotary_tensors_are_not_read_as_tables():
    generator = torch.Generator().manual_seed(0)
    assert read_rotary(torch.randn(32, 8, dtype=torch.complex64, generator=generator)) is None
    assert read_rotary(torch.randn(2, 32, 8, generator=generator)) is None
    noisy = freqs_cis(16, 32) * (1 + 0.05 * torch.randn(32, 8, generator=generator))
    assert read_rotary(noisy) is None
    assert rotary_tables(nn.Linear(4, 4)) == []


def _rotate_halves(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def test_the_rotation_applied_to_q_reads_back_its_pairing_and_theta():
    q = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(1))  # (batch, heads, positions, dim)
    cos, sin = get_1d_rotary_pos_embed(8, 16, theta=500.0, use_real=True, repeat_interleave_real=False)
    form = rotary_from_rotation(q, _rotate_halves(q, cos, sin))
    assert form.layout == "halves" and form.bands[0].theta == 500.0
    # the research way: complex multiplication of interleaved pairs (Llama's apply_rotary_emb)
    z = torch.view_as_complex(q.reshape(*q.shape[:-1], 4, 2).contiguous())
    rotated = torch.view_as_real(z * freqs_cis(8, 16)).flatten(-2)
    form = rotary_from_rotation(q, rotated)
    assert form.layout == "interleaved" and form.bands[0].theta == 10000.0
    # no rotation: a scaled q is none
    assert rotary_from_rotation(q, 1.5 * q) is None


def test_the_skills_relation_and_rotary_snippet_runs_and_prints_what_it_says(capsys):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "skills/parity-testing/references/workflow.md").read_text()
    block = text.split("The same functions work on any two")[1].split("```python\n")[1].split("```")[0]
    exec(compile(block, "workflow.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert "axis 2 (8) is read as (2, 4) in the reference and (4, 2) in the port" in printed[0]
    assert printed[1].startswith("rotary table (complex layout; band 0: entries 0–3, θ 500")
    assert printed[2] == "interleaved"


# ------------------------------------------------------------------------ tables passed down, in a bisect


class RotaryAttention(nn.Module):
    r"""q and k rotated by the table it is given: a complex table (the research side, Llama's
    apply_rotary_emb) or diffusers' (cos, sin) tuple with interleaved pairs."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x, rotary):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)  # (batch, heads, seq, dim)
        if isinstance(rotary, tuple):
            cos, sin = rotary
            q, k = (
                t * cos + torch.stack([-t[..., 1::2], t[..., 0::2]], -1).flatten(-2) * sin for t in (q, k)
            )
        else:
            q, k = (
                torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (4, 2))) * rotary).flatten(-2)
                for t in (q, k)
            )
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).flatten(-2))


class RotaryNet(nn.Module):
    r"""A DiT reduced to its rotary path: the table is computed inline in ``forward`` and passed down."""

    def __init__(self, theta: float, diffusers_style: bool):
        super().__init__()
        self.attn, self.theta, self.diffusers_style = RotaryAttention(), theta, diffusers_style

    def forward(self, x):
        if self.diffusers_style:
            rotary = get_1d_rotary_pos_embed(
                8, x.shape[1], theta=self.theta, use_real=True, repeat_interleave_real=True
            )
        else:
            rotary = freqs_cis(8, x.shape[1], theta=self.theta)
        return self.attn(x, rotary)


def test_tables_computed_inline_and_passed_down_are_read_and_their_theta_named():
    from paritykit.bisection.entry import bisect

    torch.manual_seed(0)
    reference = RotaryNet(1e4, diffusers_style=False).eval()
    port = RotaryNet(1e6, diffusers_style=True).eval()
    port.load_state_dict(reference.state_dict())
    inputs = ((torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(3)),), {})
    report = bisect(reference, port, inputs, repair=False)
    assert report.culprit.reference == ""
    # attention is untestable (a complex table against a (cos, sin) tuple): its arguments are read
    assert [t.status for t in report.tested if t.reference == "attn"] == ["untestable"]
    (relation,) = [r for r in report.culprit.relations if r.kind == "rotary"]
    assert relation.words.startswith(
        "the rotary tables passed to attn differ (reference rotary, port rotary.0, rotary.1): band 0:"
        " θ 1.00e+04 (reference) vs 1.00e+06 (port); read from their values: reference rotary: rotary table"
        " (complex layout;"
    )
    assert relation.residual < 1e-4 and relation.verified is None
    # the same θ written the diffusers way: nothing about rotary is claimed
    faithful = RotaryNet(1e4, diffusers_style=True).eval()
    faithful.load_state_dict(reference.state_dict())
    clean = bisect(reference, faithful, inputs, repair=False)
    assert clean.verdict == "match" and "rotary table" not in clean.render()


# ------------------------------------------------------------------- rotations applied inside a culprit


class ResearchRotaryAttention(nn.Module):
    r"""Attention that builds its rotary table in ``forward`` with θ written in the code (no setting, buffer
    or argument holds it), the research way: Llama's complex multiply on (batch, seq, heads, dim)."""

    theta = 1e4

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def rotate(self, q, k):
        table = freqs_cis(8, q.shape[1], theta=self.theta)[:, None]
        q, k = (
            torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (4, 2))) * table).flatten(-2)
            for t in (q, k)
        )
        return q.transpose(1, 2), k.transpose(1, 2)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).unbind(2)  # each (batch, seq, heads, dim)
        q, k = self.rotate(q, k)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v.transpose(1, 2))
        return self.out(o.transpose(1, 2).flatten(-2))


class PortRotaryAttention(ResearchRotaryAttention):
    r"""The same attention rotating the diffusers way: ``apply_rotary_emb`` with a (cos, sin) table on
    (batch, heads, seq, dim), its θ written in the code too."""

    theta = 1e6

    def rotate(self, q, k):
        from diffusers.models.embeddings import apply_rotary_emb

        rotary = get_1d_rotary_pos_embed(8, q.shape[1], theta=self.theta, use_real=True)
        return tuple(apply_rotary_emb(t.transpose(1, 2), rotary) for t in (q, k))


class SameThetaAttention(PortRotaryAttention):
    theta = 1e4


class InlineRotaryNet(nn.Module):
    def __init__(self, attention: type):
        super().__init__()
        self.proj, self.attn = nn.Linear(16, 16), attention()

    def forward(self, x):
        return self.attn(self.proj(x))


def test_rotations_applied_inside_a_culprit_are_read_from_q_and_k_and_their_theta_named():
    from paritykit.bisection.entry import bisect

    torch.manual_seed(0)
    reference = InlineRotaryNet(ResearchRotaryAttention).eval()
    port = InlineRotaryNet(PortRotaryAttention).eval()
    port.load_state_dict(reference.state_dict())
    inputs = ((torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(5)),), {})
    report = bisect(reference, port, inputs, repair=False)
    assert report.culprit.reference == "attn"
    (relation,) = [r for r in report.culprit.relations if r.kind == "rotary"]
    assert relation.words.startswith(
        "the rotary rotations applied inside attn differ: band 0: θ 1.00e+04 (reference) vs 1.00e+06 (port);"
        " read from q and k before and after rotation: reference rotary table (interleaved layout;"
    )
    # the same θ on both sides, written the other way: the port matches and nothing about rotary is said
    same = InlineRotaryNet(SameThetaAttention).eval()
    same.load_state_dict(reference.state_dict())
    clean = bisect(reference, same, inputs, repair=False)
    assert clean.verdict == "match" and "rotary" not in clean.render()
