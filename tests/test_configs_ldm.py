"""config-diff on an original LDM YAML: the diffusers config comes from diffusers' own single-file helpers."""

import copy
import json

import pytest
import yaml
from paritykit.base.errors import ParityKitError
from paritykit.forensics.config_ldm import UNET_HELPER, VAE_HELPER, derive_from_ldm, is_ldm_config
from paritykit.forensics.configs import DEFAULT, NO_COUNTERPART, REFERENCE_ONLY, config_diff

# The public layout of Stable Diffusion v1's v1-inference.yaml, with tiny sizes (32 channels, 2 levels).
V1_INFERENCE = {
    "model": {
        "base_learning_rate": 1.0e-04,
        "target": "ldm.models.diffusion.ddpm.LatentDiffusion",
        "params": {
            "linear_start": 0.00085,
            "linear_end": 0.0120,
            "num_timesteps_cond": 1,
            "log_every_t": 200,
            "timesteps": 1000,
            "first_stage_key": "jpg",
            "cond_stage_key": "txt",
            "image_size": 8,
            "channels": 4,
            "cond_stage_trainable": False,
            "conditioning_key": "crossattn",
            "monitor": "val/loss_simple_ema",
            "scale_factor": 0.18215,
            "use_ema": False,
            "unet_config": {
                "target": "ldm.modules.diffusionmodules.openaimodel.UNetModel",
                "params": {
                    "image_size": 32,
                    "in_channels": 4,
                    "out_channels": 4,
                    "model_channels": 32,
                    "attention_resolutions": [2],
                    "num_res_blocks": 1,
                    "channel_mult": [1, 2],
                    "num_heads": 2,
                    "use_spatial_transformer": True,
                    "transformer_depth": 1,
                    "context_dim": 16,
                    "use_checkpoint": True,
                    "legacy": False,
                },
            },
            "first_stage_config": {
                "target": "ldm.models.autoencoder.AutoencoderKL",
                "params": {
                    "embed_dim": 4,
                    "monitor": "val/rec_loss",
                    "ddconfig": {
                        "double_z": True,
                        "z_channels": 4,
                        "resolution": 256,
                        "in_channels": 3,
                        "out_ch": 3,
                        "ch": 32,
                        "ch_mult": [1, 2],
                        "num_res_blocks": 1,
                        "attn_resolutions": [],
                        "dropout": 0.0,
                    },
                    "lossconfig": {"target": "torch.nn.Identity"},
                },
            },
            "cond_stage_config": {"target": "ldm.modules.encoders.modules.FrozenCLIPEmbedder"},
        },
    }
}
UNET_PARAMS = ("model", "params", "unet_config", "params")
DDCONFIG = ("model", "params", "first_stage_config", "params", "ddconfig")


def write_yaml(path, changes=()):
    config = copy.deepcopy(V1_INFERENCE)
    for keys, value in changes:
        node = config
        for key in keys[:-1]:
            node = node[key]
        if value is None:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    path.write_text(yaml.safe_dump(config))
    return path


def save_unet(folder):
    """The diffusers port of the YAML above, as a user would write it by hand: attention at level 2 only."""
    from diffusers import UNet2DConditionModel

    UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=2,
    ).save_pretrained(folder)
    return folder


