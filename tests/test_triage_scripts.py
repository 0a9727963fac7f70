"""`paritykit triage --reference-script … --port-script …`: two sampling scripts in, no SPEC written by hand.

Each case writes a research folder and a port folder, each with its own `model.py` (the same module name,
other code), a research script that saves the weights the port script loads, and both scripts sampling with
diffusers' DDIMScheduler. What is asserted: the denoiser each run is read as (by its class and its number of
calls), the result, the port's scheduler, the verdict, and the cases where no denoiser or result can be told.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from paritykit.base.errors import ParityKitError
from paritykit.triage import triage_spec
from paritykit.triage.scripts import run_script
from paritykit.triage.spec import spec_from_scripts

from tests.conftest import run_cli

STEPS = 4

MODEL = """
import torch


class {name}(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.time = torch.nn.Linear(1, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))

    def forward(self, x, t):
        emb = self.time(torch.as_tensor(t, dtype=x.dtype).reshape(1, 1).expand(x.shape[0], 1) / 50)
        return self.body(torch.cat([x, emb], -1)){slip}
"""

LOOP = """
scheduler = DDIMScheduler(num_train_timesteps=50)
scheduler.set_timesteps({steps})
x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
for t in scheduler.timesteps:
    eps = {call}
    x = scheduler.step(eps{scale}, t, x).prev_sample
"""

RESEARCH = """
import torch
from diffusers import DDIMScheduler
from model import Net

{extra}
torch.manual_seed(0)
net = Net()
torch.save(net.state_dict(), "weights.pt")
{loop}
torch.save(x, "out/research.pt")
"""

PORT = """
import torch
from diffusers import DDIMScheduler
from model import PortNet


def run():
    net = PortNet()
    net.load_state_dict(torch.load("weights.pt"))
{loop}
    torch.save({{"sample": x, "steps": torch.tensor({steps})}}, "out/port.pt")


if __name__ == "__main__":
    run()
