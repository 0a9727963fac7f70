"""Drive generated pipeline stubs with tiny real components, as the stub's docstring documents.

Usage: python drive_stub.py WORK_DIR   (the generated stubs must be importable, e.g. on PYTHONPATH)
Checks: end-to-end runs, non-destructive saving, stop, injection, latent output, save/from_pretrained, the
stub's own main() writing checkpoints to disk, and the --modular file sets (modular_tiny/, modular_pixel/)
computing exactly what the standard stubs compute. Prints "CHECK <name> OK" or "CHECK <name> FAILED" + why.
Also saves what the generated component and stage tests load, so one process pays torch's import:
WORK_DIR/saved_pipeline (the tiny stub pipeline), saved_unet (a faithful port), stale_unet (one weight off),
saved_cond_unet and saved_vae (faithful ports of the other reference models), saved_wan (diffusers'
Wan DiT converted from the research one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from diffusers import DDIMScheduler, Transformer2DModel, UNet2DModel
from paritykit.tracing.checkpoints import Checkpoint, load_checkpoints, run_until_stop

STEPS = 5


def check_text_pipeline(work: Path) -> None:
    from pipeline_tiny import TinyPipeline
    from scaffold_parts import tiny_components

    pipe = TinyPipeline(**tiny_components(work))
    pipe.set_progress_bar_config(disable=True)

    def call(seed=0, **kwargs):
        generator = torch.Generator().manual_seed(seed)
        return pipe(
            prompt="a cat", num_inference_steps=STEPS, generator=generator, output_type="pt", **kwargs
        )

    plain = call().images
    assert plain.shape == (1, 3, 16, 16), plain.shape
    assert 0 <= plain.min() and plain.max() <= 1

    names = ["text_encoding", "preloop", *(f"after_step_{i}" for i in range(STEPS)), "post_loop"]
    checkpoints = {name: Checkpoint(save=True) for name in names}
    saved = call(_checkpoints=checkpoints).images
    assert torch.equal(saved, plain), "saving checkpoints changed the output"
    assert set(checkpoints["preloop"].data) == {"latents", "timesteps", "prompt_embeds"}
    assert all(checkpoints[name].data for name in names), [n for n in names if not checkpoints[n].data]

    stop = {"preloop": Checkpoint(save=True, stop=True)}
    assert run_until_stop(call, _checkpoints=stop) is None
    assert torch.equal(stop["preloop"].data["latents"], checkpoints["preloop"].data["latents"])

    other_seed = call(seed=1).images
    assert not torch.equal(other_seed, plain)
    injected = call(seed=1, _checkpoints={"preloop": Checkpoint(load=True, data=checkpoints["preloop"].data)})
    assert torch.equal(injected.images, plain), "injecting run A's preloop into run B must reproduce A"

    latents = call(seed=0, _checkpoints=None).images
    latent_out = pipe(
        prompt="a cat",
        num_inference_steps=STEPS,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert latent_out.shape == (1, 4, 8, 8) and latents.shape == (1, 3, 16, 16)
    assert torch.equal(latent_out, checkpoints["post_loop"].data["latents"])

    pipe.save_pretrained(work / "saved_pipeline")
    reloaded = TinyPipeline.from_pretrained(work / "saved_pipeline")
    reloaded.set_progress_bar_config(disable=True)
    again = reloaded(
        prompt="a cat",
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    # Reloaded weights may take other kernels (strides), so equal to float32 rounding, not bitwise.
    assert torch.allclose(again, plain, atol=1e-5), "save_pretrained/from_pretrained changed the output"

    import pipeline_tiny

    pipeline_tiny.main([str(work / "saved_pipeline"), "--steps", "3", "--checkpoints-out", str(work / "ck")])
    on_disk = load_checkpoints(work / "ck")
    assert list(on_disk) == [
        "text_encoding",
        "preloop",
        "after_step_0",
        "after_step_1",
        "after_step_2",
        "post_loop",
    ], list(on_disk)
    assert on_disk["post_loop"].data["latents"].shape == (1, 4, 8, 8)


def check_modular_pipelines(work: Path) -> None:
    """The --modular file sets compute what the standard stubs compute, with the same checkpoints."""
    from modular_pixel import PixelBlocks, PixelModularPipeline
    from modular_tiny import TinyBlocks, TinyModularPipeline
    from pipeline_pixel import PixelPipeline
    from pipeline_tiny import TinyPipeline
    from scaffold_parts import UNET_CONFIG, tiny_components

    standard = TinyPipeline(**tiny_components(work))
    standard.set_progress_bar_config(disable=True)
    modular = TinyModularPipeline(blocks=TinyBlocks())
    modular.update_components(**tiny_components(work))

    names = ["text_encoding", "preloop", *(f"after_step_{i}" for i in range(STEPS)), "post_loop"]
    expected = {name: Checkpoint(save=True) for name in names}
    images = standard(
        prompt="a cat",
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        _checkpoints=expected,
    ).images
    actual = {name: Checkpoint(save=True) for name in names}
    modular_images = modular(
        prompt="a cat",
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        _checkpoints=actual,
        output="images",
    )
    assert torch.equal(modular_images, images), "modular and standard stubs differ"
    for name in names:
        assert actual[name].data.keys() == expected[name].data.keys(), name
        for key, value in expected[name].data.items():
            assert torch.equal(actual[name].data[key], value), (name, key)

    stop = {"preloop": Checkpoint(save=True, stop=True)}
    generator = torch.Generator().manual_seed(0)
    assert (
        run_until_stop(
            modular, prompt="a cat", num_inference_steps=STEPS, generator=generator, _checkpoints=stop
        )
        is None
    )
    assert torch.equal(stop["preloop"].data["latents"], expected["preloop"].data["latents"])
    injected = modular(
        prompt="a cat",
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(1),
        output_type="pt",
        _checkpoints={"preloop": Checkpoint(load=True, data=expected["preloop"].data)},
        output="images",
    )
    assert torch.equal(injected, images), "injecting preloop into the modular pipeline must reproduce it"

    torch.manual_seed(0)
    unet = UNet2DModel(**UNET_CONFIG).eval()
    pixel = PixelPipeline(unet=unet, scheduler=DDIMScheduler())
    pixel.set_progress_bar_config(disable=True)
    pixel_modular = PixelModularPipeline(blocks=PixelBlocks())
    pixel_modular.update_components(unet=unet, scheduler=DDIMScheduler())
    kwargs = {"batch_size": 2, "num_inference_steps": 3, "output_type": "np"}
    a = pixel(generator=torch.Generator().manual_seed(0), **kwargs).images
    b = pixel_modular(generator=torch.Generator().manual_seed(0), output="images", **kwargs)
    assert a.shape == b.shape == (2, 8, 8, 3) and (a == b).all()


def check_pixel_pipeline() -> None:
    from pipeline_pixel import PixelPipeline
    from scaffold_parts import UNET_CONFIG

    torch.manual_seed(0)
    pipe = PixelPipeline(unet=UNet2DModel(**UNET_CONFIG), scheduler=DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    checkpoints = {"post_loop": Checkpoint(save=True)}
    images = pipe(batch_size=2, num_inference_steps=3, output_type="np", _checkpoints=checkpoints).images
    assert images.shape == (2, 8, 8, 3), images.shape
    assert checkpoints["post_loop"].data["latents"].shape == (2, 3, 8, 8)


def check_transformer_pipeline() -> None:
    from pipeline_dit import DiTPipeline
    from scaffold_parts import tiny_components

    parts = tiny_components(".", text=False)
    torch.manual_seed(0)
    transformer = Transformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        norm_num_groups=4,
        sample_size=8,
    )
    pipe = DiTPipeline(transformer=transformer, scheduler=parts["scheduler"], vae=parts["vae"])
    pipe.set_progress_bar_config(disable=True)
    stop = {"after_step_1": Checkpoint(save=True, stop=True)}
    assert run_until_stop(pipe, num_inference_steps=4, _checkpoints=stop) is None
    assert stop["after_step_1"].data["latents"].shape == (1, 4, 8, 8)
    images = pipe(num_inference_steps=2, output_type="pt").images
    assert images.shape == (1, 3, 16, 16), images.shape


if __name__ == "__main__":
    import traceback

    work_dir = Path(sys.argv[1])
    sys.path.insert(0, str(work_dir))
    checks = {
        "text": lambda: check_text_pipeline(work_dir),
        "pixel": check_pixel_pipeline,
        "transformer": check_transformer_pipeline,
        "modular": lambda: check_modular_pipelines(work_dir),
    }
    failed = False
    for name, check in checks.items():
        try:
            check()
            print(f"CHECK {name} OK")
        except Exception:  # report every check, then fail the process
            failed = True
            print(f"CHECK {name} FAILED\n{traceback.format_exc()}")
    from scaffold_parts import build_reference_cond_unet, build_reference_vae, save_port, save_wan_port

    save_port(work_dir / "saved_unet")
    save_port(work_dir / "stale_unet", perturb=True)
    save_port(work_dir / "saved_cond_unet", build=build_reference_cond_unet)
    save_port(work_dir / "saved_vae", build=build_reference_vae)
    save_wan_port(work_dir / "saved_wan")
    sys.exit(1 if failed else 0)
