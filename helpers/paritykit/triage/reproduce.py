r"""What lets each triage finding be run again alone: the recordings in ``--out``, the commands that read
them, and the files those commands need.

The order is fixed: :func:`write_recordings` before the walk (the schedule fit reads them), the commands built
during the walk by :class:`Commands` (pure: a command and the :class:`~paritykit.triage.report.ReproduceFile`
list it needs), and :func:`write_files` after it. A file that cannot be written leaves its finding without a
command, and the finding's evidence says why.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError, first_line
from paritykit.schedule.schedulers import fit_name
from paritykit.tracing.recording import Call
from paritykit.triage.report import Finding, ReproduceFile
from paritykit.triage.sides import SideRun

DEFAULT_OUT = "triage-out"
# the file that marks a folder as triage's own, so a later run may write into it again
MARKER = "paritykit-triage.json"
Built = tuple[str | None, list[ReproduceFile]]


def checked_out(out: Any) -> Path | None:
    r"""``--out`` as a folder triage may write: absent, empty, or an earlier triage's (its marker file); never
    a folder of the user's own files, whose names triage would overwrite."""
    if out is None:
        return None
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise ParityKitError(f"--out {str(out)!r}: exists and is not an empty folder or an earlier triage's")
    return out


def write_recordings(out_dir: Path, spec_path: Any, ref: SideRun, port: SideRun) -> tuple[Path, Path]:
    r"""The marker and both sides' recorded calls (the ``record_loop`` format) in ``out_dir``; returns the two
    folders, reference first."""
    from paritykit.tracing import save_checkpoints
    from paritykit.tracing.checkpoints import Checkpoint
    from paritykit.tracing.recording import loop_checkpoints

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER).write_text(json.dumps({"spec": str(spec_path)}) + "\n")
    folders = (out_dir / "reference_calls", out_dir / "port_calls")
    for run, folder in zip((ref, port), folders):
        final = Checkpoint(data={"latents": run.result}) if run.vae is None else None
        save_checkpoints(folder, loop_checkpoints(run.calls, final), side=run.side)
    return folders


def write_files(findings: Iterable[Finding]) -> None:
    r"""Write every finding's files; a finding whose files cannot all be written loses its command, and its
    evidence names the file and the error."""
    for finding in findings:
        for file in finding.files:
            try:
                _write(file)
            # an argument torch cannot save: the finding stands, its command does not
            except Exception as exc:
                finding.command = None
                finding.evidence.append(
                    f"no reproduce command: {file.path.name} not written ({first_line(exc)})"
                )
                break
        finding.files = []


def _write(file: ReproduceFile) -> None:
    if file.kind == "text":
        file.path.write_text(file.content)
    elif file.kind == "safetensors":
        from safetensors.torch import save_file

        save_file(file.content, str(file.path))
    else:
        import torch

        torch.save(file.content, file.path)


