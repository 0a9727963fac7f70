"""paritykit triage on a research DDIM sampler with the original LDM decoder against a diffusers-style port,
with one bug planted in each place a port goes wrong, two at once, and none (tests/triage_pairs.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.triage import triage_spec

from tests.sampling import one_thread  # noqa: F401  (one torch thread for these tiny models)
from tests.triage_pairs import LDM_SCALE, write_spec

from .conftest import REPO


def run(tmp_path, bugs=(), *, all_causes=False, vae=True):
    spec = write_spec(tmp_path, bugs, vae=vae)
    return triage_spec(spec, all_causes=all_causes, out=tmp_path / "out")


def places(report):
    return [f.place for f in report.findings]


@pytest.mark.parametrize("vae", [True, False])
def test_a_correct_port_is_a_match_and_nothing_else(tmp_path, vae):
    report = run(tmp_path, vae=vae)
    assert report.verdict == "match" and report.exit_code == 0
    assert report.findings == [] and report.result["passed"]
    assert len(report.curve) == 5 and all(row.latents < 1e-5 for row in report.curve)


def test_initial_noise_cast_to_bf16(tmp_path):
    report = run(tmp_path, ["noise-bf16"])
    (finding,) = report.findings
    assert (finding.place, finding.call) == ("initial noise", 0)
    assert any("[bf16-cast]" in line for line in finding.evidence)
    assert finding.command.startswith("paritykit compare") and "step_0.safetensors" in finding.command


def test_schedule_spacing_is_fitted_and_the_fix_verified(tmp_path):
    report = run(tmp_path, ["spacing-leading"])
    (finding,) = report.findings
    assert finding.place == "schedule" and finding.call == 0
    assert finding.verified and 'timestep_spacing="trailing"' in finding.fix
    assert "--fit DDIMScheduler" in finding.command


def test_conditioning_of_another_length_is_a_difference_never_a_rule_out(tmp_path):
    # the port pads its prompt embedding with zero rows: the rows both have agree, the lengths do not. That is
    # measured at the conditioning, never "ruled out" for agreeing on the common rows
    report = run(tmp_path, ["cond-padded"], vae=False)
    (finding,) = report.findings  # the denoiser is not bisected: it cannot be fed the reference's inputs
    assert any(n.place == "denoiser" and "another length" in n.text for n in report.not_checked)
    assert (finding.place, finding.call) == ("conditioning", 0), report.render()
    assert "differ in length along axis 1: the first 3 there agree; the port's other 2 are all zero" in (
        finding.summary
    )
    assert not any(n.place == "conditioning" for n in report.ruled_out)
    # a clean port says what was compared: shapes, every element, every call
    clean = run(tmp_path, vae=False)
    (note,) = [n for n in clean.ruled_out if n.place == "conditioning"] or [None]
    assert note is None or "agree element by element at all 5 calls" in note.text


def test_the_verdict_is_the_results_and_differences_inside_a_matching_run_are_no_causes():
    from paritykit.triage.report import Finding, TriageReport

    def report(passed, findings, all_causes=False):
        return TriageReport(
            spec="s.py",
            findings=findings,
            ruled_out=[],
            not_checked=[],
            curve=[],
            calls=(3, 3),
            result={"passed": passed, "max_abs": 1e-6, "cosine": 1.0},
            all_causes=all_causes,
            out_dir=None,
        )

    inside = [Finding("denoiser", 0, "the batch halves are in the other order")]
    matching = report(True, inside)
    assert matching.verdict == "match" and matching.exit_code == 0
    text = matching.render()
    assert text.startswith(
        "verdict: match (the results agree within tolerance; inside the run 1 place differs"
    )
    assert "1. inside the run, denoiser at call 0" in text and "cause" not in text
    differing = report(False, inside * 3, all_causes=True)
    assert (
        differing.exit_code == 1
        and "3 places differ, each checked on its own; causes in a place are not counted"
        in differing.render()
    )
    assert "independent" not in differing.render()
    first = report(False, inside).render()
    assert "(the first place that differs; --all checks every place on its own)" in first
    assert report(True, []).verdict == "match" and report(False, []).verdict == "differ"


def test_conditioning_cast_before_the_denoiser(tmp_path):
    report = run(tmp_path, ["cond-bf16"])
    (finding,) = report.findings
    assert finding.place == "conditioning" and "encoder_hidden_states" in finding.summary
    assert any("[bf16-cast]" in line for line in finding.evidence)


def test_calls_that_cannot_be_paired_are_said_so_not_blamed_on_the_schedule(tmp_path):
    report = run(tmp_path, ["double-call"])
    (finding,) = report.findings
    assert finding.place == "schedule" and "calls the denoiser 2 times per timestep" in finding.summary
    assert finding.fix is None and report.result["passed"]  # the same result: only the calls differ


def test_a_schedule_that_differs_is_read_once_per_step_when_one_side_calls_twice_per_step(tmp_path):
    # the port calls its denoiser once per guidance half and steps another spacing: the count is not the
    # difference (5 steps each), the timesteps are, compared once per step
    report = run(tmp_path, ["double-call", "spacing-leading"], vae=False)
    finding = report.findings[0]
    assert finding.place == "schedule", report.render()
    assert (
        "(5 values on both sides once repeats are collapsed: the reference calls its denoiser 1 time(s)"
        in (finding.summary)
    )
    assert finding.verified and 'timestep_spacing="trailing"' in finding.fix
    assert "a different step count" not in report.render()


def test_timesteps_rounded_to_bfloat16_are_named_as_a_cast_not_a_schedule(tmp_path):
    report = run(tmp_path, ["timestep-bf16"], vae=False)
    finding = report.findings[0]
    assert finding.place == "schedule" and "the reference's rounded to bfloat16, every one" in finding.summary
    assert finding.fix is None  # no scheduler config to change: the list agrees before the cast


def test_conditioning_of_another_length_or_a_mask_in_another_form_is_measured_without_crashing():
    from paritykit.triage.pairs import Tolerance, unpaired_conditioning

    mask = torch.ones(1, 76, dtype=torch.bool)
    short = torch.ones(1, 12, dtype=torch.bool)
    differences, alone = unpaired_conditioning(
        [("mask", mask)], [("encoder_attention_mask", short)], Tolerance()
    )
    assert differences == [
        "reference mask (1, 76) and port encoder_attention_mask (1, 12) differ in length along axis 1: the"
        " first 12 there agree; the reference's other 64 are not zero (max |value| 1)"
    ]
    # must not fire: a batch of two (guidance halves) against one is no padding, nor a 1-D tensor's length
    t1, t2 = torch.tensor([750.0]), torch.tensor([0.75, 0.75])
    assert unpaired_conditioning([("t", t1)], [("t", t2)], Tolerance()) == (
        [],
        ["reference t (1,)", "port t (2,)"],
    )
    batch = torch.ones(1, 7, 8), torch.ones(2, 7, 8)
    assert unpaired_conditioning([("c", batch[0])], [("c", batch[1])], Tolerance())[0] == []


def test_a_denoiser_module_is_bisected_on_the_calls_inputs(tmp_path):
    report = run(tmp_path, ["norm-eps"])
    (finding,) = report.findings
    assert finding.place == "denoiser" and finding.call == 0
    assert "down_blocks.1.resnets.0.norm1" in finding.summary
    assert finding.verified and finding.fix == "down_blocks.1.resnets.0.norm1.eps = 1e-05"
    assert (tmp_path / "out" / "bisect_denoiser.py").is_file()


def test_the_update_rule_is_named_by_the_coefficient_that_differs(tmp_path):
    report = run(tmp_path, ["v-prediction"])
    (finding,) = report.findings
    assert finding.place == "update" and finding.call == 0
    assert "coefficient of the output" in finding.summary and "coefficient of the latents" in finding.summary
    assert "timesteps, latents and output of the step agree" in finding.evidence
    # the port's own step() replayed over the keys that change only the update names the key, verified
    assert finding.verified and finding.fix.endswith('prediction_type="epsilon")')
    assert "--step-check" in finding.command


def test_the_decoder_is_bisected_on_its_recorded_call(tmp_path):
    report = run(tmp_path, ["decoder-groups"])
    (finding,) = report.findings
    assert finding.place == "decoder" and finding.fix == "mid_block.resnets.0.norm1.num_groups = 32"
    calls = next(n for n in report.ruled_out if n.place == "denoiser")
    assert calls.check == "calls" and "every call (5)" in calls.text


def test_the_latents_scaling_before_the_decoder_is_fitted(tmp_path, cli):
    report = run(tmp_path, ["sdxl-scale"])
    (finding,) = report.findings
    assert finding.place == "decoder input"
    assert f"{LDM_SCALE / 0.13025:.6f}"[:6] in finding.summary
    # its command compares the two decoder inputs alone, and compare names the scale on its own
    words = shlex.split(finding.command)
    assert words[:2] == ["paritykit", "compare"]
    alone = cli(*words[1:], "--json")
    assert alone.returncode == 1, alone.stderr
    (pair,) = json.loads(alone.stdout)["pairs"]
    assert pair["hints"][0]["id"] == "constant-scale"
    assert pair["hints"][0]["evidence"]["k"] == pytest.approx(LDM_SCALE / 0.13025, rel=1e-3)


def test_the_post_processing_map_is_fitted_where_unclamped(tmp_path):
    report = run(tmp_path, ["no-denormalize"])
    (finding,) = report.findings
    assert finding.place == "post-processing"
    assert "coefficient of the decoder output: reference 0.5, port 1" in finding.summary


def test_two_bugs_first_difference_then_both_with_all(tmp_path):
    first = run(tmp_path, ["norm-eps", "spacing-leading"])
    assert places(first) == ["schedule"]  # the timesteps differ before any module computes
    both = run(tmp_path, ["norm-eps", "spacing-leading"], all_causes=True)
    assert places(both) == ["schedule", "denoiser"]
    assert all(f.verified for f in both.findings)
    # the schedule differs at every step: the update cannot be compared, and is said not to be, not blamed
    assert any(note.place == "update" for note in both.not_checked)


@pytest.mark.parametrize(
    "bugs, expected",
    [
        (["noise-bf16"], ["initial noise"]),
        (["v-prediction", "decoder-groups", "no-denormalize"], ["update", "decoder", "post-processing"]),
    ],
)
def test_all_names_each_independent_cause_and_nothing_else(tmp_path, bugs, expected):
    report = run(tmp_path, bugs, all_causes=True)
    assert places(report) == expected


def test_cli_json_exit_codes_and_reproduce_commands(tmp_path):
    spec = write_spec(tmp_path, ["spacing-leading"])
    out = tmp_path / "out"
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'helpers'}"}
    cmd = [sys.executable, "-m", "paritykit", "triage", str(spec), "--out", str(out), "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "differ" and report["findings"][0]["place"] == "schedule"
    # the finding's own command reproduces it alone: the fit, exit 0 (found)
    words = shlex.split(report["findings"][0]["command"])
    assert words[0] == "paritykit"
    again = subprocess.run(
        [sys.executable, "-m", *words], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert again.returncode == 0 and 'timestep_spacing="trailing"' in again.stdout


def test_bad_specs_are_one_line_errors(tmp_path):
    missing = tmp_path / "missing.py"
    with pytest.raises(ParityKitError, match="no such file"):
        triage_spec(missing, out=None)
    partial = tmp_path / "partial.py"
    partial.write_text("import torch\nM = torch.nn.Linear(2, 2)\ndef reference_denoiser():\n    return M\n")
    with pytest.raises(
        ParityKitError,
        match=r"defines no run_reference\(\), run_port\(\), port_denoiser\(\); see `paritykit triage --help`",
    ):
        triage_spec(partial, out=None)
    unused = tmp_path / "unused.py"
    unused.write_text(
        "import torch\nM = torch.nn.Linear(2, 2)\n"
        "def reference_denoiser():\n    return M\n\ndef port_denoiser():\n    return M\n\n"
        "def run_reference():\n    return torch.zeros(2)\n\ndef run_port():\n    return torch.zeros(2)\n"
    )
    recorded = r"no call of reference_denoiser\(\)'s module was recorded during run_reference"
    with pytest.raises(ParityKitError, match=recorded):
        triage_spec(unused, out=None)


def test_the_generated_triage_spec_runs_as_generated(tmp_path, monkeypatch):
    from paritykit.pack import scaffold

    monkeypatch.chdir(tmp_path)
    targets = {
        "pipeline": "tests.triage_pairs:PortPipeline",
        "reference": "tests.triage_pairs:reference",
        "reference_denoiser": "tests.triage_pairs:reference_unet",
        "reference_vae": "tests.triage_pairs:reference_decoder",
    }
    (path,) = scaffold.generate("triage-spec", "ddim", out_dir=tmp_path, **targets).paths
    report = triage_spec(path, out=tmp_path / "out")
    assert report.verdict == "match" and report.calls == (10, 10)
    assert any(note.place == "decoder" for note in report.ruled_out)


def test_out_is_never_a_folder_of_the_users_own_files(tmp_path):
    spec = write_spec(tmp_path, [])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ParityKitError, match="exists and is not an empty folder or an earlier triage"):
        triage_spec(spec, out=mine)
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
    triage_spec(spec, out=tmp_path / "out")
    assert triage_spec(spec, out=tmp_path / "out").verdict == "match"  # an earlier triage's folder is reused


def test_run_results_are_read_as_pipelines_return_them():
    import numpy as np
    import torch
    from paritykit.triage.sides import result_tensor
    from PIL import Image

    class Spec:
        path = "spec.py"

    class Output:
        images = [Image.new("RGB", (4, 4)), Image.new("RGB", (4, 4))]

    assert result_tensor((torch.ones(1, 3, 4, 4), None), "run_port()", Spec).shape == (1, 3, 4, 4)
    assert result_tensor(Output(), "run_port()", Spec).shape == (2, 4, 4, 3)
    assert result_tensor(np.zeros((2, 2)), "run_port()", Spec).dtype == torch.float64
    with pytest.raises(ParityKitError, match="run_port\\(\\) returned object, which is not a tensor"):
        result_tensor(object(), "run_port()", Spec)


# ------------------------------------------------------------------------------------- reproduce files


def test_command_builders_write_nothing_the_files_come_after_the_walk(tmp_path):
    from diffusers import DDIMScheduler
    from paritykit.triage.report import Finding
    from paritykit.triage.reproduce import Commands, write_files

    folders = (tmp_path / "reference_calls", tmp_path / "port_calls")
    commands = Commands(tmp_path / "spec.py", {}, folders)
    command, files = commands.schedule(DDIMScheduler())
    assert "--fit DDIMScheduler" in command and [f.path.name for f in files] == ["port_scheduler.json"]
    assert list(tmp_path.iterdir()) == []  # building the command wrote nothing
    finding = Finding("schedule", 0, "the timesteps differ", command=command, files=files)
    write_files([finding])
    assert json.loads((tmp_path / "port_scheduler.json").read_text())["num_train_timesteps"] == 1000
    assert finding.command == command and finding.files == []
    # without --out there is no command and nothing to write
    assert Commands(tmp_path / "spec.py", {}, None).steps() == (None, [])


def test_a_file_that_cannot_be_written_leaves_its_finding_without_a_command(tmp_path):
    from paritykit.triage.report import Finding, ReproduceFile
    from paritykit.triage.reproduce import write_files

    unsaveable = ReproduceFile(tmp_path / "denoiser_call0.pt", "torch", {"port": lambda x: x})
    spec = ReproduceFile(tmp_path / "bisect_denoiser.py", "text", "")
    finding = Finding("denoiser", 0, "differs", command="paritykit bisect x.py", files=[unsaveable, spec])
    write_files([finding])
    assert finding.command is None
    assert any("denoiser_call0.pt not written" in line for line in finding.evidence)
    assert not (tmp_path / "bisect_denoiser.py").exists()  # no SPEC pointing at inputs that are not there
    assert finding.to_dict()["command"] is None


def test_a_masked_module_is_the_cause_only_where_the_run_saw_its_output_differ():
    from paritykit.bisection import bisect
    from paritykit.triage.measures import module_differs

    from tests.test_bisect_all import masked_vit, vit_output

    reference, port, inputs = masked_vit("gelu")
    masked = bisect(reference, port, inputs, select_output=vit_output, atol=1e-4, rtol=0)
    assert masked.verdict == "masked"
    assert module_differs(masked, seen_differing=True) and not module_differs(masked, seen_differing=False)
    diverged = bisect(reference, port, inputs, select_output=vit_output, atol=1e-7, rtol=0)
    assert diverged.verdict == "diverge" and module_differs(diverged, seen_differing=False)
    reference, port, inputs = masked_vit(None)  # the same port without the bug
    clean = bisect(reference, port, inputs, select_output=vit_output, atol=1e-4, rtol=0)
    assert clean.verdict == "match" and not module_differs(clean, seen_differing=True)


def test_list_arguments_are_recorded_and_paired_as_the_batch(tmp_path):
    # the reference's denoiser takes x and context as lists of per-sample tensors: nothing of them dropped
    from tests.triage_pairs import write_list_spec

    clean = triage_spec(write_list_spec(tmp_path), out=tmp_path / "clean")
    assert clean.verdict == "match", clean.render()
    assert all(row.latents is not None and row.latents < 1e-5 for row in clean.curve), clean.render()
    import safetensors.torch

    step = safetensors.torch.load_file(str(tmp_path / "clean" / "reference_calls" / "step_0.safetensors"))
    assert {"x.0", "context.0", "x"} <= set(step), sorted(step)

    report = triage_spec(write_list_spec(tmp_path, ["cond-bf16"]), out=tmp_path / "cond")
    (finding,) = report.findings
    assert finding.place == "conditioning" and "context" in finding.summary, report.render()


@pytest.mark.parametrize("vae, covered", [(True, "4 of 5"), (False, "5 of 5")])
def test_the_update_is_ruled_out_only_as_far_as_it_was_replayed(tmp_path, vae, covered):
    # with a decoder the run's result is an image: the last update (after the last call) is not recorded,
    # so it is not counted as checked
    report = run(tmp_path, vae=vae, all_causes=True)
    (note,) = [n for n in report.ruled_out if n.place == "update"]
    assert f"{covered} updates replayed in lockstep with port_scheduler()" in note.text


def test_the_last_update_to_the_final_alpha_is_found_and_fixed(tmp_path):
    report = run(tmp_path, ["final-alpha"], vae=False)
    (finding,) = report.findings
    assert finding.place == "update" and finding.call == 4
    assert finding.verified and "set_alpha_to_one=True" in finding.fix


def test_timesteps_in_other_units_are_one_schedule_and_replayed_converted(tmp_path):
    # the research passes t in [0, 1], the port in [0, 1000]: not two schedules, and the port's denoiser is
    # replayed on the reference's timestep converted (else "the forward code differs" would be claimed)
    from tests.triage_pairs import write_unit_spec

    clean = triage_spec(write_unit_spec(tmp_path), out=tmp_path / "clean", all_causes=True)
    assert clean.verdict == "match" and clean.exit_code == 0, clean.render()
    (note,) = [n for n in clean.ruled_out if n.place == "schedule"]
    assert "the reference gives its timesteps in [0, 1], the port in [0, 1000]" in note.text
    (denoiser,) = [n for n in clean.ruled_out if n.place == "denoiser"]
    assert "matches" in denoiser.text

    report = triage_spec(write_unit_spec(tmp_path, ["norm-eps"]), out=tmp_path / "eps")
    (finding,) = report.findings
    assert finding.place == "denoiser" and finding.call == 0, report.render()


def test_triage_without_a_spec_file_from_callables(tmp_path, monkeypatch):
    (tmp_path / "my_runs.py").write_text(
        "from tests.triage_pairs import Pair\n\nPAIR = Pair({'cond-bf16'}, vae=False)\n"
        "run_reference, run_port = PAIR.run_reference, PAIR.run_port\n"
        "port_scheduler = PAIR.port_scheduler\n\n\n"
        "def reference_unet():\n    return PAIR.ref_unet\n\n\ndef port_unet():\n    return PAIR.port_unet\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    from click.testing import CliRunner
    from paritykit.cli import cli

    names = ["--run-reference", "my_runs:run_reference", "--run-port", "my_runs:run_port"]
    names += ["--reference-denoiser", "my_runs:reference_unet", "--port-denoiser", "my_runs:port_unet"]
    result = CliRunner().invoke(
        cli, ["triage", *names, "--port-scheduler", "my_runs:port_scheduler", "--json"]
    )
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    assert [f["place"] for f in payload["findings"]] == ["conditioning"]
    written = tmp_path / "triage-out" / "triage_spec.py"
    assert payload["spec_written"] == str(Path("triage-out") / "triage_spec.py") and written.is_file()
    again = triage_spec(written, out=tmp_path / "again")  # the written SPEC runs as it is
    assert [f.place for f in again.findings] == ["conditioning"]
    missing = CliRunner().invoke(cli, ["triage", "--run-reference", "my_runs:run_reference", "--out", "x"])
    assert missing.exit_code == 2 and "--run-port" in missing.output
    # the written SPEC, once edited, is the user's: a rerun with the callables refuses to replace it
    written.write_text(written.read_text() + "\nSEED = 3\n")
    kept = written.read_text()
    rerun = CliRunner().invoke(cli, ["triage", *names])
    assert rerun.exit_code == 2 and "exists and differs" in rerun.output and written.read_text() == kept


@pytest.mark.parametrize("bugs", [(), ("norm-eps",)], ids=["clean", "norm-eps"])
def test_latents_packed_into_tokens_are_compared_through_the_packing(tmp_path, bugs):
    # the port keeps its latents as 2x2-patch tokens: the same values rearranged, read as an exact index map,
    # never a difference in itself; every call is compared in the reference's layout
    from tests.triage_pairs import write_packed_spec

    report = triage_spec(write_packed_spec(tmp_path, bugs), out=tmp_path / "out")
    noise = next(n for n in report.ruled_out if n.place == "initial noise")
    assert "hold the reference's (1, 4, 8, 8) values rearranged" in noise.text
    assert all(row.latents is not None for row in report.curve)
    if not bugs:
        assert report.verdict == "match" and not report.findings, report.render()
    else:
        (finding,) = report.findings
        assert finding.place == "denoiser" and finding.call == 0, report.render()
        named = "differs on identical inputs (not necessarily the first to differ in the run): unet"
        assert named + ".down_blocks.1.resnets.0.norm1" in finding.summary
        assert "first differing module" not in finding.summary


def test_timesteps_counted_the_other_way_are_one_schedule_in_other_units():
    from paritykit.triage.pairs import SAME_UNITS, timestep_units

    reference = [1000.0, 875.0, 750.0, 500.0]
    flow_time = [1 - t / 1000 for t in reference]  # diffusers' Z-Image: the model is given (1000 - t) / 1000
    units = timestep_units(reference, flow_time)
    assert units.words.endswith("the port 1 - t/1000") and units(750.0) == pytest.approx(0.25)
    assert timestep_units(reference, [t / 1000 for t in reference]).scale == 0.001
    # must not fire: a schedule that differs in values, or one timestep repeated (no units read from it)
    assert timestep_units(reference, [1 - t / 900 for t in reference]) is SAME_UNITS
    assert timestep_units([999.0, 999.0], [0.001, 0.001]) is SAME_UNITS


def test_conditioning_padded_on_the_left_is_measured_on_the_rows_both_have():
    from paritykit.triage.pairs import Tolerance, unpaired_conditioning

    text = torch.randn(1, 34, 8, generator=torch.Generator().manual_seed(0))
    padded = torch.cat([torch.zeros(1, 6, 8), text], dim=1)
    (line,), _ = unpaired_conditioning([("llm", text)], [("encoder_hidden_states", padded)], Tolerance())
    assert "the last 34 there agree; the port's first 6 are all zero" in line
    (line,), _ = unpaired_conditioning(
        [("llm", text)], [("ehs", torch.cat([text, padded[:, :6]], 1))], Tolerance()
    )
    assert "the first 34 there agree; the port's other 6 are all zero" in line


def test_a_port_scheduler_that_is_no_scheduler_is_refused_before_either_side_runs(tmp_path):
    spec = write_spec(tmp_path, ())
    spec.write_text(spec.read_text() + "\n\ndef port_scheduler():\n    return 'DDIM'\n")
    with pytest.raises(ParityKitError, match=r"port_scheduler\(\) returned a str, not a diffusers scheduler"):
        triage_spec(spec, out=tmp_path / "out")
    assert not (tmp_path / "out" / "reference_calls").exists()  # nothing was recorded


def test_timesteps_in_other_units_are_read_so_up_to_where_the_schedules_differ():
    r"""Round-4 exercise (FLUX.1 of DiffSynth: t in [0, 1000], the port's transformer in [0, 1], and a
    schedule that differs from call 1): triage said "the timesteps differ from call 0" and replayed the port's
    denoiser on t = 1000. The map the first calls obey is read for the pairing and the replay, and said."""
    from paritykit.triage.pairs import SAME_UNITS, leading_units

    units, run = leading_units([1000.0, 937.5, 833.3], [1.0, 0.9091, 0.7173])
    assert run == 1 and units(1000.0) == 1.0 and "the port in [0, 1]" in units.words
    # must not fire: timesteps that agree as given at the first call, or that agree under no map, or under two
    assert leading_units([1000.0, 900.0], [1000.0, 800.0]) == (SAME_UNITS, 0)
    assert leading_units([1000.0, 900.0], [3.0, 2.0]) == (SAME_UNITS, 0)
    assert leading_units([0.0], [0.0]) == (SAME_UNITS, 0)


@pytest.mark.parametrize("bugs", [("ema",), ("norm-eps",)], ids=["ema", "norm-eps"])
def test_a_denoiser_not_in_the_state_that_ran_is_not_replayed_or_ruled_out(tmp_path, bugs):
    # round 7 (AudioLDM): the reference sampled inside an EMA scope, the SPEC handed over the live module, and
    # triage said "ruled out: denoiser: the port's module matches the reference's on call 0's inputs" of a
    # port converted from the live weights; a rerun of the reference on its recorded inputs now shows it
    report = run(tmp_path, list(bugs), vae=False)
    denoiser_notes = [n.text for n in report.not_checked if n.place == "denoiser"]
    if bugs == ("ema",):
        assert not any(n.place == "denoiser" for n in report.ruled_out), report.render()
        assert any("not in the state that ran" in text for text in denoiser_notes), report.render()
    else:  # must not fire: a reference that reproduces its own run is bisected as before
        assert not any("not in the state that ran" in text for text in denoiser_notes)
        assert "denoiser" in places(report)


class _PriorNet(torch.nn.Module):
    r"""A DALL-E 2 style prior network's call: the latents are an image embedding ``(batch, dim)``, next to a
    text encoding ``(batch, tokens, dim)`` of three dimensions."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, image_embed, diffusion_timesteps, *, text_embed, text_encodings):
        return self.proj(image_embed + text_embed + text_encodings.mean(1)) * diffusion_timesteps[:, None]


