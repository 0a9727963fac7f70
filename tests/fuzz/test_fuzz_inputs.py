"""Property-based fuzzing of every command that reads user files.

Each example copies a folder of small, valid inputs (tensor files, pickles, checkpoint folders, configs,
schedules, images, trace folders, an installed skill pack), damages one of them the way real files get
damaged (truncated, emptied, a corrupted or huge safetensors header, random bytes, a JSON of the wrong type,
NaN in a JSON, a file deleted from a folder) or mixes the arguments up (swapped, the same path twice, a file
of another kind), runs the command in-process through the CLI's real entry point, and holds it to:

* no traceback, and an exit code of 0, 1 or 2;
* exit 2 comes with exactly one ``paritykit: error:`` line naming the damaged file, its folder or an argument;
* no file outside the command's output is written, changed or removed;
* a mix-up is never a verdict of ``match``: two trace folders that are the same folder or swapped are refused,
  and comparing a path with itself says so.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from paritykit.cli import cli

from tests.fuzz.conftest import KIND_STATS, STATS

SPEC = """import torch


def make_inputs():
    return (torch.ones(2, 3),), {}


def build_reference():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.GELU())


def build_port():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.GELU(approximate="tanh"))
"""


@dataclass(frozen=True)
class Case:
    r"""One command: its argv with ``{A}``/``{B}`` for the two inputs, the input pairs to try, the outputs it
    may write (relative to the working folder), and the pairs whose swap is a mix-up it must refuse (trace
    folders, and run folders that record their side)."""

    argv: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...] = ()
    ordered: tuple[tuple[str, str], ...] = ()  # pairs whose swap (or doubling) is a mix-up to refuse


CASES = {
    "compare": Case(
        ("compare", "{A}", "{B}"),
        (("a.safetensors", "b.safetensors"), ("a.pt", "b.pt"), ("ckpt_a", "ckpt_b")),
        ordered=(("ckpt_a", "ckpt_b"),),
    ),
    "weights diff": Case(
        ("weights", "diff", "{A}", "{B}"), (("a.safetensors", "b.safetensors"), ("a.pt", "b.pt"))
    ),
    "weights map": Case(
        ("weights", "map", "{A}", "{B}"), (("a.safetensors", "b.safetensors"), ("a.pt", "b.pt"))
    ),
    "config-diff": Case(("config-diff", "{A}", "{B}"), (("cfg_a.json", "cfg_b.json"),)),
    "schedule": Case(
        ("schedule", "{A}", "{B}"),
        (("sched_a.json", "sched_b.json"), ("ckpt_a", "ckpt_b")),
        ordered=(("ckpt_a", "ckpt_b"),),
    ),
    "schedule --fit": Case(
        ("schedule", "{A}", "--fit", "DDIMScheduler", "--config", "{B}"),
        (("sched_a.json", "sched_cfg.json"),),
    ),
    "steps": Case(("steps", "{A}", "{B}"), (("ckpt_a", "ckpt_b"),), ordered=(("ckpt_a", "ckpt_b"),)),
    "images": Case(
        ("images", "{A}", "{B}", "--out", "out.png"), (("i1.png", "i2.png"),), outputs=("out.png",)
    ),
    "bisect --traces": Case(
        ("bisect", "--traces", "{A}", "{B}"),
        (("trace_ref", "trace_port"),),
        ordered=(("trace_ref", "trace_port"),),
    ),
    "skills install": Case(
        ("skills", "install", "--agent", "claude", "--target", "{A}"),
        (("target", "target"),),
        outputs=("{A}",),
    ),
}
KINDS = (
    "truncate",
    "empty",
    "flip-header",
    "huge-header",
    "wrong-dtype",
    "nan-values",
    "random-bytes",
    "json-wrong-type",
    "json-nan",
    "delete",
    "swap",
    "same",
    "cross",
)
# a file of another kind, put where a command expects its own
CROSS = ("i1.png", "cfg_a.json", "a.pt", "ckpt_a", "trace_ref", "sched_a.json", "notes.txt")


# --- the valid inputs
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def seeds(tmp_path_factory) -> Path:
    import numpy as np
    import torch
    from paritykit import Checkpoint, save_checkpoints
    from PIL import Image
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("fuzz_seeds")
    torch.manual_seed(0)
    a = {"down.0.weight": torch.randn(4, 3), "down.0.bias": torch.randn(4), "up.weight": torch.randn(3, 4)}
    b = {k: v + 1e-3 * torch.randn_like(v) for k, v in a.items()}
    save_file(a, root / "a.safetensors")
    save_file(b, root / "b.safetensors")
    torch.save(a, root / "a.pt")
    torch.save(b, root / "b.pt")
    for name, shift in (("ckpt_a", 0.0), ("ckpt_b", 1e-3)):
        steps = {
            "preloop": Checkpoint(
                data={"latents": torch.ones(1, 2, 4, 4), "timesteps": torch.tensor([999, 666, 333])}
            )
        }
        for i in range(3):
            steps[f"after_step_{i}"] = Checkpoint(
                data={
                    "latents": torch.full((1, 2, 4, 4), 1.0 - i / 3 + shift),
                    "noise_pred": torch.ones(1, 2, 4, 4),
                }
            )
        save_checkpoints(root / name, steps, side="reference" if name == "ckpt_a" else "port")
    config = {"_class_name": "UNet2DModel", "sample_size": 8, "in_channels": 4, "block_out_channels": [8, 16]}
    (root / "cfg_a.json").write_text(json.dumps(config))
    (root / "cfg_b.json").write_text(json.dumps({**config, "sample_size": 16}))
    (root / "sched_a.json").write_text(json.dumps([999, 899, 799, 699, 599, 499, 399, 299, 199, 99]))
    (root / "sched_b.json").write_text(json.dumps([900, 800, 700, 600, 500, 400, 300, 200, 100, 0]))
    (root / "sched_cfg.json").write_text(json.dumps({"beta_schedule": "scaled_linear", "clip_sample": False}))
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "i1.png")
    Image.fromarray(255 - pixels).save(root / "i2.png")
    (root / "notes.txt").write_text("not an input of any kind\n")
    (root / "spec.py").write_text(SPEC)
    runner = CliRunner()
    for side, out in (("reference", "trace_ref"), ("port", "trace_port")):
        result = runner.invoke(
            cli, ["trace", str(root / "spec.py"), "--side", side, "--out", str(root / out)]
        )
        assert result.exit_code == 0, result.output
    (root / "target").mkdir()
    result = runner.invoke(cli, ["skills", "install", "--agent", "claude", "--target", str(root / "target")])
    assert result.exit_code == 0, result.output
    return root


# --- damaging a file
# ---------------------------------------------------------------------------------------------
def damage(path: Path, kind: str, data: st.DataObject) -> None:
    raw = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(raw[: data.draw(st.integers(0, max(0, len(raw) - 1)), label="cut at")])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "flip-header":
        head = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            i = data.draw(st.integers(0, max(0, min(len(head), 96) - 1)), label="at")
            if head:
                head[i] ^= data.draw(st.integers(1, 255), label="xor")
        path.write_bytes(bytes(head))
    elif kind == "huge-header":
        length = data.draw(st.sampled_from([2**31, 2**40, 2**63, len(raw) * 4]), label="header length")
        path.write_bytes(struct.pack("<Q", length) + raw[8:])
    elif kind in ("wrong-dtype", "nan-values") and _safetensors_header(raw) is not None:
        header, body = _safetensors_header(raw)
        names = sorted(k for k in header if k != "__metadata__")
        if names:
            name = data.draw(st.sampled_from(names), label="tensor")
            if kind == "wrong-dtype":
                header[name]["dtype"] = data.draw(
                    st.sampled_from(["F64", "BOOL", "I8", "F8_E4M3", "X9", ""]), label="dtype"
                )
            elif header[name]["dtype"] == "F32":
                start, end = header[name]["data_offsets"]
                bad = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]), label="value")
                count = (end - start) // 4
                body = body[:start] + struct.pack(f"<{count}f", *[bad] * count) + body[end:]
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    elif kind in ("wrong-dtype", "nan-values"):  # not a safetensors file: corrupt its head instead
        damage(path, "flip-header", data)
    elif kind == "random-bytes":
        path.write_bytes(data.draw(st.binary(min_size=1, max_size=256), label="bytes"))
    elif kind == "json-wrong-type":
        value = data.draw(
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                lambda inner: (
                    st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
                ),
                max_leaves=6,
            ),
            label="json",
        )
        path.write_text(json.dumps(value))
    elif kind == "json-nan":
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        path.write_text(json.dumps(_with_nan(value, data), allow_nan=True))
    elif kind == "delete":
        path.unlink()


def _safetensors_header(raw: bytes) -> tuple[dict, bytes] | None:
    r"""A safetensors file's header (as a dict) and the bytes after it, or ``None`` when ``raw`` is not
    one."""
    if len(raw) < 8:
        return None
    (length,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8 : 8 + length])
    except (ValueError, UnicodeDecodeError):
        return None
    return (header, raw[8 + length :]) if isinstance(header, dict) else None


def _with_nan(value, data):
    bad = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]), label="non-finite")
    if isinstance(value, list) and value:
        value[data.draw(st.integers(0, len(value) - 1), label="index")] = bad
        return value
    if isinstance(value, dict) and value:
        key = data.draw(st.sampled_from(sorted(value)), label="key")
        value[key] = bad
        return value
    return [bad]


def files_of(path: Path) -> list[Path]:
    return (
        [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    )


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


@dataclass
class Run:
    code: int
    out: str


def invoke(cwd: Path, argv: list[str]) -> Run:
    with contextlib.chdir(cwd):
        result = CliRunner().invoke(cli, argv, catch_exceptions=True, prog_name="paritykit")
    text = result.stdout + result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        text += "".join(traceback.format_exception(*result.exc_info))
        return Run(1, text)
    return Run(result.exit_code, text)


# --- the property
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", sorted(CASES))
@given(data=st.data())
def test_damaged_or_mixed_up_input_is_refused_in_one_line_and_nothing_else_is_touched(
    seeds, command, kind, data
):
    case = CASES[command]
    pair = a, b = data.draw(st.sampled_from(case.pairs), label="pair")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in {a, b, *CROSS}:
            source = seeds / name
            if source.is_dir():
                shutil.copytree(source, work / name, symlinks=True)
            else:
                shutil.copy2(source, work / name)
        damaged, names = None, {a, b}
        if kind == "swap":
            a, b = b, a
        elif kind == "same":
            b = a
        elif kind == "cross":
            a = data.draw(st.sampled_from([c for c in CROSS if c not in (a, b)]), label="cross")
            names.add(a)
        else:
            side = data.draw(st.sampled_from([a, b]), label="damaged side")
            candidates = files_of(work / side)
            if command == "skills install":
                candidates = [p for p in candidates if p.name == ".paritykit-manifest.json"]
            damaged = data.draw(st.sampled_from(candidates), label="file")
            damage(damaged, kind, data)
        before = snapshot(work)
        argv = [part.replace("{A}", a).replace("{B}", b) for part in case.argv]
        run = invoke(work, argv)
        after = snapshot(work)
        outcome = f"exit {run.code}" if run.code in (0, 1, 2) else "other exit"
        STATS[command][outcome] += 1
        KIND_STATS[kind][outcome] += 1
        try:
            assert "Traceback" not in run.out, run.out
            assert run.code in (0, 1, 2), run.out
            if run.code == 2:
                errors = [line for line in run.out.splitlines() if line.startswith("paritykit: error:")]
                assert len(errors) == 1, run.out
                named = {*names, *(p.name for p in ([damaged, damaged.parent] if damaged else []))}
                assert any(n in errors[0] for n in named) or " --" in errors[0] or "REF" in errors[0], errors[
                    0
                ]
            touched = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
            outputs = [o.replace("{A}", a) for o in case.outputs]  # skills install writes into its --target
            assert all(any(k == o or k.startswith(o + "/") for o in outputs) for k in touched), touched
            if kind in ("same", "swap") and pair in case.ordered:
                assert run.code == 2, run.out  # a mix-up of the two sides is refused, never bisected
            if kind == "same" and command == "compare" and run.code == 0:
                assert "same path" in run.out
        except AssertionError:
            STATS[command]["failure"] += 1
            KIND_STATS[kind]["failure"] += 1
            raise


# --- new: arbitrary names and options; a file already at the output is never touched
# ----------------------------
NEW_TEMPLATES = {
    "component-test": ("--reference", "r:b", "--diffusers", "UNet2DModel"),
    "config-diff": ("--reference", "ref.json", "--diffusers", "port.json"),
    "pipeline-stub": (),
    "stage-test": ("--pipeline", "p:P", "--reference", "r:run"),
}


@pytest.mark.parametrize("template", sorted(NEW_TEMPLATES))
@given(
    name=st.one_of(st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True), st.text(max_size=12)),
    existing=st.one_of(st.none(), st.binary(max_size=64)),
)
def test_new_with_any_name_is_one_line_or_a_file_and_never_replaces_one(template, name, existing):
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        first = invoke(work, ["new", template, name, *NEW_TEMPLATES[template], "--out", "gen"])
        outcome = f"exit {first.code}" if first.code in (0, 1, 2) else "other exit"
        STATS[f"new {template}"][outcome] += 1
        KIND_STATS["new: any name"][outcome] += 1
        assert "Traceback" not in first.out and first.code in (0, 2), first.out
        if first.code == 2:
            assert len([x for x in first.out.splitlines() if x.startswith("paritykit: error:")]) == 1, (
                first.out
            )
            return
        made = sorted(p for p in (work / "gen").rglob("*") if p.is_file())
        assert made, first.out
        if existing is not None:
            made[0].write_bytes(existing)
        before = snapshot(work)
        again = invoke(work, ["new", template, name, *NEW_TEMPLATES[template], "--out", "gen"])
        assert again.code == 2 and "--force" in again.out and "Traceback" not in again.out, again.out
        assert snapshot(work) == before  # the user's file (or the first render) is kept, byte for byte