class Commands:
    r"""The ``paritykit …`` command that reproduces each kind of finding alone, and the files it reads; with
    no ``--out`` every command is ``None``. Nothing here writes."""

    def __init__(self, spec_path: Any, tolerance: dict[str, float], folders: tuple[Path, Path] | None):
        self.spec_path, self.tolerance, self.folders = spec_path, tolerance, folders
        self.out_dir = folders[0].parent if folders is not None else None

    def compare(self, call: int, ref_key: str | None, port_key: str | None) -> Built:
        r"""``paritykit compare`` of one recorded call's argument on both sides."""
        if self.folders is None or not ref_key or not port_key:
            return None, []
        a, b = (str(f / f"step_{call}.safetensors") for f in self.folders)
        words = ["paritykit", "compare", a, b, "--only", port_key]
        if ref_key != port_key:
            words += ["--map", f"^{ref_key}$={port_key}"]
        return shlex.join(words), []

    def compare_tensors(self, what: str, reference: Any, port: Any) -> Built:
        r"""Both sides' tensor at one place as ``{what}_reference.safetensors`` and
        ``{what}_port.safetensors``
        (key ``latents``), and the ``paritykit compare`` that diagnoses them."""
        if self.out_dir is None:
            return None, []
        paths = [self.out_dir / f"{what}_{side}.safetensors" for side in ("reference", "port")]
        files = [
            ReproduceFile(path, "safetensors", {"latents": tensor.detach().contiguous().cpu()})
            for path, tensor in zip(paths, (reference, port))
        ]
        return shlex.join(["paritykit", "compare", *map(str, paths)]), files

    def schedule(self, scheduler: Any = None, seq_len: int | None = None) -> Built:
        r"""``paritykit schedule`` of both recordings, or with the port's scheduler its ``--fit`` from the
        reference's recording (its config written beside them), with the port's run and its size."""
        if self.folders is None:
            return None, []
        name = fit_name(type(scheduler)) if scheduler is not None else None
        if name is None:  # no scheduler, or a class no command can name: the two lists side by side
            return shlex.join(["paritykit", "schedule", *map(str, self.folders)]), []
        words = ["paritykit", "schedule", str(self.folders[0]), "--fit", name]
        words += [*self.config_words(scheduler), "--port-run", str(self.folders[1])]
        words += ["--seq-len", str(seq_len)] if seq_len is not None else []
        return shlex.join(words), [self.config_file(scheduler)]

    def config_file(self, scheduler: Any) -> ReproduceFile:
        r"""The port's scheduler config, written beside the recordings for the commands that read it."""
        text = json.dumps(dict(scheduler.config), indent=2, default=str)
        return ReproduceFile(self.out_dir / "port_scheduler.json", "text", text)

    def config_words(self, scheduler: Any) -> list[str]:
        return ["--config", str(self.out_dir / "port_scheduler.json")]

    def steps(self) -> Built:
        r"""``paritykit steps`` over both recordings' outputs."""
        if self.folders is None:
            return None, []
        return shlex.join(["paritykit", "steps", *map(str, self.folders), "--key", "output"]), []

    def bisect(
        self,
        what: str,
        call: int,
        ref_call: Call,
        port_inputs: tuple[tuple, dict],
        rows: tuple[int, int] | None = None,
    ) -> Built:
        r"""A bisect SPEC that rebuilds both modules from the triage SPEC and feeds them this call's inputs,
        and the command that runs it; ``rows``: the block of the reference's output batch the port's call
        computes (a guidance half the port runs alone)."""
        if self.out_dir is None:
            return None, []
        inputs = self.out_dir / f"{what}_call{call}.pt"
        path = self.out_dir / f"bisect_{what}.py"
        text = BISECT_SPEC.format(
            what=what,
            call=call,
            spec=str(Path(self.spec_path).resolve()),
            inputs=inputs.name,
            module="vae" if what == "decoder" else "denoiser",
            tolerance=repr(self.tolerance),
        )
        if rows is not None:
            text += ROWS_SPEC.format(start=rows[0], stop=rows[1])
        payload = {"reference": (ref_call.args, ref_call.kwargs), "port": port_inputs}
        files = [ReproduceFile(inputs, "torch", payload), ReproduceFile(path, "text", text)]
        return shlex.join(["paritykit", "bisect", str(path)]), files


BISECT_SPEC = '''"""Written by paritykit triage: the {what}'s call {call} on both sides, for paritykit bisect.

Both modules come from the triage SPEC {spec}; the inputs are the ones recorded (or substituted) at that call.
"""

import importlib.util
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path({spec!r}).parent))  # the triage SPEC's own imports resolve from its folder
_found = importlib.util.spec_from_file_location("triage_spec", {spec!r})
TRIAGE = importlib.util.module_from_spec(_found)
_found.loader.exec_module(TRIAGE)
CALL = torch.load(HERE / {inputs!r}, weights_only=True)
TOLERANCE = {tolerance}


def build_reference():
    return TRIAGE.reference_{module}()


def build_port():
    return TRIAGE.port_{module}()


def make_inputs():
    return CALL["reference"]


def port_inputs(args, kwargs):
    return CALL["port"]
'''


ROWS_SPEC = """

def select_output(side, out):
    # the port's call computes one block of the reference's batch: its rows {start}:{stop}
    from paritykit.tracing.recording import output_tensor

    found = output_tensor(out)
    return found[{start}:{stop}] if side == "reference" else found
"""
