"""paritykit.forensics.conversion.matching: conversions inferred from tensor values, collapsed into rules,
emitted as code."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paritykit.base.errors import ParityKitError
from paritykit.base.report import to_json
from paritykit.forensics.conversion.emit import apply_rules_to_state_dict, emit_rules
from paritykit.forensics.conversion.fingerprints import multiset_hashes
from paritykit.forensics.conversion.matching import infer_conversion_map
from paritykit.forensics.conversion.modules import match_modules
from paritykit.forensics.conversion.runtime import OPS

D = 16


def _rand(*shape, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 10_000)
    return torch.randn(*shape, generator=g)


def _entries(cmap):
    return {e.target: e for e in cmap.mapping}


def _import(path):
    spec = importlib.util.spec_from_file_location(f"emitted_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_lint_clean(path):
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    config = str(Path(__file__).resolve().parents[1] / "pyproject.toml")
    for args in (["check"], ["format", "--check"]):
        proc = subprocess.run([ruff, *args, "--config", config, str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _assert_reproduces(converted, target):
    assert set(converted) == set(target)
    for key, value in target.items():
        assert converted[key].dtype == value.dtype, key
        assert torch.equal(converted[key], value), key


# ------------------------------------------------------------------------------------------------------------
# one hand-made case per op
# ------------------------------------------------------------------------------------------------------------


def test_fused_qkv_weight_and_bias_are_split_into_chunks_with_layer_rules():
    torch.manual_seed(0)
    src = {}
    tgt = {}
    for i in range(3):
        w, b = torch.randn(3 * D, D), torch.randn(3 * D)
        src[f"net.blocks.{i}.attn.qkv.weight"], src[f"net.blocks.{i}.attn.qkv.bias"] = w, b
        for j, name in enumerate("qkv"):
            tgt[f"transformer_blocks.{i}.attn.to_{name}.weight"] = w.chunk(3)[j].clone()
            tgt[f"transformer_blocks.{i}.attn.to_{name}.bias"] = b.chunk(3)[j].clone()
    cmap = infer_conversion_map(src, tgt)
    assert cmap.exit_code == 0 and not cmap.unmapped_target and not cmap.unused_source and not cmap.ambiguous
    entry = _entries(cmap)["transformer_blocks.2.attn.to_v.bias"]
    assert entry.sources == ["net.blocks.2.attn.qkv.bias"]
    assert entry.op == "chunk"
    assert (entry.args["index"], entry.args["count"], entry.args["dim"]) == (2, 3, 0)
    # weight and bias rules with the same op share one rule
    assert [r.text for r in cmap.rules] == [
        rf"net\.blocks\.(\d+)\.attn\.qkv\.(weight|bias) [chunk {j}/3 dim 0] ->"
        rf" transformer_blocks.\1.attn.to_{n}.\2"
        for j, n in enumerate("qkv")
    ]
    assert all(r.count == 6 for r in cmap.rules)
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)
    # weights alone: the rule exactly as the issue spells it
    weights_only = {k: v for k, v in tgt.items() if k.endswith("weight")}
    texts = {r.text for r in infer_conversion_map(src, weights_only).rules}
    assert (
        r"net\.blocks\.(\d+)\.attn\.qkv\.weight [chunk 0/3 dim 0] -> transformer_blocks.\1.attn.to_q.weight"
        in texts
    )


def test_a_projection_of_concatenated_inputs_split_into_unequal_column_pieces():
    # round 9 (F5-TTS): proj(cat(x, cond, text)) becomes x_proj, cond_proj, text_proj of 24, 24 and 32 input
    # columns; only the bias was explained, and the aligner took proj for x_proj alone
    torch.manual_seed(0)
    w, b = torch.randn(64, 80), torch.randn(64)
    src = {"input_embed.proj.weight": w, "input_embed.proj.bias": b}
    tgt = {
        "input_embed.x_proj.weight": w[:, :24].clone(),
        "input_embed.x_proj.bias": b.clone(),
        "input_embed.cond_proj.weight": w[:, 24:48].clone(),
        "input_embed.text_proj.weight": w[:, 48:].clone(),
    }
    cmap = infer_conversion_map(src, tgt)
    entries = _entries(cmap)
    assert not cmap.unmapped_target
    for key, (start, stop) in {"x_proj": (0, 24), "cond_proj": (24, 48), "text_proj": (48, 80)}.items():
        entry = entries[f"input_embed.{key}.weight"]
        assert entry.sources == ["input_embed.proj.weight"] and entry.op == "chunk"
        assert (entry.args["dim"], entry.args["start"], entry.args["stop"]) == (1, start, stop)
    # must not fire: a column block found nowhere in the source stays unexplained
    tgt["input_embed.text_proj.weight"] = torch.randn(64, 32)
    assert "input_embed.text_proj.weight" in infer_conversion_map(src, tgt).unmapped_target


def test_swapped_shift_scale_is_swap_halves():
    w, b = _rand(2 * D, D), _rand(2 * D)
    src = {"final_layer.adaLN_modulation.1.weight": w, "final_layer.adaLN_modulation.1.bias": b}
    shift, scale = w.chunk(2)
    tgt = {
        "norm_out.linear.weight": torch.cat([scale, shift]),
        "norm_out.linear.bias": torch.cat(b.chunk(2)[::-1]),
    }
    entries = _entries(infer_conversion_map(src, tgt))
    assert entries["norm_out.linear.weight"].op == "swap_halves"
    assert entries["norm_out.linear.weight"].args == {"dim": 0}
    assert entries["norm_out.linear.bias"].sources == ["final_layer.adaLN_modulation.1.bias"]


def test_1x1_conv_to_linear_is_a_reshape():
    q = _rand(D, D, 1, 1)
    cmap = infer_conversion_map(
        {"mid.attn_1.q.weight": q}, {"mid_block.attentions.0.to_q.weight": q[:, :, 0, 0]}
    )
    entry = cmap.mapping[0]
    assert (entry.op, entry.args) == ("reshape", {"shape": [D, D]})
    # and back: linear -> 1x1 conv
    back = _entries(infer_conversion_map({"lin": q[:, :, 0, 0]}, {"conv": q.clone()}))["conv"]
    assert (back.op, back.args) == ("reshape", {"shape": [D, D, 1, 1]})


def test_transposed_conv1d_style_projection():
    w = _rand(D, 3 * D)  # GPT-2 Conv1D stores (in, out)
    cmap = infer_conversion_map({"h.0.mlp.c_fc.weight": w}, {"layers.0.fc.weight": w.t().contiguous()})
    entry = cmap.mapping[0]
    assert (entry.op, entry.args) == ("transpose", {"dims": [0, 1]})


def test_permute_of_three_dims():
    w = _rand(4, 5, 6)
    entry = infer_conversion_map({"a": w}, {"b": w.permute(2, 0, 1).contiguous()}).mapping[0]
    assert (entry.op, entry.args) == ("permute", {"dims": [2, 0, 1]})


def test_rotary_row_permutation_is_described_as_a_pattern():
    heads, head_dim = 2, 8
    w = _rand(heads * head_dim, D)
    # the LLaMA-style permutation: interleaved (x0, y0, x1, y1, …) -> halves (x…, y…) within each head
    permuted = w.view(heads, head_dim // 2, 2, D).transpose(1, 2).reshape(heads * head_dim, D)
    entry = infer_conversion_map({"wq": w}, {"q_proj": permuted}).mapping[0]
    assert entry.op == "permute_rows"
    assert entry.args == {"dim": 0, "pattern": "deinterleave", "group": head_dim}
    # the inverse direction is the inverse pattern
    back = infer_conversion_map({"q_proj": permuted}, {"wq": w}).mapping[0]
    assert back.args == {"dim": 0, "pattern": "interleave", "group": head_dim}


def test_heads_reordered_is_a_block_permutation():
    w = _rand(4 * 4, D)
    order = [2, 0, 3, 1]
    target = torch.cat([w[i * 4 : (i + 1) * 4] for i in order])
    entry = infer_conversion_map({"w": w}, {"t": target}).mapping[0]
    assert entry.op == "permute_rows"
    assert entry.args == {"dim": 0, "pattern": "blocks", "block": 4, "order": order}


def test_irregular_row_permutation_round_trips_through_ranges():
    w = _rand(12, 3)
    perm = [5, 0, 1, 2, 11, 10, 9, 3, 4, 6, 7, 8]
    src, tgt = {"w": w}, {"t": w[perm]}
    cmap = infer_conversion_map(src, tgt)
    assert cmap.mapping[0].args["pattern"] == "ranges"
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)


def test_fp32_to_fp16_cast_and_cast_combined_with_a_chunk():
    w = _rand(D, D)
    qkv = _rand(3 * D, D)
    src = {"w": w, "qkv": qkv}
    tgt = {"w16": w.half(), "k16": qkv.chunk(3)[1].to(torch.bfloat16)}
    entries = _entries(infer_conversion_map(src, tgt))
    assert (entries["w16"].op, entries["w16"].args) == ("cast", {"dtype": "float16"})
    k = entries["k16"]
    assert k.op == "chunk" and k.args["index"] == 1
    assert k.args["then"] == [{"op": "cast", "dtype": "bfloat16"}]
    _assert_reproduces(apply_rules_to_state_dict(infer_conversion_map(src, tgt), src), tgt)


def test_upcast_fp16_to_fp32_is_exact():
    w = _rand(D, D).half()
    entry = infer_conversion_map({"w": w}, {"w": w.float()}).mapping[0]
    assert (entry.op, entry.args) == ("cast", {"dtype": "float32"})


def test_pure_prefix_strip_is_one_rule():
    src = {
        f"model.diffusion_model.blocks.{i}.{n}.weight": _rand(D, D, seed=10 * i + j)
        for i in range(4)
        for j, n in enumerate(["q", "k"])
    }
    src["model.diffusion_model.out.bias"] = _rand(D, seed=99)
    tgt = {k.replace("model.diffusion_model.", ""): v.clone() for k, v in src.items()}
    cmap = infer_conversion_map(src, tgt)
    assert all(e.op == "identity" for e in cmap.mapping)
    assert [r.text for r in cmap.rules] == [r"model\.diffusion_model\.(.+) -> \1"]
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)
    # with EMA copies beside them the strip still covers everything under its prefix
    ema = {"model_ema.decay": torch.tensor(0.99), **src}
    assert [r.text for r in infer_conversion_map(ema, tgt).rules] == [r"model\.diffusion_model\.(.+) -> \1"]


def test_prefix_strip_with_one_renamed_tensor_keeps_index_rules():
    # one tensor under the prefix is renamed: a blanket strip would build a wrong name, so none is made
    src = {f"model.blocks.{i}.q.weight": _rand(D, D, seed=i) for i in range(3)}
    src["model.final.weight"] = _rand(D, seed=9)
    tgt = {k.replace("model.", ""): v.clone() for k, v in src.items() if "final" not in k}
    tgt["norm_out.weight"] = src["model.final.weight"].clone()
    cmap = infer_conversion_map(src, tgt)
    texts = [r.text for r in cmap.rules]
    assert r"model\.(.+) -> \1" not in texts
    assert r"model\.blocks\.(\d+)\.q\.weight -> blocks.\1.q.weight" in texts
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)


def test_unused_ema_scalar_is_listed_and_does_not_fail_the_map():
    w = _rand(D, D)
    cmap = infer_conversion_map({"model.w": w, "model_ema.decay": torch.tensor(0.9999)}, {"w": w.clone()})
    assert cmap.unused_source == ["model_ema.decay"]
    assert cmap.exit_code == 0


def test_constant_tensors_are_settled_by_the_block_their_neighbours_come_from():
    src, tgt = {}, {}
    for i in range(3):
        src[f"blocks.{i}.ln.weight"] = torch.ones(D)
        src[f"blocks.{i}.proj.weight"] = _rand(D, D, seed=i)
        tgt[f"layers.{i}.norm.weight"] = torch.ones(D)
        tgt[f"layers.{i}.linear.weight"] = src[f"blocks.{i}.proj.weight"].clone()
    cmap = infer_conversion_map(src, tgt)
    assert cmap.exit_code == 0 and not cmap.ambiguous and not cmap.warnings
    entries = _entries(cmap)
    for i in range(3):
        e = entries[f"layers.{i}.norm.weight"]
        assert e.sources == [f"blocks.{i}.ln.weight"] and e.evidence.startswith("structure"), e
        assert entries[f"layers.{i}.linear.weight"].evidence == "values"
    assert r"blocks\.(\d+)\.ln\.weight -> layers.\1.norm.weight" in {r.text for r in cmap.rules}


def test_constant_tensors_without_value_unique_neighbours_are_ambiguous_with_every_candidate():
    # nothing ties layers.i to blocks.j: the norms are a guess, listed with all candidates, exit 1
    src = {f"blocks.{i}.ln.weight": torch.ones(D) for i in range(12)}
    tgt = {f"layers.{i}.norm.weight": torch.ones(D) for i in range(12)}
    cmap = infer_conversion_map(src, tgt)
    assert cmap.exit_code == 1 and len(cmap.ambiguous) == 12
    for a in cmap.ambiguous:
        assert a.n_candidates == 12 and sorted(a.candidates) == sorted(src), a
    payload = json.loads(to_json(cmap.to_dict()))
    assert all(len(a["candidates"]) == 12 for a in payload["ambiguous"])
    assert infer_conversion_map(src, tgt, allow_ambiguous=True).exit_code == 0


def test_concat_of_several_sources_with_order():
    k, v = _rand(D, D, seed=1), _rand(D, D, seed=2)
    entry = infer_conversion_map({"k": k, "v": v}, {"kv": torch.cat([v, k])}).mapping[0]
    assert (entry.op, entry.sources, entry.args) == ("concat", ["v", "k"], {"dim": 0})
    along1 = infer_conversion_map({"k": k, "v": v}, {"kv": torch.cat([k, v], dim=1)}).mapping[0]
    assert (along1.op, along1.sources, along1.args) == ("concat", ["k", "v"], {"dim": 1})


def test_concat_of_unequal_parts_and_transposed_parts():
    q, kv = _rand(2 * D, D, seed=3), _rand(D, 2 * D, seed=4)  # kv stored transposed
    src, tgt = {"q": q, "kv": kv}, {"qkv": torch.cat([q, kv.t()])}
    cmap = infer_conversion_map(src, tgt)
    entry = cmap.mapping[0]
    assert entry.op == "concat" and entry.sources == ["q", "kv"]
    assert entry.args["parts"][1] == [{"op": "transpose", "dims": [0, 1]}]
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)


def test_unequal_fused_split_uses_the_leftover_range():
    fused = _rand(7 * D, D)  # q, k, v (D rows each) + mlp (4 D rows), as in Flux single blocks
    q, k, v, mlp = fused[:D], fused[D : 2 * D], fused[2 * D : 3 * D], fused[3 * D :]
    src = {"linear1.weight": fused}
    tgt = {"to_q": q.clone(), "to_k": k.clone(), "to_v": v.clone(), "proj_mlp": mlp.clone()}
    cmap = infer_conversion_map(src, tgt)
    entries = _entries(cmap)
    assert cmap.exit_code == 0
    assert entries["to_k"].args == {"dim": 0, "start": D, "stop": 2 * D, "index": 1, "count": 7}
    assert entries["proj_mlp"].args == {"dim": 0, "start": 3 * D, "stop": 7 * D}
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)


def test_unexplained_target_exits_1_and_json_is_strict():
    w = _rand(D, D)
    cmap = infer_conversion_map({"w": w}, {"w": w.clone(), "new.bias": _rand(D)})
    assert cmap.exit_code == 1
    assert cmap.unmapped_target == ["new.bias"]
    payload = json.loads(to_json(cmap.to_dict()))
    assert payload["schema_version"] == 1
    assert set(payload) >= {
        "mapping",
        "rules",
        "unmapped_target",
        "unused_source",
        "ambiguous",
        "environment",
    }
    assert payload["mapping"] == [
        {"target": "w", "sources": ["w"], "op": "identity", "args": {}, "evidence": "values"}
    ]
    assert payload["warnings"] == [] and payload["ambiguous"] == []
    assert all(m["op"] in OPS for m in payload["mapping"])
    text = cmap.render()
    assert "Unexplained target tensors (1):" in text and "new.bias" in text


def test_render_is_bounded_by_limit():
    tgt = {f"t{i}": _rand(3, seed=i) for i in range(30)}
    text = infer_conversion_map({"s": _rand(2)}, tgt).render(limit=5)
    assert "… 25 more" in text
    assert sum(line.startswith("  t") for line in text.splitlines()) == 5


def test_layer_offsets_do_not_overreach():
    # numbers that do not correspond between the two namings (down_blocks.1 -> input_blocks.3) must not be
    # generalised into a rule that would build targets that do not exist
    src = {f"down.{i}.w": _rand(D, seed=i) for i in range(4)}
    tgt = {f"input.{2 * i + 1}.w": src[f"down.{i}.w"].clone() for i in range(4)}
    cmap = infer_conversion_map(src, tgt)
    assert cmap.exit_code == 0
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)


def test_fingerprints_are_layout_insensitive_and_pieces_add_up():
    w = _rand(6, 4, 10)
    full, pieces = multiset_hashes(w, torch.float32, [(0, 3), (2, 5)])
    assert full == multiset_hashes(w.permute(2, 0, 1).contiguous(), torch.float32)[0]
    assert full == multiset_hashes(w.reshape(-1).flip(0), torch.float32)[0]
    assert full != multiset_hashes(w + 1e-6, torch.float32)[0]
    for (dim, count), hashes in pieces.items():
        assert hashes == [multiset_hashes(p, torch.float32)[0] for p in w.chunk(count, dim=dim)]
    # casting commutes with the fingerprint (rounding is monotone): what the cast matching relies on
    assert multiset_hashes(w, torch.float16)[0] == multiset_hashes(w.half().transpose(0, 2), torch.float16)[0]


# ------------------------------------------------------------------------------------------------------------
# a real tiny diffusers model in a "research layout"
# ------------------------------------------------------------------------------------------------------------


def _tiny_flux(seed=0, randomise=True):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    sd = model.state_dict()
    if randomise:  # a trained checkpoint: no two tensors share values (norm scales are not all ones)
        sd = {k: torch.randn_like(v) for k, v in sd.items()}
    return sd


# diffusers name (per block) -> BFL research name, for tensors that are only renamed
_DOUBLE = {
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
}
_SINGLE = {
    "norm.linear": "modulation.lin",
    "proj_out": "linear2",
    "attn.norm_q": "norm.query_norm",
    "attn.norm_k": "norm.key_norm",
}
_TOP = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
}


def _research_layout(sd):
    r"""The diffusers Flux state dict written the way the original repository stores it (test helper)."""
    out = {}
    for key, value in sd.items():
        if m := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)\.(weight|bias)", key):
            i, mod, kind = m.groups()
            if mod in _DOUBLE:
                name = _DOUBLE[mod]
                kind = "scale" if name.endswith("_norm") else kind
                out[f"double_blocks.{i}.{name}.{kind}"] = value
            elif mod == "attn.to_q":
                parts = [sd[f"transformer_blocks.{i}.attn.to_{n}.{kind}"] for n in "qkv"]
                out[f"double_blocks.{i}.img_attn.qkv.{kind}"] = torch.cat(parts)
            elif mod == "attn.add_q_proj":
                parts = [sd[f"transformer_blocks.{i}.attn.add_{n}_proj.{kind}"] for n in "qkv"]
                out[f"double_blocks.{i}.txt_attn.qkv.{kind}"] = torch.cat(parts)
        elif m := re.fullmatch(r"single_transformer_blocks\.(\d+)\.(.+)\.(weight|bias)", key):
            i, mod, kind = m.groups()
            if mod in _SINGLE:
                name = _SINGLE[mod]
                kind = "scale" if name.endswith("_norm") else kind
                out[f"single_blocks.{i}.{name}.{kind}"] = value
            elif mod == "attn.to_q":
                parts = [sd[f"single_transformer_blocks.{i}.attn.to_{n}.{kind}"] for n in "qkv"]
                parts.append(sd[f"single_transformer_blocks.{i}.proj_mlp.{kind}"])
                out[f"single_blocks.{i}.linear1.{kind}"] = torch.cat(parts)
        elif key.startswith("norm_out.linear."):
            shift, scale = value.chunk(2)  # diffusers stores (scale, shift); BFL stores (shift, scale)
            out[f"final_layer.adaLN_modulation.1.{key.rsplit('.', 1)[1]}"] = torch.cat([scale, shift])
        else:
            mod, kind = key.rsplit(".", 1)
            out[f"{_TOP[mod]}.{kind}"] = value
    out["model_ema.num_updates"] = torch.tensor(1000)
    return out


def test_real_flux_research_layout_is_mapped_back_exactly(tmp_path):
    target = _tiny_flux()
    source = _research_layout(target)
    cmap = infer_conversion_map(source, target)
    assert cmap.exit_code == 0, cmap.render()
    assert not cmap.ambiguous
    assert cmap.unused_source == ["model_ema.num_updates"]
    entries = _entries(cmap)
    # spot checks against the known layout
    e = entries["transformer_blocks.1.attn.add_v_proj.bias"]
    assert (e.sources, e.op, e.args["index"], e.args["count"]) == (
        ["double_blocks.1.txt_attn.qkv.bias"],
        "chunk",
        2,
        3,
    )
    e = entries["single_transformer_blocks.0.proj_mlp.weight"]
    assert (e.sources, e.op, e.args["start"], e.args["stop"]) == (
        ["single_blocks.0.linear1.weight"],
        "chunk",
        96,
        224,
    )
    assert entries["norm_out.linear.weight"].op == "swap_halves"
    assert entries["transformer_blocks.0.attn.norm_q.weight"].sources == [
        "double_blocks.0.img_attn.norm.query_norm.scale"
    ]
    # every other tensor is a pure rename
    special = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "proj_mlp", "norm_out")
    for target_key, entry in entries.items():
        if not any(s in target_key for s in special):
            assert entry.op == "identity", target_key
    # the rules generalise over layer indices
    texts = {r.text for r in cmap.rules}
    assert (
        r"double_blocks\.(\d+)\.img_attn\.qkv\.(weight|bias) [chunk 0/3 dim 0] ->"
        r" transformer_blocks.\1.attn.to_q.\2" in texts
    )
    assert (
        r"single_blocks\.(\d+)\.linear1\.(weight|bias) [slice 96:224 dim 0] ->"
        r" single_transformer_blocks.\1.proj_mlp.\2" in texts
    )
    assert all(r.count in (2, 4) for r in cmap.rules if "blocks" in r.target)
    assert len(cmap.rules) < len(cmap.mapping) / 3

    # the emitted module, imported and run on SOURCE, reproduces TARGET exactly
    path = emit_rules(cmap, tmp_path / "convert_flux.py")
    _assert_lint_clean(path)
    module = _import(path)
    _assert_reproduces(module.convert(source), target)
    _assert_reproduces(apply_rules_to_state_dict(cmap.to_dict()["rules"], source), target)

    # module alignment for bisect: fused qkv aligns with all three projections
    modules = match_modules(source, target, conversion_map=cmap)
    for n in "qkv":
        assert modules[f"transformer_blocks.0.attn.to_{n}"] == ["double_blocks.0.img_attn.qkv"]
    assert modules["single_transformer_blocks.1.proj_mlp"] == ["single_blocks.1.linear1"]
    assert modules["transformer_blocks.1.attn.to_out.0"] == ["double_blocks.1.img_attn.proj"]
    assert modules["proj_out"] == ["final_layer.linear"]


def test_real_flux_fresh_init_norms_are_ambiguous_but_rules_still_reproduce(tmp_path):
    target = _tiny_flux(randomise=False)  # RMSNorm scales are all ones
    source = _research_layout(target)
    cmap = infer_conversion_map(source, target)
    # the q/k norms of the image and text streams hold the same ones: only names tell them apart
    assert cmap.exit_code == 1 and not cmap.warnings
    ambiguous = {a.target for a in cmap.ambiguous}
    assert "transformer_blocks.0.attn.norm_q.weight" in ambiguous
    assert len(ambiguous) == 12 and cmap.unused_source == ["model_ema.num_updates"]
    with pytest.raises(ParityKitError, match="ambiguous"):
        emit_rules(cmap, tmp_path / "refused.py")
    assert not (tmp_path / "refused.py").exists()
    cmap = infer_conversion_map(source, target, allow_ambiguous=True)
    assert cmap.exit_code == 0
    # names break the ties the way the layout really is (layer index, q ~ query, added ~ txt, one use each):
    # the truth comes from the same layout with unique values
    trained = _tiny_flux()
    truth = {e.target: e.sources[0] for e in infer_conversion_map(_research_layout(trained), trained).mapping}
    for a in cmap.ambiguous:
        assert a.chosen == truth[a.target], a
    # in whatever order the target lists its keys
    reordered = dict(sorted(target.items()))
    for a in infer_conversion_map(source, reordered).ambiguous:
        assert a.chosen == truth[a.target], a
    path = emit_rules(cmap, tmp_path / "conv.py")
    assert "# GUESSED:" in path.read_text()
    module = _import(path)
    _assert_reproduces(module.convert(source), target)
    modules = match_modules(source, target, conversion_map=cmap, include_ambiguous=False)
    assert "transformer_blocks.0.attn.norm_q" not in modules
    assert modules["transformer_blocks.0.attn.to_q"] == ["double_blocks.0.img_attn.qkv"]


TINY_VAE_CONFIG = dict(
    block_out_channels=(8, 16, 16),
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    latent_channels=4,
    norm_num_groups=4,
    layers_per_block=1,
)


def _tiny_vae(randomise=True):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(**TINY_VAE_CONFIG)
    sd = vae.state_dict()
    return {k: torch.randn_like(v) for k, v in sd.items()} if randomise else sd


_LDM_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _ldm_name(key: str, n_blocks: int = 3) -> str:
    r"""The original latent-diffusion name of a diffusers AutoencoderKL key (test helper).

    Note the decoder: diffusers' ``up_blocks.0`` is LDM's ``up.2`` (reversed), so layer numbers do not carry
    over."""
    name = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", key)
    name = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", name)
    name = re.sub(r"^decoder\.up_blocks\.(\d+)\.", lambda m: f"decoder.up.{n_blocks - 1 - int(m[1])}.", name)
    name = re.sub(r"^(decoder\.up\.\d+\.)resnets\.", r"\1block.", name)
    name = re.sub(r"^(decoder\.up\.\d+\.)upsamplers\.0\.", r"\1upsample.", name)
    name = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", name)
    name = name.replace("mid_block.attentions.0.", "mid.attn_1.")
    for new, old in _LDM_ATTENTION.items():
        name = name.replace(f"attn_1.{new}.", f"attn_1.{old}.")
    return "first_stage_model." + name.replace("conv_shortcut", "nin_shortcut").replace(
        "conv_norm_out", "norm_out"
    )


def _ldm_layout(sd):
    out = {}
    for key, value in sd.items():
        if ".attentions." in key and key.endswith("weight") and value.ndim == 2:
            value = value[:, :, None, None]  # LDM stores attention projections as 1x1 convs
        out[_ldm_name(key)] = value
    return out


def test_real_autoencoder_in_ldm_layout_reversed_up_blocks_and_1x1_convs(tmp_path):
    target = _tiny_vae()
    source = _ldm_layout(target)
    cmap = infer_conversion_map(source, target)
    assert cmap.exit_code == 0 and not cmap.unused_source and not cmap.ambiguous
    for e in cmap.mapping:
        assert e.sources == [_ldm_name(e.target)], e
    e = _entries(cmap)["decoder.mid_block.attentions.0.to_k.weight"]
    assert (e.op, e.args) == ("reshape", {"shape": [16, 16]})
    # reversed block numbers cannot become back-references; the rules spell them out and stay exact
    texts = {r.text for r in cmap.rules}
    assert (
        r"first_stage_model\.decoder\.up\.2\.block\.(\d+)\.conv(\d+)\.(weight|bias) ->"
        r" decoder.up_blocks.0.resnets.\1.conv\2.\3" in texts
    )
    path = emit_rules(cmap, tmp_path / "vae.py")
    _assert_lint_clean(path)
    _assert_reproduces(_import(path).convert(source), target)


def test_real_autoencoder_fresh_init_norms_follow_their_blocks(tmp_path):
    target = _tiny_vae(randomise=False)  # GroupNorm weights are ones, biases zeros
    source = _ldm_layout(target)
    cmap = infer_conversion_map(source, target, allow_ambiguous=True)
    assert cmap.exit_code == 0 and not cmap.warnings
    # the value-unique convolutions of each block tie its norms to the right block, even where the layer
    # numbers of the two namings disagree (the decoder's reversed up blocks); norm1 and norm2 of one block
    # are told apart by size where they differ, and elsewhere only by names (ambiguous, but consistent)
    assert cmap.n_structure > 20 and cmap.ambiguous
    for e in cmap.mapping:
        assert e.sources == [_ldm_name(e.target)], e
    for a in cmap.ambiguous:
        assert a.chosen in a.plausible and set(a.plausible) <= set(a.candidates), a
        assert len(a.plausible) == 2 and all(".norm" in p for p in a.plausible), a
    _assert_reproduces(_import(emit_rules(cmap, tmp_path / "vae.py")).convert(source), target)


# ------------------------------------------------------------------------------------------------------------
# inputs, paths, emitting
# ------------------------------------------------------------------------------------------------------------


def test_paths_are_read_through_the_safe_loader(tmp_path):
    from safetensors.torch import save_file

    w = _rand(3 * D, D)
    save_file({"qkv.weight": w}, tmp_path / "src.safetensors")
    torch.save(
        {"state_dict": {"q": w[:D].clone(), "k": w[D : 2 * D].clone(), "v": w[2 * D :].clone()}},
        tmp_path / "tgt.pt",
    )
    cmap = infer_conversion_map(tmp_path / "src.safetensors", str(tmp_path / "tgt.pt"))
    assert cmap.exit_code == 0
    assert cmap.source_label.endswith("src.safetensors")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("/nonexistent/x.safetensors", "no such file"),
        ({}, "holds no tensors"),
        ({"a": 1.0}, "not a tensor"),
        (42, "expected a path"),
    ],
)
def test_bad_inputs_raise_one_line_errors(source, message):
    with pytest.raises(ParityKitError, match=message) as info:
        infer_conversion_map(source, {"w": torch.zeros(2)})
    assert "\n" not in str(info.value) and "SOURCE" in str(info.value)


def test_emit_rules_never_overwrites_without_force(tmp_path):
    w = _rand(D, D)
    cmap = infer_conversion_map({"a": w}, {"b": w.t().contiguous()})
    path = tmp_path / "rules.py"
    path.write_text("# my edits\n")
    before = path.read_bytes()
    with pytest.raises(ParityKitError, match="--force"):
        emit_rules(cmap, path)
    assert path.read_bytes() == before
    emit_rules(cmap, path, force=True)
    assert "def convert(" in path.read_text()
    assert not list(tmp_path.glob(".rules.py.*"))  # no temporary file left behind
    _assert_reproduces(_import(path).convert({"a": w}), {"b": w.t().contiguous()})


def test_emitted_module_is_readable_python_with_only_torch(tmp_path):
    qkv, qkv1 = _rand(3 * D, D), _rand(3 * D, D, seed=7)
    cmap = infer_conversion_map(
        {"blk.0.qkv": qkv, "blk.1.qkv": qkv1},
        {"b.0.q": qkv[:D].clone(), "b.1.q": qkv1[:D].clone()},
    )
    text = emit_rules(cmap, tmp_path / "m.py").read_text()
    compile(text, "m.py", "exec")
    assert "import torch" in text and "paritykit" not in text.split('"""', 2)[2]
    assert r"# blk\.(\d+)\.qkv [chunk 0/3 dim 0] -> b.\1.q" in text


