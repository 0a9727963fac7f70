"""weights map on real diffusers models converted by diffusers' own single-file converters.

Fresh-init weights (norms all ones, biases zeros) hold the same values in many tensors: what structure settles
must be right, what it cannot settle must be flagged (every candidate listed, exit 1). Distinct-value weights,
EMA copies equal to the live weights, a fused-qkv ViT with a planted chunk swap and a shift/scale swap in one
block only are the look-alikes on both sides of each rule.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from paritykit.base.report import to_json
from paritykit.forensics.conversion.emit import apply_rules_to_state_dict
from paritykit.forensics.conversion.matching import infer_conversion_map

from tests.test_convert import TINY_VAE_CONFIG, _ldm_name, _tiny_vae

L = 1  # layers per block of the tiny UNet
_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


def _tiny_unet(randomise: bool):
    from tests.sampling import tiny_cond_unet

    unet = tiny_cond_unet(layers_per_block=L)
    sd = unet.state_dict()
    if randomise:
        g = torch.Generator().manual_seed(1)
        sd = {k: torch.randn(v.shape, generator=g) for k, v in sd.items()}
    return unet, sd


def _ldm_unet_name(key: str, unet) -> str:
    r"""The original single-file name of a diffusers UNet key (checked below against diffusers' converter)."""

    def resnet(rest: str) -> str:
        head, tail = rest.split(".", 1)
        return f"{_RESNET.get(head, head)}.{tail}"

    up_has_attn = ["CrossAttn" in t for t in unet.config.up_block_types]
    fixed = {
        "conv_in.": "input_blocks.0.0.",
        "time_embedding.linear_1.": "time_embed.0.",
        "time_embedding.linear_2.": "time_embed.2.",
        "conv_norm_out.": "out.0.",
        "conv_out.": "out.2.",
    }
    name = next((new + key[len(old) :] for old, new in fixed.items() if key.startswith(old)), None)
    if name is None:
        m = re.match(
            r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)", key
        )
        mm = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", key)
        if mm:
            kind, j, rest = mm[1], int(mm[2]), mm[3]
            index = 1 if kind == "attentions" else 2 * j
            name = f"middle_block.{index}.{resnet(rest) if kind == 'resnets' else rest}"
        else:
            side, i, kind, j, rest = m[1], int(m[2]), m[3], int(m[4]), m[5]
            if side == "down":
                base = 1 + i * (L + 1)
                if kind == "downsamplers":
                    name = f"input_blocks.{base + L}.0.op.{rest.removeprefix('conv.')}"
                else:
                    sub = 0 if kind == "resnets" else 1
                    name = f"input_blocks.{base + j}.{sub}.{resnet(rest) if sub == 0 else rest}"
            else:
                base = i * (L + 1)
                if kind == "upsamplers":
                    name = f"output_blocks.{base + L}.{2 if up_has_attn[i] else 1}.{rest}"
                else:
                    sub = 0 if kind == "resnets" else 1
                    name = f"output_blocks.{base + j}.{sub}.{resnet(rest) if sub == 0 else rest}"
    return "model.diffusion_model." + name