"""


def _write(root: Path, *, slip: str = "", scale: str = "", call: str = "net(x, t)", extra: str = "") -> None:
    (root / "research").mkdir(parents=True)
    (root / "port").mkdir()
    (root / "out").mkdir()
    (root / "research" / "model.py").write_text(MODEL.format(name="Net", slip=""))
    (root / "port" / "model.py").write_text(MODEL.format(name="PortNet", slip=slip))
    loop = LOOP.format(steps=STEPS, call=call, scale="")
    (root / "research" / "sample.py").write_text(RESEARCH.format(loop=loop, extra=textwrap.dedent(extra)))
    port_loop = textwrap.indent(LOOP.format(steps=STEPS, call="net(x, t)", scale=scale), "    ")
    (root / "port" / "run.py").write_text(PORT.format(loop=port_loop, steps=STEPS))


def _triage(root: Path, monkeypatch):
    monkeypatch.chdir(root)
    spec = spec_from_scripts("triage-out", "research/sample.py", "port/run.py")
    return triage_spec(spec, out="triage-out")


def test_two_scripts_that_compute_alike_match_and_each_side_names_its_denoiser_result_and_scheduler(
    tmp_path, monkeypatch
):
    _write(tmp_path)
    argv = list(sys.argv)
    report = _triage(tmp_path, monkeypatch)
    assert report.verdict == "match", report.render()
    assert report.calls == (STEPS, STEPS)
    reference, port = report.sides
    assert f"denoiser Net ({STEPS} calls" in reference and "research.pt" in reference
    # the port saved a dict: its first tensor is the result, named by its key
    assert f"denoiser PortNet ({STEPS} calls" in port and "port.pt['sample']" in port
    assert "scheduler DDIMScheduler" in port
    text = report.render()
    assert "reference: research/sample.py: denoiser Net" in text
    # the scripts' sys.path and sys.argv are put back, and each found its own model.py
    assert not [p for p in sys.path if p.endswith(("research", "port"))] and sys.argv == argv
    assert "model" not in sys.modules or "research" not in str(getattr(sys.modules["model"], "__file__", ""))


def test_a_slip_in_the_ports_loop_is_a_difference_found_from_the_scripts(tmp_path, monkeypatch):
    _write(tmp_path, scale=" * 1.05")
    report = _triage(tmp_path, monkeypatch)
    assert report.verdict == "differ"
    assert report.exit_code == 1
    # the denoiser itself computes alike: no module of it is blamed
    assert all(f.place != "denoiser" for f in report.findings), report.render()


def test_a_slip_in_the_ports_model_is_found_in_the_denoiser(tmp_path, monkeypatch):
    _write(tmp_path, slip=" * 1.05")
    report = _triage(tmp_path, monkeypatch)
    assert report.verdict == "differ"
    assert report.findings[0].place == "denoiser", report.render()


def test_a_denoiser_called_by_forward_directly_is_found_and_recorded(tmp_path, monkeypatch):
    # as lucidrains' forward_with_cond_scale does: self.forward(...), which no module hook sees
    _write(tmp_path, call="guided(net, x, t)", extra="def guided(net, x, t):\n    return net.forward(x, t)\n")
    report = _triage(tmp_path, monkeypatch)
    assert report.sides[0].startswith(f"research/sample.py: denoiser Net ({STEPS} calls"), report.sides
    assert report.verdict == "match", report.render()


def test_a_denoiser_inside_a_sampler_module_called_once_is_found(tmp_path, monkeypatch):
    # the whole loop is a module's forward (called once): the denoiser's calls are inside it
    extra = """
    class Loop(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x):
            for t in scheduler.timesteps:
                x = scheduler.step(self.net(x, t), t, x).prev_sample
            return x
    """
    _write(tmp_path, call="net(x, t)", extra=extra)
    research = tmp_path / "research" / "sample.py"
    text = research.read_text().replace(
        "for t in scheduler.timesteps:\n    eps = net(x, t)\n    x = scheduler.step(eps, t, x).prev_sample",
        "x = Loop(net)(x)",
    )
    assert "Loop(net)(x)" in text
    research.write_text(text)
    report = _triage(tmp_path, monkeypatch)
    assert report.sides[0].startswith(f"research/sample.py: denoiser Net ({STEPS} calls"), report.sides
    assert report.verdict == "match", report.render()


def test_a_small_module_called_more_often_than_the_denoiser_is_not_taken_for_it(tmp_path, monkeypatch):
    extra = """
    gain = torch.nn.Linear(4, 4)
    """
    _write(tmp_path, call="net(gain(gain(x)) * 0 + x, t)", extra=extra)
    monkeypatch.chdir(tmp_path)
    run = run_script("research/sample.py")
    assert type(run.denoiser).__name__ == "Net"
    assert len(run.calls) == STEPS


def test_a_script_without_a_repeated_module_or_a_saved_tensor_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    once = tmp_path / "once.py"
    once.write_text("import torch\nm = torch.nn.Linear(2, 2)\ntorch.save(m(torch.ones(1, 2)), 'o.pt')\n")
    with pytest.raises(ParityKitError, match="once.py: no module was called more than once"):
        run_script(once)
    unsaved = tmp_path / "unsaved.py"
    unsaved.write_text(
        "import torch\nm = torch.nn.Linear(2, 2)\nfor _ in range(3):\n    m(torch.ones(1, 2))\n"
    )
    with pytest.raises(ParityKitError, match="unsaved.py saved no tensor or array"):
        run_script(unsaved)
    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ParityKitError, match="failing.py exited with 3"):
        run_script(failing)
    with pytest.raises(ParityKitError, match="expected a Python script"):
        run_script(tmp_path)  # a folder
    assert Path.cwd() == tmp_path


def test_the_cli_runs_two_scripts_and_refuses_a_missing_one_in_one_line(tmp_path):
    _write(tmp_path, slip=" * 1.05")
    done = run_cli(
        "triage", "--reference-script", "research/sample.py", "--port-script", "port/run.py", cwd=tmp_path
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "reference: research/sample.py: denoiser Net" in done.stdout
    assert "written from the scripts" in done.stdout
    assert (tmp_path / "triage-out" / "triage_spec.py").is_file()
    # the SPEC it wrote runs again on its own, from another folder
    again = run_cli(
        "triage", str(tmp_path / "triage-out" / "triage_spec.py"), "--out", "t2", cwd=tmp_path / "out"
    )
    assert again.returncode == 1, again.stdout + again.stderr
    missing = run_cli("triage", "--reference-script", "nope.py", "--port-script", "port/run.py", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "paritykit: error: --reference-script 'nope.py': no such file or folder"
    ]
    one = run_cli("triage", "--reference-script", "research/sample.py", cwd=tmp_path)
    assert one.returncode == 2 and "give both --reference-script and --port-script" in one.stderr
    assert os.listdir(tmp_path / "out")  # the scripts' own files are where they wrote them


def test_a_call_one_side_makes_before_its_loop_is_left_out_of_the_pairing_and_said(tmp_path, monkeypatch):
    # round 27 (pi-zero): the research calls its model once on zero actions (its prefix) before the loop;
    # pairing by order compared that call with the port's first step and called the noise "other noise"
    _write(tmp_path)
    research = tmp_path / "research" / "sample.py"
    text = research.read_text().replace(
        "x = torch.randn(2, 4,", "net(torch.zeros(2, 4), 0)\nx = torch.randn(2, 4,"
    )
    research.write_text(text)
    report = _triage(tmp_path, monkeypatch)
    assert report.calls == (STEPS + 1, STEPS)
    assert "the reference's first call (of 5) pairs with no port call" in report.grouping, report.render()
    assert report.verdict == "match" and not report.findings, report.render()
    assert "initial noise" not in " ".join(f.place for f in report.findings)


def test_calls_of_other_counts_that_nothing_pairs_are_said_to_be_compared_by_order(tmp_path, monkeypatch):
    # round 27 (styletts2): 8 reference calls against 20 port calls, the table's rows paired by index with
    # nothing saying so; must not fire where the counts agree
    _write(tmp_path)
    port = tmp_path / "port" / "run.py"
    port.write_text(port.read_text().replace(f"set_timesteps({STEPS})", f"set_timesteps({STEPS + 2})"))
    report = _triage(tmp_path, monkeypatch)
    assert report.calls == (STEPS, STEPS + 2) and report.by_order
    assert "by order alone: the sides make 4 and 6 calls and no grouping pairs them" in report.render()
    # round 27 (styletts2, --all): calls after the first paired by order gave "update at call 0 … differs"
    # (the port's next call was its guidance pass at the same noise level): only the first calls are compared
    monkeypatch.chdir(tmp_path)
    every = triage_spec(
        spec_from_scripts("triage-all", "research/sample.py", "port/run.py"),
        out="triage-all",
        all_causes=True,
    )
    assert all(f.place != "update" for f in every.findings), every.render()
    assert any(n.place == "update" and "not paired" in n.text for n in every.not_checked), every.render()
    _write(tmp_path / "same")
    same = _triage(tmp_path / "same", monkeypatch)
    assert not same.by_order and "by order alone" not in same.render()


def test_a_wrapper_holding_only_the_network_yields_the_network(tmp_path, monkeypatch):
    # round 28 (k-diffusion): its Denoiser wraps the network with c_in, c_skip and c_out and holds nothing
    # else; taking the wrapper compared its raw input with the port network's preconditioned one ("initial
    # noise: the port's are 0.0125 x the reference's"). The network is the denoiser, as a diffusers model is.
    extra = """
    class Wrap(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, t):
            return self.net(x * 0.5, t) + x
    """
    _write(tmp_path, call="wrap(x, t)", extra=extra)
    research = tmp_path / "research" / "sample.py"
    research.write_text(research.read_text().replace("net = Net()\n", "net = Net()\nwrap = Wrap(net)\n"))
    monkeypatch.chdir(tmp_path)
    run = run_script("research/sample.py")
    assert type(run.denoiser).__name__ == "Net" and len(run.calls) == STEPS
    # must not fire: a wrapper holding parameters of its own is the larger module, and is taken
    research.write_text(
        research.read_text().replace(
            "self.net = net\n", "self.net = net\n        self.gain = torch.nn.Linear(4, 4)\n"
        )
    )
    assert type(run_script("research/sample.py").denoiser).__name__ == "Wrap"


def test_libraries_beside_the_scripts_stay_one_copy_and_odd_locals_do_not_break_a_run(tmp_path, monkeypatch):
    # round 28 (alphafold3-pytorch): einx vendored beside the scripts was dropped after the research run and
    # imported again by the port's, and objects of the two copies failed each other's checks; a local whose
    # attributes raise on reading (einx's tracers) must not break the scheduler lookup either
    _write(tmp_path)
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "sharedlib.py").write_text(
        "class Odd:\n    def __getattr__(self, name):\n        raise ValueError('a tracer')\n"
    )
    research = tmp_path / "research" / "sample.py"
    head = "import sys\nsys.path.insert(0, 'vendor')\nimport sharedlib\nodd = sharedlib.Odd()\n"
    research.write_text(head + research.read_text())
    monkeypatch.chdir(tmp_path)
    run = run_script("research/sample.py")
    assert type(run.denoiser).__name__ == "Net"
    assert "sharedlib" in sys.modules  # vendored beside the scripts: kept, one copy for both runs
    assert "model" not in sys.modules  # the script's own folder's module: dropped


SIGMA_NET = """
import torch


