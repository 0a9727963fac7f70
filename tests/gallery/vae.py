r"""Pair 2: the latent-diffusion autoencoder as the original Stable Diffusion VAE ran it - ``Encoder`` /
``Decoder`` from ``taming.modules.diffusionmodules.model`` (PyPI ``taming-transformers-rom1504``) - <->
diffusers ``AutoencoderKL``, its weights converted by diffusers' own ``convert_ldm_vae_checkpoint``.

The taming package's ``__init__`` files import nothing heavy, but the package declares torchvision and
pytorch-lightning; the Makefile installs it with ``--no-deps`` and this module imports only the model file,
which needs torch and numpy."""

from __future__ import annotations

import contextlib
import io

import torch
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
from diffusers.models.attention_processor import AttnProcessor
from taming.modules.diffusionmodules.model import Decoder, Encoder
from torch import nn

from tests.gallery.base import BuiltPair, compute_in_bf16, load_exactly, seeded, with_weights

DDCONFIG = dict(
    double_z=True,
    z_channels=4,
    resolution=8,
    in_channels=3,
    out_ch=3,
    ch=32,  # taming's GroupNorm is hard-wired to 32 groups
    ch_mult=(1, 2),
    num_res_blocks=1,
    attn_resolutions=[],
    dropout=0.0,
)
EMBED_DIM = 4


class LDMAutoencoder(nn.Module):
    r"""The LDM ``AutoencoderKL`` inference path around taming's Encoder/Decoder: moments, mean, decode."""

    def __init__(self):
        super().__init__()
        self.encoder = Encoder(**DDCONFIG)
        self.decoder = Decoder(**DDCONFIG)
        self.quant_conv = nn.Conv2d(2 * DDCONFIG["z_channels"], 2 * EMBED_DIM, 1)
        self.post_quant_conv = nn.Conv2d(EMBED_DIM, DDCONFIG["z_channels"], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean, _logvar = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return self.decoder(self.post_quant_conv(mean))


def make_port() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=EMBED_DIM,
        norm_num_groups=32,
        sample_size=8,
    )


def convert(sd: dict[str, torch.Tensor], port: AutoencoderKL) -> dict[str, torch.Tensor]:
    r"""diffusers' own LDM -> diffusers VAE conversion (keys prefixed as in a full SD checkpoint)."""
    full = {f"first_stage_model.{k}": t.clone() for k, t in sd.items()}
    return convert_ldm_vae_checkpoint(full, dict(port.config))


def inputs() -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(1, 3, 8, 8, generator=g),), {}


def select_output(side: str, output) -> torch.Tensor:
    return output if torch.is_tensor(output) else output.sample


def build(variant: str, bug: str | None = None) -> BuiltPair:
    r"""The pair with ``bug`` planted: None, ``math-attention``, ``num-groups``, ``affine-off``,
    ``transposed-1x1``, ``bf16-attention``, ``attention-scale`` (decoder mid attention scaled by 1/sqrt of the
    base width 32, not its own 64 channels), or several joined by ``+``."""
    bugs = set(bug.split("+")) if bug else set()
    with contextlib.redirect_stdout(io.StringIO()):  # taming prints the latent shape on construction
        reference = with_weights(seeded(LDMAutoencoder), variant)
    sd = {k: t.detach().clone() for k, t in reference.state_dict().items()}
    port = make_port()
    state = convert(sd, port)
    if "transposed-1x1" in bugs:  # conv 1x1 -> linear written as w[:, :, 0, 0].T
        key = "decoder.mid_block.attentions.0.to_q.weight"
        state[key] = state[key].t().contiguous()
    load_exactly(port, state)
    if "math-attention" in bugs:  # explicit softmax(QK^T)V instead of SDPA: float noise only
        port.set_attn_processor(AttnProcessor())
    if "num-groups" in bugs:  # a block built with 16 groups where the reference has 32
        old = port.decoder.mid_block.resnets[0].norm1
        new = nn.GroupNorm(16, old.num_channels, eps=old.eps, affine=True)
        new.load_state_dict(old.state_dict())
        port.decoder.mid_block.resnets[0].norm1 = new
    if "affine-off" in bugs:  # the final encoder norm built without its scale and shift
        old = port.encoder.conv_norm_out
        port.encoder.conv_norm_out = nn.GroupNorm(old.num_groups, old.num_channels, eps=old.eps, affine=False)
    if "bf16-attention" in bugs:
        compute_in_bf16(port.encoder.mid_block.attentions[0])
    if "attention-scale" in bugs:  # softmax scale from the wrong width (explicit attention reads attn.scale)
        attn = port.decoder.mid_block.attentions[0]
        attn.set_processor(AttnProcessor())
        attn.scale = DDCONFIG["ch"] ** -0.5
    _plant_after_engine(port, bugs)
    port.eval()
    target = {k: t.detach().clone() for k, t in port.state_dict().items()}
    return BuiltPair(reference, port, inputs(), sd, target, select_output)


def _plant_after_engine(port: AutoencoderKL, bugs: set[str]) -> None:
    r"""Bug classes planted after the repair search was written (issue 22's held-out split)."""
    with torch.no_grad():
        if "conv-flipped" in bugs:  # a converter that turns correlation kernels into convolution ones
            port.decoder.conv_in.weight.copy_(port.decoder.conv_in.weight.flip((2, 3)))
        if "norm-bias-negated" in bugs:  # a sign slip in the conversion of one norm's shift
            port.encoder.conv_norm_out.bias.neg_()
    if "residual-sign" in bugs:  # the port's resnet returns input - h where taming returns input + h
        block = port.decoder.mid_block.resnets[1]
        original = type(block).forward

        def forward(self, input_tensor, temb=None, *args, **kwargs):
            out = original(self, input_tensor, temb, *args, **kwargs)
            return 2 * input_tensor - out  # (x + h) -> (x - h), all else as diffusers computes it

        block.forward = forward.__get__(block)
    if "latent-scaled" in bugs:  # the latents divided by the SD scaling factor a second time, inside the port
        port.post_quant_conv.register_forward_pre_hook(lambda _m, args: (args[0] / 0.18215, *args[1:]))