def test_match_modules_for_concat_lists_every_source_module():
    k, v = _rand(D, D, seed=1), _rand(D, D, seed=2)
    modules = match_modules({"attn.k.weight": k, "attn.v.weight": v}, {"attn.kv.weight": torch.cat([k, v])})
    assert modules == {"attn.kv": ["attn.k", "attn.v"]}


def test_match_modules_accepts_modules():
    a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 2))
    b = torch.nn.ModuleDict({"proj_in": torch.nn.Linear(4, 4), "proj_out": torch.nn.Linear(4, 2)})
    b.proj_in.load_state_dict(a[0].state_dict())
    b.proj_out.load_state_dict(a[2].state_dict())
    assert match_modules(a, b) == {"proj_in": ["0"], "proj_out": ["2"]}


def test_constant_fused_bias_gives_each_target_its_own_piece():
    src = {"attn.qkv.bias": torch.zeros(3 * D), "attn.qkv.weight": _rand(3 * D, D)}
    tgt = {f"attn.to_{n}.bias": torch.zeros(D) for n in "qkv"}
    cmap = infer_conversion_map(src, tgt)
    assert [e.args["index"] for e in cmap.mapping] == [0, 1, 2]
    assert cmap.unused_source == ["attn.qkv.weight"]
    # which zero chunk is which is a guess: nothing but the names says so
    assert len(cmap.ambiguous) == 3 and cmap.exit_code == 1


