"""Step curves over real checkpoint folders of a tiny diffusers pipeline, and image/video comparisons."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DiffusionPipeline
from paritykit.base.errors import ParityKitError
from paritykit.base.report import to_json
from paritykit.compare.images import compare_images
from paritykit.compare.steps import (
    BOUNDED_MAX_GROWTH,
    BOUNDED_MAX_LATE_GROWTH,
    EXPONENTIAL_MIN_FACTOR,
    EXPONENTIAL_MIN_R2,
    classify_growth,
    step_curve,
)
from paritykit.tracing.checkpoints import (
    Checkpoint,
    load_checkpoints,
    maybe_checkpoint,
    save_checkpoints,
    seeded_noise,
)
from PIL import Image

from tests._pipelines import make_tiny_unet

STEPS = 6


class TinyDDIMPipeline(DiffusionPipeline):
    """A real DiffusionPipeline over a tiny UNet2DModel + DDIMScheduler, instrumented with checkpoints."""

    def __init__(self, unet, scheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)

    @torch.no_grad()
    def __call__(self, num_inference_steps=STEPS, seed=0, noise_dtype=torch.float32, _checkpoints=None):
        latents = seeded_noise((1, 3, 16, 16), seed).to(noise_dtype).to(torch.float32)
        self.scheduler.set_timesteps(num_inference_steps)
        for i, t in enumerate(self.scheduler.timesteps):
            eps = self.unet(latents, t).sample
            latents = self.scheduler.step(eps, t, latents).prev_sample
            latents = maybe_checkpoint(_checkpoints, f"after_step_{i}", latents=latents)["latents"]
        return latents


def _pipeline() -> TinyDDIMPipeline:
    unet = make_tiny_unet(sample_size=16, attention=False)
    return TinyDDIMPipeline(unet=unet, scheduler=DDIMScheduler(num_train_timesteps=1000))


def _run(pipe, folder, **kwargs):
    checkpoints = {f"after_step_{i}": Checkpoint(save=True) for i in range(STEPS)}
    out = pipe(_checkpoints=checkpoints, **kwargs)
    save_checkpoints(folder, checkpoints)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Reference run, an identical rerun, and a port whose initial noise was rounded to bfloat16."""
    root = tmp_path_factory.mktemp("runs")
    pipe = _pipeline()
    out = {
        "ref": _run(pipe, root / "ref"),
        "same": _run(pipe, root / "same"),
        "port": _run(pipe, root / "port", noise_dtype=torch.bfloat16),
    }
    sched = pipe.scheduler
    alphas = sched.alphas_cumprod[sched.timesteps]
    sigmas = ((1 - alphas) / alphas).sqrt().tolist()
    return root, out, sigmas


# ------------------------------------------------------------------------------------------------------------
# step curves from real pipeline runs
# ------------------------------------------------------------------------------------------------------------
def test_bf16_noise_gives_a_failing_curve_with_the_true_per_step_errors(runs):
    root, _, _ = runs
    curve = step_curve(root / "ref", root / "port")
    assert [p.step for p in curve.points] == list(range(STEPS))
    assert curve.exit_code == 1 and not curve.passed
    assert curve.first_failing_step == 0
    ref, port = load_checkpoints(root / "ref"), load_checkpoints(root / "port")
    for p in curve.points:
        a = ref[f"after_step_{p.step}"].data["latents"]
        b = port[f"after_step_{p.step}"].data["latents"]
        assert p.max_abs == pytest.approx((a - b).abs().max().item(), rel=1e-6)
        assert p.mean_abs == pytest.approx((a - b).abs().mean().item(), rel=1e-5)
        assert p.cosine == pytest.approx(
            torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item(), abs=1e-6
        )
        assert p.max_abs > 0
    assert curve.growth.growth in ("bounded", "polynomial", "exponential")
    assert curve.growth.growth == classify_growth([p.max_abs for p in curve.points]).growth
    assert "growth:" in curve.render() and "OUTSIDE tolerance" in curve.render()


