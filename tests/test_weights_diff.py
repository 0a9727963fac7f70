import json
import math
import re
import subprocess
import sys

import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.forensics import weights_values as weights_module
from paritykit.forensics.safetensors_header import read_safetensors_header
from paritykit.forensics.weights import component_of, kind_of, plot_weights_diff, weights_diff
from safetensors.torch import save_file

from .conftest import REPO


def ldm_state(seed=0, *, text_prefix="cond_stage_model.transformer.text_model."):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    unet = "model.diffusion_model."
    block = unet + "input_blocks.1.1.transformer_blocks.0."
    return {
        "first_stage_model.encoder.conv_in.weight": r(8, 3, 3, 3),
        "first_stage_model.encoder.mid.attn_1.q.weight": r(8, 8, 1, 1),
        "first_stage_model.decoder.norm_out.weight": r(8),
        text_prefix + "embeddings.token_embedding.weight": r(50, 16),
        text_prefix + "encoder.layers.0.self_attn.q_proj.weight": r(16, 16),
        text_prefix + "encoder.layers.0.mlp.fc1.weight": r(32, 16),
        text_prefix + "final_layer_norm.weight": r(16),
        unet + "input_blocks.0.0.weight": r(16, 4, 3, 3),
        unet + "input_blocks.1.0.in_layers.0.weight": r(16),
        unet + "input_blocks.1.0.emb_layers.1.weight": r(16, 64),
        unet + "time_embed.0.weight": r(64, 16),
        block + "attn1.to_q.weight": r(16, 16).half(),
        block + "attn2.to_k.weight": r(16, 16),
        block + "ff.net.0.proj.weight": r(64, 16),
        block + "norm1.weight": r(16),
        unet + "input_blocks.1.1.proj_in.weight": r(16, 16),
        "model_ema.diffusion_modelinput_blocks00weight": r(16, 4, 3, 3),
        "model_ema.decay": torch.tensor(0.9999),
        "alphas_cumprod": torch.linspace(1, 0, 10),
    }


def test_component_and_kind_detection():
    assert component_of("first_stage_model.encoder.conv_in.weight") == "vae"
    assert component_of("cond_stage_model.transformer.text_model.x") == "text_encoder"
    assert component_of("conditioner.embedders.0.transformer.text_model.x") == "text_encoder"
    assert (
        component_of("conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight")
        == "text_encoder_2"
    )
    assert component_of("model.diffusion_model.out.2.weight") == "diffusion_model"
    assert component_of("model_ema.diffusion_modelout2weight") == "ema"
    assert component_of("unet.down_blocks.0.resnets.0.conv1.weight") == "unet"
    assert component_of("text_encoder_2.text_model.final_layer_norm.weight") == "text_encoder_2"
    assert component_of("double_blocks.0.img_attn.qkv.weight") == "transformer"
    assert component_of("decoder.up_blocks.0.resnets.0.conv1.weight") == "vae"
    assert component_of("down_blocks.0.resnets.0.conv1.weight") == "model"
    assert component_of("betas") == "schedule"

    assert kind_of("x.transformer_blocks.0.attn1.to_q.weight") == "self-attention"
    assert kind_of("x.transformer_blocks.0.attn2.to_k.weight") == "cross-attention"
    assert kind_of("text_model.encoder.layers.0.self_attn.q_proj.weight") == "self-attention"
    assert kind_of("resblocks.0.attn.in_proj_weight") == "self-attention"
    assert kind_of("x.ff.net.0.proj.weight") == "feed-forward"
    assert kind_of("encoder.layers.0.mlp.fc1.weight") == "feed-forward"
    assert kind_of("double_blocks.0.txt_mlp.0.weight") == "feed-forward"
    assert kind_of("single_transformer_blocks.0.proj_mlp.weight") == "feed-forward"
    assert kind_of("transformer_blocks.0.ff_context.net.0.proj.weight") == "feed-forward"
    assert kind_of("double_blocks.0.img_attn.proj.weight") == "self-attention"
    assert kind_of("conv_norm_out.weight") == "norm"
    assert kind_of("down_blocks.0.resnets.0.time_emb_proj.weight") == "embedding"
    assert kind_of("encoder.block.0.layer.1.EncDecAttention.q.weight") == "cross-attention"
    assert kind_of("x.norm1.weight") == "norm"
    assert kind_of("input_blocks.1.0.in_layers.0.weight") == "norm"
    assert kind_of("input_blocks.1.0.emb_layers.1.weight") == "embedding"
    assert kind_of("x.proj_in.weight") == "proj"
    assert kind_of("down_blocks.0.resnets.0.conv1.weight") == "conv"
    assert kind_of("input_blocks.0.0.weight", (16, 4, 3, 3)) == "conv"
    assert kind_of("input_blocks.0.0.bias", (16,)) == "conv"  # the LDM conv_in position
    assert kind_of("head.bias", (16,)) == "other"