def _recorded(module, *args, **kwargs):
    from paritykit.tracing.recording import record_calls

    with torch.no_grad(), record_calls(module) as calls:
        module(*args, **kwargs)
    return calls[0]


def test_the_latents_are_the_argument_the_output_has_the_shape_of():
    # round 8: triage took the (2, 5, 32) text encoding of a prior for its (2, 32) latents
    from diffusers import PriorTransformer, UNet2DModel
    from paritykit.triage.roles import roles_of

    g = torch.Generator().manual_seed(0)
    embed, text = torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)
    tokens = torch.randn(2, 5, 16, generator=g)
    ref = _recorded(_PriorNet(), embed, torch.tensor([3.0, 3.0]), text_embed=text, text_encodings=tokens)
    assert roles_of(ref).latents == "image_embed"
    assert roles_of(ref).conditioning == ["text_embed", "text_encodings"]
    prior = PriorTransformer(
        num_attention_heads=2, attention_head_dim=8, num_layers=1, embedding_dim=16, num_embeddings=5
    ).eval()
    port = _recorded(prior, embed, 3, proj_embedding=text, encoder_hidden_states=tokens)
    assert roles_of(port).latents == "hidden_states"
    # a learned variance stacked on the prediction (twice the channels) still points at the sample
    unet = UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=6,
        block_out_channels=(8, 8),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        class_embed_type="identity",
    ).eval()
    sample = torch.randn(1, 3, 8, 8, generator=g)
    call = _recorded(unet, sample, 5, class_labels=torch.randn(1, 32, generator=g))
    assert roles_of(call).latents == "sample"


