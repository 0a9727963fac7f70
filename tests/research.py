"""Published research code from PyPI, loaded file by file, as the reference side of real port pairs.

diffsynth (DiffSynth-Studio) carries the Wan video models as their authors wrote them: ``wan_video_vae.py`` is
the Wan 2.1 causal video VAE, which decodes one latent frame at a time through a cache of each causal
convolution's last frames. The Makefile installs diffsynth with --no-deps: it declares torchvision,
modelscope, transformers pins and others, whose PyPI builds would replace the CPU torch, and its package
``__init__`` imports all of them. The VAE file needs only torch, einops and tqdm, so it is loaded by path,
without running the package's ``__init__``.
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