_OPS_FOR_RANDOM = ("identity", "transpose", "swap", "chunk", "cast", "rows", "reshape")


@pytest.mark.parametrize("seed", range(12))
def test_random_conversions_are_inferred_and_reproduced(seed):
    g = torch.Generator().manual_seed(seed)
    src, tgt = {}, {}
    layers = 2 + seed % 3
    for i in range(layers):
        for j, op in enumerate(_OPS_FOR_RANDOM):
            rows = 4 * (1 + (seed + j) % 3)
            w = torch.randn(rows * (3 if op == "chunk" else 1), 6, generator=g)
            src[f"model.layers.{i}.{op}.w"] = w
            name = f"blocks.{i}.m{j}.weight"
            if op == "identity":
                tgt[name] = w.clone()
            elif op == "transpose":
                tgt[name] = w.t().contiguous()
            elif op == "swap":
                tgt[name] = torch.cat(w.chunk(2)[::-1])
            elif op == "chunk":
                for k, piece in enumerate(w.chunk(3)):
                    tgt[f"blocks.{i}.m{j}.{k}.weight"] = piece.clone()
            elif op == "cast":
                tgt[name] = w.to(torch.bfloat16)
            elif op == "rows":
                tgt[name] = w.view(-1, 2, 2, 6).transpose(1, 2).reshape(w.shape)
            else:
                tgt[name] = w.reshape(-1, 2, 3)
    cmap = infer_conversion_map(src, tgt)
    assert cmap.exit_code == 0 and not cmap.unused_source and not cmap.ambiguous
    assert all(r.count == layers for r in cmap.rules)
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)