def test_a_guidance_batch_stacked_the_other_way_and_undone_alike_is_no_difference(tmp_path):
    # issue 45: a port that stacks (cond, uncond) and reads its halves the same way round computed the same
    # result, yet triage listed its conditioning as a place that differs
    from tests.triage_pairs import write_guidance_spec

    swapped = triage_spec(write_guidance_spec(tmp_path, "swapped"), out=tmp_path / "s")
    text = swapped.render()
    assert swapped.verdict == "match" and not swapped.findings
    assert "the port stacks its denoiser's batch in another order (its rows (1, 0) hold" in text
    # stacked the other way but read as the reference reads it: guidance reversed, found after the denoiser
    kept = triage_spec(write_guidance_spec(tmp_path, "swapped-kept"), out=tmp_path / "k")
    assert kept.verdict == "differ" and kept.findings[0].place == "update"
    assert not any(f.place == "conditioning" for f in kept.findings)
    # must not fire: the same order on both sides says nothing of an order
    same = triage_spec(write_guidance_spec(tmp_path, "same"), out=tmp_path / "n")
    assert same.verdict == "match" and "another order" not in same.render()


def test_guidance_passes_packed_in_one_call_against_one_call_each_are_compared_step_by_step(tmp_path):
    # round 9 (F5-TTS): the research packs (cond, uncond) into one call per step, the port calls once per
    # pass; triage read a schedule difference, a denoiser that differs and a culprit on the correct port
    from tests.triage_pairs import write_passes_spec

    clean = triage_spec(write_passes_spec(tmp_path), all_causes=True, out=tmp_path / "c")
    text = clean.render()
    assert clean.verdict == "match" and not clean.findings, text
    assert "reference 5, port 10 (the port calls its denoiser 2 times per timestep" in text
    assert "ruled out: denoiser: the port's module matches the reference's on call 0's inputs" in text
    # a slip inside the port's network is still found on the reference's inputs, against the rows it computes
    buggy = triage_spec(write_passes_spec(tmp_path, ["norm-eps"]), out=tmp_path / "b")
    finding = buggy.findings[0]
    assert buggy.verdict == "differ" and finding.place == "denoiser"
    assert "down_blocks.1.resnets.0.norm1" in " ".join([finding.summary, *finding.evidence])
    from paritykit.bisection.spec import bisect_spec

    bisected = bisect_spec(tmp_path / "b" / "bisect_denoiser.py")
    assert bisected.culprit.port.endswith("down_blocks.1.resnets.0.norm1")


