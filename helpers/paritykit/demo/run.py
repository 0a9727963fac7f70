"""`paritykit demo`: find the one-knob-two-concepts bug end to end, then verify the fix.

Each step prints the equivalent `paritykit …` command and writes its JSON report into the output folder.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click

SPEC_TEMPLATE = '''"""Bisect spec written by `paritykit demo` ({variant} port).

Run: paritykit bisect {name}
"""

from paritykit.demo.reference import build_reference  # noqa: F401
from paritykit.demo.specs import build_port_model, make_inputs, select_output  # noqa: F401


def build_port():
    return build_port_model(fixed={fixed})
'''


MARKER = ".paritykit-demo"


@dataclass
class DemoResult:
    out_dir: Path
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 0 if all(self.checks.values()) else 1


def _section(echo: Callable[[str], None], number: int, title: str, command: str, look: str = "") -> None:
    r"""A step's header, what to look for in it, then its command: below the command only its own output."""
    echo("")
    echo(click.style(f"[{number}/6] {title}", bold=True))
    if look:
        echo(f"  look for: {look}")
    _command(echo, command)


def _command(echo: Callable[[str], None], command: str) -> None:
    echo(f"  $ {command}")


def _indent(text: str) -> str:
    return textwrap.indent(text, "    ")


def _write_report(out: Path, name: str, report) -> None:
    from paritykit.base.report import to_json

    (out / f"{name}.json").write_text(to_json(report.to_dict()) + "\n")