def test_identical_files_exit_0_without_distances(tmp_path):
    save_file(ldm_state(), tmp_path / "a.safetensors")
    save_file(ldm_state(), tmp_path / "b.safetensors")
    report = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", progress=False)
    assert report.exit_code == 0
    assert report.identical == len(ldm_state())
    assert report.changed == []
    assert "identical" in report.render()


def test_ldm_layout_mismatches_and_metrics_match_torch(tmp_path):
    a = ldm_state()
    b = {k: v.clone() for k, v in a.items()}
    unet_q = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    b[unet_q] += 0.01
    b["first_stage_model.encoder.conv_in.weight"] *= 1.5
    b["model_ema.diffusion_modelinput_blocks00weight"][0, 0, 0, 0] = 3.0
    b["cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"] = torch.randn(51, 16)
    b["model.diffusion_model.time_embed.0.weight"] = a["model.diffusion_model.time_embed.0.weight"].half()
    del b["first_stage_model.decoder.norm_out.weight"]
    b["model.diffusion_model.label_emb.0.0.weight"] = torch.zeros(4)
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")

    report = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", progress=False)
    assert report.exit_code == 1
    assert report.only_a == ["first_stage_model.decoder.norm_out.weight"]
    assert report.only_b == ["model.diffusion_model.label_emb.0.0.weight"]
    assert [m["key"] for m in report.shape_mismatch] == [
        "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"
    ]
    assert report.dtype_mismatch == [
        {"key": "model.diffusion_model.time_embed.0.weight", "a": "float32", "b": "float16"}
    ]
    changed = {c.key: c for c in report.changed}
    assert set(changed) == {
        unet_q,
        "first_stage_model.encoder.conv_in.weight",
        "model_ema.diffusion_modelinput_blocks00weight",
        "model.diffusion_model.time_embed.0.weight",
    }
    for key, item in changed.items():
        ta, tb = a[key].double().flatten(), b[key].double().flatten()
        assert item.l2 == pytest.approx(torch.dist(ta, tb).item(), rel=1e-4, abs=1e-7)
        assert item.max_abs == pytest.approx((ta - tb).abs().max().item(), rel=1e-4, abs=1e-7)
        assert item.cosine == pytest.approx(
            torch.nn.functional.cosine_similarity(ta, tb, dim=0).item(), abs=1e-6
        )
    assert report.largest_changes()[0].key == "first_stage_model.encoder.conv_in.weight"

    groups = report.groups
    assert groups["vae"].changed == 1 and groups["vae"].only_a == 1 and groups["vae"].identical == 1
    assert groups["text_encoder"].shape_mismatch == 1 and groups["text_encoder"].identical == 3
    assert groups["ema"].changed == 1
    assert groups["diffusion_model"].only_b == 1 and groups["diffusion_model"].dtype_mismatch == 1
    unet_changed = [c.l2 for c in report.changed if c.group == "diffusion_model"]
    assert groups["diffusion_model"].distance == pytest.approx(sum(x * x for x in unet_changed) ** 0.5)

    by_kind = weights_diff(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", group_by="both", progress=False
    )
    assert by_kind.groups["diffusion_model/self-attention"].changed == 1
    assert by_kind.groups["vae/conv"].changed == 1
    assert by_kind.groups["diffusion_model/embedding"].dtype_mismatch == 1