def test_guidance_passes_called_apart_against_one_stacked_call_compare_through_the_stacking(tmp_path):
    # round 10 (MMDiT): the reference called its denoiser once per pass, the port once on repeated latents;
    # triage kept the shared latents once, read "latents shapes differ" and said no place it compared differs
    from tests.triage_pairs import write_split_spec

    report = triage_spec(write_split_spec(tmp_path), out=tmp_path / "s")
    text = report.render()
    assert report.verdict == "match" and not report.findings, text
    assert "reference 10, port 5 (the reference calls its denoiser 2 times per timestep" in text
    assert "stacked in the order (1, 0)" in text and "latents shapes differ" not in text
    assert "ruled out: denoiser calls: inputs, timestep and output agree at every call (5)" in text


def test_a_port_calling_once_on_the_stacked_passes_is_bisected_on_the_references_first_pass(tmp_path):
    # round 36 (AudioSR): the research calls its denoiser for the conditional then the unconditional pass,
    # the port once on both stacked; "not checked: denoiser: not bisected" hid a slip in the port's network
    from tests.triage_pairs import write_split_spec

    report = triage_spec(write_split_spec(tmp_path, ("norm-eps",)), out=tmp_path / "b")
    text = report.render()
    (finding,) = [f for f in report.findings if f.place == "denoiser"]
    assert "down_blocks.1.resnets.0.norm1" in finding.summary, text
    assert finding.verified and finding.fix == "down_blocks.1.resnets.0.norm1.eps = 1e-05", text