def save_vae(folder):
    from diffusers import AutoencoderKL

    AutoencoderKL(
        sample_size=16,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from diffusers import DDIMScheduler

    root = tmp_path_factory.mktemp("ldm")
    save_unet(root / "unet")
    save_vae(root / "vae")
    pipeline = root / "pipeline"
    save_unet(pipeline / "unet")
    save_vae(pipeline / "vae")
    DDIMScheduler().save_pretrained(pipeline / "scheduler")
    index = {
        "_class_name": "StableDiffusionPipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "scheduler": ["diffusers", "DDIMScheduler"],
    }
    (pipeline / "model_index.json").write_text(json.dumps(index))
    return root


def test_a_correct_port_of_the_v1_yaml_exits_0_with_the_derived_keys_checked(tmp_path, saved):
    report = config_diff(write_yaml(tmp_path / "v1-inference.yaml"), saved / "unet")
    assert report.exit_code == 0, report.render()
    assert report.derived_with == {"": UNET_HELPER}
    # the values diffusers derives (channels × multipliers, block types from attention_resolutions, heads,
    # latent sample size) were compared, not skipped
    derived = {
        "block_out_channels",
        "down_block_types",
        "up_block_types",
        "attention_head_dim",
        "sample_size",
    }
    assert derived <= set(report.equal)
    reasons = {u.key: u.reason for u in report.not_compared}
    for key in ("use_checkpoint", "legacy", "use_spatial_transformer", "image_size"):
        assert reasons[f"model.params.unet_config.params.{key}"] == REFERENCE_ONLY
    # read by diffusers' helper, so never listed as reference only
    assert "model.params.unet_config.params.channel_mult" not in reasons
    assert "model.params.image_size" not in reasons
    # port keys the YAML says nothing about sit at the class default: listed, not counted
    assert reasons["norm_num_groups"] == DEFAULT and reasons["act_fn"] == DEFAULT
    text = report.render()
    assert "reference only, not compared" in text and "model.params.cond_stage_config.*" in text
    assert text.splitlines()[-1].startswith("configs match")


@pytest.mark.parametrize(
    "keys, value, expected",
    [
        ((*UNET_PARAMS, "channel_mult"), [1, 4], {"block_out_channels"}),
        ((*UNET_PARAMS, "model_channels"), 16, {"block_out_channels"}),
        ((*UNET_PARAMS, "attention_resolutions"), [1], {"down_block_types", "up_block_types"}),
        ((*UNET_PARAMS, "num_heads"), 4, {"attention_head_dim"}),
        ((*UNET_PARAMS, "context_dim"), 768, {"cross_attention_dim"}),
        (("model", "params", "image_size"), 16, {"sample_size"}),
    ],
)
def test_one_derived_value_that_differs_is_named(tmp_path, saved, keys, value, expected):
    report = config_diff(write_yaml(tmp_path / "v1.yaml", [(keys, value)]), saved / "unet")
    assert report.exit_code == 1
    assert {d.key for d in report.differences} == expected
    assert not report.only_a and not report.only_b


def test_an_older_port_config_is_completed_from_class_defaults_on_request(tmp_path, saved):
    # configs written by older diffusers lack keys the helper now derives (SD v1.5's own unet/config.json)
    config = json.loads((saved / "unet" / "config.json").read_text())
    for key in ("transformer_layers_per_block", "use_linear_projection", "class_embed_type"):
        del config[key]
    (tmp_path / "old_unet").mkdir()
    (tmp_path / "old_unet" / "config.json").write_text(json.dumps(config))
    yaml_path = write_yaml(tmp_path / "v1.yaml")
    plain = config_diff(yaml_path, tmp_path / "old_unet")
    assert plain.only_a == ["class_embed_type", "transformer_layers_per_block", "use_linear_projection"]
    assert plain.only_a_with_b_default == plain.only_a
    filled = config_diff(yaml_path, tmp_path / "old_unet", with_defaults=True)
    assert filled.exit_code == 0, filled.render()
    assert set(filled.filled_defaults["b"]) >= set(plain.only_a)
    # must still fire: a derived value the class default does not match
    deep = write_yaml(tmp_path / "deep.yaml", [((*UNET_PARAMS, "transformer_depth"), 2)])
    report = config_diff(deep, tmp_path / "old_unet", with_defaults=True)
    assert [(d.key, d.a, d.b, d.b_default) for d in report.differences] == [
        ("transformer_layers_per_block", 2, 1, True)
    ]


def test_vae_and_pipeline_targets(tmp_path, saved):
    yaml_path = write_yaml(tmp_path / "v1.yaml")
    vae = config_diff(yaml_path, saved / "vae")
    assert vae.exit_code == 0, vae.render()
    assert vae.derived_with == {"": VAE_HELPER}
    assert {"block_out_channels", "latent_channels", "scaling_factor", "sample_size"} <= set(vae.equal)

    pipeline = config_diff(yaml_path, saved / "pipeline")
    assert pipeline.exit_code == 0, pipeline.render()
    assert pipeline.derived_with == {"unet": UNET_HELPER, "vae": VAE_HELPER}
    assert "unet.block_out_channels" in pipeline.equal and "vae.block_out_channels" in pipeline.equal
    reasons = {u.key: u.reason for u in pipeline.not_compared}
    assert reasons["scheduler.timestep_spacing"] == NO_COUNTERPART

    wrong = write_yaml(tmp_path / "wrong.yaml", [((*DDCONFIG, "ch"), 16)])
    assert {d.key for d in config_diff(wrong, saved / "pipeline").differences} == {"vae.block_out_channels"}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_derivation_is_diffusers_own(saved):
    from diffusers.loaders.single_file_utils import create_unet_diffusers_config_from_ldm

    derivation = derive_from_ldm(V1_INFERENCE, {"_class_name": "UNet2DConditionModel"}, label="v1.yaml")
    expected = create_unet_diffusers_config_from_ldm(V1_INFERENCE, {}, image_size=8 * 2)
    assert derivation.config == json.loads(json.dumps(expected))
    assert derivation.notes == []


def test_without_an_image_size_sample_size_is_not_derived(tmp_path, saved):
    report = config_diff(
        write_yaml(tmp_path / "v1.yaml", [(("model", "params", "image_size"), None)]), saved / "unet"
    )
    assert "sample_size" not in report.equal and "sample_size" not in {d.key for d in report.differences}
    assert any("sample_size not derived" in note for note in report.notes)
    assert {u.key: u.reason for u in report.not_compared}["sample_size"] == NO_COUNTERPART
    assert report.exit_code == 0


def test_no_ldm_compares_raw_keys_and_two_yamls_are_compared_raw(tmp_path, saved):
    yaml_path = write_yaml(tmp_path / "v1.yaml")
    raw = config_diff(yaml_path, saved / "unet", ldm=False)
    assert raw.derived_with == {} and raw.exit_code == 1
    assert "model.params.unet_config.params.channel_mult" in raw.only_a
    other = write_yaml(tmp_path / "other.yaml", [((*UNET_PARAMS, "legacy"), True)])
    both = config_diff(yaml_path, other)
    assert both.derived_with == {}
    assert [d.key for d in both.differences] == ["model.params.unet_config.params.legacy"]
    assert is_ldm_config(V1_INFERENCE) and not is_ldm_config({"model": {"params": {}}})


@pytest.mark.parametrize(
    "changes, target, message",
    [
        (
            [((*UNET_PARAMS, "transformer_depth"), None)],
            "unet",
            "model.params.unet_config.params.transformer_depth",
        ),
        ([(("model", "params", "first_stage_config"), None)], "vae", "no model.params.first_stage_config"),
        # SDXL-style class conditioning without its input size: diffusers' helper asserts
        ([((*UNET_PARAMS, "num_classes"), "sequential")], "unet", "cannot read this YAML"),
    ],
)
def test_a_yaml_missing_what_diffusers_needs_is_one_line(tmp_path, saved, changes, target, message):
    yaml_path = write_yaml(tmp_path / "v1.yaml", changes)
    with pytest.raises(ParityKitError, match=message) as info:
        config_diff(yaml_path, saved / target)
    assert "v1.yaml" in str(info.value) and "\n" not in str(info.value)


def run(*args):
    """``paritykit ARGS`` in-process (the subprocess path is covered in test_configs.py)."""
    from click.testing import CliRunner
    from paritykit.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args], prog_name="paritykit")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    result.returncode = result.exit_code
    return result