def test_identical_runs_are_bounded_and_exit_zero(runs):
    root, out, _ = runs
    assert torch.equal(out["ref"], out["same"])
    curve = step_curve(root / "ref", root / "same")
    assert curve.exit_code == 0
    assert all(p.max_abs == 0 and p.passed for p in curve.points)
    assert curve.growth.growth == "bounded"
    assert curve.first_failing_step is None


def test_json_report_is_strict_with_schema_and_environment(runs):
    root, _, _ = runs
    payload = json.loads(to_json(step_curve(root / "ref", root / "port").to_dict()))
    assert payload["schema_version"] == 1
    assert "torch" in payload["environment"] and "diffusers" in payload["environment"]
    assert payload["verdict"] == "diverge" and len(payload["steps"]) == STEPS
    assert payload["growth"]["thresholds"]["exponential_min_factor"] == EXPONENTIAL_MIN_FACTOR
    assert payload["last_step"]["step"] == STEPS - 1


@pytest.mark.parametrize("suffix", [".json", ".txt", ".npy", ".safetensors"])
def test_sigmas_from_every_file_kind_add_amplification(runs, tmp_path, suffix):
    root, _, sigmas = runs
    path = tmp_path / f"sigmas{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(sigmas + [0.0]))
    elif suffix == ".txt":
        path.write_text("\n".join(str(s) for s in sigmas))
    elif suffix == ".npy":
        np.save(path, np.asarray(sigmas))
    else:
        from safetensors.torch import save_file

        save_file({"sigmas": torch.tensor(sigmas, dtype=torch.float64)}, str(path))
    curve = step_curve(root / "ref", root / "port", sigmas=path)
    for p, s in zip(curve.points, sigmas):
        assert p.sigma == pytest.approx(s)
        assert p.inv_sigma == pytest.approx(1 / s)
        assert p.max_abs_times_sigma == pytest.approx(p.max_abs * s)
    assert curve.sigma_scaled_growth is not None
    assert curve.sigma_scaled_growth.growth in ("bounded", "polynomial", "exponential")
    text = curve.render()
    assert "1/sigma" in text and "max_abs*sigma" in text
    assert json.loads(to_json(curve.to_dict()))["steps"][0]["inv_sigma"] == pytest.approx(1 / sigmas[0])


def test_too_few_sigmas_or_a_bad_file_is_one_line_naming_it(runs, tmp_path):
    root, _, sigmas = runs
    short = tmp_path / "short.json"
    short.write_text(json.dumps(sigmas[:2]))
    with pytest.raises(ParityKitError, match="short.json"):
        step_curve(root / "ref", root / "port", sigmas=short)
    bad = tmp_path / "bad.txt"
    bad.write_text("0.5 banana")
    with pytest.raises(ParityKitError, match="bad.txt"):
        step_curve(root / "ref", root / "port", sigmas=bad)


def test_missing_key_folder_and_unequal_step_counts(runs, tmp_path):
    root, _, _ = runs
    with pytest.raises(ParityKitError, match="noise_pred"):
        step_curve(root / "ref", root / "port", key="noise_pred")
    with pytest.raises(ParityKitError, match="nowhere"):
        step_curve(tmp_path / "nowhere", root / "port")
    shorter = tmp_path / "shorter"
    full = load_checkpoints(root / "ref")
    save_checkpoints(
        shorter, {n: Checkpoint(data=c.data) for n, c in full.items() if n != f"after_step_{STEPS - 1}"}
    )
    curve = step_curve(shorter, root / "ref")
    assert curve.only_b == [STEPS - 1] and curve.exit_code == 1
    assert all(p.passed for p in curve.points)