def test_results_of_other_shapes_are_never_a_match():
    # round 11 (v-diffusion): "verdict: match" over "results not compared: shapes differ" (batch 2 against 1)
    from paritykit.triage.report import TriageReport

    report = TriageReport(
        spec="s.py",
        findings=[],
        ruled_out=[],
        not_checked=[],
        curve=[],
        calls=(3, 3),
        result={"error": "shapes differ: reference (2, 3, 16, 16), port (1, 3, 16, 16)"},
        all_causes=False,
        out_dir=None,
    )
    assert report.verdict == "differ" and report.exit_code == 1
    assert "results not compared: shapes differ" in report.render()


def test_timestep_values_that_reach_no_output_are_measured_as_such_not_listed_as_a_place(tmp_path):
    # round 11 (v-diffusion): the fixed port passes alpha²/sigma² where the reference passes t; every call
    # agreed, yet "inside the run, schedule at call 0: the timesteps differ" was listed
    from tests.triage_pairs import write_squared_spec

    report = triage_spec(write_squared_spec(tmp_path), out=tmp_path / "q")
    text = report.render()
    assert report.verdict == "match" and not report.findings, text
    assert "the values passed as the timestep differ from call 0" in text and "reaches no output" in text
    assert "the timestep values do not (the schedule line above)" in text


