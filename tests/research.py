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
        import torch
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
