"""`paritykit demo` (interim): the smallest real parity check until the worked example lands."""

from __future__ import annotations

import click


@click.command()
def demo() -> None:
    """Run a tiny diffusers UNet twice: float32 noise vs the same noise rounded to bfloat16."""
    import torch
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
    ).eval()
    noise = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = unet(noise, 10).sample
        b = unet(noise.to(torch.bfloat16).float(), 10).sample
    click.echo("Interim demo: a tiny UNet2DModel fed float32 noise vs the same noise cast to bfloat16.")
    click.echo(f"max |a-b| = {(a - b).abs().max().item():.3e}  (bit-identical would be 0)")
