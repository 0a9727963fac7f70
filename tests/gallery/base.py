r"""What every pair shares: the two weight variants and the built pair handed to the runner."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

VARIANTS = ("distinct", "fresh")


@dataclass
class BuiltPair:
    r"""One case made concrete: both models in eval mode, the inputs, and how the weights went across.

    ``source_state`` / ``target_state`` are the checkpoints a user would hand to ``paritykit weights map``
    (the reference's weights and the converted port's weights).
    """

    reference: nn.Module
    port: nn.Module
    inputs: Any
    source_state: dict[str, torch.Tensor] = field(default_factory=dict)
    target_state: dict[str, torch.Tensor] = field(default_factory=dict)
    select_output: Callable[[str, Any], Any] | None = None
    port_inputs: Callable[[tuple, dict], Any] | None = None


def seeded(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    r"""Build a module under a fixed seed, so the fresh-init variant is reproducible."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build()


def make_distinct(module: nn.Module, seed: int = 1) -> nn.Module:
    r"""Trained-like weights: every trainable tensor gets distinct values (norm scales around 1, small
    biases).

    Frozen parameters (rotary frequencies) keep the values their constructor computed.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            r = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * r)
            else:
                p.copy_(r / math.sqrt(p[0].numel()))
    return module


def with_weights(module: nn.Module, variant: str, seed: int = 1) -> nn.Module:
    r"""Apply a weight variant: ``distinct`` (trained-like) or ``fresh`` (the constructor's own init)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "distinct":
        make_distinct(module, seed)
    return module.eval()


def load_exactly(port: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    r"""Load a converted state dict; every port tensor must be covered (a gap would be a gallery bug)."""
    missing, unexpected = port.load_state_dict(state, strict=False)
    # rotary caches and similar non-persistent state are not weights
    if missing or unexpected:
        raise AssertionError(f"conversion left missing={missing} unexpected={unexpected}")
    return port.eval()


def compute_in_bf16(module: nn.Module) -> nn.Module:
    r"""Make ``module`` compute its forward in bfloat16 and hand back float32, keeping its weights and config.

    This is what an ``autocast`` region or a stray ``.to(torch.bfloat16)`` inside one block does.
    """
    original = type(module)

    def forward(self, *args, **kwargs):
        cast = [a.to(torch.bfloat16) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        with torch.no_grad():
            saved = {n: p.data for n, p in self.named_parameters()}
            try:
                for p in self.parameters():
                    p.data = p.data.to(torch.bfloat16)
                out = original.forward(self, *cast, **kwargs)
            finally:
                for n, p in self.named_parameters():
                    p.data = saved[n]
        return out.to(torch.float32)

    module.__class__ = type(original.__name__, (original,), {"forward": forward})
    return module
