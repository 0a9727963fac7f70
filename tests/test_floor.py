"""The float floor (paritykit.bisection.floor): a difference within a few times both sides' own float32 error
is float noise; one far above it is real, even hidden at the output and aligned on weak evidence."""

from __future__ import annotations

import pytest
import torch
from paritykit.bisection.entry import bisect
from paritykit.bisection.floor import far_above, measure, module_floor, rounded_inputs, within

from tests.devices import DEVICES


class Mlp(torch.nn.Module):
    """An MLP whose activation sits under another name on each side (so it aligns by order, low confidence)
    and whose output projection is small enough to hide an activation's difference at the output."""

    def __init__(self, act: torch.nn.Module, names: tuple[str, str, str]):
        super().__init__()
        torch.manual_seed(0)
        self.names = names
        setattr(self, names[0], torch.nn.Linear(8, 64))
        setattr(self, names[1], act)
        setattr(self, names[2], torch.nn.Linear(64, 8))
        with torch.no_grad():
            getattr(self, names[2]).weight.mul_(0.02)

    def forward(self, x):
        for name in self.names:
            x = getattr(self, name)(x)
        return x


def pair(port_act):
    reference = Mlp(torch.nn.GELU(), ("fc1", "act", "fc2"))
    port = Mlp(port_act, ("proj_in", "net_1", "proj_out"))
    port.load_state_dict(
        {k.replace("fc1", "proj_in").replace("fc2", "proj_out"): v for k, v in reference.state_dict().items()}
    )
    return reference.eval(), port.eval(), [torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 3]


class TanhGelu(torch.nn.Module):
    """diffusers-style: the tanh GELU as its own class, so nothing but order pairs it with the reference's."""

    def forward(self, x):
        return torch.nn.functional.gelu(x, approximate="tanh")


def _weak(port_act):
    """The activation pair forced to low confidence (aligned on order and shape alone)."""
    import dataclasses

    from paritykit.bisection.align import Alignment, align_modules
    from paritykit.bisection.floor import measure
    from paritykit.tracing.trace import capture

    reference, port, inputs = pair(port_act)
    with torch.no_grad(), capture(reference) as ref_trace:
        reference(*inputs)
    with torch.no_grad(), capture(port) as port_trace:
        port(*inputs)
    found = align_modules(reference, port, ref_trace, port_trace)
    weak = Alignment(
        pairs=[dataclasses.replace(p, confidence="low") if p.port == "net_1" else p for p in found.pairs],
        unaligned_reference=found.unaligned_reference,
        unaligned_port=found.unaligned_port,
    )
    floor = measure(reference, port, (tuple(inputs), {}), (tuple(inputs), {}))
    return (ref_trace, port_trace), dict(reference=reference, port=port, alignment=weak), floor, found


def test_an_activation_far_above_its_floor_is_masked_and_a_weak_pair_is_a_lead_not_the_culprit():
    # the tanh GELU is 5e-4 off, the output 6e-6: hidden. Aligned on weak evidence (order and shape alone, low
    # confidence), a difference was no evidence; far above its measured float floor, it is: masked. A pair by
    # order alone is named the culprit only when a verified fix confirms it by value.
    from paritykit.bisection.align import Alignment
    from paritykit.bisection.entry import bisect_traces

    traces, search, floor, _ = _weak(torch.nn.GELU(approximate="tanh"))
    report = bisect_traces(*traces, float_floor=floor, **search)
    assert report.output.passed  # hidden at the output
    assert report.verdict == "masked", report.render()
    # one class on both sides, and the setting fix verifies: the pair is confirmed by value
    assert report.culprit.port == "net_1" and report.culprit.hints[0].verified
    # measured, not assumed: without the floor the same low-confidence pair is no evidence
    assert bisect_traces(*traces, **search).verdict == "match"

    # another class on the port's side, no fix that verifies: the output matches and nothing confidently
    # aligned fails, so the verdict is match; the weak pair's failure is still said, as a lead
    traces, search, floor, found = _weak(TanhGelu())
    report = bisect_traces(*traces, float_floor=floor, **search)
    assert report.verdict == "match" and report.culprit is None, report.render()
    assert [(c.port, c.status) for c in report.candidates] == [("net_1", "fail")]
    assert "lead: reference act <-> port net_1 fails on identical inputs" in report.render()
    # named by the user (--map), the same pair is the culprit
    named = bisect_traces(*traces, float_floor=floor, **{**search, "alignment": Alignment(pairs=found.pairs)})
    assert named.verdict == "masked" and named.culprit.port == "net_1"


