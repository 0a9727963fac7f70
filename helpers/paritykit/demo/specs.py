"""Bisect specs for the demo; `paritykit demo` writes small SPEC.py files that import these."""

from __future__ import annotations

import torch

from paritykit.demo.conversion import convert_reference_state_dict
from paritykit.demo.port import TinyControlDenoiserModel, port_config_from_reference
from paritykit.demo.reference import REFERENCE_CONFIG, build_reference


def build_port_model(fixed: bool) -> TinyControlDenoiserModel:
    port = TinyControlDenoiserModel(**port_config_from_reference(REFERENCE_CONFIG, fixed))
    port.load_state_dict(convert_reference_state_dict(build_reference().state_dict()))
    return port.eval()


def make_inputs() -> tuple[tuple, dict]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=generator)
    hint = torch.randn(2, 3, 8, 8, generator=generator)
    return (x, torch.tensor([700.0, 250.0]), hint), {}


def select_output(side: str, output):
    return output.sample if hasattr(output, "sample") else output
