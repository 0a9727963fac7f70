"""Published research code from PyPI, loaded file by file, as the reference side of real port pairs.

diffsynth (DiffSynth-Studio) carries the Wan video models as their authors wrote them: ``wan_video_vae.py`` is
the Wan 2.1 causal video VAE, which decodes one latent frame at a time through a cache of each causal
convolution's last frames; ``wan_video_dit.py`` is the Wan 2.1 diffusion transformer, whose blocks take
``(x, context, t_mod, freqs)`` with a complex rotary table and whose timestep sinusoid is computed in
float64.

The Makefile installs diffsynth with --no-deps: it declares torchvision, modelscope, transformers pins and
others, whose PyPI builds would replace the CPU torch, and its package ``__init__`` imports all of them. The
VAE file needs only torch, einops and tqdm, so it is loaded by path, without running the package's
``__init__``; the DiT file imports three sibling modules (torch, numpy and einops only), so it is loaded
inside a stand-in package that skips the ``__init__`` files that import the rest.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch


def _root(package: str) -> Path:
    found = importlib.util.find_spec(package)  # the folder, without running the package's __init__
    if found is None or not found.submodule_search_locations:
        raise ImportError(f"{package} is not installed: run `make install` (it installs it with --no-deps)")
    return Path(next(iter(found.submodule_search_locations)))


def research_module(package: str, relative: str) -> types.ModuleType:
    """The file ``relative`` of the installed ``package``, executed as a module of its own (once)."""
    name = f"_research_{package}_{relative.replace('/', '_').removesuffix('.py')}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _root(package) / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def wan_vae():
    """Wan 2.1's research VAE module (``VideoVAE_``, ``ResidualBlock``, ``CausalConv3d``, …)."""
    return research_module("diffsynth", "models/wan_video_vae.py")


def wan_dit():
    """Wan 2.1's research DiT module (``WanModel``, ``DiTBlock``, ``sinusoidal_embedding_1d``, …)."""
    import importlib

    package = "_research_diffsynth"
    if f"{package}.models.wan_video_dit" not in sys.modules:
        root = _root("diffsynth")
        for name, folder in ((package, root), (f"{package}.core", root / "core")):
            stand_in = types.ModuleType(name)
            stand_in.__path__ = [str(folder)]  # a package whose __init__ is not run
            sys.modules[name] = stand_in
    return importlib.import_module(f"{package}.models.wan_video_dit")


class WanResearchForward:
    """The research side's denoiser call, as DiffSynth's ``model_fn_wan_video`` runs a plain text-to-video
    step (no image input, cache or adapters): the research code calls the blocks from its pipeline, not from
    ``WanModel.forward``."""

    @staticmethod
    def run(dit, x, timestep, context):
        from einops import rearrange

        module = wan_dit()
        t = dit.time_embedding(module.sinusoidal_embedding_1d(dit.freq_dim, timestep))
        t_mod = dit.time_projection(t).unflatten(1, (6, dit.dim))
        context = dit.text_embedding(context)
        x = dit.patchify(x)
        f, h, w = x.shape[2:]
        x = rearrange(x, "b c f h w -> b (f h w) c").contiguous()
        freqs = (
            torch.cat(
                [
                    dit.freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                    dit.freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                    dit.freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
                ],
                dim=-1,
            )
            .reshape(f * h * w, 1, -1)
            .to(x.device)
        )
        for block in dit.blocks:
            x = block(x, context, t_mod, freqs)
        x = dit.head(x, t)
        return dit.unpatchify(x, (f, h, w))


class ResearchDecode(torch.nn.Module):
    """The research VAE's decode as DiffSynth's ``WanVideoVAE.single_decode`` runs it (the video clamped to
    [-1, 1]), its latent scale set to identity (diffusers' ``AutoencoderKLWan`` leaves the scale to the
    pipeline)."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z, [torch.zeros(z.shape[1]), torch.ones(z.shape[1])]).clamp_(-1, 1)


class PortDecode(torch.nn.Module):
    """diffusers' ``AutoencoderKLWan.decode(z).sample`` as a module."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z).sample


class ResearchDenoise(torch.nn.Module):
    """The research side's denoiser call as a module: the blocks driven as DiffSynth's pipeline drives
    them."""

    def __init__(self, dit: torch.nn.Module):
        super().__init__()
        self.dit = dit

    def forward(self, x, timestep, context):
        return WanResearchForward.run(self.dit, x, timestep, context)


class PortDenoise(torch.nn.Module):
    """diffusers' ``WanTransformer3DModel`` returning its sample."""

    def __init__(self, dit: torch.nn.Module):
        super().__init__()
        self.dit = dit

    def forward(self, x, timestep, context):
        return self.dit(x, timestep, context, return_dict=False)[0]


def wan_vae_pair():
    """Wan's research VAE (channels cut to 4) and diffusers' ``AutoencoderKLWan`` with its weights moved by
    diffusers' own converter."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    torch.manual_seed(0)
    research = wan_vae().VideoVAE_(dim=4, z_dim=4).eval()
    port = AutoencoderKLWan(base_dim=4, z_dim=4).eval()
    missing, unexpected = port.load_state_dict(convert_wan_vae_to_diffusers(research.state_dict()))
    assert not missing and not unexpected
    return research, port


def wan_dit_pair_built(num_layers: int = 2, text_order: bool = False):
    """Wan's research DiT and diffusers' ``WanTransformer3DModel`` with its weights moved by diffusers' own
    converter, and inputs (t = 999). Head dim 24: the research rotary table splits it 8/8/8 over frames, rows
    and columns as diffusers does. ``text_order`` loads the converted blocks in the order their indices sort
    as text (0, 1, 10, 11, …, 2), as a port reading per-block shards by name would."""
    import re

    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    torch.manual_seed(0)
    shape = dict(ffn_dim=64, freq_dim=256, num_layers=num_layers, patch_size=(1, 2, 2))
    module = wan_dit()
    research = module.WanModel(
        dim=48, in_dim=4, out_dim=4, text_dim=16, eps=1e-6, num_heads=2, has_image_input=False, **shape
    ).eval()
    port = WanTransformer3DModel(
        num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4, text_dim=16, **shape
    ).eval()
    converted = convert_wan_transformer_to_diffusers(research.state_dict())
    if text_order:
        order = sorted(range(num_layers), key=str)
        moved = {}
        for key, value in converted.items():
            found = re.match(r"blocks\.(\d+)\.(.*)", key)
            moved[f"blocks.{order.index(int(found[1]))}.{found[2]}" if found else key] = value
        converted = moved
    missing, unexpected = port.load_state_dict(converted)
    assert not missing and not unexpected
    inputs = [torch.randn(1, 4, 2, 4, 4), torch.tensor([999.0]), torch.randn(1, 5, 16)]
    return research, port, inputs
