"""k-diffusion's own code, the sampler library behind A1111 and ComfyUI, as the reference for sampler parity.

The Makefile installs k-diffusion with --no-deps: it declares torchvision, clip and others, whose PyPI builds
would replace the CPU torch. Its package ``__init__`` imports every submodule (``augmentation`` needs
scikit-image, ``utils`` imports torchvision at the top), but ``sampling.py`` and ``external.py`` need only
torch, scipy, torchsde, torchdiffeq, tqdm and one helper of ``utils`` (``append_dims``). So the two files are
loaded as they are, as submodules of a package that skips ``__init__``, with a ``utils`` holding
``append_dims`` compiled from k-diffusion's own ``utils.py`` source; the rest of that file is not loaded.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

PACKAGE = "_kdiffusion_reference"


def _root() -> Path:
    spec = importlib.util.find_spec("k_diffusion")  # finds the folder without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("k-diffusion is not installed: run `make install` (it installs it with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations)))


def _load(name: str, root: Path) -> types.ModuleType:
    full = f"{PACKAGE}.{name}"
    spec = importlib.util.spec_from_file_location(full, root / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


def load() -> tuple[types.ModuleType, types.ModuleType]:
    """k-diffusion's ``sampling`` and ``external`` modules."""
    if f"{PACKAGE}.external" in sys.modules:
        return sys.modules[f"{PACKAGE}.sampling"], sys.modules[f"{PACKAGE}.external"]
    root = _root()
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(root)]
    sys.modules[PACKAGE] = package
    utils = types.ModuleType(f"{PACKAGE}.utils")
    tree = ast.parse((root / "utils.py").read_text())
    kept = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "append_dims"]
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(root / "utils.py"), "exec"), utils.__dict__)
    sys.modules[utils.__name__] = package.utils = utils
    package.sampling = _load("sampling", root)
    package.external = _load("external", root)
    return package.sampling, package.external
