r"""The devices a test runs its models on: the CPU always, and CUDA where torch sees a GPU. A CUDA case
carries the ``cuda`` mark (``pytest -m cuda`` runs them alone, as ../shared/gpu does) and is skipped with
its reason elsewhere."""

from __future__ import annotations

import pytest
import torch

CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"
)
ON_CUDA = (pytest.mark.cuda, CUDA)
DEVICES = ["cpu", pytest.param("cuda", marks=ON_CUDA, id="cuda")]