def test_bf16_and_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(weights_module, "DISTANCE_CHUNK_ELEMENTS", 512)
    g = torch.Generator().manual_seed(1)
    a = {"big": torch.randn(3000, 7, generator=g).bfloat16(), "tail": torch.randn(5000, generator=g).half()}
    b = {k: v.clone() for k, v in a.items()}
    b["tail"][-1] += 1  # only the very last element of a multi-chunk tensor differs
    b["big"][1234, 3] = 100
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    report = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", progress=False, workers=1)
    changed = {c.key: c for c in report.changed}
    assert set(changed) == {"big", "tail"}
    for key in changed:
        ta, tb = a[key].double().flatten(), b[key].double().flatten()
        assert changed[key].l2 == pytest.approx(torch.dist(ta, tb).item(), rel=1e-5)
        assert changed[key].l1 == pytest.approx((ta - tb).abs().sum().item(), rel=1e-5)


def test_half_decode_is_bit_exact_on_every_float16_value():
    import numpy as np

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)  # every float16: zeros, denormals, inf, NaN
    out = weights_module._half_to_float(bits, np.empty(len(bits), np.float32))
    exact = bits.view(np.float16).astype(np.float32)
    finite = np.isfinite(exact)
    assert np.array_equal(out[finite].view(np.uint32), exact[finite].view(np.uint32))
    # what the fast path makes of an infinity or a NaN is large enough for the square-norm check to catch
    assert np.abs(out[~finite]).min() ** 2 >= 2 * weights_module._HALF_SUSPECT_NORM


