"""Benchmark section: published research code (Wan 2.1's DiT and causal video VAE, from DiffSynth-Studio on
PyPI) against diffusers' own classes, weights moved by diffusers' own converters (tests/research.py).

Two measures issue 36 set, besides each case's culprit:

* blocks tested one-to-one: of the research DiT's blocks the search tested, how many were replayed (their
  arguments paired across signatures), not judged from capture or left untestable. Goal: every block.
* correct ports at float noise, false alarms: correct ports (the VAE whose shared activation is called twice
  per frame chunk, the DiT at the default tolerance, the DiT at atol 1e-7 where its float32 sinusoid differs
  from the research's float64 one) that come out anything but ``match``. Goal: 0.

Run by benchmarks/diagnosis.py, which writes the section into benchmarks/results/diagnosis.txt.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tests.research import (
    PortDecode,
    PortDenoise,
    ResearchDecode,
    ResearchDenoise,
    wan_dit_pair_built,
    wan_vae_pair,
)


@dataclass
class ResearchCase:
    name: str
    what: str
    build: Callable[[], tuple[torch.nn.Module, torch.nn.Module, list]]
    # the culprit's port module (None: a correct port, whose verdict must be match); "" is the top level
    expected: str | None = None
    # a phrase the report must hold where the top level is the place (the hint that names the cause)
    says: str = ""
    options: dict[str, Any] | None = None


def _dit(mutate: Callable[[torch.nn.Module], None] | None = None, **built: Any) -> Callable:
    def build() -> tuple[torch.nn.Module, torch.nn.Module, list]:
        research, port, inputs = wan_dit_pair_built(**built)
        port = copy.deepcopy(port)
        if mutate is not None:
            mutate(port)
        return ResearchDenoise(research), PortDenoise(port), inputs

    return build


def _vae(mutate: Callable[[torch.nn.Module], None] | None = None) -> Callable:
    def build() -> tuple[torch.nn.Module, torch.nn.Module, list]:
        research, port = wan_vae_pair()
        port = copy.deepcopy(port)
        if mutate is not None:
            mutate(port)
        torch.manual_seed(1)
        return ResearchDecode(research), PortDecode(port), [torch.randn(1, 4, 3, 2, 2)]

    return build


def _exact_gelu(port: torch.nn.Module) -> None:
    port.blocks[1].ffn.net[0].approximate = "none"


def _norm_eps(port: torch.nn.Module) -> None:
    port.blocks[1].attn2.norm_k.eps = 1e-2


def _modulation(port: torch.nn.Module) -> None:
    with torch.no_grad():
        table = port.blocks[1].scale_shift_table
        table.copy_(table[:, [1, 0, 2, 3, 4, 5]].clone())


def _theta(port: torch.nn.Module) -> None:
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    port.rope = WanRotaryPosEmbed(24, (1, 2, 2), 1024, theta=500.0)


def _vae_gelu(port: torch.nn.Module) -> None:
    port.decoder.mid_block.resnets[1].nonlinearity = torch.nn.GELU()


CASES = (
    ResearchCase("wan-vae-clean", "correct causal VAE port (shared SiLU called twice per chunk)", _vae()),
    ResearchCase("wan-dit-clean", "correct DiT port", _dit()),
    ResearchCase(
        "wan-dit-clean-strict",
        "correct DiT port at atol 1e-7 (float32 sinusoid vs the research's float64)",
        _dit(),
        options={"atol": 1e-7, "rtol": 0.0},
    ),
    ResearchCase("wan-dit-exact-gelu", "exact GELU in block 1's FFN", _dit(_exact_gelu), "dit.blocks.1.ffn"),
    ResearchCase(
        "wan-dit-norm-eps", "cross-attention norm_k eps 1e-2", _dit(_norm_eps), "dit.blocks.1.attn2.norm_k"
    ),
    ResearchCase(
        "wan-dit-modulation", "block 1's shift/scale rows swapped", _dit(_modulation), "dit.blocks.1"
    ),
    ResearchCase(
        "wan-dit-rope-theta",
        "rotary table built with theta 500",
        _dit(_theta),
        "",
        "dit.rope (WanRotaryPosEmbed)",
    ),
    ResearchCase(
        "wan-dit-text-order",
        "12 blocks loaded in text order (0, 1, 10, 11, …)",
        _dit(num_layers=12, text_order=True),
        "",
        "the indices were sorted as text",
    ),
    ResearchCase(
        "wan-vae-gelu",
        "GELU for SiLU in a decoder resnet",
        _vae(_vae_gelu),
        "vae.decoder.mid_block.resnets.1.nonlinearity",
    ),
)


@dataclass
class ResearchOutcome:
    case: ResearchCase
    verdict: str
    found: str | None
    ok: bool
    blocks: tuple[int, int]  # (replayed, tested) research DiT blocks
    seconds: float


def run(case: ResearchCase) -> ResearchOutcome:
    from paritykit.bisection.entry import bisect

    reference, port, inputs = case.build()
    started = time.perf_counter()
    report = bisect(reference, port, inputs, **(case.options or {}))
    seconds = time.perf_counter() - started
    found = report.culprit.port if report.culprit is not None else None
    if case.expected is None:
        ok = report.verdict == "match"
    else:
        ok = report.verdict != "match" and found == case.expected
        ok = ok and (not case.says or case.says in report.render())
    blocks = [
        t for t in report.tested if t.reference.split("#")[0].count(".") == 2 and ".blocks." in t.reference
    ]
    replayed = sum(t.test == "replay" for t in blocks)
    return ResearchOutcome(case, report.verdict, found, ok, (replayed, len(blocks)), seconds)


def section() -> tuple[list[str], dict[str, str]]:
    r"""The benchmark's lines for this section, and its totals."""
    outcomes = [run(case) for case in CASES]
    clean = [o for o in outcomes if o.case.expected is None]
    bugs = [o for o in outcomes if o.case.expected is not None]
    replayed = sum(o.blocks[0] for o in outcomes)
    tested = sum(o.blocks[1] for o in outcomes)
    totals = {
        "research ports: culprit": f"{sum(o.ok for o in bugs)}/{len(bugs)}",
        "research ports: blocks tested one-to-one": f"{replayed}/{tested}",
        "correct ports at float noise: false alarms": f"{sum(not o.ok for o in clean)}/{len(clean)}",
    }
    lines = [
        "-- research ports: Wan 2.1 DiT and causal VAE (DiffSynth-Studio) against diffusers' classes",
        *(
            f"{o.case.name:25s} {'yes' if o.ok else 'NO':3s}  {o.case.what}: {o.verdict}"
            + (f", culprit {o.found or '(top)'}" if o.found is not None else "")
            + (f"; blocks replayed {o.blocks[0]}/{o.blocks[1]}" if o.blocks[1] else "")
            + f"; {o.seconds:.2f} s"
            for o in outcomes
        ),
    ]
    return lines, totals