def test_plain_folders_of_step_tensors_without_a_manifest(runs, tmp_path):
    root, _, _ = runs
    ref, port = load_checkpoints(root / "ref"), load_checkpoints(root / "port")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for name in ref:
        torch.save(ref[name].data["latents"], tmp_path / "a" / f"{name}.pt")  # one bare tensor per step
        np.save(tmp_path / "b" / f"{name}.npy", port[name].data["latents"].numpy())
    (tmp_path / "a" / "notes.txt").write_text("ignored")
    plain = step_curve(tmp_path / "a", tmp_path / "b")
    saved = step_curve(root / "ref", root / "port")
    assert [p.max_abs for p in plain.points] == [p.max_abs for p in saved.points]
    assert plain.growth.growth == saved.growth.growth


def test_plot_reads_back_as_png(runs, tmp_path):
    root, _, sigmas = runs
    for name, kwargs, other in (
        ("plain", {}, "port"),
        ("sig", {"sigmas": sigmas}, "port"),
        ("zero", {}, "same"),
    ):
        path = tmp_path / "plots" / f"{name}.png"
        curve = step_curve(root / "ref", root / other, plot=path, **kwargs)
        assert curve.plot_path == str(path)
        with Image.open(path) as img:
            assert img.format == "PNG" and img.size == (750, 450) and img.mode == "RGBA"
            assert len(np.unique(np.asarray(img.convert("L")))) > 2  # something was drawn


