"""Real port pairs: published research code (tests/research.py) against diffusers' own classes, weights moved
by diffusers' own converters. Nothing on the reference side copies diffusers."""

from __future__ import annotations

import copy

import pytest
import torch
from paritykit.base.inputs import to_device
from paritykit.bisection.entry import bisect

from tests.devices import DEVICES
from tests.research import (
    PortDecode,
    PortDenoise,
    ResearchDecode,
    ResearchDenoise,
    wan_dit_pair_built,
    wan_vae_pair,
)

LATENT = (1, 4, 3, 2, 2)  # three latent frames, each decoded as one chunk through the causal cache


@pytest.fixture(scope="module")
def wan_pair():
    return wan_vae_pair()


def _on(device, *modules):
    r"""The modules themselves on the CPU, copies moved to ``device`` elsewhere (the fixtures are shared)."""
    return modules if device == "cpu" else tuple(copy.deepcopy(m).to(device) for m in modules)


@pytest.mark.parametrize("device", DEVICES)
def test_correct_chunked_causal_vae_port_matches(wan_pair, device):
    # diffusers' residual block calls one shared SiLU twice per frame chunk, the research block has two SiLUs:
    # calls paired by order would compare the first SiLU's second call with the shared one's second call (the
    # other activation), a "masked" on a bit-identical port
    research, port = _on(device, *wan_pair)
    report = bisect(ResearchDecode(research), PortDecode(port), [torch.randn(LATENT, device=device)])
    assert report.verdict == "match" and report.exit_code == 0, report.render()
    assert report.first_output_divergence is None


@pytest.mark.parametrize("device", DEVICES)
def test_wan_vae_port_with_a_wrong_activation_is_found_in_its_block(wan_pair, device):
    research, port = _on(device, *wan_pair)
    broken = copy.deepcopy(port)
    broken.decoder.mid_block.resnets[1].nonlinearity = torch.nn.GELU()
    report = bisect(ResearchDecode(research), PortDecode(broken), [torch.randn(LATENT, device=device)])
    assert report.verdict == "diverge", report.render()
    assert report.culprit.port == "vae.decoder.mid_block.resnets.1.nonlinearity", report.render()
    assert any(h.verified and "nn.SiLU()" in (h.fix or "") for h in report.culprit.hints), report.render()


@pytest.fixture(scope="module")
def wan_dit_pair():
    return wan_dit_pair_built()


def _bisect_wan(pair, mutate=None, device="cpu"):
    research, port, inputs = pair
    (research,) = _on(device, research)
    port = copy.deepcopy(port).to(device)
    if mutate is not None:
        mutate(port)
    return bisect(ResearchDenoise(research), PortDenoise(port), to_device(inputs, device))


@pytest.mark.parametrize("device", DEVICES)
def test_research_blocks_with_another_signature_are_replayed_with_arguments_paired_by_value(
    wan_dit_pair, device
):
    # research DiTBlock(x, context, t_mod, freqs: complex) vs diffusers' block(hidden_states,
    # encoder_hidden_states, temb, rotary_emb: (cos, sin)): every block is replayed, the rotary pair computed
    # from the research's complex table
    report = _bisect_wan(wan_dit_pair, device=device)
    assert report.verdict == "match", report.render()
    blocks = {t.reference: t for t in report.tested if t.reference in ("dit.blocks.0", "dit.blocks.1")}
    assert len(blocks) == 2 and all(t.test == "replay" for t in blocks.values()), report.render()
    note = blocks["dit.blocks.0"].note
    assert note.startswith("arguments paired by value: hidden_states = x; encoder_hidden_states = context;")
    assert "rotary_emb.0 = cos (pairs interleaved) of freqs (complex)" in note
    assert "rotary_emb.1 = sin (pairs interleaved) of freqs (complex)" in note


@pytest.mark.parametrize("device", DEVICES)
def test_bug_inside_a_research_block_is_named_in_it(wan_dit_pair, device):
    def exact_gelu(port):
        port.blocks[1].ffn.net[0].approximate = "none"

    report = _bisect_wan(wan_dit_pair, exact_gelu, device)
    assert (report.culprit.reference, report.culprit.port) == ("dit.blocks.1.ffn", "dit.blocks.1.ffn")
    assert any(h.verified and "approximate = 'tanh'" in (h.fix or "") for h in report.culprit.hints)

    def modulation_order(port):
        table = port.blocks[1].scale_shift_table
        with torch.no_grad():
            table.copy_(table[:, [1, 0, 2, 3, 4, 5]].clone())

    report = _bisect_wan(wan_dit_pair, modulation_order, device)
    assert report.culprit.port == "dit.blocks.1", report.render()
    assert any(h.verified and "scale_shift_table" in (h.fix or "") for h in report.culprit.hints)


