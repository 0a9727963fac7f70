import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from paritykit.base.errors import ParityKitError
from paritykit.forensics.config_files import flatten, load_config, values_equal
from paritykit.forensics.configs import config_diff


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


# ------------------------------------------------------------------ ignore on both sides, equal keys listed
def test_ignore_drops_the_key_on_both_sides_before_and_after_map():
    a = {"ref": {"dim": 8, "eps": 1e-6}, "heads": 2}
    b = {"dim": 8, "norm_eps": 1e-5, "heads": 2}
    rules = [(r"^ref\.", ""), (r"^eps$", "norm_eps")]
    assert [d.key for d in config_diff(a, b, rules=rules).differences] == ["norm_eps"]
    # the pattern in A's original naming, in A's renamed naming, or B's naming: the pair is gone from both
    # sides
    for pattern in ("ref.eps", "ref.*", "norm_eps", "*eps"):
        report = config_diff(a, b, rules=rules, ignore=[pattern])
        assert report.exit_code == 0, pattern
        assert "norm_eps" in report.ignored, pattern
        assert "norm_eps" not in report.only_a + report.only_b + [d.key for d in report.differences]
    # must not fire: an unrelated pattern leaves the difference in place
    assert config_diff(a, b, rules=rules, ignore=["head*"]).exit_code == 1


def test_equal_keys_are_counted_and_listed():
    report = config_diff({"a": 1, "b": [1, 2], "c": 3}, {"a": 1.0, "b": (1, 2), "c": 4})
    assert report.equal == ["a", "b"] and report.same == 2
    assert report.to_dict()["equal"] == ["a", "b"]
    assert "2 equal" in report.render()


# ------------------------------------------------------------------------------------ class defaults
def test_port_keys_at_the_class_default_are_listed_not_counted(tmp_path):
    from paritykit.forensics.configs import DEFAULT

    tiny_unet().save_pretrained(tmp_path / "unet")
    reference = {k: v for k, v in load_config(tmp_path / "unet").items() if not k.startswith("_")}
    del reference["act_fn"]  # at UNet2DConditionModel's default: the port's value is not a claim
    del reference["cross_attention_dim"]  # 32, not the default 1280: must still be reported
    report = config_diff(reference, tmp_path / "unet")
    reasons = {u.key: u.reason for u in report.not_compared}
    assert reasons["act_fn"] == DEFAULT and "act_fn" not in report.only_b
    assert report.only_b == ["cross_attention_dim"] and report.exit_code == 1
    strict = config_diff(reference, tmp_path / "unet", compare_defaults=True)
    assert strict.only_b == ["act_fn", "cross_attention_dim"]


def test_reference_keys_compares_only_what_the_reference_has(tmp_path):
    from paritykit.forensics.configs import NOT_IN_REFERENCE

    tiny_unet().save_pretrained(tmp_path / "unet")
    reference = {"ldm.in_channels": 4, "ldm.context_dim": 32}
    rules = [(r"^ldm\.", ""), (r"^context_dim$", "cross_attention_dim")]
    assert config_diff(reference, tmp_path / "unet", rules=rules).exit_code == 1  # block_out_channels …
    report = config_diff(reference, tmp_path / "unet", rules=rules, reference_keys=True)
    assert report.exit_code == 0, report.render()
    assert report.equal == ["cross_attention_dim", "in_channels"]
    assert {u.key for u in report.not_compared if u.reason == NOT_IN_REFERENCE} >= {"block_out_channels"}
    # must still fire on a key the reference has
    reference["ldm.context_dim"] = 768
    report = config_diff(reference, tmp_path / "unet", rules=rules, reference_keys=True)
    assert [(d.key, d.a, d.b) for d in report.differences] == [("cross_attention_dim", 768, 32)]