def _unet_pair(randomise: bool, ema: bool = False):
    r"""(single-file checkpoint, what diffusers' convert_ldm_unet_checkpoint makes of it, name truth)."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    unet, sd = _tiny_unet(randomise)
    source = {_ldm_unet_name(k, unet): v for k, v in sd.items()}
    if ema:  # SD v1 keeps EMA copies under flattened names: model_ema.diffusion_modelinput_blocks00weight
        source.update({"model_ema." + "".join(k.split(".")[1:]): v.clone() for k, v in list(source.items())})
    target = convert_ldm_unet_checkpoint(dict(source), dict(unet.config))
    # the inverse naming is right: diffusers' own converter gives back every tensor of the model
    assert set(target) == set(sd)
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    truth = {k: _ldm_unet_name(k, unet) for k in target}
    return source, target, truth


def _vae_pair(randomise: bool):
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    sd = _tiny_vae(randomise)
    source = {}
    for key, value in sd.items():
        if ".attentions." in key and key.endswith("weight") and value.ndim == 2:
            value = value[:, :, None, None]
        source[_ldm_name(key)] = value
    config = dict(AutoencoderKL(**TINY_VAE_CONFIG).config)
    target = convert_ldm_vae_checkpoint(dict(source), config)
    assert set(target) == set(sd) and all(torch.equal(target[k], sd[k]) for k in sd)
    return source, target, {k: _ldm_name(k) for k in target}


def _check_honest(cmap, truth):
    r"""Every settled target is right; every wrong one is flagged; the truth is always a listed candidate."""
    ambiguous = {a.target: a for a in cmap.ambiguous}
    for e in cmap.mapping:
        a = ambiguous.get(e.target)
        if a is None:
            assert e.sources == [truth[e.target]], e
        else:
            assert truth[e.target] in a.candidates and truth[e.target] in a.plausible, a
            assert e.evidence.startswith("guess")
    assert not cmap.unmapped_target


@pytest.fixture(scope="module")
def unet_fresh():
    source, target, truth = _unet_pair(randomise=False)
    return source, target, truth, infer_conversion_map(source, target)


def test_unet_distinct_values_are_exact_and_exit_0():
    source, target, truth = _unet_pair(randomise=True)
    cmap = infer_conversion_map(source, target)
    assert cmap.exit_code == 0 and not cmap.ambiguous and not cmap.warnings and not cmap.unused_source
    assert all(e.sources == [truth[e.target]] and e.evidence == "values" for e in cmap.mapping)
    out = apply_rules_to_state_dict(cmap, source)
    assert all(torch.equal(out[k], target[k]) for k in target)


def test_unet_fresh_init_is_settled_by_structure_or_flagged(unet_fresh):
    source, target, truth, cmap = unet_fresh
    _check_honest(cmap, truth)
    assert cmap.n_structure > 10 and not cmap.warnings
    # final norm and the attention blocks' group norms sit beside their value-unique convolutions
    entries = {e.target: e for e in cmap.mapping}
    for key in ("conv_norm_out.weight", "down_blocks.0.attentions.0.norm.weight"):
        assert entries[key].sources == [truth[key]] and entries[key].evidence.startswith("structure"), key
    if cmap.ambiguous:
        assert cmap.exit_code == 1
        assert infer_conversion_map(source, target, allow_ambiguous=True).exit_code == 0


def test_unet_fresh_rules_on_trained_weights_are_right_or_flagged(unet_fresh):
    _, _, _, cmap = unet_fresh
    trained_source, trained_target, _ = _unet_pair(randomise=True)
    out = apply_rules_to_state_dict(cmap, trained_source)
    flagged = {a.target for a in cmap.ambiguous}
    wrong = {k for k in trained_target if not torch.equal(out[k], trained_target[k])}
    assert wrong <= flagged


@pytest.mark.parametrize("randomise", [True, False])
def test_unet_with_ema_copies_never_takes_the_ema(randomise):
    source, target, truth = _unet_pair(randomise=randomise, ema=True)
    cmap = infer_conversion_map(source, target)
    assert not any(s.startswith("model_ema.") for e in cmap.mapping for s in e.sources)
    _check_honest(cmap, truth)
    if randomise:
        assert cmap.exit_code == 0 and not cmap.ambiguous
        assert all(e.evidence.startswith("values") for e in cmap.mapping)


def test_vae_fresh_and_distinct():
    source, target, truth = _vae_pair(randomise=True)
    assert infer_conversion_map(source, target).exit_code == 0
    source, target, truth = _vae_pair(randomise=False)
    cmap = infer_conversion_map(source, target)
    _check_honest(cmap, truth)
    entries = {e.target: e for e in cmap.mapping}
    assert entries["decoder.conv_norm_out.weight"].sources == [truth["decoder.conv_norm_out.weight"]]


# ------------------------------------------------------------------------------------------------------------
# a research ViT with a fused qkv, converted to transformers' ViT (separate query/key/value)
# ------------------------------------------------------------------------------------------------------------


def _vit(randomise: bool):
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=8,
        patch_size=4,
        num_channels=3,
    )
    sd = ViTModel(config, add_pooling_layer=False).state_dict()
    if randomise:
        g = torch.Generator().manual_seed(2)
        sd = {k: torch.randn(v.shape, generator=g) for k, v in sd.items()}
    return sd


def _research_vit(sd):
    r"""timm-style names: one fused ``qkv`` per block (q, k, v stacked in that order)."""
    out = {
        "cls_token": sd["embeddings.cls_token"],
        "pos_embed": sd["embeddings.position_embeddings"],
        "patch_embed.proj.weight": sd["embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": sd["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": sd["layernorm.weight"],
        "norm.bias": sd["layernorm.bias"],
    }
    for i in range(2):
        p = f"layers.{i}."
        for leaf in ("weight", "bias"):
            out[f"blocks.{i}.attn.qkv.{leaf}"] = torch.cat(
                [sd[f"{p}attention.{n}_proj.{leaf}"] for n in "qkv"]
            )
            out[f"blocks.{i}.attn.proj.{leaf}"] = sd[f"{p}attention.o_proj.{leaf}"]
            out[f"blocks.{i}.norm1.{leaf}"] = sd[f"{p}layernorm_before.{leaf}"]
            out[f"blocks.{i}.norm2.{leaf}"] = sd[f"{p}layernorm_after.{leaf}"]
            out[f"blocks.{i}.mlp.fc1.{leaf}"] = sd[f"{p}mlp.fc1.{leaf}"]
            out[f"blocks.{i}.mlp.fc2.{leaf}"] = sd[f"{p}mlp.fc2.{leaf}"]
    return out


def test_vit_fresh_init_qkv_biases_are_chunks_of_the_fused_bias_not_other_zeros():
    target = _vit(randomise=False)
    source = _research_vit(target)
    cmap = infer_conversion_map(source, target)
    entries = {e.target: e for e in cmap.mapping}
    for j, n in enumerate("qkv"):
        e = entries[f"layers.1.attention.{n}_proj.bias"]
        assert e.sources == ["blocks.1.attn.qkv.bias"] and (e.op, e.args["index"]) == ("chunk", j), e
        assert e.evidence.startswith("structure")
    e = entries["layernorm.weight"]
    assert e.sources == ["norm.weight"], e
    assert not cmap.warnings


def test_vit_planted_chunk_swap_is_a_warning_and_exit_1():
    target = _vit(randomise=True)
    source = _research_vit(target)
    clean = infer_conversion_map(source, target)
    assert clean.exit_code == 0 and not clean.warnings  # must not fire on the right split
    p = "layers.1.attention."
    swapped = dict(target)
    swapped[p + "q_proj.weight"], swapped[p + "k_proj.weight"] = (
        target[p + "k_proj.weight"],
        target[p + "q_proj.weight"],
    )
    cmap = infer_conversion_map(source, swapped)
    assert cmap.exit_code == 1 and not cmap.unmapped_target
    flagged = {w.target for w in cmap.warnings}
    assert {p + "q_proj.weight", p + "k_proj.weight"} <= flagged
    assert any("chunk order contradicts" in w.message for w in cmap.warnings)
    payload = json.loads(to_json(cmap.to_dict()))
    assert payload["warnings"] and set(payload["warnings"][0]) == {"target", "message"}
    assert "Warnings (" in cmap.render()


def test_shift_scale_swapped_in_one_block_only_is_a_warning():
    g = torch.Generator().manual_seed(3)
    src = {f"blocks.{i}.ada.weight": torch.randn(8, 4, generator=g) for i in range(3)}

    def swap(w):
        return torch.cat(w.chunk(2)[::-1])

    consistent = {f"layers.{i}.norm.linear.weight": swap(src[f"blocks.{i}.ada.weight"]) for i in range(3)}
    assert not infer_conversion_map(src, consistent).warnings  # swapped everywhere: a convention
    odd = dict(consistent)
    odd["layers.1.norm.linear.weight"] = src["blocks.1.ada.weight"].clone()
    cmap = infer_conversion_map(src, odd)
    assert cmap.exit_code == 1
    (w,) = cmap.warnings
    assert w.target == "layers.1.norm.linear.weight" and "shift/scale" in w.message


def test_json_lists_are_complete_and_tables_fit_120_columns():
    n = 30
    src = {
        f"model.encoder.very_long_module_name.blocks.{i}.layer_norm.weight": torch.ones(8) for i in range(n)
    }
    tgt = {f"transformer.layers.{i}.attention_block.norm.weight": torch.ones(8) for i in range(n)}
    tgt.update({f"extra.{i}": torch.full((3,), float(i + 7)) for i in range(50)})
    cmap = infer_conversion_map(src, tgt)
    payload = json.loads(to_json(cmap.to_dict()))
    assert len(payload["unmapped_target"]) == 50
    assert all(len(a["candidates"]) == a["n_candidates"] == n for a in payload["ambiguous"])
    text = cmap.render(limit=5)
    # the header names the two inputs in full; every other line fits
    assert max(len(line) for line in text.splitlines() if not line.startswith("weights map:")) <= 120
    # ambiguous rows alike but for layer numbers fold into one counted row
    assert f"  {n}" in text.split("Ambiguous targets")[1]


@pytest.mark.parametrize(
    ("order", "warns"),
    [(("k", "v"), False), (("q", "k", "v"), False), (("v", "k"), True), (("k", "q", "v"), True)],
)
def test_fused_order_warning_fires_only_against_the_usual_orders(order, warns):
    g = torch.Generator().manual_seed(4)
    fused = torch.randn(4 * len(order), 4, generator=g)
    tgt = {f"attn.to_{n}.weight": piece.clone() for n, piece in zip(order, fused.chunk(len(order)))}
    cmap = infer_conversion_map({"attn.fused.weight": fused}, tgt)
    assert not cmap.unmapped_target and bool(cmap.warnings) == warns, cmap.warnings
    assert cmap.exit_code == int(warns)


@pytest.mark.parametrize(("order", "warns"), [("qkv", False), ("kqv", True)])
def test_concatenation_order_is_read_against_the_names(order, warns):
    g = torch.Generator().manual_seed(5)
    src = {f"attn.{n}_proj.weight": torch.randn(4, 4, generator=g) for n in "qkv"}
    tgt = {"attn.qkv.weight": torch.cat([src[f"attn.{n}_proj.weight"] for n in order])}
    cmap = infer_conversion_map(src, tgt)
    assert cmap.mapping[0].op == "concat" and bool(cmap.warnings) == warns


def test_zero_bias_with_no_settled_sibling_still_lists_the_fused_chunk():
    # the q/k/v weights are not in the target, so nothing is split like them: the zero biases match the
    # zero proj bias whole and the zero qkv bias in pieces, and the pieces must be among the candidates
    g = torch.Generator().manual_seed(6)
    src = {
        "blocks.0.attn.qkv.bias": torch.zeros(12),
        "blocks.0.attn.proj.bias": torch.zeros(4),
        "blocks.0.attn.proj.weight": torch.randn(4, 4, generator=g),
    }
    tgt = {"layers.0.attn.to_out.weight": src["blocks.0.attn.proj.weight"].clone()}
    tgt.update({f"layers.0.attn.to_{n}.bias": torch.zeros(4) for n in "qkv"})
    cmap = infer_conversion_map(src, tgt)
    amb = {a.target: a for a in cmap.ambiguous}
    for n in "qkv":
        a = amb[f"layers.0.attn.to_{n}.bias"]
        assert "blocks.0.attn.qkv.bias" in a.candidates, a
    assert cmap.exit_code == 1


def test_norms_swapped_in_one_layer_only_are_a_warning():
    target = _vit(randomise=True)
    source = _research_vit(target)
    swapped = dict(target)
    for leaf in ("weight", "bias"):
        before, after = f"layers.1.layernorm_before.{leaf}", f"layers.1.layernorm_after.{leaf}"
        swapped[before], swapped[after] = target[after], target[before]
    cmap = infer_conversion_map(source, swapped)
    assert cmap.exit_code == 1 and not cmap.ambiguous
    flagged = {w.target for w in cmap.warnings}
    assert (
        "layers.1.layernorm_before.weight" in flagged
        and "inconsistent across layer" in cmap.warnings[0].message
    )
    assert not any(t.startswith("layers.0.") for t in flagged)


def _mha_and_attention(randomise: bool, prefix: str = ""):
    r"""A torch MultiheadAttention and the diffusers Attention it converts to (q/k/v split from the fused
    top-level ``in_proj_weight`` / ``in_proj_bias``), with an optional module prefix on both sides."""
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    if randomise:
        with torch.no_grad():
            for p in mha.parameters():
                p.normal_()
    attn = Attention(16, heads=2, dim_head=8, bias=True, out_bias=True)
    src = {k: v.detach() for k, v in mha.state_dict().items()}
    sd = {"to_out.0.weight": src["out_proj.weight"], "to_out.0.bias": src["out_proj.bias"]}
    for n, w, b in zip("qkv", src["in_proj_weight"].chunk(3), src["in_proj_bias"].chunk(3), strict=True):
        sd[f"to_{n}.weight"], sd[f"to_{n}.bias"] = w, b
    attn.load_state_dict(sd)
    tgt = attn.state_dict()
    return {prefix + k: v for k, v in src.items()}, {prefix + k: v for k, v in tgt.items()}


def _sources(cmap) -> dict[str, tuple]:
    return {e.target: (e.sources, e.op, e.args.get("index")) for e in cmap.mapping}


@pytest.mark.parametrize("prefix", ["", "blocks.0.attn."])
def test_mha_fresh_init_zero_biases_are_the_in_proj_bias_chunks(prefix):
    # in_proj_bias and out_proj.bias are all zeros: out_proj.bias holds to_q.bias's values whole, but the
    # bias is built like its weight, a chunk of the fused in_proj_weight -> the same chunk of in_proj_bias
    src, tgt = _mha_and_attention(randomise=False, prefix=prefix)
    assert not src[prefix + "in_proj_bias"].any() and not src[prefix + "out_proj.bias"].any()
    cmap = infer_conversion_map(src, tgt)
    got = _sources(cmap)
    for i, n in enumerate("qkv"):
        assert got[f"{prefix}to_{n}.bias"] == ([prefix + "in_proj_bias"], "chunk", i)
    assert got[prefix + "to_out.0.bias"][0] == [prefix + "out_proj.bias"]
    assert not cmap.unused_source and not cmap.ambiguous and cmap.exit_code == 0
    out = apply_rules_to_state_dict(cmap, src)
    assert all(torch.equal(out[k], v) for k, v in tgt.items())


def test_mha_distinct_values_stay_exact():
    src, tgt = _mha_and_attention(randomise=True)
    cmap = infer_conversion_map(src, tgt)
    got = _sources(cmap)
    for i, n in enumerate("qkv"):
        assert got[f"to_{n}.bias"] == (["in_proj_bias"], "chunk", i)
        assert got[f"to_{n}.weight"] == (["in_proj_weight"], "chunk", i)
    assert not cmap.ambiguous and cmap.n_structure == 0 and cmap.exit_code == 0


def test_mha_zero_biases_without_their_weights_are_ambiguous_with_the_fused_chunks_listed():
    # no weight in the target to be built like: structure cannot tell out_proj.bias from an in_proj_bias
    # chunk, so the answer is ambiguous (exit 1) and the true source is among the candidates
    src, tgt = _mha_and_attention(randomise=False)
    tgt = {k: v for k, v in tgt.items() if k.endswith("bias")}
    cmap = infer_conversion_map(src, tgt)
    amb = {a.target: a for a in cmap.ambiguous}
    for n in "qkv":
        assert "in_proj_bias" in amb[f"to_{n}.bias"].candidates
    assert cmap.exit_code == 1


def test_root_level_weight_bias_pair_by_stem_and_no_pair_across_stems():
    # a top-level Linear (keys ``weight`` / ``bias``) cut from chunk 1 of ``qkv_weight``: its zero bias is
    # chunk 1 of ``qkv_bias``, not the zero ``proj_bias`` beside it
    g = torch.Generator().manual_seed(7)
    src = {
        "qkv_weight": torch.randn(12, 4, generator=g),
        "qkv_bias": torch.zeros(12),
        "proj_bias": torch.zeros(4),
    }
    tgt = {"weight": src["qkv_weight"][4:8].clone(), "bias": torch.zeros(4)}
    got = _sources(infer_conversion_map(src, tgt))
    assert got["bias"] == (["qkv_bias"], "chunk", 1)
    # look-alike: the weight's stem has no bias; two other zeros remain, which structure cannot tell apart
    src = {"a_weight": torch.randn(4, 4, generator=g), "c_bias": torch.zeros(4), "d_bias": torch.zeros(4)}
    cmap = infer_conversion_map(src, {"x.weight": src["a_weight"].clone(), "x.bias": torch.zeros(4)})
    amb = {a.target: a for a in cmap.ambiguous}
    assert set(amb["x.bias"].candidates) == {"c_bias", "d_bias"} and cmap.exit_code == 1