def test_an_input_that_differs_is_never_taken_for_the_ports_own(wan_dit_pair):
    # the port's rotary table built with another theta: its (cos, sin) equal nothing the reference passes.
    # Taking them as "the port's own" would replay attention on them and blame its forward code, which is
    # correct.
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    def theta(port):
        port.rope = WanRotaryPosEmbed(24, (1, 2, 2), 1024, theta=500.0)

    report = _bisect_wan(wan_dit_pair, theta)
    assert report.verdict == "diverge"
    assert not report.culprit.port.startswith("dit.blocks"), report.render()
    # the top level is the place: the hint says between which calls, and which port module computes the input
    (hint,) = [h for h in report.culprit.hints if h.id == "inline-reference"]
    said = "dit.blocks.0 <-> dit.blocks.0 (port rotary_emb.0, rotary_emb.1 equal no reference argument"
    assert said in hint.message and "(reference freqs left unpaired)" in hint.message
    assert "computes that input in dit.rope (WanRotaryPosEmbed)" in hint.message
    # and why: both sides' rotary tables read back from their values, the difference said first
    assert hint.message.startswith(
        "the rotary tables differ (reference dit.freqs, port dit.rope.freqs): θ 1.00e+04 (reference) vs 500"
        " (port) in all 3 bands;"
    )
    assert not any(h.id == "module-config" for h in report.culprit.hints), report.render()
    attention = next(t for t in report.tested if t.port == "dit.blocks.0.attn1")
    assert attention.status == "untestable"
    assert "port rotary_emb.0, rotary_emb.1 equal no reference argument by value (reference freqs left" in (
        attention.note
    )


def test_research_float64_sinusoid_is_float_noise_not_a_divergence(wan_dit_pair):
    # the research embeds t = 999 through a float64 sinusoid, diffusers in float32: with a strict tolerance
    # the correct port differs at the output. Each side's own float32 error is the floor: a match, and one
    # line on where the two differ in precision.
    research, port, inputs = wan_dit_pair
    strict = dict(atol=1e-7, rtol=0.0)
    report = bisect(ResearchDenoise(research), PortDenoise(port), inputs, **strict)
    assert report.verdict == "match" and report.exit_code == 0, report.render()
    assert report.precision.startswith("float noise: the output differs by"), report.render()
    assert "first difference: dit.time_embedding" in report.precision
    assert report.culprit is None and report.first_output_divergence is None
    without = bisect(ResearchDenoise(research), PortDenoise(port), inputs, float_floor=False, **strict)
    assert without.verdict == "diverge" and not without.precision


def test_the_float_floor_does_not_hide_a_rounded_timestep(wan_dit_pair):
    research, port, inputs = wan_dit_pair

    class Rounded(PortDenoise):
        def forward(self, x, timestep, context):
            return super().forward(x, timestep.round(), context)

    x, _, context = inputs
    at = [x, torch.tensor([999.4]), context]
    report = bisect(ResearchDenoise(research), Rounded(port), at, atol=1e-7, rtol=0.0)
    assert report.verdict == "diverge" and not report.precision, report.render()


SPEC = """
from tests.research import PortDenoise, ResearchDenoise, wan_dit_pair_built

RESEARCH, PORT, INPUTS = wan_dit_pair_built()


def build_reference():
    return ResearchDenoise(RESEARCH)


def build_port():
    return PortDenoise(PORT)


def make_inputs():
    return INPUTS
"""


def test_interface_map_writes_the_pairing_table_and_never_overwrites(tmp_path):
    from click.testing import CliRunner
    from paritykit.cli import cli

    spec = tmp_path / "wan_spec.py"
    spec.write_text(SPEC)
    table = tmp_path / "interface.md"
    result = CliRunner().invoke(cli, ["bisect", str(spec), "--interface-map", str(table)])
    assert result.exit_code == 0, result.output
    text = table.read_text()
    block = text[text.index("## dit.blocks.0 <-> dit.blocks.0") :]
    assert "| `hidden_states` | `x` | exact: x |" in block
    assert "| `temb` | `t_mod` | exact: t_mod |" in block
    assert "| `rotary_emb.0` | `freqs` | rotary: cos (pairs interleaved) of freqs (complex)" in block
    again = CliRunner().invoke(cli, ["bisect", str(spec), "--interface-map", str(table)])
    assert again.exit_code == 2 and "exists" in again.output
    assert table.read_text() == text
    nowhere = CliRunner().invoke(cli, ["bisect", str(spec), "--interface-map", str(tmp_path / "no" / "t.md")])
    assert nowhere.exit_code == 2 and "its folder does not exist" in nowhere.output


def test_a_rotary_table_rounded_to_bfloat16_is_the_difference_not_float_noise(wan_dit_pair):
    # the held-out case: the port keeps its rotary table rounded to bfloat16 (~2e-3 off). The port's own
    # float32 error is large there, but the floor is the reference's: the rounding is found, never excused
    import torch

    def rounded(port):
        for name in ("freqs_cos", "freqs_sin"):
            table = getattr(port.rope, name)
            table.data = table.data.to(torch.bfloat16).float()

    report = _bisect_wan(wan_dit_pair, rounded)
    assert report.verdict == "diverge" and not report.precision, report.render()
    (hint,) = [h for h in report.culprit.hints if h.id == "inline-reference"]
    assert "the port computes that input in dit.rope (WanRotaryPosEmbed)" in hint.message
