r"""Fold evidence (``folded-gain``): a culprit whose output is the reference's without the reference's gain,
and the port's projections that read it with that gain folded into their columns, or without it.

A port may drop a norm's gain and multiply it into the columns of every projection that reads the norm's
output (round 35, make-a-video: the research's ``RMSNorm`` with ``gamma`` before ``to_q`` and a fused
``to_kv``, the port's norm without weight and ``to_q``, ``to_k`` folded, ``to_v`` not). The norm is then a
module that differs on identical inputs, by design; what matters is which reader lacks the fold. Each line is
measured: the culprit's output times the gain against the reference's, and each reader's weight against
the reference's projection weights (or their row chunks) with and without the gain.
"""

from __future__ import annotations

from typing import Any

from paritykit.bisection.evidence.culprit import Culprit
from paritykit.compare.diagnose import Hint

# how close ``port output × gain`` must be to the reference's output, relative to its largest value
GAIN_RTOL = 1e-4


def folded_gain(c: Culprit) -> list[Hint]:
    r"""``folded-gain``: the reference's 1-D parameter ``g`` with ``port output · g = reference output`` along
    one axis, every element; the port's ``Linear`` layers beside the culprit that read that many features,
    each said as the reference's weight with ``g`` folded into its columns, or as the reference's weight
    without it."""
    import torch

    if c.reference is None or c.port is None or c.port_model is None or c.reference_model is None:
        return []
    ref_out, port_out = c.reference_output, c.port_output
    if not isinstance(ref_out, torch.Tensor) or not isinstance(port_out, torch.Tensor):
        return []
    if ref_out.shape != port_out.shape or not ref_out.is_floating_point():
        return []
    found = _gain(c.reference, ref_out.detach().double(), port_out.detach().double())
    if found is None:
        return []
    gain_name, gain = found
    folded, plain = _readers(c, gain)
    if not folded:
        return []  # nothing folds it: the gain is simply missing, which the module's weights say
    ref_gain = ".".join(p for p in (c.reference_name, gain_name) if p)
    message = (
        f"the port's output is the reference's without its gain {ref_gain} (port output × {gain_name} ="
        f" reference output, every element); port {', '.join(p for p, _ in folded)} = reference"
        f" {', '.join(r for _, r in folded)} with each column multiplied by {gain_name} (the gain folded in)"
    )
    if plain:
        message += (
            f"; port {', '.join(p for p, _ in plain)} = reference {', '.join(r for _, r in plain)} without it"
            " (a lead: the fold is missing there)"
        )
    return [
        Hint(
            "folded-gain",
            message + " (evidence: outputs and parameter values compared)",
            {"gain": ref_gain, "folded": dict(folded), "unfolded": dict(plain)},
            score=0.95 if plain else 0.3,
        )
    ]


def _gain(reference: Any, ref_out: Any, port_out: Any) -> tuple[str, Any] | None:
    r"""The reference module's 1-D parameter (size above 1) that the port's output times it, along the last
    axis or axis 1, gives the reference's output."""
    scale = max(float(ref_out.abs().max()), 1e-12)
    for name, p in reference.named_parameters():
        g = p.detach().double().reshape(-1)
        if g.numel() < 2 or p.squeeze().dim() != 1:
            continue
        for axis in (-1, 1):
            if ref_out.dim() < 2 or ref_out.shape[axis] != g.numel():
                continue
            shape = [1] * ref_out.dim()
            shape[axis] = g.numel()
            if float((port_out * g.reshape(shape) - ref_out).abs().max()) <= GAIN_RTOL * scale:
                if not bool(((g - 1).abs() <= 1e-6).all()):
                    return name, g
    return None


def _readers(c: Culprit, gain: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    r"""The port's ``Linear`` layers under the culprit's parent that read ``len(gain)`` features, each paired
    with a reference weight (or a row chunk of one, a fused projection) under the reference culprit's parent:
    ``(folded, plain)`` as ``(port name, reference name)``."""
    import torch

    width = gain.numel()
    port_parent = c.port_name.rpartition(".")[0]
    ref_parent = c.reference_name.rpartition(".")[0]
    candidates = [
        (name, p.detach().double())
        for name, p in c.reference_model.named_parameters()
        if p.dim() == 2 and p.shape[1] == width and name.startswith(ref_parent)
    ]
    folded, plain = [], []
    fused_folded: set[str] = set()  # reference tensors one of whose row chunks a port reader holds folded
    for name, module in c.port_model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module.in_features != width:
            continue
        if not name.startswith(port_parent) or name.startswith(c.port_name + ".") or name == c.port_name:
            continue
        w = module.weight.detach().double()
        for ref_name, r in candidates:
            hit = _chunk_of(w, r, gain)
            if hit is not None:
                if hit[1]:
                    folded.append((f"{name}.weight", ref_name + hit[0]))
                    fused_folded.add(ref_name)
                elif hit[0]:
                    plain.append((f"{name}.weight", ref_name + hit[0], ref_name))
                break
    # a reader without the gain is only known to read the culprit's output where another chunk of its fused
    # reference projection (one input, several outputs) is read folded; a whole weight of that width may read
    # anything
    return folded, [(p, r) for p, r, source in plain if source in fused_folded]


def _chunk_of(w: Any, r: Any, gain: Any) -> tuple[str, bool] | None:
    r"""``(words, folded)`` where ``w`` is ``r`` (or one of its 2 to 4 equal row chunks) with ``gain`` folded
    into its columns, or as it is; ``None`` otherwise."""
    import torch

    if r.shape[0] % w.shape[0]:
        return None
    count = r.shape[0] // w.shape[0]
    if count > 4:
        return None
    scale = max(float(r.abs().max()) * float(gain.abs().max()), 1e-12)
    for index, part in enumerate(r.chunk(count, 0)):
        words = f" rows {index * w.shape[0]}:{(index + 1) * w.shape[0]}" if count > 1 else ""
        if float((part * gain[None, :] - w).abs().max()) <= 1e-6 * scale:
            return words, True
        if torch.equal(part, w):
            return words, False
    return None
