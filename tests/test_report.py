import json
import math
import re

import pytest
from paritykit.base.errors import ParityKitError
from paritykit.base.naming import apply_rules, natural_key, parse_map_options, rename_all
from paritykit.base.report import environment_stamp, render_table, to_json, with_verdict


def test_to_json_is_strict_and_flags_nonfinite():
    text = to_json({"a": math.nan, "rows": [{"x": math.inf}, {"x": 1.5}], "b": -math.inf})
    payload = json.loads(text)  # strict parser: would choke on NaN only with parse_constant; check text too
    assert "NaN" not in text and "Infinity" not in text
    assert payload["schema_version"] == 1
    assert payload["a"] is None and payload["rows"][0]["x"] is None and payload["rows"][1]["x"] == 1.5
    assert payload["nonfinite"] == {"a": "nan", "rows.0.x": "inf", "b": "-inf"}


def test_environment_stamp_names_versions_without_importing_torch():
    stamp = environment_stamp(device="cpu")
    assert stamp["device"] == "cpu"
    assert stamp["paritykit"]
    assert stamp["torch"] and stamp["diffusers"]


def test_table_is_bounded():
    rows = [[f"t{i}", float(i)] for i in range(100)]
    text = render_table(["name", "value"], rows, limit=10, summary="100 rows")
    assert text.count("\n") == 1 + 10 + 2
    assert "… 90 more" in text
    assert render_table(["name", "value"], rows, limit=0).count("\n") == 101


def test_map_rules_apply_in_order_to_first_argument_names():
    rules = parse_map_options([r"^blocks\.(\d+)\.=transformer_blocks.\1.", r"qkv=to_qkv"])
    assert apply_rules("blocks.3.attn.qkv.weight", rules) == "transformer_blocks.3.attn.to_qkv.weight"
    with pytest.raises(ParityKitError, match="--map"):
        parse_map_options(["no-equals-sign"])
    with pytest.raises(ParityKitError, match="invalid regular expression"):
        parse_map_options(["(unclosed=x"])
    with pytest.raises(ParityKitError, match="both"):
        rename_all(["a.x", "b.x"], [(r"^[ab]\.", "")])


@pytest.mark.parametrize(
    "text",
    [r"x=\9", r"(a)=\2", r"(?P<blk>a)=\g<block>", "a=\\", r"(a)=\g<1", r"a=\q"],
    ids=["no-group-9", "only-one-group", "unknown-name", "trailing-backslash", "unclosed-g", "bad-escape"],
)
def test_a_bad_replacement_is_refused_when_parsed(text):
    # Before any name is renamed: the error names the option and the rule, never a re.error traceback later.
    with pytest.raises(ParityKitError, match=r"--map .*invalid replacement"):
        parse_map_options([text])


@pytest.mark.parametrize(
    "text", [r"(a)(?P<n>b)=\1-\g<n>-\g<2>", r"x=", r"^model\.diffusion_model\.=", r"a=b\\c", r"(a)?=\1"]
)
def test_valid_replacements_still_parse(text):
    (rule,) = parse_map_options([text])
    assert rule == tuple(text.rsplit("=", 1))


def test_every_json_report_leads_with_verdict_and_passed():
    own = with_verdict({"verdict": "diverge", "passed": True, "rows": []}, 1)
    assert list(own)[:2] == ["verdict", "passed"]
    assert own == {"verdict": "diverge", "passed": False, "rows": []}  # the exit code decides passed
    assert with_verdict({"same": []}, 0) == {"verdict": "pass", "passed": True, "same": []}
    assert with_verdict({"same": []}, 1)["verdict"] == "fail"


def test_natural_sort():
    names = ["after_step_10", "after_step_2", "preloop", "after_step_1"]
    assert sorted(names, key=natural_key) == ["after_step_1", "after_step_2", "after_step_10", "preloop"]


# ------------------------------------------------------------------------------------ reports read true


def test_images_heatmap_colorbar_shows_the_amplified_values_its_title_names():
    import numpy as np
    from paritykit.compare.images import compare_images

    rng = np.random.RandomState(0)
    reference = rng.rand(16, 16, 3).astype(np.float32)
    port = reference.copy()
    port[4:8, 4:8] += 0.02  # a small patch: the raw max |diff| is 0.02
    result = compare_images(reference, port)
    figure = result.figure()
    heatmap = figure.axes[2]
    (image,) = heatmap.get_images()
    gain, raw_max = map(float, re.search(r"×(\S+) \(max (\S+)\)", heatmap.get_title()).groups())
    assert np.isclose(raw_max, 0.02, rtol=1e-3)
    # what is drawn, and so what the colorbar reads, is |diff| × gain: 0 … 1, not 0 … 0.02
    assert image.get_clim() == (0, 1)
    assert np.isclose(float(np.asarray(image.get_array()).max()), gain * raw_max, rtol=1e-3)
    assert np.isclose(gain * raw_max, 1.0, rtol=1e-2)


@pytest.mark.parametrize(("side", "flag"), [(0, "--range-a"), (1, "--range-b")])
def test_images_range_error_names_the_cli_flag_of_that_side(side, flag):
    import numpy as np
    from paritykit.compare.images import compare_images

    fine, odd = np.zeros((4, 4, 3), np.float32), np.full((4, 4, 3), 900.0, np.float32)
    pair = (odd, fine) if side == 0 else (fine, odd)
    with pytest.raises(ParityKitError, match=re.escape(flag)) as refused:
        compare_images(*pair)
    other = "--range-b" if flag == "--range-a" else "--range-a"
    assert other not in str(refused.value) and "set value_range)" not in str(refused.value)


def test_versions_read_from_dist_info_folders_agree_with_importlib_metadata():
    from importlib import metadata

    from paritykit.base.report import _package_version

    for name in ("torch", "diffusers", "numpy", "k-diffusion"):
        assert _package_version(name) == metadata.version(name)
    assert _package_version("no-such-distribution-here") is None


def test_a_cosine_that_is_not_one_never_reads_as_one():
    from paritykit.base.report import format_cosine

    assert format_cosine(1.0) == "1" and format_cosine(None) == "-"
    assert format_cosine(0.9813892123) == "0.9813892"
    for value in (0.99999994, 0.9999999999, 1 - 3e-13, 0.9999):
        text = format_cosine(value)
        assert text != "1" and not text.startswith("1.0"), text
        assert float(text.replace("1 - ", "")) != 1.0 or text.startswith("1 - ")
    assert format_cosine(0.5) == "0.5" and format_cosine(-0.3) == "-0.3"