@pytest.mark.parametrize("clamp_copy", [True, False])
def test_all_reports_the_update_that_changes_latents_after_a_step_whose_inputs_and_output_agree(
    tmp_path, clamp_copy
):
    # round 12 (rectified-flow-pytorch): the port clipped only its denoiser's input copy; with --all triage
    # said "the results differ, and no place the walk compared differs" where the walk without --all named
    # the update after step 0
    from tests.triage_pairs import write_clamped_spec

    spec = write_clamped_spec(tmp_path, clamp_copy)
    first = triage_spec(spec, out=tmp_path / "first")
    every = triage_spec(spec, out=tmp_path / "all", all_causes=True)
    if clamp_copy:
        step = first.findings[0].call  # where the clamped values come back within range
        for report in (first, every):
            assert report.verdict == "differ" and [f.place for f in report.findings] == ["update"]
            finding = report.findings[0]
            assert finding.call == step and f"the latents after step {step} differ while" in finding.summary
            assert "not equal but" not in finding.summary  # the step's inputs are the same: nothing carried
        assert "no place the walk compared differs" not in every.render()
    else:  # must not fire: both clamp the state; every place agrees
        assert first.verdict == every.verdict == "match" and not every.findings


@pytest.mark.parametrize("case", ["converted", "scheduler"])
def test_a_schedule_finding_says_when_the_port_feeds_its_denoiser_other_values_than_its_scheduler(
    tmp_path, case
):
    # round 12 (imagen-pytorch): the port's scheduler was right and its pipeline divided the timestep by the
    # wrong count before the call; "schedule at call 0: the timesteps differ" sent the agent to the scheduler
    from tests.triage_pairs import write_shifted_spec

    if case == "converted":
        spec = write_shifted_spec(tmp_path, shifted=True)
    else:  # must not fire: the scheduler's own list differs and is fed as it is
        spec = write_shifted_spec(tmp_path, shifted=False, bugs=("spacing-leading",))
    report = triage_spec(spec, out=tmp_path / "t")
    assert report.findings[0].place == "schedule", report.render()
    said = "its denoiser is fed" in report.render() and "the port's pipeline converts them" in report.render()
    assert said == (case == "converted"), report.render()