def test_sharded_safetensors_are_read_as_one_state_dict(tmp_path):
    from safetensors.torch import save_file

    qkv, proj = _rand(3 * D, D, seed=5), _rand(D, D, seed=6)
    save_file({"blocks.0.qkv.weight": qkv}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"blocks.0.proj.weight": proj}, tmp_path / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "blocks.0.qkv.weight": "model-00001-of-00002.safetensors",
            "blocks.0.proj.weight": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    # a bool tensor no source explains, next to tensors read from memory-mapped shards
    save_file(
        {
            "a_mask": torch.tensor([True, False, True]),
            "b.to_k": qkv[D : 2 * D].clone(),
            "b.to_out": proj.t().contiguous(),
        },
        tmp_path / "target.safetensors",
    )
    cmap = infer_conversion_map(tmp_path / "model.safetensors.index.json", tmp_path / "target.safetensors")
    assert cmap.unmapped_target == ["a_mask"]
    entries = _entries(cmap)
    assert entries["b.to_k"].args["index"] == 1 and entries["b.to_out"].op == "transpose"


def test_values_rounded_through_bf16_are_a_cast_round_trip():
    w, q = _rand(8, 4, seed=7), _rand(4, 4, seed=8)
    src = {"w": w, "q": q}
    tgt = {
        "w": w.to(torch.bfloat16).float(),
        "q_t": q.t().half().float(),
    }  # saved in half precision, loaded as fp32
    cmap = infer_conversion_map(src, tgt)
    entries = _entries(cmap)
    assert (entries["w"].op, entries["w"].args) == (
        "cast",
        {"dtype": "bfloat16", "then": [{"op": "cast", "dtype": "float32"}]},
    )
    assert entries["q_t"].op == "transpose"
    assert entries["q_t"].args["then"] == [
        {"op": "cast", "dtype": "float16"},
        {"op": "cast", "dtype": "float32"},
    ]
    _assert_reproduces(apply_rules_to_state_dict(cmap, src), tgt)


@settings(max_examples=60, deadline=None)
@given(st.permutations(list(range(12))) | st.permutations(list(range(16))))
def test_any_row_permutation_is_described_compactly_and_exactly(perm):
    from paritykit.forensics.conversion.fingerprints import _describe_permutation
    from paritykit.forensics.conversion.runtime import row_index

    description = _describe_permutation(perm)
    assert row_index(description, len(perm)).tolist() == perm
    if description["pattern"] == "ranges":
        assert len(description["ranges"]) <= len(perm)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 7),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64]),
    seed=st.integers(0, 1000),
)
def test_fingerprint_ignores_layout_and_sees_one_changed_element(rows, cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 100).to(dtype)
    h = multiset_hashes(w, dtype)[0]
    assert h == multiset_hashes(w.t().contiguous(), dtype)[0]
    assert h == multiset_hashes(w.reshape(-1)[torch.randperm(w.numel(), generator=g)], dtype)[0]
    changed = w.clone()
    changed.view(-1)[0] = changed.view(-1)[0] + 1
    if not torch.equal(changed, w):
        assert h != multiset_hashes(changed, dtype)[0]
