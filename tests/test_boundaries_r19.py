"""Round 19 of the agent A/B (benchmarks/results/agent_ab.md): research outputs held in a dataclass
(audiocraft's ``Output(sample=…)``), a pair aligned by order alone that differs before the first counted one
(audiocraft's transformer norms built without their affine parameters), and a position table the research
adds after another call (smalldiffusion's DiT embeds sigma between its patch embedding and its blocks)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from paritykit.bisection.entry import bisect
from torch import nn


@dataclass
class Output:
    sample: torch.Tensor


class HeldRef(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return Output(self.b(torch.tanh(self.a(x))))


class PlainPort(nn.Module):
    def __init__(self, reference: HeldRef, slip: float = 0.0):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.load_state_dict(reference.state_dict())
        with torch.no_grad():
            self.b.bias.add_(slip)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_an_output_held_in_a_dataclass_is_read_and_the_float_floor_measured():
    # audiocraft: "float floor: … the reference run again does not reproduce its own output" on a
    # reference that reproduced itself bit for bit: its output, a dataclass, held no tensor paritykit read
    reference = HeldRef().eval()
    report = bisect(reference, PlainPort(reference).eval(), ((torch.randn(2, 8),), {}))
    text = report.render()
    assert report.verdict == "match" and report.output.passed, text
    assert "does not reproduce its own output" not in text, text
    assert report.float_floor in ("", "measured") or "measured" in report.float_floor, report.float_floor
    report = bisect(reference, PlainPort(reference, slip=0.1).eval(), ((torch.randn(2, 8),), {}))
    assert report.verdict == "diverge" and report.culprit.port == "b", report.render()


class NormsRef(nn.Module):
    def __init__(self, affine: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8, elementwise_affine=affine)
        self.mlp = nn.Linear(8, 8)
        if affine:
            with torch.no_grad():
                self.norm.weight.add_(torch.randn(8) * 0.5)

    def forward(self, x):
        return self.mlp(self.norm(self.proj(x)))


def _norm_port(reference: NormsRef, affine: bool) -> nn.Module:
    class Port(nn.Module):
        def __init__(self):
            super().__init__()
            self.to_hidden = nn.Linear(8, 8)
            self.ln = nn.LayerNorm(8, elementwise_affine=affine)
            self.ff = nn.Linear(8, 8)

        def forward(self, x):
            return self.ff(self.ln(self.to_hidden(x)))

    port = Port()
    state = {"to_hidden": reference.proj, "ff": reference.mlp}
    for name, module in state.items():
        getattr(port, name).load_state_dict(module.state_dict())
    if affine:
        port.ln.load_state_dict(reference.norm.state_dict())
    return port.eval()


def test_a_pair_aligned_by_order_that_differs_before_the_first_counted_one_is_said():
    # audiocraft: "first aligned module whose outputs differ: …linear1" with the norm before it, paired by
    # order and output shape alone, differing already (its affine parameters dropped by the conversion)
    reference = NormsRef().eval()
    report = bisect(reference, _norm_port(reference, affine=False), ((torch.randn(3, 8),), {}))
    first = report.first_output_divergence
    text = report.render()
    if first is not None and first.reference == "mlp":
        assert "before it, norm <-> ln, paired by order and output shape only" in text, text
    else:  # the norm itself is named where its pair counts
        assert first is not None and first.reference == "norm", text
    # must not fire: the norm converted with its parameters, a later slip
    port = _norm_port(reference, affine=True)
    with torch.no_grad():
        port.ff.bias.add_(0.1)
    text = bisect(reference, port, ((torch.randn(3, 8),), {})).render()
    assert "before it" not in text, text


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x):
        return self.proj(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, y):
        return self.lin(h) + y[:, None]


class PatchRef(nn.Module):
    r"""smalldiffusion's DiT: a patch embedding, then sigma embedded, then the position table added and the
    blocks run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.x_embed = Embed()
        self.sig_embed = nn.Linear(1, 8)
        self.register_buffer("pos", torch.randn(6, 8))
        self.block = Block()

    def forward(self, x, sigma):
        h = self.x_embed(x)
        y = self.sig_embed(sigma[:, None])
        return self.block(h + self.pos, y)


class WithTable(nn.Module):
    def __init__(self, linear: nn.Linear, pos: torch.Tensor):
        super().__init__()
        self.proj = linear
        self.register_buffer("pos", pos)

    def forward(self, x):
        return self.proj(x) + self.pos


class PatchPort(nn.Module):
    r"""The port's patch embedding adds the table itself, as diffusers' ``PatchEmbed`` does."""

    def __init__(self, reference: PatchRef, table_slip: float = 0.0):
        super().__init__()
        proj = nn.Linear(4, 8)
        proj.load_state_dict(reference.x_embed.proj.state_dict())
        self.pos_embed = WithTable(proj, reference.pos.clone() * (1 + table_slip))
        self.time = nn.Linear(1, 8)
        self.time.load_state_dict(reference.sig_embed.state_dict())
        self.block = Block()
        self.block.load_state_dict(reference.block.state_dict())

    def forward(self, x, sigma):
        return self.block(self.pos_embed(x), self.time(sigma[:, None]))