def test_a_correct_port_is_a_clean_match_with_the_floor():
    reference, port, inputs = pair(torch.nn.GELU())
    report = bisect(reference, port, inputs)
    assert report.verdict == "match" and report.culprit is None and not report.precision
    assert report.float_floor.startswith("measured")


def test_floor_measurements():
    module = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    with torch.no_grad():
        out = module(x)
        floor = module_floor(module, (x,), {}, [("output", out)])
    assert floor is not None and 0 < floor < 1e-5
    moved = rounded_inputs(((x, torch.tensor([3])), {"t": torch.tensor([999.0])}))
    (moved_x, steps), kwargs = moved
    assert torch.equal(steps, torch.tensor([3]))  # integers are not moved
    step = (moved_x - x).abs() / x.abs()
    assert bool((step <= 2 * torch.finfo(torch.float32).eps).all()) and bool((moved_x != x).any())
    assert abs(float(kwargs["t"]) - 999.0) > 0
    assert within(3e-6, 1e-6) and not within(5e-6, 1e-6) and not within(1e-6, None)
    assert far_above(1e-4, 1e-6) and not far_above(5e-5, 1e-6) and far_above(1e-9, 0.0)
    assert not far_above(0.0, 0.0)


class Float32Only(torch.nn.Module):
    """Research code that hard-codes float32 (``.float()`` on its inputs): no float64 run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        if self.proj.weight.dtype != torch.float32:
            raise TypeError("this model runs in float32 only")
        return self.proj(x)


def test_a_reference_that_cannot_run_in_float64_is_measured_on_rounded_inputs_and_says_so():
    model = Float32Only()
    x = torch.randn(2, 4)
    floor = measure(model, torch.nn.Linear(4, 4), ((x,), {}), ((x,), {}))
    assert floor.measured and floor.ref64 is None and floor.ref_moved is not None
    assert floor.port64 is not None  # the port's own float64 run is kept
    assert (
        floor.reason == "the reference does not run in float64 (TypeError: this model runs in float32 only)"
    )
    port = Float32Only()
    port.load_state_dict(model.state_dict())
    report = bisect(model, port, [x])
    assert report.verdict == "match", report.render()
    state = (
        "measured on the reference's rounded inputs only (it does not run in float64 (TypeError: this model"
    )
    assert report.float_floor.startswith(state)
    assert f"float floor: {state}" in report.render()  # the text report says it, not only the JSON


def test_a_port_that_cannot_run_in_float64_is_named_as_the_port():
    reference = torch.nn.Linear(4, 4)
    floor = measure(reference, Float32Only(), ((torch.randn(2, 4),), {}), ((torch.randn(2, 4),), {}))
    assert floor.ref64 is not None and floor.port64 is None
    assert floor.reason.startswith("the port does not run in float64")


class Table(torch.nn.Module):
    """A sinusoid table of the timestep, then a projection; ``dtype``: the precision the table is kept in."""

    def __init__(self, dtype=None):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(16, 16)
        self.dtype = dtype

    def forward(self, t):
        freqs = torch.exp(-torch.arange(8, dtype=t.dtype) / 8 * 9.2)
        angles = t[:, None] * freqs[None]
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        if self.dtype is not None:
            table = table.to(self.dtype).to(t.dtype)
        return self.proj(table)


class Embedder(torch.nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.table = Table(dtype)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, t):
        return self.out(self.table(t))


def test_a_port_computing_in_lower_precision_is_the_difference_not_its_excuse():
    # the port rounds its table to bfloat16: a difference of ~1e-3 that the port's own (large) float32 error
    # must not excuse. The floor is the reference's error, so the table is the culprit.
    t = [torch.tensor([999.0, 500.0, 10.0, 3.0])]
    reference, port = Embedder(), Embedder(torch.bfloat16)
    port.load_state_dict(reference.state_dict())
    report = bisect(reference, port, t)
    assert report.verdict == "diverge" and not report.precision, report.render()
    assert report.culprit.port == "table", report.render()
    # and a correct port of the same model matches
    same = Embedder()
    same.load_state_dict(reference.state_dict())
    assert bisect(reference, same, t).verdict == "match"


class Lookup(torch.nn.Module):
    """A timestep embedding read from a table by index (``t.long()``), then projected; ``scale`` is a bug."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(1000, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.scale = scale

    def forward(self, t):
        return self.proj(self.table(t.long()) * self.scale)


def test_the_floor_does_not_hide_a_bug_behind_a_step_function():
    # moving t = 999.0 by a rounding step must not read as float noise the jump to another table row
    t = [torch.tensor([999.0, 500.0, 10.0, 3.0])]
    report = bisect(Lookup(), Lookup(scale=1.001), t)
    assert report.verdict == "diverge" and not report.precision, report.render()
    assert not any("float noise" in test.note for test in report.tested)