# ------------------------------------------------------------------------------------------------------------
# growth classes on synthetic curves
# ------------------------------------------------------------------------------------------------------------
def _write_curve(folder, errors, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = 0.5 * torch.randn(2, 4, 8, 8, generator=g)
    direction = torch.randn(2, 4, 8, 8, generator=g)
    direction /= direction.abs().max()
    a, b = {}, {}
    for i, e in enumerate(errors):
        latents = base * (1 - i / (2 * len(errors)))
        a[f"after_step_{i}"] = Checkpoint(data={"latents": latents})
        b[f"after_step_{i}"] = Checkpoint(data={"latents": latents + e * direction})
    save_checkpoints(folder / "a", a)
    save_checkpoints(folder / "b", b)
    return folder / "a", folder / "b"


SYNTHETIC = {
    "bounded": [2e-3 * (1 + 0.1 * math.sin(i)) for i in range(12)],
    "polynomial": [1e-4 * (i + 1) for i in range(12)],
    "exponential": [1e-4 * 1.6**i for i in range(12)],
}


@pytest.mark.parametrize("growth", sorted(SYNTHETIC))
def test_synthetic_checkpoint_folders_get_their_growth_class(tmp_path, growth):
    a, b = _write_curve(tmp_path, SYNTHETIC[growth])
    curve = step_curve(a, b)
    measured = [p.max_abs for p in curve.points]
    assert measured == pytest.approx(SYNTHETIC[growth], rel=1e-2)
    assert curve.growth.growth == growth
    assert curve.exit_code == 1


def test_growth_thresholds_at_their_edges():
    steps = range(10)
    # just over / under / over the per-step factor for exponential
    assert (
        classify_growth([1e-6 * (EXPONENTIAL_MIN_FACTOR * 1.02) ** i for i in steps]).growth == "exponential"
    )
    slow = classify_growth([1e-6 * (EXPONENTIAL_MIN_FACTOR * 0.97) ** i for i in range(30)])
    assert slow.growth == "polynomial" and slow.per_step_factor < EXPONENTIAL_MIN_FACTOR
    # growth below the bounded factor over the whole run
    just_bounded = [1e-3 * (BOUNDED_MAX_GROWTH * 0.9) ** (i / 9) for i in steps]
    assert classify_growth(just_bounded).growth == "bounded"
    # a curve that rose and then levelled off (last half grows < BOUNDED_MAX_LATE_GROWTH)
    plateau = [1e-3 * (1 - 0.9 * math.exp(-i)) for i in range(12)]
    fit = classify_growth(plateau)
    assert fit.growth == "bounded" and fit.late_growth < BOUNDED_MAX_LATE_GROWTH
    # power law: quadratic growth is polynomial, not exponential
    quad = classify_growth([1e-6 * (i + 1) ** 2 for i in steps])
    assert quad.growth == "polynomial" and quad.power_exponent == pytest.approx(2.0, rel=1e-6)
    assert quad.r2_power >= EXPONENTIAL_MIN_R2
    # shrinking error, all-zero, too short, non-finite
    assert classify_growth([1e-2 / (i + 1) for i in steps]).growth == "bounded"
    assert classify_growth([0.0] * 5).growth == "bounded"
    assert classify_growth([0.0, 0.0, 1e-3]).growth == "unknown"
    assert classify_growth([1e-3, 2e-3, float("nan")]).growth == "unknown"


def test_one_over_sigma_amplification_is_recognised(tmp_path):
    sigmas = [1.0 / (1.0 + 0.8 * i) ** 2 for i in range(10)]
    errors = [1e-4 / s for s in sigmas]  # a fixed difference amplified by 1/sigma
    a, b = _write_curve(tmp_path, errors)
    curve = step_curve(a, b, sigmas=sigmas)
    assert curve.growth.growth in ("polynomial", "exponential")
    assert curve.sigma_scaled_growth.growth == "bounded"
    assert curve.amplification_explains_growth() is True
    assert "1/sigma amplification" in curve.render()


# ------------------------------------------------------------------------------------------------------------
# CLI (subprocess): exit codes, JSON, one-line errors, help quotes the thresholds
# ------------------------------------------------------------------------------------------------------------
def test_cli_steps_exit_codes_json_and_plot(runs, cli, tmp_path):
    root, _, _ = runs
    plot = tmp_path / "curve.png"
    res = cli("steps", root / "ref", root / "port", "--json", "--plot", plot)
    assert res.returncode == 1, res.stderr
    payload = json.loads(res.stdout)
    assert payload["schema_version"] == 1 and payload["plot"] == str(plot)
    assert Image.open(plot).format == "PNG"
    same = cli("steps", root / "ref", root / "same", "--limit", "2")
    assert same.returncode == 0, same.stderr
    assert "4 more" in same.stdout and "within tolerance" in same.stdout
    table = same.stdout.splitlines()
    # the verdict (last step, growth) first, then the table with its middle elided
    assert table[1].startswith("last step") and table[2].startswith("growth:")
    assert table[5].startswith("0 ") and table[6].startswith("…") and table[7].startswith(f"{STEPS - 1} ")
    bad = cli("steps", tmp_path / "missing", root / "port")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "missing" in bad.stderr
    help_text = " ".join(cli("steps", "--help").stdout.split())
    for number in (BOUNDED_MAX_GROWTH, BOUNDED_MAX_LATE_GROWTH, EXPONENTIAL_MIN_FACTOR, EXPONENTIAL_MIN_R2):
        assert f"{number:g}" in help_text


# ------------------------------------------------------------------------------------------------------------
# images
# ------------------------------------------------------------------------------------------------------------
def _photo(h=24, w=32, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x / w, y / h, 0.5 + 0.3 * np.sin(x / 3.0)], axis=-1)
    return np.clip(img + 0.05 * rng.standard_normal(img.shape), 0, 1).astype(np.float32)


def _psnr(a, b):
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return 10 * math.log10(1 / mse)


def test_identical_images_have_infinite_psnr_and_exit_zero(tmp_path):
    arr = (_photo() * 255).round().astype(np.uint8)
    pil = Image.fromarray(arr)
    result = compare_images(pil, arr, out=tmp_path / "same.png")
    assert result.psnr == math.inf and result.max_pixel_diff == 0 and result.exit_code == 0
    payload = json.loads(to_json(result.to_dict()))
    assert payload["psnr"] is None and payload["nonfinite"]["psnr"] == "inf"
    assert payload["environment"]["paritykit"]
    with Image.open(tmp_path / "same.png") as img:
        assert img.format == "PNG" and img.mode == "RGBA" and img.size[0] > img.size[1]