def test_a_port_the_helpers_cannot_describe_is_refused(tmp_path, saved):
    yaml_path = write_yaml(tmp_path / "v1.yaml")
    with pytest.raises(ParityKitError, match="not SD3Transformer2DModel"):
        config_diff(yaml_path, {"_class_name": "SD3Transformer2DModel", "num_layers": 2})
    scheduler_only = {"scheduler": {"_library": "diffusers", "_class": "DDIMScheduler", "beta_end": 0.012}}
    with pytest.raises(ParityKitError, match="no UNet2DConditionModel or AutoencoderKL component"):
        config_diff(yaml_path, scheduler_only)
    # --no-ldm still compares the raw keys
    assert config_diff(yaml_path, scheduler_only, ldm=False).only_a


def test_cli_ldm(tmp_path, saved):
    good = write_yaml(tmp_path / "v1-inference.yaml")
    result = run("config-diff", good, saved / "unet", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads(result.stdout)
    assert payload["derived_with"] == {"": UNET_HELPER}
    assert "block_out_channels" in payload["equal"]
    assert {
        "key": "model.params.unet_config.params.legacy",
        "side": "a",
        "reason": REFERENCE_ONLY,
        "value": False,
    } in payload["not_compared"]

    bad = write_yaml(tmp_path / "bad.yaml", [((*UNET_PARAMS, "channel_mult"), [1, 4])])
    result = run("config-diff", bad, saved / "unet")
    assert result.returncode == 1 and "block_out_channels" in result.stdout

    (tmp_path / "plain.yaml").write_text(yaml.safe_dump({"depth": 2}))
    result = run("config-diff", tmp_path / "plain.yaml", saved / "unet", "--ldm")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        result.returncode == 2 and len(lines) == 1 and "plain.yaml" in lines[0] and "unet_config" in lines[0]
    )
