"""`paritykit weights map` as a user runs it: exit codes, JSON, --emit-rules and its overwrite refusal."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


@pytest.fixture
def checkpoints(tmp_path):
    g = torch.Generator().manual_seed(0)
    qkv, ada = torch.randn(48, 16, generator=g), torch.randn(32, 16, generator=g)
    source = {
        "net.blocks.0.attn.qkv.weight": qkv,
        "net.blocks.0.ada.weight": ada,
        "ema.decay": torch.tensor(0.99),
    }
    target = {
        "transformer_blocks.0.attn.to_q.weight": qkv[:16].clone(),
        "transformer_blocks.0.attn.to_k.weight": qkv[16:32].clone(),
        "transformer_blocks.0.attn.to_v.weight": qkv[32:].clone(),
        "transformer_blocks.0.norm1.linear.weight": torch.cat([ada[16:], ada[:16]]),
    }
    save_file(source, tmp_path / "research.safetensors")
    save_file(target, tmp_path / "diffusers.safetensors")
    return tmp_path, source, target


def test_json_report_exit_0(cli, checkpoints):
    d, _, target = checkpoints
    proc = cli("weights", "map", d / "research.safetensors", d / "diffusers.safetensors", "--json")
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["schema_version"] == 1
    assert payload["environment"]["paritykit"]
    assert {m["target"] for m in payload["mapping"]} == set(target)
    ops = {m["target"]: (m["op"], m["args"]) for m in payload["mapping"]}
    assert ops["transformer_blocks.0.attn.to_k.weight"][0] == "chunk"
    assert ops["transformer_blocks.0.norm1.linear.weight"] == ("swap_halves", {"dim": 0})
    assert payload["unmapped_target"] == [] and payload["unused_source"] == ["ema.decay"]
    assert payload["ambiguous"] == []


def test_table_and_exit_1_when_a_target_is_unexplained(cli, checkpoints):
    d, _, target = checkpoints
    save_file({**target, "extra.bias": torch.arange(5.0)}, d / "more.safetensors")
    proc = cli("weights", "map", d / "research.safetensors", d / "more.safetensors")
    assert proc.returncode == 1
    assert "chunk 1/3 dim 0" in proc.stdout
    assert "Unexplained target tensors (1):" in proc.stdout and "extra.bias" in proc.stdout
    assert "Unused source tensors (1):" in proc.stdout


def test_emit_rules_then_refuse_overwrite_then_force(cli, checkpoints):
    d, source, target = checkpoints
    out = d / "convert_rules.py"
    args = ("weights", "map", d / "research.safetensors", d / "diffusers.safetensors", "--emit-rules", out)
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    assert f"rules module written to {out}" in first.stdout

    spec = importlib.util.spec_from_file_location("convert_rules", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    converted = module.convert(source)
    assert set(converted) == set(target) and all(torch.equal(converted[k], target[k]) for k in target)

    out.write_text("# hand edits\n")
    before = out.read_bytes()
    refused = cli(*args)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and "--force" in refused.stderr and str(out) in refused.stderr
    assert out.read_bytes() == before
    forced = cli(*args, "--force")
    assert forced.returncode == 0 and "def convert(" in out.read_text()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(("missing.safetensors",), "no such file"), (("diffusers.safetensors", "--force"), "--force")],
)
def test_bad_input_is_one_line_exit_2(cli, checkpoints, extra, needle):
    d, _, _ = checkpoints
    proc = cli(
        "weights", "map", d / "research.safetensors", *(d / e if e.endswith("tensors") else e for e in extra)
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("paritykit: error:") and proc.stderr.count("\n") == 1
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_bad_input_with_json_is_a_json_error(cli, checkpoints, tmp_path):
    d, _, _ = checkpoints
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    proc = cli("weights", "map", d / "research.safetensors", tmp_path / "junk.safetensors", "--json")
    assert proc.returncode == 2
    payload = json.loads(proc.stdout)
    assert payload["schema_version"] == 1 and "junk.safetensors" in payload["error"]


def test_importing_the_command_and_library_is_torch_free():
    code = (
        "import sys, paritykit.forensics.conversion, paritykit.cli.weights_map; "
        "print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "helpers"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_ambiguous_map_exits_1_and_emit_rules_needs_allow_ambiguous(cli, tmp_path):
    # four zero biases and nothing that ties them to one another: structure cannot choose
    source = {f"net.{i}.bias": torch.zeros(4) for i in range(4)}
    target = {f"layers.{i}.norm.bias": torch.zeros(4) for i in range(4)}
    save_file(source, tmp_path / "a.safetensors")
    save_file(target, tmp_path / "b.safetensors")
    base = ("weights", "map", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    plain = cli(*base)
    assert plain.returncode == 1 and "GUESS" in plain.stdout and "--allow-ambiguous" in plain.stdout
    payload = json.loads(cli(*base, "--json").stdout)
    assert [len(a["candidates"]) for a in payload["ambiguous"]] == [4] * 4
    out = tmp_path / "rules.py"
    refused = cli(*base, "--emit-rules", out)
    assert refused.returncode == 2 and "--allow-ambiguous" in refused.stderr and not out.exists()
    allowed = cli(*base, "--emit-rules", out, "--allow-ambiguous")
    assert allowed.returncode == 0, allowed.stderr
    assert "# GUESSED:" in out.read_text()


def test_planted_chunk_swap_exits_1_with_a_warning(cli, checkpoints):
    d, _, target = checkpoints
    swapped = dict(target)
    q, k = "transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.to_k.weight"
    swapped[q], swapped[k] = target[k], target[q]
    save_file(swapped, d / "swapped.safetensors")
    proc = cli("weights", "map", d / "research.safetensors", d / "swapped.safetensors", "--json")
    assert proc.returncode == 1
    warnings = json.loads(proc.stdout)["warnings"]
    assert {w["target"] for w in warnings} >= {q, k}


def test_a_lone_transposed_linear_is_a_warning_and_a_transposing_conversion_is_not():
    import torch
    from paritykit.forensics.conversion.matching import infer_conversion_map

    torch.manual_seed(0)
    # one attention block: four Linears with different names, so no layer of the same name to compare with
    names = ("q", "k", "v", "o")
    source = {f"attn.{n}.weight": torch.randn(8, 8) for n in names}
    renamed = {f"attn1.to_{n}.weight": source[f"attn.{n}.weight"].clone() for n in names}
    assert not infer_conversion_map(source, renamed).warnings
    slipped = {**renamed, "attn1.to_k.weight": source["attn.k.weight"].T.contiguous()}
    report = infer_conversion_map(source, slipped)
    assert report.exit_code == 1
    (warning,) = report.warnings
    assert warning.target == "attn1.to_k.weight" and "stored transposed" in warning.message
    every = {k: source[f"attn.{n}.weight"].T.contiguous() for n, k in zip(names, renamed)}
    assert not infer_conversion_map(source, every).warnings  # GPT-2 style: every weight transposed
    # a non-square weight stored transposed on purpose: the wrong way round it would not have loaded
    wide = {**source, "attn.proj.weight": torch.randn(16, 8)}
    stored = {**renamed, "attn1.proj.weight": wide["attn.proj.weight"].T.contiguous()}
    assert not infer_conversion_map(wide, stored).warnings