def test_a_unit_map_is_read_only_where_each_sides_values_lie_in_its_range():
    # round 13 (audio-diffusion-pytorch): a reference at sigma 1.0 and a port fed 0.999 (t/1000 for t = 999)
    # were "read in other units: the reference gives t in [0, 1000] (noise at 1000), the port 1 - t/1000", and
    # the denoiser was then replayed on the port's own 0.999
    from paritykit.triage.pairs import SAME_UNITS, leading_units, timestep_units

    ref = [1.0 - i / 10 for i in range(10)]
    port = [(999 - 100 * i) / 1000 for i in range(10)]
    assert leading_units(ref, port) == (SAME_UNITS, 0)
    # must not fire: a reference counting to 1000 against a port in [0, 1] agreeing at the first call only
    units, lead = leading_units([1000.0, 800.0, 600.0], [1.0, 0.75, 0.5])
    assert lead == 1 and units.scale == 0.001
    assert timestep_units([1.0, 0.5], [1000.0, 500.0]).scale == 1000.0
    assert timestep_units([0.5, 0.25], [0.9995, 0.99975]) == SAME_UNITS  # 1 - t/1000 of values in [0, 1]


@pytest.mark.parametrize("scaled", [False, True])
def test_a_context_a_flagged_call_replaces_inside_is_not_compared_on_that_calls_rows(tmp_path, scaled):
    # round 13 (video-diffusion-pytorch): the research passes its real `cond` to both calls of a step and
    # swaps in the null embedding inside the call with null_cond_prob=1.0; the port stacks (null, cond) into
    # one call: "conditioning at call 0: … cond (port: encoder_hidden_states) differs at call 0, before any
    # denoiser computation" on a port whose conditioning was right
    from tests.triage_pairs import write_drop_flag_spec

    spec = write_drop_flag_spec(tmp_path, scaled)
    for all_causes in (False, True):
        report = triage_spec(spec, out=tmp_path / f"t{all_causes}", all_causes=all_causes)
        text = report.render()
        if not scaled:
            assert report.verdict == "match" and not report.findings, text
            assert "which differ in drop (True, None)" in text or "which differ in drop (True, False)" in text
            assert "not in that of drop=True" in text and "inside its denoiser (not compared)" in text
        else:  # must not fire: the conditional rows differ too
            assert [f.place for f in report.findings][:1] == ["conditioning"], text
            assert "not compared" not in text