class InPlace(torch.nn.Module):
    def __init__(self, approximate: str, in_place: bool):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.act = torch.nn.GELU(approximate=approximate)
        self.in_place = in_place

    def forward(self, x):
        x = x.mul_(2) if self.in_place else x * 2
        return self.act(self.proj(x))


def test_the_floor_runs_on_clean_inputs_and_only_where_a_run_repeats():
    x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(2))]
    # the reference edits its input in place: the floor's runs must start from the inputs as made
    report = bisect(InPlace("none", True), InPlace("tanh", False), x)
    assert report.verdict == "diverge" and not report.precision, report.render()
    assert report.float_floor.startswith("measured")

    class Noisy(torch.nn.Module):
        def forward(self, x):
            return x + 1e-3 * torch.randn_like(x)

    floor = measure(Noisy(), Noisy(), ((x[0],), {}), ((x[0],), {}), outputs=(x[0], x[0]))
    assert not floor.measured and "does not reproduce its own output" in floor.reason


def test_a_spec_reference_without_float64_is_named_as_the_reference(tmp_path):
    # through a SPEC every forward is guarded by user-code naming: the float64 copy of the reference must be
    # named the reference's (it was once "the port model's forward raised")
    from paritykit.bisection.spec import bisect_spec

    spec = tmp_path / "spec.py"
    spec.write_text(
        "import torch\n"
        "from tests.test_floor import Float32Only\n"
        "def build_reference():\n    return Float32Only()\n"
        "def build_port():\n    return Float32Only()\n"
        "def make_inputs():\n    return (torch.ones(2, 4),), {}\n"
    )
    report = bisect_spec(spec)
    assert "it does not run in float64 (TypeError: this model runs in float32 only)" in report.float_floor
    assert "port" not in report.float_floor  # only the reference's runs make the floor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bug", [None, "eps"])
def test_a_bfloat16_port_is_judged_in_bfloat16(bug, device):
    # both sides in bfloat16: a correct port matches, a planted eps is found with its verified fix, and the
    # report names the dtype its numbers are in
    from tests.evidence_pairs import vit_pair

    reference, port, ((x,), _) = vit_pair(bug)
    reference, port = reference.to(device, torch.bfloat16), port.to(device, torch.bfloat16)
    report = bisect(reference, port, ((x.to(device, torch.bfloat16),), {}))
    text = report.render()
    assert "reference bfloat16, port bfloat16" in text.splitlines()[0]
    if bug is None:
        assert report.verdict == "match", text
    else:
        assert report.verdict in ("masked", "diverge") and report.culprit.port == "layernorm_before", text
        assert report.culprit.hints[0].verified and "eps = 1e-06" in report.culprit.hints[0].fix
        assert "float32 error" not in text


@pytest.mark.parametrize("device", DEVICES)
def test_a_bfloat16_port_of_a_float32_reference_is_held_to_float32(device):
    # the port computes everything in bfloat16 where its reference runs in float32: that is the difference,
    # found at the first module, not excused by bfloat16's own tolerance
    from tests.evidence_pairs import vit_pair

    reference, port, ((x,), _) = vit_pair(None)
    reference, port, x = reference.to(device), port.to(device, torch.bfloat16), x.to(device)

    class Cast(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x.to(torch.bfloat16))

    report = bisect(reference, Cast(port), ((x,), {}))
    assert report.verdict == "diverge" and report.culprit is not None, report.render()
    assert "reference float32, port bfloat16" in report.render().splitlines()[0]


class _SeededSampler(torch.nn.Module):
    r"""A VAE-like forward that draws its noise inside, from a fixed seed, in the dtype it runs in: a float64
    copy draws other numbers, so its distance from the float32 run is the noise, not rounding."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.enc = torch.nn.Linear(16, 16)
        self.dec = torch.nn.Linear(16, 16)
        self.scale = scale

    def forward(self, x):
        h = self.enc(x)
        torch.manual_seed(1234)
        return self.dec(h + torch.randn_like(h)) * self.scale


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_a_float64_run_that_draws_other_noise_is_no_floor(scale):
    # the float64 copy's output differed by ~1.0 relative: taken as the floor, a 0.59 difference (scale 1.3)
    # was "float noise" and the verdict masked; the floor now comes from the rounded-inputs run alone
    reference, port = _SeededSampler().eval(), _SeededSampler(scale).eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    report = bisect(reference, port, ((x,), {}), repair=False)
    assert "differs in float64 from its own run by" in report.render()
    if scale == 1.0:  # must not fire on the correct port: a clean match
        assert report.verdict == "match" and report.exit_code == 0
    else:
        assert report.verdict == "diverge" and report.exit_code == 1
        assert "float noise" not in report.render()