def _prepare_output(out: Path) -> set[Path]:
    """Make ``out`` ready; remove only what an earlier demo run wrote there (listed in its marker).

    Returns the files already there (a user's), which this run must not claim as its own.
    """
    from paritykit.base.errors import ParityKitError

    marker = out / MARKER
    if out.exists() and not out.is_dir():
        raise ParityKitError(f"--out {out}: is a file; pick a folder")
    if out.exists() and any(out.iterdir()):
        try:
            written = json.loads(marker.read_text())["written"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ParityKitError(
                f"--out {out}: exists and was not written by paritykit demo; pick another folder"
            ) from None
        root = out.resolve()
        for relative in written:
            path = (out / relative).resolve()
            if path.is_relative_to(root) and path != root:
                path.unlink(missing_ok=True)
        for folder in sorted((p for p in out.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            if not any(folder.iterdir()):
                folder.rmdir()
    out.mkdir(parents=True, exist_ok=True)
    before = {p for p in out.rglob("*") if p.is_file()}
    marker.write_text(json.dumps({"written": []}))
    return before


def _record_written(out: Path, before: set[Path]) -> None:
    """List in the marker every file this run wrote, so the next run removes those and nothing else."""
    written = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p not in before)
    (out / MARKER).write_text(json.dumps({"written": [w for w in written if w != MARKER]}, indent=1) + "\n")


def run_demo(out_dir: str | Path = "demo-output", echo: Callable[[str], None] = click.echo) -> DemoResult:
    r"""Run the six steps, writing artefacts to ``out_dir``. Returns what was checked.

    A folder from an earlier demo run is refreshed: the files that run wrote are replaced, anything a user
    added stays. Any other non-empty folder is refused.
    """
    out = Path(out_dir)
    before = _prepare_output(out)
    try:
        return _run_steps(out, echo)
    finally:
        _record_written(out, before)


def _run_steps(out: Path, echo: Callable[[str], None]) -> DemoResult:
    import torch
    import yaml
    from safetensors.torch import save_file

    from paritykit.bisection.entry import bisect
    from paritykit.compare.images import compare_images
    from paritykit.compare.sets import compare_paths
    from paritykit.compare.steps import step_curve
    from paritykit.demo.pipeline import make_hint, make_pipeline
    from paritykit.demo.reference import REFERENCE_CONFIG, build_reference
    from paritykit.demo.specs import build_port_model, make_inputs, select_output
    from paritykit.forensics.configs import config_diff
    from paritykit.forensics.conversion.emit import emit_rules
    from paritykit.forensics.conversion.matching import infer_conversion_map
    from paritykit.tracing.checkpoints import Checkpoint, save_checkpoints

    result = DemoResult(out)
    torch.set_grad_enabled(False)

    echo("paritykit demo: a research denoiser with a control branch, its diffusers port, and a parity bug.")
    echo(f"Artefacts: {out}/")

    # The two sides as a porter has them on disk.
    reference = build_reference()
    ref_dir = out / "reference"
    ref_dir.mkdir(exist_ok=True)
    (ref_dir / "config.yaml").write_text(yaml.safe_dump(REFERENCE_CONFIG, sort_keys=False))
    save_file(
        {k: v.contiguous() for k, v in reference.state_dict().items()}, str(ref_dir / "model.safetensors")
    )
    buggy, fixed = build_port_model(fixed=False), build_port_model(fixed=True)
    buggy.save_pretrained(out / "port")
    fixed.save_pretrained(out / "port_fixed")
    for variant, is_fixed in (("buggy", False), ("fixed", True)):
        name = out / f"bisect_{variant}.py"
        name.write_text(SPEC_TEMPLATE.format(variant=variant, name=name, fixed=is_fixed))

    # 1. Config diff: the field names differ, so map them; what remains is the knob the port leaves unset.
    maps = [
        ("^img_channels$", "in_channels"),
        ("^width$", "hidden_dim"),
        ("^t_freq_dim$", "time_proj_dim"),
        ("^t_dim$", "time_embed_dim"),
        ("^depth$", "num_layers"),
        ("^connection_strength$", "control_scale"),
        ("^time_mix$", "time_mixture"),
    ]
    map_flags = " ".join(f"--map '{p}={r}'" for p, r in maps)
    _section(
        echo,
        1,
        "Diff the configs first",
        f"paritykit config-diff {ref_dir}/config.yaml {out}/port {map_flags} --ignore '_*'",
        "the reference's `time_mix` (1.0) is the port's `time_mixture`, left unset (null) in the port's"
        " config, so its mixer quietly reuses control_scale.",
    )
    cfg = config_diff(ref_dir / "config.yaml", out / "port", rules=maps, ignore=["_*"])
    echo(_indent(cfg.render()))
    _write_report(out, "1_config_diff", cfg)
    unset = [d for d in cfg.differences if d.key == "time_mixture" and d.a == 1.0 and d.b is None]
    result.checks["config-diff shows time_mix unset in the port"] = bool(unset)

    # 2. Weights map: every port tensor explained by a reference tensor.
    port_weights = out / "port" / "diffusion_pytorch_model.safetensors"
    _section(
        echo,
        2,
        "Infer the weight conversion from values",
        f"paritykit weights map {ref_dir}/model.safetensors {port_weights} --emit-rules"
        f" {out}/convert_rules.py --force --limit 12",
        "every port tensor explained (qkv split, shift/scale swap, renames): the bug is not in the weights.",
    )
    cmap = infer_conversion_map(ref_dir / "model.safetensors", port_weights)
    emit_rules(cmap, out / "convert_rules.py", force=True)  # before render: the report names the file
    echo(_indent(cmap.render(limit=12)))
    _write_report(out, "2_weights_map", cmap)
    result.checks["weights map explains every port tensor"] = cmap.exit_code == 0

    # 3. Bisect the buggy port.
    args, kwargs = make_inputs()
    _section(echo, 3, "Find the culprit module", f"paritykit bisect {out}/bisect_buggy.py")
    report = bisect(reference, buggy, (args, kwargs), select_output=select_output)
    echo(_indent(report.render()))
    _write_report(out, "3_bisect_buggy", report)
    found = report.to_dict()
    culprit = found.get("culprit") or {}
    hint_ids = [h["id"] for h in culprit.get("hints", [])]
    result.checks["bisect names the time mixer"] = culprit.get("port") == "time_mixer"
    result.checks["bisect gives the remix hint"] = "remix" in hint_ids

    # 4. Per-step error of a short denoising run.
    hint = make_hint()
    images = {}
    for side, model in (("reference", reference), ("port", buggy), ("port_fixed", fixed)):
        checkpoints = {f"after_step_{i}": Checkpoint(save=True) for i in range(8)}
        images[side] = make_pipeline(model)(hint, num_inference_steps=8, seed=0, _checkpoints=checkpoints)
        save_checkpoints(out / "steps" / side, checkpoints)
    _section(
        echo,
        4,
        "Watch the error grow step by step",
        f"paritykit steps {out}/steps/reference {out}/steps/port --plot {out}/steps.png",
    )
    curve = step_curve(out / "steps" / "reference", out / "steps" / "port")
    curve.plot(out / "steps.png")
    echo(_indent(curve.render()))
    _write_report(out, "4_steps", curve)
    result.checks["step curve diverges"] = curve.exit_code == 1

    # 5. Images.
    for side, image in images.items():
        torch.save(image[0], out / f"image_{side}.pt")
    _section(
        echo,
        5,
        "Look at the outputs",
        f"paritykit images {out}/image_reference.pt {out}/image_port.pt --out {out}/images.png",
    )
    # the files the printed command reads, so the report names them as the command does
    visual = compare_images(out / "image_reference.pt", out / "image_port.pt", out=out / "images.png")
    echo(_indent(visual.render()))
    _write_report(out, "5_images", visual)
    result.checks["images differ"] = visual.exit_code == 1

    # 6. The fix: give the time mixture its own config field.
    _section(echo, 6, "Verify the fix", f"paritykit bisect {out}/bisect_fixed.py")
    fixed_report = bisect(reference, fixed, (args, kwargs), select_output=select_output)
    echo(_indent(fixed_report.render()))
    _write_report(out, "6_bisect_fixed", fixed_report)
    _command(echo, f"paritykit compare {out}/image_reference.pt {out}/image_port_fixed.pt")
    same = compare_paths(str(out / "image_reference.pt"), str(out / "image_port_fixed.pt"))
    echo(_indent(same.render()))
    _write_report(out, "6_compare_fixed_images", same)
    result.checks["fixed port: bisect verdict match"] = fixed_report.to_dict()["verdict"] == "match"
    result.checks["fixed port: final images equal"] = same.exit_code == 0

    echo("")
    echo(click.style("Summary", bold=True))
    for check, ok in result.checks.items():
        echo(f"  [{'ok' if ok else 'FAILED'}] {check}")
    (out / "summary.json").write_text(
        json.dumps({"schema_version": 1, "checks": result.checks}, indent=2) + "\n"
    )
    echo(f"PNGs: {out}/steps.png, {out}/images.png")
    echo(f"JSON reports: {out}/*.json")
    return result