def test_a_table_added_after_another_call_is_a_boundary_not_a_culprit():
    reference = PatchRef().eval()
    inputs = ((torch.randn(2, 6, 4), torch.rand(2) * math.pi), {})
    report = bisect(reference, PatchPort(reference).eval(), inputs)
    row = next(t for t in report.tested if t.reference == "x_embed")
    assert row.status == "pass" and "ends where the reference's block begins" in row.note, row.note
    assert report.verdict == "match" and report.culprit is None, report.render()
    # must not fire: the port's table is off, so its output equals no later call's input
    report = bisect(reference, PatchPort(reference, table_slip=0.05).eval(), inputs)
    row = next(t for t in report.tested if t.reference == "x_embed")
    assert row.status == "fail" and "ends where" not in (row.note or ""), report.render()
    assert report.verdict == "diverge" and report.culprit.reference == "x_embed", report.render()


class TwoNorms(nn.Module):
    def __init__(self, affine: bool):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, elementwise_affine=affine)) for _ in range(3)
        )
        self.config = {"norm_elementwise_affine": affine, "norm_eps": 1e-5}
        if affine:
            with torch.no_grad():
                for layer in self.layers:
                    layer[1].weight.add_(torch.randn(8) * 0.5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_parameter_every_norm_lacks_is_counted_and_its_config_key_named():
    # audiocraft: "fix (verified): copy parameter …layers.0.norm1.weight …" for one norm of 12 lacking it;
    # the hint now counts the pairs that lack it alike and names the port's config key
    reference = TwoNorms(affine=True).eval()
    port = TwoNorms(affine=False).eval()
    for a, b in zip(reference.layers, port.layers):
        b[0].load_state_dict(a[0].state_dict())
    report = bisect(reference, port, ((torch.randn(2, 8),), {}))
    text = report.render()
    assert report.culprit is not None, text
    said = "the same setting differs the same way in 3 aligned module pairs of the two models"
    assert said in text and "the port's config holds norm_elementwise_affine=False" in text, text
    # must not fire: one norm of three lacks it, so no config-wide count
    port = TwoNorms(affine=True).eval()
    port.load_state_dict(reference.state_dict())
    port.layers[1][1] = nn.LayerNorm(8, elementwise_affine=False)
    text = bisect(reference, port, ((torch.randn(2, 8),), {})).render()
    assert "differs the same way in" not in text, text


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj_in, self.proj_out = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.proj_out(self.proj_in(x))


class WithAct(nn.Module):
    def __init__(self, reference: TwoLinears):
        super().__init__()
        self.linear_1, self.linear_2, self.act = nn.Linear(4, 8), nn.Linear(8, 8), nn.ReLU()
        self.linear_1.load_state_dict(reference.proj_in.state_dict())
        self.linear_2.load_state_dict(reference.proj_out.state_dict())

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


def test_the_captures_stay_as_recorded_whatever_bisect_runs_on_them():
    # round 20 (score-models): the port's time MLP has a ReLU the research's lacks; bisect's module fit tried
    # nn.ReLU(inplace=True) on the captured input, which rewrote the port's captured linear_1 output: "first
    # aligned module whose outputs differ: …linear_1", whose outputs were identical
    from paritykit.bisection.entry import bisect_traces
    from paritykit.tracing.trace import capture

    reference = TwoLinears().eval()
    port = WithAct(reference).eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        with capture(reference) as ref_trace:
            reference(x)
        with capture(port) as port_trace:
            port(x)
    versions = {
        (side, r.name, path): t._version
        for side, trace in (("reference", ref_trace), ("port", port_trace))
        for r in trace.records
        for path, t in (*r.inputs.items(), *r.outputs.items())
        if isinstance(t, torch.Tensor)
    }
    report = bisect_traces(ref_trace, port_trace, reference=reference, port=port)
    for (side, name, path), version in versions.items():
        trace = ref_trace if side == "reference" else port_trace
        t = {**trace[name].inputs, **trace[name].outputs}[path]
        assert t._version == version, f"{side} {name} {path} rewritten"
    first = report.first_output_divergence
    assert first is not None and first.reference == "proj_out", report.render()


def test_padding_same_or_valid_and_a_flag_off_against_an_absent_part_are_one_setting():
    # round 20 (score-models): 19 hints "[module-config] reference Conv2d padding='same', port padding=(1, 1)"
    # and 3 "conv_shortcut=False, port conv_shortcut=None", none a difference
    from paritykit.bisection.evidence.settings import settings_diff

    assert settings_diff(nn.Conv2d(4, 4, 3, padding="same"), nn.Conv2d(4, 4, 3, padding=1)) == []
    assert settings_diff(nn.Conv2d(4, 4, 2, padding="valid"), nn.Conv2d(4, 4, 2, padding=0)) == []
    dilated = nn.Conv2d(4, 4, 3, padding="same", dilation=2)
    assert settings_diff(dilated, nn.Conv2d(4, 4, 3, padding=2, dilation=2)) == []
    # must not fire as equal: another padding, or 'same' on an even kernel (it pads one side more)
    assert settings_diff(nn.Conv2d(4, 4, 3, padding="same"), nn.Conv2d(4, 4, 3, padding=0))
    assert settings_diff(nn.Conv2d(4, 4, 4, padding="same"), nn.Conv2d(4, 4, 4, padding=1))

    class Block(nn.Module):
        def __init__(self, shortcut):
            super().__init__()
            self.conv_shortcut = shortcut

    assert settings_diff(Block(False), Block(None)) == []
    assert settings_diff(Block(True), Block(None)), "a flag on against an absent part differs"


def test_a_relu_is_named_as_one_and_never_as_a_mask():
    # round 20 (score-models): "B = clamp(A, 0.0, 0.9689)", a bound at the data's own maximum that cut
    # nothing, and "[masked] … values masked to zero on B's side only" for the port's extra ReLU
    from paritykit.compare.diagnose import detect_masked, detect_saturation

    torch.manual_seed(0)
    a = torch.randn(64, 8)
    hint = detect_saturation(a, torch.relu(a))
    assert hint is not None and "B = max(A, 0) (a ReLU)" in hint.message, hint
    assert detect_masked(a, torch.relu(a)) is None
    # must fire as a mask: whole rows zeroed whatever their sign; and as a clamp with both bounds cutting
    masked = a.clone()
    masked[::4] = 0
    assert detect_masked(a, masked) is not None
    hint = detect_saturation(a, a.clamp(-1.0, 1.0))
    assert hint is not None and "B = clamp(A, -1, 1)" in hint.message, hint


class WithNorm(nn.Module):
    def __init__(self, reference: TwoLinears, filled: bool):
        super().__init__()
        self.linear_1, self.linear_2, self.norm = nn.Linear(4, 8), nn.Linear(8, 8), nn.LayerNorm(8)
        self.linear_1.load_state_dict(reference.proj_in.state_dict())
        self.linear_2.load_state_dict(reference.proj_out.state_dict())
        if not filled:
            with torch.no_grad():
                self.norm.weight.normal_()

    def forward(self, x):
        return self.linear_2(self.norm(self.linear_1(x)))


def test_a_parameter_the_port_holds_as_one_constant_is_said_so():
    # round 20 (score-models): a norm the research lacks, filled with ones and zeros by the conversion, was
    # "port parameters …group_norm.weight, …bias equal no reference tensor": its constant is said now
    reference = TwoLinears().eval()
    text = bisect(reference, WithNorm(reference, filled=True).eval(), ((torch.randn(3, 4),), {})).render()
    assert "norm.weight (all 1), norm.bias (all 0) equal no reference tensor" in text, text
    # must not fire: a weight that is no constant is named alone
    text = bisect(reference, WithNorm(reference, filled=False).eval(), ((torch.randn(3, 4),), {})).render()
    assert "norm.weight (all" not in text and "norm.weight, norm.bias (all 0)" in text, text


class UnderInference(TwoLinears):
    @torch.inference_mode()
    def forward(self, x):  # as Matcha-TTS samples: its tensors keep no version counter
        return super().forward(x)


def test_a_reference_run_under_inference_mode_is_bisected():
    # round 21 (matcha-tts): `triage --all` crashed, "Inference tensors do not track version counter"
    from paritykit.tracing.trace import version_of

    with torch.inference_mode():
        made = torch.ones(2)
    assert version_of(made) is None and version_of(torch.ones(2)) == 0
    reference = UnderInference().eval()
    port = WithAct(reference).eval()
    report = bisect(reference, port, ((torch.randn(3, 4),), {}))
    assert report.verdict == "diverge", report.render()


class Dilated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Conv1d(4, 4, 3, padding=1, dilation=1)
        self.second = nn.Conv1d(4, 4, 3, padding=2, dilation=2)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


class DilatedPort(nn.Module):
    def __init__(self, reference: Dilated, crossed: bool):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv1d(4, 4, 3, padding=1), nn.Conv1d(4, 4, 3, padding=2, dilation=2)])
        sources = (reference.second, reference.first) if crossed else (reference.first, reference.second)
        for conv, source in zip(self.convs, sources):
            conv.load_state_dict(source.state_dict())
        if not crossed:  # the weights in their slots, the second conv built without its dilation
            self.convs[1].dilation, self.convs[1].padding = (1,), (1,)

    def forward(self, x):
        return self.convs[1](torch.tanh(self.convs[0](x)))


def test_weights_converted_into_each_others_slot_are_said_to_cross():
    # round 21 (wavegrad): two up-block convs' weights swapped by the conversion, the convs dilated
    # otherwise; bisect paired each by its weights and printed "fix (verified): …convs.2.dilation = (2,)"
    reference = Dilated().eval()
    inputs = ((torch.randn(2, 4, 16),), {})
    text = bisect(reference, DilatedPort(reference, crossed=True).eval(), inputs).render()
    assert "called in crossed places" in text and "a setting fix here is for this module alone" in text, text
    # must not fire: the weights in their own slots, one dilation built otherwise
    text = bisect(reference, DilatedPort(reference, crossed=False).eval(), inputs).render()
    assert "crossed places" not in text and "dilation" in text, text
