"""The worked example finds the bug, names the culprit with the right hint, and verifies the fix."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.demo.conversion import convert_reference_state_dict
from paritykit.demo.port import TinyControlDenoiserModel, port_config_from_reference
from paritykit.demo.reference import REFERENCE_CONFIG, build_reference
from paritykit.demo.run import run_demo
from PIL import Image

PRINTED: list[str] = []


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo-output"
    result = run_demo(out, echo=PRINTED.append)
    assert result.exit_code == 0, result.checks
    return out


def load(out, name):
    return json.loads((out / f"{name}.json").read_text())


def test_buggy_port_differs_and_fixed_port_matches_exactly():
    reference = build_reference()
    state = convert_reference_state_dict(reference.state_dict())
    x, hint, t = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8), torch.tensor([900.0, 10.0])
    outputs = {}
    for fixed in (False, True):
        port = TinyControlDenoiserModel(**port_config_from_reference(REFERENCE_CONFIG, fixed)).eval()
        port.load_state_dict(state)
        with torch.no_grad():
            outputs[fixed] = port(x, t, hint).sample
    with torch.no_grad():
        expected = reference(x, t, hint)
    assert torch.equal(outputs[True], expected)
    assert (outputs[False] - expected).abs().max() > 1e-4


def test_config_diff_shows_the_knob_the_port_leaves_unset(demo_dir):
    # the demo's own words ("time_mixture, left unset (null) in the port's config") against its own output
    report = load(demo_dir, "1_config_diff")
    assert report["differences"] == [
        {"key": "time_mixture", "a": 1.0, "b": None, "a_default": False, "b_default": False}
    ]
    assert report["only_a"] == [] and report["only_b"] == []


def test_weights_map_explains_every_tensor(demo_dir):
    report = load(demo_dir, "2_weights_map")
    assert report["unmapped_target"] == []
    ops = {entry["op"] for entry in report["mapping"]}
    assert {"chunk", "swap_halves", "identity"} <= ops


def test_bisect_names_the_time_mixer_with_the_remix_hint(demo_dir):
    report = load(demo_dir, "3_bisect_buggy")
    assert report["verdict"] == "diverge"
    culprit = report["culprit"]
    assert culprit["port"] == "time_mixer"
    assert culprit["reference"] == "time_mix"
    assert culprit["test"] == "replay"
    # the repair search's verified fix leads (the mixture knob set back to 1); the remix observation follows
    first = culprit["hints"][0]
    assert first["id"] == "repair" and first["verified"] is True
    assert first["fix"].startswith("time_mixer.mixture = 1 ")
    assert "remix" in [h["id"] for h in culprit["hints"]]


def test_fixed_port_matches(demo_dir):
    report = load(demo_dir, "6_bisect_fixed")
    assert report["verdict"] == "match"
    assert report["culprit"] is None
    summary = load(demo_dir, "summary")
    assert all(summary["checks"].values())


def test_pictures_are_pngs(demo_dir):
    for name in ("steps.png", "images.png"):
        with Image.open(demo_dir / name) as image:
            assert image.format == "PNG" and image.size[0] > 100


def test_demo_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ParityKitError, match="--out"):
        run_demo(precious, echo=lambda _line: None)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_rerun_replaces_its_own_files_and_keeps_a_users(demo_dir):
    users = demo_dir / "my-notes.txt"
    users.write_text("mine")
    stale = demo_dir / "steps.png"
    stale.write_bytes(b"stale")
    result = run_demo(demo_dir, echo=lambda _line: None)
    assert result.exit_code == 0
    assert users.read_text() == "mine"
    with Image.open(stale) as image:  # rewritten, not the stale bytes
        assert image.format == "PNG"
    assert "my-notes.txt" not in json.loads((demo_dir / ".paritykit-demo").read_text())["written"]


def printed_blocks() -> list[tuple[list[str], str]]:
    """Each printed ``$ paritykit …`` command with the lines the demo printed under it (de-indented)."""
    blocks: list[tuple[list[str], list[str]]] = []
    for line in (line for entry in PRINTED for line in entry.split("\n")):
        if line.startswith("  $ paritykit"):
            blocks.append((shlex.split(line.strip().removeprefix("$ "))[1:], []))
        elif blocks and (line.startswith("    ") or line == ""):
            blocks[-1][1].append(line.removeprefix("    "))
        elif blocks:
            blocks.append((None, []))  # a header or the summary ends the command's output
    return [(argv, "\n".join(lines).strip("\n")) for argv, lines in blocks if argv]


def test_every_printed_command_runs_and_prints_exactly_what_the_demo_shows_under_it(demo_dir):
    from tests.conftest import run_cli

    blocks = printed_blocks()
    assert len(blocks) == 7
    runs = [run_cli(*argv, cwd=demo_dir.parent) for argv, _ in blocks]
    # config-diff: time_mix set in A, unset in B -> differ (1); weights map: all explained (0); bisect buggy:
    # diverge (1); steps: diverge (1); images: below threshold (1); bisect fixed: match (0); compare fixed
    # images: same (0)
    assert [run.returncode for run in runs] == [1, 0, 1, 1, 1, 0, 0], [run.stderr for run in runs]
    for (argv, shown), run in zip(blocks, runs):
        actual = run.stdout.strip("\n")
        if argv[:2] == ["weights", "map"]:  # its timing line carries the seconds it took
            actual, shown = (re.sub(r"\(\d+\.\d+ s\)", "(… s)", text) for text in (actual, shown))
        assert shown == actual, f"paritykit {' '.join(argv)}:\n--- demo\n{shown}\n--- command\n{actual}"


def test_readme_demo_excerpt_is_what_the_demo_prints(demo_dir):
    r"""The README quotes the bisect step of ``make demo``: every quoted line is a line the demo printed."""
    from tests.conftest import REPO

    readme = (REPO / "README.md").read_text()
    excerpt = readme.split("[3/6] Find the culprit module", 1)[1].split("```", 1)[0]
    quoted = [line.strip() for line in excerpt.splitlines() if line.strip()]
    # the README shows `make demo`'s own folder; this run wrote to a temporary one
    printed = {
        line.strip().replace(str(demo_dir), "demo-output") for chunk in PRINTED for line in chunk.splitlines()
    }
    assert quoted, "the README no longer quotes the demo's bisect step"
    assert [line for line in quoted if line not in printed] == []
