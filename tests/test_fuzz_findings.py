"""What the fuzz suite (tests/fuzz) found, each kept as its minimal example: before the fix every one of these
was a traceback; now each is one line naming the file, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from paritykit.cli import cli

SPEC = (
    "import torch\n\n\ndef make_inputs():\n    return (torch.ones(2, 3),), {}\n\n\n"
    "def build_reference():\n    torch.manual_seed(0)\n    return torch.nn.Linear(3, 3)\n\n\n"
    "def build_port():\n    torch.manual_seed(0)\n    return torch.nn.Linear(3, 3)\n"
)


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def one_error(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("paritykit: error:")]
    assert len(lines) == 1 and "Traceback" not in out, out
    return lines[0]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("findings")
    (root / "spec.py").write_text(SPEC)
    for side, out in (("reference", "ref"), ("port", "port")):
        assert run("trace", root / "spec.py", "--side", side, "--out", root / out)[0] == 0
    return root


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: b"\x00\x00\x00\x80" + json.dumps(m).encode(), "unreadable trace manifest"),  # not UTF-8
        (lambda m: json.dumps({**m, "about": float("nan")}).encode(), "malformed trace manifest"),
        (lambda m: json.dumps({**m, "records": 3}).encode(), "malformed trace manifest"),
        (
            lambda m: json.dumps({**m, "tensors": dict.fromkeys(m["tensors"], "../weights.json")}).encode(),
            "not a file name inside the trace folder",
        ),
    ],
    ids=["not-utf8", "about-nan", "records-int", "shard-outside"],
)
def test_a_damaged_trace_manifest_is_one_line(traces, tmp_path, edit, message):
    folder = tmp_path / "ref"
    shutil.copytree(traces / "ref", folder)
    manifest = json.loads((folder / "trace.json").read_text())
    (folder / "trace.json").write_bytes(edit(manifest))
    code, out = run("bisect", "--traces", folder, traces / "port")
    assert code == 2 and message in one_error(out) and "trace.json" in one_error(out)


@pytest.mark.parametrize("value", [0, "999", None, True])
def test_a_json_schedule_that_is_not_a_list_or_object_is_one_line(tmp_path, value):
    (tmp_path / "ref.json").write_text(json.dumps(value))
    (tmp_path / "port.json").write_text(json.dumps([999, 500, 0]))
    code, out = run("schedule", tmp_path / "ref.json", tmp_path / "port.json")
    assert code == 2 and "ref.json: expected a JSON list of numbers" in one_error(out)


@pytest.mark.parametrize("value", [None, 3, [], "entries"])
def test_a_skills_manifest_that_is_not_an_object_is_one_line_and_nothing_changes(tmp_path, value):
    assert run("skills", "install", "--agent", "claude", "--target", tmp_path)[0] == 0
    manifest = tmp_path / ".claude" / "skills" / ".paritykit-manifest.json"
    manifest.write_text(json.dumps(value))
    before = sorted(p.name for p in manifest.parent.iterdir())
    code, out = run("skills", "install", "--agent", "claude", "--target", tmp_path)
    assert code == 2 and ".paritykit-manifest.json: unreadable paritykit manifest" in one_error(out)
    assert sorted(p.name for p in manifest.parent.iterdir()) == before
    assert manifest.read_text() == json.dumps(value)


def test_a_png_with_one_flipped_byte_is_one_line(tmp_path):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (16, 16, 3), dtype=np.uint8)
    for name, array in (("a.png", pixels), ("b.png", 255 - pixels)):
        Image.fromarray(array).save(tmp_path / name)
    raw = bytearray((tmp_path / "a.png").read_bytes())
    raw[35] ^= 1  # inside the first chunk: PIL raises SyntaxError("broken PNG file")
    (tmp_path / "a.png").write_bytes(bytes(raw))
    code, out = run("images", tmp_path / "a.png", tmp_path / "b.png", "--out", tmp_path / "d.png")
    assert code == 2 and "a.png: cannot read this image" in one_error(out)
    assert not (tmp_path / "d.png").exists()


def test_nan_in_a_captured_tensor_is_searched_not_crashed_on(traces, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ref"
    shutil.copytree(traces / "ref", folder)
    shard = next(folder.glob("tensors-*.safetensors"))
    tensors = load_file(shard)
    tensors = {
        k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in tensors.items()
    }
    save_file(
        tensors, shard
    )  # every captured float of the reference is NaN (a lstsq fit used to crash on it)
    code, out = run("bisect", "--traces", folder, traces / "port")
    assert code in (0, 1) and "Traceback" not in out and "verdict" in out, out