def scheduler_json(path, **extra):
    config = {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", **extra}
    path.write_text(json.dumps(config))
    return path


def test_with_defaults_shows_what_the_port_assumes(tmp_path):
    reference = {
        "num_train_timesteps": 1000,
        "beta_schedule": "scaled_linear",
        "timestep_spacing": "trailing",
    }
    port = scheduler_json(tmp_path / "scheduler_config.json", _class_name="DDIMScheduler")
    plain = config_diff(reference, port)
    assert plain.only_a == ["timestep_spacing"] and plain.differences == []
    assert plain.only_a_with_b_default == ["timestep_spacing"] and "--with-defaults" in plain.render()

    report = config_diff(reference, port, with_defaults=True)
    assert [(d.key, d.a, d.b, d.b_default) for d in report.differences] == [
        ("timestep_spacing", "trailing", "leading", True)
    ]
    assert "timestep_spacing" in report.filled_defaults["b"]
    assert "'leading' (default)" in report.render()
    # keys only the filled-in port has are defaults: listed, not counted
    assert not report.only_b
    # a folder, and --class for a config without _class_name, read the same defaults
    assert config_diff(reference, tmp_path, with_defaults=True).differences == report.differences
    bare = scheduler_json(tmp_path / "bare.json")
    by_class = config_diff(reference, bare, with_defaults=True, class_name="DDIMScheduler")
    assert by_class.differences == report.differences
    # must not fire: the reference's value equals the assumed default
    reference["timestep_spacing"] = "leading"
    assert config_diff(reference, port, with_defaults=True).exit_code == 0


def test_unknown_class_is_one_line_naming_the_option(cli, tmp_path):
    with pytest.raises(ParityKitError, match="--class NoSuchScheduler"):
        config_diff({"a": 1}, {"a": 1}, class_name="NoSuchScheduler")
    bare = scheduler_json(tmp_path / "bare.json")
    result = cli("config-diff", bare, bare, "--class", "NoSuchScheduler")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "--class" in lines[0]


# ----------------------------------------------------------------------------------------- --suggest-map
def test_suggest_map_proposes_rules_that_line_keys_up():
    from paritykit.base.naming import parse_map_options

    reference = {"net": {"in_channels": 4, "out_channels": 4, "context_dim": 77, "depth": 2}}
    port = {"in_channels": 4, "out_channels": 4, "cross_attention_dim": 77, "layers": 3}
    report = config_diff(reference, port, suggest=True)
    arguments = [s.argument for s in report.suggestions]
    assert arguments == ["--map '^net\\.='", "--map '^context_dim$=cross_attention_dim'"]
    # the printed arguments parse as --map and, applied, line the keys up
    rules = parse_map_options([a.removeprefix("--map ").strip("'") for a in arguments])
    applied = config_diff(reference, port, rules=rules)
    assert applied.equal == ["cross_attention_dim", "in_channels", "out_channels"]
    assert "suggested --map" in report.render()


def test_suggest_map_leaves_ties_and_common_values_alone():
    # two reference keys hold 7 and the port has one: which is the rename is not settled by values
    tie = config_diff({"alpha": 7, "beta": 7}, {"gamma": 7}, suggest=True)
    assert tie.suggestions == []
    # a flag value (True) with unrelated names is no evidence
    flags = config_diff({"use_checkpoint": True}, {"flip_sin_to_cos": True}, suggest=True)
    assert flags.suggestions == []
    # look-alikes from SD v1's YAML: one key each side holds the value, but the names are unrelated
    unrelated = config_diff(
        {"image_size": 32, "dropout": 0.0}, {"norm_num_groups": 32, "freq_shift": 0}, suggest=True
    )
    assert unrelated.suggestions == []


# ------------------------------------------------------------------------- the generated config-diff script
def test_generated_script_has_the_reference_keys_switch(tmp_path):
    import subprocess
    import sys

    from paritykit.pack import scaffold

    (tmp_path / "ref.json").write_text(json.dumps({"in_channels": 4}))
    (tmp_path / "port.json").write_text(json.dumps({"in_channels": 4, "layers": 3}))
    script = scaffold.generate(
        "config-diff",
        "s",
        out_dir=tmp_path / "gen",
        reference=str(tmp_path / "ref.json"),
        diffusers=str(tmp_path / "port.json"),
    ).paths[0]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "helpers")}
    runs = {
        flag: subprocess.run(
            [sys.executable, str(script), *flag.split()], capture_output=True, text=True, env=env
        )
        for flag in ("", "--reference-keys --json")
    }
    assert runs[""].returncode == 1, runs[""].stdout + runs[""].stderr
    assert runs["--reference-keys --json"].returncode == 0, runs["--reference-keys --json"].stderr
    payload = json.loads(runs["--reference-keys --json"].stdout)
    assert payload["passed"] is True and payload["equal"] == ["in_channels"]
