import json

import pytest
import torch
import yaml
from paritykit.configs import config_diff, flatten, load_config, values_equal
from paritykit.errors import ParityKitError


def tiny_unet(cross_attention_dim=32):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=2,
        norm_num_groups=4,
    )


def tiny_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8,),
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        norm_num_groups=4,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
    )


def save_pipeline(folder, *, cross_attention_dim=32, beta_end=0.012):
    from diffusers import DDIMScheduler

    folder.mkdir()
    tiny_unet(cross_attention_dim).save_pretrained(folder / "unet")
    tiny_vae().save_pretrained(folder / "vae")
    DDIMScheduler(beta_end=beta_end).save_pretrained(folder / "scheduler")
    index = {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": "0.42.1",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "DDIMScheduler"],
        "safety_checker": [None, None],
        "requires_safety_checker": False,
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def test_values_equal_is_type_aware():
    assert values_equal(1, 1.0)
    assert values_equal([1, 2], (1, 2.0))
    assert values_equal(float("nan"), float("nan"))
    assert not values_equal("1", 1)
    assert not values_equal(True, 1)
    assert not values_equal([1, 2], [1, 2, 3])
    assert not values_equal(None, 0)
    assert values_equal({"a": [1]}, {"a": (1.0,)})


def test_flatten_uses_dotted_paths():
    assert flatten({"a": {"b": {"c": 1}}, "d": [1, {"e": 2}], "f": {}}) == {
        "a.b.c": 1,
        "d": [1, {"e": 2}],
        "f": {},
    }


def test_identical_model_folders_match(tmp_path):
    tiny_unet().save_pretrained(tmp_path / "a")
    tiny_unet().save_pretrained(tmp_path / "b")
    report = config_diff(tmp_path / "a", tmp_path / "b")
    assert report.exit_code == 0
    assert report.same > 10
    assert "configs match" in report.render()


def test_live_model_config_against_dict_reports_one_difference(tmp_path):
    model = tiny_unet()
    changed = dict(model.config)
    changed["cross_attention_dim"] = 64
    changed["layers_per_block"] = 1.0  # int vs float of equal value is not a difference
    report = config_diff(model, changed)
    assert [(d.key, d.a, d.b) for d in report.differences] == [("cross_attention_dim", 32, 64)]
    assert report.exit_code == 1


def test_pipeline_folders_compared_component_by_component(tmp_path):
    a = save_pipeline(tmp_path / "a")
    b = save_pipeline(tmp_path / "b", cross_attention_dim=16, beta_end=0.02)
    report = config_diff(a, b, ignore=["_diffusers_version"])
    keys = {d.key for d in report.differences}
    assert keys == {"unet.cross_attention_dim", "scheduler.beta_end"}
    assert not report.only_a and not report.only_b
    data = report.to_dict()
    assert {"differences", "only_a", "only_b", "environment"} <= data.keys()
    # the component class is part of the comparison
    assert load_config(a)["vae"]["_class"] == "AutoencoderKL"
    assert load_config(a / "model_index.json") == load_config(a)


def test_ignore_globs_match_full_key_or_leaf(tmp_path):
    a = {"x": {"_name_or_path": "/a", "v": 1}, "_diffusers_version": "1"}
    b = {"x": {"_name_or_path": "/b", "v": 1}, "_diffusers_version": "2"}
    assert config_diff(a, b).exit_code == 1
    report = config_diff(a, b, ignore=["_diffusers_version", "x._name_*"])
    assert report.exit_code == 0
    assert report.ignored == ["_diffusers_version", "x._name_or_path"]


def test_yaml_vs_diffusers_config_with_map(tmp_path):
    unet = tiny_unet()
    unet.save_pretrained(tmp_path / "unet")
    ldm = {
        "model": {
            "target": "ldm.models.diffusion.ddpm.LatentDiffusion",
            "params": {
                "unet_config": {
                    "params": {
                        "in_channels": 4,
                        "out_channels": 4,
                        "num_res_blocks": 1,
                        "context_dim": 32,
                        "model_channels": 8,
                        "num_head_channels": 2,
                    }
                }
            },
        }
    }
    (tmp_path / "v1-inference.yaml").write_text(yaml.safe_dump(ldm))
    rules = [
        (r"^model\.params\.unet_config\.params\.", ""),
        (r"^context_dim$", "cross_attention_dim"),
        (r"^num_res_blocks$", "layers_per_block"),
        (r"^num_head_channels$", "attention_head_dim"),
    ]
    # --no-ldm: the raw YAML keys, renamed by hand (the --ldm path is in test_configs_ldm.py)
    report = config_diff(tmp_path / "v1-inference.yaml", tmp_path / "unet", rules=rules, ldm=False)
    assert report.differences == []
    assert report.renamed["model.params.unet_config.params.context_dim"] == "cross_attention_dim"
    assert "model_channels" in report.only_a and "model.target" in report.only_a
    assert "block_out_channels" in report.only_b

    ldm["model"]["params"]["unet_config"]["params"]["context_dim"] = 768
    (tmp_path / "v1-inference.yaml").write_text(yaml.safe_dump(ldm))
    report = config_diff(tmp_path / "v1-inference.yaml", tmp_path / "unet", rules=rules, ldm=False)
    assert [(d.key, d.a, d.b) for d in report.differences] == [("cross_attention_dim", 768, 32)]


def test_safetensors_metadata_config_and_whole_metadata(tmp_path):
    from safetensors.torch import save_file

    tensors = {"w": torch.zeros(2)}
    save_file(tensors, tmp_path / "a.safetensors", metadata={"config": json.dumps({"dim": 8, "heads": 2})})
    save_file(tensors, tmp_path / "b.safetensors", metadata={"config": json.dumps({"dim": 8, "heads": 4})})
    report = config_diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert [(d.key, d.a, d.b) for d in report.differences] == [("heads", 2, 4)]

    save_file(tensors, tmp_path / "c.safetensors", metadata={"ss_network_dim": "32", "format": "pt"})
    assert load_config(tmp_path / "c.safetensors") == {"ss_network_dim": "32", "format": "pt"}
    # a string "32" is not the number 32
    assert config_diff(tmp_path / "c.safetensors", {"ss_network_dim": 32, "format": "pt"}).exit_code == 1

    save_file(tensors, tmp_path / "none.safetensors")
    with pytest.raises(ParityKitError, match="none.safetensors"):
        load_config(tmp_path / "none.safetensors")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.json", None, "no such file"),
        ("list.json", "[1, 2]", "expected a JSON object"),
        ("broken.json", "{", "not valid JSON"),
        ("broken.yaml", "a: [1,", "not valid YAML"),
    ],
)
def test_bad_sources_raise_one_line_errors_naming_the_file(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ParityKitError, match=message) as info:
        load_config(path)
    assert name in str(info.value)


def test_cli_json_schema_and_exit_codes(cli, tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"a": 1, "b": {"c": [1, 2]}, "old": 3}))
    (tmp_path / "b.json").write_text(json.dumps({"a": 1.0, "b": {"c": [1, 3]}, "new": 3, "extra": True}))
    result = cli("config-diff", tmp_path / "a.json", tmp_path / "b.json", "--json", "--map", "^old$=new")
    assert result.returncode == 1, result.stderr
    payload = json.loads(result.stdout)
    assert payload["schema_version"] == 1
    assert payload["differences"] == [
        {"key": "b.c", "a": [1, 2], "b": [1, 3], "a_default": False, "b_default": False}
    ]
    assert payload["only_a"] == [] and payload["only_b"] == ["extra"]
    assert "environment" in payload

    same = cli("config-diff", tmp_path / "a.json", tmp_path / "a.json")
    assert same.returncode == 0 and "configs match" in same.stdout

    bad = cli("config-diff", tmp_path / "a.json", tmp_path / "missing.json")
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "missing.json" in lines[0]