def test_a_denoiser_is_not_replayed_on_a_timestep_of_other_units_no_map_pairs(tmp_path):
    # round 13 (audio-diffusion-pytorch): a replay that feeds the port's denoiser the reference's timestep as
    # it is, where the two count in other ranges, is no replay on identical inputs
    from tests.triage_pairs import write_unit_spec

    report = triage_spec(write_unit_spec(tmp_path, ["spacing-leading"]), out=tmp_path / "t", all_causes=True)
    text = report.render()
    assert [f.place for f in report.findings] == ["schedule"], text
    assert "not checked: denoiser: not bisected on call 0: the reference gives timesteps up to 0.999" in text
    # must not fire where a unit map pairs them: test_timesteps_in_other_units_are_one_schedule_and_replayed…


def test_conditioning_one_side_passes_at_some_calls_only_is_said_compared_there_only(tmp_path):
    # round 14 (e2-tts-pytorch): the port's unconditional calls pass text_ids=None; triage said "text /
    # text_ids (2, 9) … agree element by element at all 10 calls" and "inputs, timestep and output agree at
    # every call (10)"
    from tests.triage_pairs import write_none_context_spec

    spec = write_none_context_spec(tmp_path)
    first = triage_spec(spec, out=tmp_path / "t").render()
    every = triage_spec(spec, out=tmp_path / "a", all_causes=True).render()
    for text in (first, every):
        assert "verdict: match" in text and "agree element by element at all" not in text, text
    assert "inputs, timestep and output agree" not in first
    assert (
        "latents, conditioning (where both sides pass it: context / context (1, 3, 8) at some calls only)"
        in first
    )
    assert (
        "context / context (1, 3, 8) agree element by element at the calls where both sides pass them"
        in every
    )
    assert "at calls 0, 2, 4, 6, 8 one side passes none, so they are not compared there" in every