def test_perturbed_image_falls_below_threshold(tmp_path):
    ref = _photo()
    rng = np.random.default_rng(1)
    port = np.clip(ref + 0.03 * rng.standard_normal(ref.shape), 0, 1).astype(np.float32)
    result = compare_images(ref, port, psnr_min=40)
    assert result.psnr == pytest.approx(_psnr(ref, port), rel=1e-6)
    assert result.psnr < 40 and result.exit_code == 1 and result.status == "fail"
    assert result.max_pixel_diff == pytest.approx(np.abs(ref - port).max() * 255, rel=1e-5)
    assert compare_images(ref, port, psnr_min=result.psnr - 1).exit_code == 0
    assert "FAIL" in result.render()


def test_minus_one_to_one_tensor_against_zero_to_one_image_file(tmp_path):
    ref = _photo()
    Image.fromarray((ref * 255).round().astype(np.uint8)).save(tmp_path / "ref.png")
    port = torch.from_numpy(ref).permute(2, 0, 1)[None] * 2 - 1  # 1×C×H×W in [-1, 1], as a VAE decodes
    torch.save(port, tmp_path / "port.pt")
    for b in (port, tmp_path / "port.pt"):
        result = compare_images(tmp_path / "ref.png", b, psnr_min=45)
        assert result.range_a.startswith("0..255") and result.range_b == "-1..1"
        assert result.shape_a == result.shape_b == [1, 24, 32, 3]
        assert result.exit_code == 0 and result.psnr > 45  # only 8-bit rounding differs
    # float [0, 1] against float [-1, 1]: each side keeps its own range
    floats = compare_images(ref, port)
    assert (floats.range_a, floats.range_b, floats.range_note) == ("0..1", "-1..1", None)
    assert floats.psnr > 100
    # the same tensor read as [0, 1] (wrong) is far off
    wrong = compare_images(tmp_path / "ref.png", port.clamp(0, 1), value_range=("auto", "0..1"))
    assert wrong.exit_code == 1


def test_bright_minus_one_to_one_image_without_negatives_is_read_like_its_partner():
    bright = _photo() * 0.5 + 0.45  # a [-1, 1] picture that happens to be bright: all values >= 0 ...
    ref = bright.copy()
    ref[0, 0, 0] = -0.01  # ... except one pixel on the reference side
    port = bright.copy()
    port[0, 0, 0] = 0.0
    result = compare_images(ref, port)
    assert result.range_a == result.range_b == "-1..1" and result.range_note.startswith("B has no negative")
    assert result.exit_code == 0 and result.max_pixel_diff == pytest.approx(0.005 * 255, rel=1e-3)
    assert "note:" in result.render()
    # an explicit range on both sides is taken as given
    forced = compare_images(ref, port, value_range=("-1..1", "0..1"))
    assert forced.range_note is None and forced.exit_code == 1


def test_video_gets_per_frame_figures_and_chosen_frames(tmp_path):
    frames = np.stack([_photo(seed=i) for i in range(6)])  # F×H×W×C
    port = frames.copy()
    port[3] = np.clip(port[3] + 0.1, 0, 1)
    port[1] = np.clip(port[1] + 0.001, 0, 1)
    result = compare_images(frames, port, out=tmp_path / "video.png")
    assert result.video and len(result.frames) == 6
    assert result.frames[0].psnr == math.inf and result.frames[3].psnr == pytest.approx(
        _psnr(frames[3], port[3])
    )
    assert result.worst.frame == 3 and result.exit_code == 1
    assert result.chosen == [(0, "first"), (3, "worst"), (5, "last")]
    assert "frame" in result.render()
    with Image.open(tmp_path / "video.png") as img:
        assert img.format == "PNG" and img.size[1] > img.size[0] / 3  # three rows
    # a torch video F×C×H×W and a list of PIL frames are read the same way
    as_torch = torch.from_numpy(port).permute(0, 3, 1, 2)
    as_pil = [Image.fromarray((f * 255).round().astype(np.uint8)) for f in frames]
    again = compare_images(as_pil, as_torch)
    assert again.worst.frame == 3 and len(again.frames) == 6


