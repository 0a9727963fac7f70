"""paritykit.record_loop: a loop's denoiser calls become checkpoints, with forward hooks only."""

from __future__ import annotations

import pytest
import torch
from paritykit import compare_paths, load_checkpoints, record_loop
from paritykit.base.errors import ParityKitError
from paritykit.compare.sets import run_order
from paritykit.compare.steps import step_curve

from tests._pipelines import make_tiny_unet
from tests.sampling import one_thread  # noqa: F401 (a fixture, applied by importing it)


class Denoiser(torch.nn.Module):
    """A k-diffusion style wrapper: called with (x, sigma, cond=...)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, sigma, cond=None):
        return self.proj(x) * sigma + (0 if cond is None else cond.mean())


def test_every_call_is_a_step_named_by_argument_and_preloop_holds_the_schedule(tmp_path):
    torch.manual_seed(0)
    model = Denoiser()
    forward = model.forward
    x, cond = torch.randn(2, 4), torch.randn(3)
    sigmas = [14.6, 7.0, 2.5, 0.3]
    with torch.no_grad(), record_loop(model, out=tmp_path / "run") as calls:
        for s in sigmas:
            x = x - 0.1 * model(x, torch.tensor(s), cond=cond)
        assert len(calls) == len(sigmas)
        with pytest.raises(ParityKitError, match="record_loop final: expected the final latents tensor"):
            calls.final([1.0])
        assert calls.final(x) is x
    assert model.forward == forward and not model._forward_hooks  # nothing patched, hook removed
    ck = load_checkpoints(tmp_path / "run")
    assert list(ck) == ["preloop", *(f"step_{i}" for i in range(len(sigmas))), "final"]
    assert torch.equal(ck["final"].data["latents"], x) and ck["preloop"].data["recorded_calls"] == len(sigmas)
    step = ck["step_2"].data
    assert set(step) == {"x", "sigma", "cond", "output"}
    assert torch.equal(step["cond"], cond)
    assert (
        ck["preloop"].data["sigmas"].tolist() == torch.tensor(sigmas, dtype=torch.float32).double().tolist()
    )
    assert torch.equal(ck["step_0"].data["x"], ck["preloop"].data["x"])
    # a per-call list lacks the final sigma: against a full list ending in 0 that is no difference ...
    from paritykit import compare_schedules

    full = [float(v) for v in torch.tensor(sigmas, dtype=torch.float32)] + [0.0]
    cmp = compare_schedules(tmp_path / "run", {"sigmas": full})
    assert cmp.exit_code == 0 and cmp.hints == [] and "final sigma is unknown" in cmp.notes[0]
    # ... while the same short list given by hand still gets the final-sigma hint
    hand = compare_schedules({"sigmas": full[:-1]}, {"sigmas": full})
    assert [h.id for h in hand.hints] == ["final-sigma-zero"]


def test_two_recorded_runs_feed_compare_and_steps(tmp_path):
    unet = make_tiny_unet(attention=False)
    noise = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))

    def loop(drift: float):
        x = noise
        for t in (900, 600, 300, 0):
            x = x - 0.1 * unet(x, t).sample + drift  # positional (sample, timestep): names from the signature
        return x

    for name, drift in (("a", 0.0), ("b", 0.0), ("c", 1e-2)):
        with torch.no_grad(), record_loop(unet, out=tmp_path / name):
            loop(drift)
    data = load_checkpoints(tmp_path / "a")["step_1"].data
    assert {"sample", "timestep", "output"} <= set(data)
    assert load_checkpoints(tmp_path / "a")["preloop"].data["timesteps"].tolist() == [900, 600, 300, 0]
    assert compare_paths(tmp_path / "a", tmp_path / "b").passed
    same = step_curve(tmp_path / "a", tmp_path / "b", key="output")
    assert same.exit_code == 0 and all(p.max_abs == 0 for p in same.points)
    differ = compare_paths(tmp_path / "a", tmp_path / "c")
    assert differ.first_divergence.startswith("step_1/")  # the drift enters after the first call


def test_single_file_names_are_ordered_as_a_run_writes_them():
    names = [
        "after_step_10/latents",
        "after_step_2/latents",
        "post_loop/latents",
        "preloop/latents",
        "text_encoding/prompt_embeds",
    ]
    assert run_order(names) == [
        "text_encoding/prompt_embeds",
        "preloop/latents",
        "after_step_2/latents",
        "after_step_10/latents",
        "post_loop/latents",
    ]
    # must not fire: names that are not all checkpoints keep their order
    other = ["b.weight", "after_step_1/latents", "a.weight"]
    assert run_order(other) == other


def test_compare_on_one_file_reports_the_first_divergence_in_time(tmp_path):
    from safetensors.torch import save_file

    a = {f"after_step_{i}/latents": torch.full((2,), float(i)) for i in range(12)}
    b = {
        k: v + (1.0 if k in ("after_step_2/latents", "after_step_10/latents") else 0.0) for k, v in a.items()
    }
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    assert (
        compare_paths(tmp_path / "a.safetensors", tmp_path / "b.safetensors").first_divergence
        == "after_step_2/latents"
    )


def test_nested_arguments_are_recorded_and_what_cannot_be_is_named(tmp_path):
    class Research(torch.nn.Module):
        def forward(self, x, t, context, grid, extras, handle):
            return [xi * 2 for xi in x]

    model = Research()
    x = [torch.randn(4, 3), torch.randn(4, 3)]
    context = (torch.randn(5, 8),)
    extras = {"mask": torch.ones(2, dtype=torch.bool), "lens": [5, 3]}
    with record_loop(model, tmp_path / "run") as rec:
        model(x, torch.tensor([0.5]), context, (2, 2), extras, handle=object())
    step = load_checkpoints(tmp_path / "run")["step_0"].data
    assert torch.equal(step["x.0"], x[0]) and torch.equal(step["x.1"], x[1])
    assert torch.equal(step["x"], torch.stack(x))  # the list is the batch
    assert torch.equal(step["context.0"], context[0])
    assert torch.equal(step["extras.mask"], extras["mask"])
    assert step["extras.lens.1"] == 3 and step["grid.0"] == 2
    assert step["unrecorded"] == "handle (object)"
    assert torch.equal(step["output"], torch.stack(x) * 2)  # a list of per-sample results, stacked
    assert "step_0" in rec


def test_a_time_embedding_named_time_is_no_timestep():
    # round 11 (stable-diffusion-pytorch): Diffusion(latent, context, time) takes a (1, 320) time embedding;
    # triage read its first element as the timestep
    from paritykit.tracing.recording import timestep_argument

    latents, context = torch.randn(2, 4, 8, 8), torch.randn(2, 7, 32)
    assert timestep_argument({"latent": latents, "context": context, "time": torch.randn(1, 320)}) is None
    found = timestep_argument({"latent": latents, "context": context, "time": torch.tensor([999.0, 999.0])})
    assert found is not None and found[0] == "time" and found[2] == 999.0