class {name}(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.time = torch.nn.Linear(1, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))

    def forward(self, x, {arg}):
        level = {level}
        emb = self.time(level.reshape(-1, 1).expand(x.shape[0], 1))
        return self.body(torch.cat([x, emb], -1))
"""

SIGMA_LOOP = """
import torch
from model import {name}

torch.manual_seed(0)
net = {name}()
{load}
x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)) * 10
for sigma in [10.0, 4.0, 1.5, 0.5, 0.1]:
    sigma = torch.tensor([sigma])
    x = x - 0.1 * net(x, {feed})
torch.save(x, "out/{out}.pt")
"""


@pytest.mark.parametrize("factor", [4, 2])
def test_a_noise_level_against_edm_c_noise_is_one_schedule_in_other_units(tmp_path, monkeypatch, factor):
    # round 29 (k-diffusion's transformer): the research denoiser takes sigma, diffusers' EDM preconditioning
    # hands the network c_noise = ln(sigma)/4; triage said "schedule: the timesteps differ" and fed the port
    # sigma as its timestep, a false culprit on the fixed port. ln(sigma)/4 is now a unit map (compared and
    # replayed so); a port reading ln(sigma)/2 is a schedule that differs (must not be read as one).
    for side in ("research", "port", "out"):
        (tmp_path / side).mkdir()
    (tmp_path / "research" / "model.py").write_text(
        SIGMA_NET.format(name="Net", arg="sigma", level="torch.log(sigma) / 4")
    )
    (tmp_path / "port" / "model.py").write_text(
        SIGMA_NET.format(name="PortNet", arg="timestep", level="timestep")
    )
    (tmp_path / "research" / "sample.py").write_text(
        SIGMA_LOOP.format(
            name="Net", load="torch.save(net.state_dict(), 'weights.pt')", feed="sigma", out="research"
        )
    )
    (tmp_path / "port" / "run.py").write_text(
        SIGMA_LOOP.format(
            name="PortNet",
            load="net.load_state_dict(torch.load('weights.pt'))",
            feed=f"torch.log(sigma) / {factor}",
            out="port",
        )
    )
    report = _triage(tmp_path, monkeypatch)
    text = report.render()
    if factor == 4:
        assert report.verdict == "match" and not report.findings, text
        assert "timestep and output agree at every call (5)" in text, text
        return
    assert report.verdict == "differ" and any(f.place == "schedule" for f in report.findings), text
    assert "c_noise" not in text


def test_a_spec_triage_wrote_is_replaced_by_the_next_run_and_an_edited_one_is_kept(tmp_path):
    # round 34 (AudioLDM 2): a second `triage --reference-script … --port-script other/run_port.py` into the
    # same folder was refused ("triage-out/triage_spec.py exists and differs …"); the agent reran with --out
    from paritykit.base.errors import ParityKitError
    from paritykit.triage.spec import _write_spec

    out = tmp_path / "triage-out"
    path = _write_spec(out, "A = 1\n", "these scripts")
    _write_spec(out, "A = 2\n", "these scripts")  # triage's own, unedited: replaced
    assert path.read_text() == "A = 2\n"
    path.write_text("A = 2\nSEED = 3\n")  # edited: the user's now
    with pytest.raises(ParityKitError, match="exists and differs"):
        _write_spec(out, "A = 4\n", "these scripts")
    assert path.read_text() == "A = 2\nSEED = 3\n"


def test_modules_a_script_makes_by_hand_or_replaces_do_not_reach_the_other_script(tmp_path, monkeypatch):
    # round 35 (lerobot): the research script put a hand-made `torchvision` in sys.modules; diffusers' imports
    # in the port's script then failed ("torchvision.__spec__ is None") and triage stopped
    import colorsys
    import importlib.util

    stub = """
import colorsys
import sys
import types

sys.modules["pk_hand_made_stub"] = types.ModuleType("pk_hand_made_stub")
sys.modules["colorsys"] = types.ModuleType("colorsys")
"""
    _write(tmp_path, extra=stub)
    report = _triage(tmp_path, monkeypatch)
    assert report.verdict == "match", report.render()
    assert "pk_hand_made_stub" not in sys.modules and importlib.util.find_spec("pk_hand_made_stub") is None
    assert sys.modules["colorsys"] is colorsys  # the module it replaced is put back