def test_animated_gif_is_a_video(tmp_path):
    frames = [Image.fromarray((_photo(seed=i) * 255).round().astype(np.uint8)) for i in range(3)]
    frames[0].save(tmp_path / "clip.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    result = compare_images(tmp_path / "clip.gif", tmp_path / "clip.gif")
    assert result.video and len(result.frames) == 3 and result.exit_code == 0


def test_truncated_checkpoint_is_one_line_naming_the_file(runs, tmp_path):
    import shutil

    root, _, _ = runs
    shutil.copytree(root / "port", tmp_path / "port")
    broken = tmp_path / "port" / "after_step_2.safetensors"
    broken.write_bytes(broken.read_bytes()[:40])
    with pytest.raises(ParityKitError, match="after_step_2.safetensors"):
        step_curve(root / "ref", tmp_path / "port")


def test_shape_mismatch_and_bad_inputs(tmp_path):
    result = compare_images(_photo(24, 32), _photo(32, 32))
    assert result.status == "shape_mismatch" and result.exit_code == 1 and result.psnr is None
    assert "SHAPE MISMATCH" in result.render()
    with pytest.raises(ParityKitError, match="nope.png"):
        compare_images(tmp_path / "nope.png", _photo())
    (tmp_path / "notes.xyz").write_text("x")
    with pytest.raises(ParityKitError, match="notes.xyz"):
        compare_images(tmp_path / "notes.xyz", _photo())
    with pytest.raises(ParityKitError, match="values span"):
        compare_images(_photo() * 1000, _photo())


def test_pipeline_outputs_as_images(runs, tmp_path):
    _, out, _ = runs
    same = compare_images(out["ref"], out["same"], value_range="-1..1")
    assert same.exit_code == 0 and same.psnr == math.inf
    port = compare_images(out["ref"], out["port"], psnr_min=200, value_range="-1..1")
    assert port.psnr < 200 and port.exit_code == 1 and port.shape_a == [1, 16, 16, 3]


def test_cli_images(tmp_path, cli):
    ref = (_photo() * 255).round().astype(np.uint8)
    Image.fromarray(ref).save(tmp_path / "a.png")
    Image.fromarray(255 - ref).save(tmp_path / "b.png")
    ok = cli("images", tmp_path / "a.png", tmp_path / "a.png")
    assert ok.returncode == 0, ok.stderr
    assert "PASS" in ok.stdout
    res = cli("images", tmp_path / "a.png", tmp_path / "b.png", "--out", tmp_path / "d.png", "--json")
    assert res.returncode == 1, res.stderr
    payload = json.loads(res.stdout)
    assert payload["status"] == "fail" and payload["psnr"] < 40 and payload["out"] == str(tmp_path / "d.png")
    assert Image.open(tmp_path / "d.png").format == "PNG"
    bad = cli("images", tmp_path / "a.png", tmp_path / "zzz.png")
    assert bad.returncode == 2 and "zzz.png" in bad.stderr and bad.stderr.strip().count("\n") == 0


def test_a_report_path_naming_an_input_is_refused_by_the_library(tmp_path):
    image = Image.new("RGB", (8, 8), (10, 20, 30))
    a, b = tmp_path / "ref.png", tmp_path / "port.png"
    image.save(a)
    image.save(b)
    before = b.read_bytes()
    with pytest.raises(ParityKitError, match="--out"):
        compare_images(str(a), str(b), out=b)
    assert b.read_bytes() == before