def test_float16_infinities_and_nans_reach_the_statistics(tmp_path):
    import numpy as np

    a = {
        "inf": torch.zeros(3000, dtype=torch.float16),
        "nan": torch.ones(3000, dtype=torch.float16),
        "large": torch.full((3000,), 2000.0, dtype=torch.float16),
    }
    b = {k: v.clone() for k, v in a.items()}
    b["inf"][1500] = float("inf")
    b["nan"][7] = float("nan")
    b["large"][0] = 1000.0  # finite, but its square norm is above the check's bound: the exact path
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    report = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", progress=False, workers=1)
    changed = {c.key: c for c in report.changed}
    assert changed["inf"].max_abs == math.inf and changed["inf"].l1 == math.inf
    assert math.isnan(changed["nan"].max_abs) and math.isnan(changed["nan"].l2)
    d = a["large"].double() - b["large"].double()
    assert changed["large"].max_abs == 1000.0
    assert changed["large"].l1 == pytest.approx(float(d.abs().sum()), rel=1e-6)
    assert np.isfinite(changed["large"].cosine)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_statistics_match_a_float64_reference_on_random_and_edge_values(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(weights_module, "DISTANCE_CHUNK_ELEMENTS", 1024)  # many chunks, a ragged last one
    g = torch.Generator().manual_seed(3)
    info = torch.finfo(dtype)
    big = min(info.max, 1e18)  # float32 accumulation: squares of float32's max overflow, today as before
    edges = torch.tensor([0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, big, -big, 1.0, -1.0, 0.5])
    a = {"rand": torch.randn(5000, generator=g).to(dtype), "edge": edges.to(dtype)}
    b = {
        "rand": (a["rand"].float() + 0.01 * torch.randn(5000, generator=g)).to(dtype),
        "edge": edges.flip(0).to(dtype),
    }
    b["rand"][:2048] = a["rand"][:2048]  # an equal prefix of two chunks: its statistics come from A alone
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    report = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", progress=False, workers=1)
    changed = {c.key: c for c in report.changed}
    for key in ("rand", "edge"):
        ta, tb = a[key].double(), b[key].double()
        d = ta - tb
        assert changed[key].l2 == pytest.approx(float(d.norm()), rel=1e-5)
        assert changed[key].l1 == pytest.approx(float(d.abs().sum()), rel=1e-5)
        assert changed[key].max_abs == pytest.approx(float(d.abs().max()), rel=1e-6)
        cosine = float(ta @ tb / (ta.norm() * tb.norm()))
        assert changed[key].cosine == pytest.approx(cosine, rel=1e-5, abs=1e-6)


def _interleaved_pair(tmp_path):
    r"""Changed and identical tensors of three dtypes in turn, each several 512-element chunks long."""
    g = torch.Generator().manual_seed(5)
    a, b = {}, {}
    for i, dtype in enumerate([torch.float16, torch.bfloat16, torch.float32] * 4):
        a[f"t{i:02d}"] = torch.randn(1500 + 37 * i, generator=g).to(dtype)
        b[f"t{i:02d}"] = a[f"t{i:02d}"].clone()
        if i % 2:
            b[f"t{i:02d}"][100 * i :] += 0.01  # from some chunk on; the chunks before it are equal
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    return a, b


def _assert_matches_float64(a, b, changed):
    assert set(changed) == {k for k in a if not torch.equal(a[k], b[k])}
    for key, item in changed.items():
        ta, tb = a[key].double(), b[key].double()
        assert item["l2"] == pytest.approx(float((ta - tb).norm()), rel=1e-5)
        assert item["l1"] == pytest.approx(float((ta - tb).abs().sum()), rel=1e-5)
        assert item["max_abs"] == pytest.approx(float((ta - tb).abs().max()), rel=1e-6)
        assert item["cosine"] == pytest.approx(float(ta @ tb / (ta.norm() * tb.norm())), rel=1e-5)


def test_fresh_process_measures_the_pairs_put_aside_while_numpy_imports(tmp_path):
    # in a fresh process numpy is not imported yet: the workers scan on and put the differing pairs aside,
    # which are measured at the end. Every one of them must come back, with its own numbers.
    a, b = _interleaved_pair(tmp_path)
    env = {"PYTHONPATH": str(REPO / "helpers")}
    command = [
        sys.executable,
        "-m",
        "paritykit",
        "weights",
        "diff",
        str(tmp_path / "a.safetensors"),
        str(tmp_path / "b.safetensors"),
        "--json",
        "--quiet",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["identical"] == 6
    _assert_matches_float64(a, b, {item["key"]: item for item in report["changed"]})


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_agree_with_a_float64_reference(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(weights_module, "DISTANCE_CHUNK_ELEMENTS", 512)
    a, b = _interleaved_pair(tmp_path)
    report = weights_diff(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", progress=False, workers=workers
    )
    _assert_matches_float64(a, b, {c.key: c.to_dict() for c in report.changed})


def test_a_file_cut_short_under_the_workers_is_one_error(tmp_path):
    from paritykit.forensics.weights import open_checkpoint

    _interleaved_pair(tmp_path)
    entries_a = open_checkpoint(tmp_path / "a.safetensors").entries
    entries_b = open_checkpoint(tmp_path / "b.safetensors").entries
    pairs = [(key, entries_a[key], entries_b[key]) for key in sorted(entries_a)]
    with open(tmp_path / "b.safetensors", "r+b") as handle:  # cut after the headers were read
        handle.truncate(entries_b["t05"].info.start + entries_b["t05"].info.nbytes // 2)
    with pytest.raises(ParityKitError, match="b.safetensors: unexpected end of file"):
        weights_module.compare_all(pairs, progress=False, workers=2)


def test_keys_only_reads_headers_only(tmp_path):
    a = ldm_state()
    b = dict(a)
    b["model.diffusion_model.time_embed.0.weight"] = torch.zeros(64, 16)  # values differ, header does not
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    report = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", keys_only=True)
    assert report.exit_code == 0
    assert report.identical == len(a)
    assert report.to_dict()["values_compared"] is False


def test_keys_only_cli_never_imports_torch_or_numpy(tmp_path):
    save_file(ldm_state(), tmp_path / "a.safetensors")
    save_file(ldm_state(1), tmp_path / "b.safetensors")
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('LOADED', sorted(m for m in ('torch', 'numpy', 'diffusers') "
        "if m in sys.modules), file=sys.stderr))\n"
        "from paritykit.cli import main\n"
        f"sys.argv = ['paritykit', 'weights', 'diff', {str(tmp_path / 'a.safetensors')!r}, "
        f"{str(tmp_path / 'b.safetensors')!r}, '--keys-only', '--json']\n"
        "main()\n"
    )
    env = {"PYTHONPATH": str(REPO / "helpers")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stderr
    assert json.loads(result.stdout)["identical"] == len(ldm_state())


def test_renamed_text_encoder_prefix_with_map(tmp_path):
    # the reference notebook's special case: one model saved its text encoder without the text_model level
    a = ldm_state(text_prefix="cond_stage_model.transformer.")
    b = ldm_state(text_prefix="cond_stage_model.transformer.text_model.")
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    plain = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", progress=False)
    assert len(plain.only_a) == 4 and len(plain.only_b) == 4
    rules = [(r"^cond_stage_model\.transformer\.", "cond_stage_model.transformer.text_model.")]
    mapped = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", rules=rules, progress=False)
    assert mapped.exit_code == 0
    assert mapped.renamed == 4
    assert mapped.groups["text_encoder"].identical == 4


def test_sdxl_layout_and_sharded_index(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.k_proj.weight": (
            torch.randn(8, 8)
        ),
        "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight": torch.randn(24, 8),
        "conditioner.embedders.1.model.transformer.resblocks.0.mlp.c_fc.weight": torch.randn(32, 8),
        "model.diffusion_model.label_emb.0.0.weight": torch.randn(16, 8, generator=g),
        "first_stage_model.decoder.conv_out.weight": torch.randn(3, 8, 3, 3),
    }
    save_file(state, tmp_path / "sdxl.safetensors")
    keys = list(state)
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    changed = {k: v.clone() for k, v in state.items()}
    changed[keys[1]] += 1
    folder = tmp_path / "sharded"
    folder.mkdir()
    weight_map = {}
    for name, names in shards.items():
        save_file({k: changed[k] for k in names}, folder / name)
        weight_map.update({k: name for k in names})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )

    header = read_safetensors_header(folder / "model.safetensors.index.json")
    assert set(header.tensors) == set(keys) and len(header.files) == 2

    report = weights_diff(tmp_path / "sdxl.safetensors", folder, progress=False)
    assert [c.key for c in report.changed] == [keys[1]]
    assert report.changed[0].group == "text_encoder_2"
    assert set(report.groups) == {"text_encoder", "text_encoder_2", "diffusion_model", "vae"}


def tiny_unet(seed):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=2,
        norm_num_groups=4,
    )


def test_diffusers_model_and_pipeline_folders(tmp_path):
    unet = tiny_unet(0)
    unet.save_pretrained(tmp_path / "a" / "unet")
    with torch.no_grad():
        unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_k.weight.mul_(1.1)
    unet.save_pretrained(tmp_path / "b" / "unet")
    for side in ("a", "b"):
        (tmp_path / side / "model_index.json").write_text(
            json.dumps({"unet": ["diffusers", "UNet2DConditionModel"]})
        )
        (tmp_path / side / "scheduler").mkdir()

    folder_report = weights_diff(
        tmp_path / "a" / "unet", tmp_path / "b" / "unet", group_by="kind", progress=False
    )
    assert [c.key for c in folder_report.changed] == [
        "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    ]
    assert folder_report.changed[0].group == "cross-attention"

    pipeline_report = weights_diff(tmp_path / "a", tmp_path / "b", progress=False)
    assert [c.key for c in pipeline_report.changed] == [
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    ]
    assert list(pipeline_report.groups) == ["unet"]


def test_plot_is_a_png_with_a_panel_per_group(tmp_path):
    from PIL import Image

    a = ldm_state()
    b = {k: v * 1.01 if v.is_floating_point() else v for k, v in a.items()}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    report = weights_diff(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", metric="cosine", progress=False
    )
    out = plot_weights_diff(report, tmp_path / "plots" / "diff.png")
    with Image.open(out) as image:
        assert image.format == "PNG"
        assert image.size[0] >= 1000  # three panels across


def test_cli_json_schema_and_plot(cli, tmp_path):
    a = ldm_state()
    b = dict(a)
    b["model.diffusion_model.input_blocks.1.1.proj_in.weight"] = torch.zeros(16, 16)
    del b["alphas_cumprod"]
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    result = cli(
        "weights",
        "diff",
        tmp_path / "a.safetensors",
        tmp_path / "b.safetensors",
        "--json",
        "--quiet",
        "--plot",
        tmp_path / "out.png",
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr == ""
    payload = json.loads(result.stdout)
    for key in ("only_a", "only_b", "shape_mismatch", "dtype_mismatch", "identical", "changed", "groups"):
        assert key in payload
    assert payload["schema_version"] == 1 and "environment" in payload
    assert payload["only_a"] == ["alphas_cumprod"]
    assert payload["changed"][0]["key"] == "model.diffusion_model.input_blocks.1.1.proj_in.weight"
    assert set(payload["changed"][0]) >= {"key", "group", "l2", "cosine", "max_abs"}
    assert set(payload["groups"]["diffusion_model"]) >= {
        "identical",
        "changed",
        "only_a",
        "only_b",
        "shape_mismatch",
        "distance",
    }
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert payload["plot"] == str(tmp_path / "out.png")
    text = cli(
        "weights",
        "diff",
        tmp_path / "a.safetensors",
        tmp_path / "b.safetensors",
        "--quiet",
        "--plot",
        tmp_path / "out2.png",
    )
    assert f"plot: {tmp_path / 'out2.png'}" in text.stdout

    same = cli("weights", "diff", tmp_path / "a.safetensors", tmp_path / "a.safetensors")
    assert same.returncode == 0 and "identical" in same.stdout


def _one_line_error(result, name):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert name in lines[0] and "Traceback" not in result.stderr


def test_bad_safetensors_inputs_exit_2_with_one_line(cli, tmp_path):
    save_file(ldm_state(), tmp_path / "good.safetensors")
    data = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) - 100])
    (tmp_path / "badlength.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    good = tmp_path / "good.safetensors"
    for name in ("truncated.safetensors", "badlength.safetensors", "tiny.safetensors", "missing.safetensors"):
        _one_line_error(cli("weights", "diff", good, tmp_path / name), name)
    _one_line_error(
        cli("weights", "diff", good, tmp_path / "truncated.safetensors", "--keys-only"), "truncated"
    )
    with pytest.raises(ParityKitError, match="truncated"):
        read_safetensors_header(tmp_path / "truncated.safetensors")
    json_error = cli("weights", "diff", good, tmp_path / "missing.safetensors", "--json")
    assert json_error.returncode == 2 and "missing.safetensors" in json.loads(json_error.stdout)["error"]


def test_pickled_checkpoints_via_safe_loader(cli, tmp_path):
    pytest.importorskip("paritykit.base.io")
    a = ldm_state()
    b = {k: v.clone() for k, v in a.items()}
    b["first_stage_model.encoder.conv_in.weight"] += 0.5
    torch.save({"state_dict": a, "global_step": 10}, tmp_path / "a.ckpt")
    save_file(b, tmp_path / "b.safetensors")
    report = weights_diff(tmp_path / "a.ckpt", tmp_path / "b.safetensors", progress=False)
    assert [c.key for c in report.changed] == ["first_stage_model.encoder.conv_in.weight"]
    assert report.identical == len(a) - 1

    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    _one_line_error(cli("weights", "diff", tmp_path / "list.pt", tmp_path / "b.safetensors"), "list.pt")
    torch.save({"state_dict": a, "bad": subprocess.Popen}, tmp_path / "code.ckpt")
    _one_line_error(cli("weights", "diff", tmp_path / "code.ckpt", tmp_path / "b.safetensors"), "code.ckpt")


def test_unwritable_plot_path_is_a_one_line_error(cli, tmp_path):
    save_file(ldm_state(), tmp_path / "a.safetensors")
    save_file(ldm_state(1), tmp_path / "b.safetensors")
    (tmp_path / "file.txt").write_text("not a folder")
    target = tmp_path / "file.txt" / "out.png"
    result = cli("weights", "diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--plot", target)
    _one_line_error(result, "out.png")


def test_folder_picks_the_full_precision_file_and_refuses_ambiguity(tmp_path):
    state = {"w": torch.ones(4)}
    folder = tmp_path / "unet"
    folder.mkdir()
    save_file(state, folder / "diffusion_pytorch_model.safetensors")
    save_file({"w": torch.ones(4).half()}, folder / "diffusion_pytorch_model.fp16.safetensors")
    save_file(state, tmp_path / "ref.safetensors")
    assert weights_diff(tmp_path / "ref.safetensors", folder, progress=False).exit_code == 0

    other = tmp_path / "other"
    other.mkdir()
    save_file(state, other / "first.safetensors")
    save_file(state, other / "second.safetensors")
    with pytest.raises(ParityKitError, match="several checkpoints"):
        weights_diff(other, folder, keys_only=True)


def test_kinds_follow_the_leaf_module_role_in_diffusers_and_research_names():
    from diffusers import FluxTransformer2DModel

    from tests.test_convert_ambiguity import _ldm_unet_name, _tiny_unet

    unet, sd = _tiny_unet(randomise=False)
    expected = {
        r"\.ff\.": "feed-forward",
        r"\.norm\d?\.|conv_norm_out|\.norm\.": "norm",
        r"\.proj_(in|out)\.": "proj",
        r"\.attn1\.": "self-attention",
        r"\.attn2\.": "cross-attention",
        r"time_emb": "embedding",
        r"\.conv\d?\.|conv_(in|out|shortcut)\.": "conv",
    }
    for key, value in sd.items():
        for pattern, kind in expected.items():
            if re.search(pattern, key):
                assert kind_of(key, value.shape) == kind, key
                break
        # the single-file (research) name of the same tensor gets the same kind
        assert kind_of(_ldm_unet_name(key, unet), value.shape) == kind_of(key, value.shape), key
    flux = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )
    kinds = {k: kind_of(k, v.shape) for k, v in flux.state_dict().items()}
    assert kinds["transformer_blocks.0.ff_context.net.0.proj.weight"] == "feed-forward"
    assert kinds["transformer_blocks.0.norm1.linear.weight"] == "norm"
    assert kinds["transformer_blocks.0.attn.norm_added_q.weight"] == "norm"
    assert kinds["transformer_blocks.0.attn.add_k_proj.weight"] == "self-attention"
    assert kinds["single_transformer_blocks.0.proj_out.weight"] == "proj"
    assert kinds["x_embedder.weight"] == "embedding"
    assert sum(k == "self-attention" for k in kinds.values()) < len(kinds) / 2
    # research names of the same roles
    for key, kind in {
        "blocks.3.mlp.fc1.weight": "feed-forward",
        "double_blocks.0.img_attn.proj.weight": "self-attention",
        "double_blocks.0.img_mod.lin.weight": "norm",
        "final_layer.adaLN_modulation.1.weight": "norm",
        "blocks.0.attn.qkv.bias": "self-attention",
        "blocks.0.norm2.weight": "norm",
        "pos_embed": "embedding",
        "time_in.in_layer.weight": "embedding",
    }.items():
        assert kind_of(key) == kind, key


def test_plot_shows_a_lone_small_change_and_tick_labels_do_not_overlap(tmp_path):
    from matplotlib import pyplot as plt
    from paritykit.forensics.weights import draw_weights_diff

    g = torch.Generator().manual_seed(0)
    a = {f"blocks.{i}.mlp.fc1.weight": torch.randn(8, 8, generator=g) for i in range(40)}
    a["blocks.0.norm1.weight"] = torch.ones(8)
    b = {k: v + 10.0 ** -(k.count("1") + 1) * (1 + int(k.split(".")[1])) for k, v in a.items()}
    b["blocks.0.norm1.weight"] = a["blocks.0.norm1.weight"] + 1e-6 * torch.arange(8)
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    report = weights_diff(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", group_by="kind", progress=False
    )
    fig = draw_weights_diff(report)
    try:
        fig.canvas.draw()
        panels = {ax.get_title().split(":")[0]: ax for ax in fig.axes if ax.get_visible()}
        norm = panels["norm"]
        heights = [patch.get_height() for patch in norm.patches]
        assert max(heights) == 1
        ymin, ymax = norm.get_ylim()
        assert ymin <= 0 < 1 <= ymax  # the single bar is inside the visible range
        renderer = fig.canvas.get_renderer()
        for ax in panels.values():
            boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
            assert all(not x.overlaps(y) for x, y in zip(boxes, boxes[1:])), ax.get_title()
    finally:
        plt.close(fig)


def test_no_shared_names_points_to_weights_map_and_map(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {f"blocks.{i}.w": torch.randn(4, generator=g) for i in range(3)}
    b = {f"layers.{i}.weight": v.clone() for i, v in enumerate(a.values())}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    report = weights_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", progress=False)
    assert report.exit_code == 1 and report.no_shared_names
    text = report.render()
    assert "weights map" in text and "--map" in text
    assert "weights map" in report.to_dict()["hint"]
    # must not fire when some names are shared
    b2 = {**b, "blocks.0.w": a["blocks.0.w"].clone()}
    save_file(b2, tmp_path / "b2.safetensors")
    partial = weights_diff(tmp_path / "a.safetensors", tmp_path / "b2.safetensors", progress=False)
    assert partial.hint() is None and "hint:" not in partial.render()


def test_a_folder_of_shards_without_an_index_is_one_checkpoint(tmp_path):
    # research checkpoints ship block by block, with no index: the folder is read as one checkpoint by
    # weights diff, weights map and every loader; a folder of variants (an fp16 copy beside the full one)
    # is still refused, naming the files
    from paritykit.base.io import load_state_dict
    from paritykit.forensics.conversion.matching import infer_conversion_map

    g = torch.Generator().manual_seed(0)
    state = {
        f"blocks.{i}.{w}": torch.randn(8, 8, generator=g) for i in range(3) for w in ("q.weight", "k.weight")
    }
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        save_file(
            {k: v for k, v in state.items() if k.startswith(f"blocks.{i}.")},
            shards / f"block_{i}.safetensors",
        )
    save_file(state, tmp_path / "whole.safetensors")
    assert set(load_state_dict(shards)) == set(state)
    assert read_safetensors_header(shards).files == [shards / f"block_{i}.safetensors" for i in range(3)]
    same = weights_diff(str(shards), str(tmp_path / "whole.safetensors"))
    assert same.exit_code == 0, same.render()
    mapped = infer_conversion_map(str(shards), str(tmp_path / "whole.safetensors"))
    assert mapped.exit_code == 0 and len(mapped.mapping) == len(state)
    # must not read as one: two files holding the same names
    variants = tmp_path / "variants"
    variants.mkdir()
    save_file(state, variants / "dit.safetensors")
    save_file({k: v.half() for k, v in state.items()}, variants / "dit.fp16.safetensors")
    with pytest.raises(ParityKitError, match="several"):
        weights_diff(str(variants), str(tmp_path / "whole.safetensors"))
