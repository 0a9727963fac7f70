r"""The culprit every detector reads (``Culprit``: the two modules, their captured call, replay of a patched
copy) and the helpers detectors share."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paritykit.compare.diagnose import Hint

# a fitted constant "reproduces" an output when the relative error left is at most this (near float precision)
FIT_REL = 1e-5


# …and at most this share of the error before the fit
FIT_GAIN = 0.01


# a module's attributes that are not settings of its computation: torch's bookkeeping, and switches that
# change memory or speed, never the numbers (the one list for the settings evidence and the repair search)
# attributes that compute nothing; ``name`` is the attribute a diffusers Upsample2D / Downsample2D keeps its
# convolution under ("conv", "Conv2d_0"), never a setting of the computation
NOT_SETTINGS = frozenset(
    {"training", "inplace", "dump_patches", "call_super_init", "gradient_checkpointing", "name"}
)


# names that mean the same setting in different code bases
SYNONYMS = {
    "epsilon": "eps",
    "variance_epsilon": "eps",
    "norm_eps": "eps",
    "layer_norm_eps": "eps",
    "scaling": "scale",
    "softmax_scale": "scale",
    "sm_scale": "scale",
    "rope_theta": "theta",
    "num_heads": "heads",
    "num_attention_heads": "heads",
    "n_heads": "heads",
}


EPS_NAMES = ("eps", "epsilon", "variance_epsilon")


SCALE_NAMES = ("scale", "scaling", "softmax_scale")


@dataclass
class Culprit:
    r"""What is known at a culprit: the two modules, their captured call and a way to re-run the port.

    Args:
        reference_name, port_name: dotted module names in their models (``""`` for the top level).
        reference, port: the module objects (``None`` when only traces are available).
        reference_output, port_output: the first output leaf that differs, as replayed on identical inputs.
        run_reference: ``run_reference(fn)`` calls ``fn`` on fresh copies of the reference's captured inputs
            and returns the output leaf that corresponds to ``reference_output``.
        run_port: the same for the port's call (the reference's tensors in the port's signature).
        check: ``check(fn) -> (matches, max_abs)``: ``fn`` run on the port's inputs, every output leaf
            compared with the reference's within the bisect tolerances.
        run_check: the same with ``fn`` run on the port's own captured inputs (against the reference's
            captured outputs), where the port fed the call other inputs in its run; ``None`` otherwise.
        subpairs: aligned ``(reference, port)`` module names inside the culprit, relative to it.
        matched_subpairs: those of ``subpairs`` that matched, replayed on identical inputs at every call.
        unpaired_subpairs: those of ``subpairs`` whose inputs could not be paired at any call (they compute on
            other layouts, a space-to-depth conv against the strided conv it was folded into).
        reference_inputs: the reference call's captured ``(args, kwargs)``.
    """

    reference_name: str
    port_name: str
    reference: Any
    port: Any
    reference_output: Any
    port_output: Any
    run_reference: Callable[[Callable], Any] | None = None
    run_port: Callable[[Callable], Any] | None = None
    check: Callable[[Callable], tuple[bool, float]] | None = None
    # the same on the port's own captured inputs, where the port fed this call other inputs in its run
    run_check: Callable[[Callable], tuple[bool, float]] | None = None
    subpairs: list[tuple[str, str]] = field(default_factory=list)
    # of those, the pairs whose every captured call matched within the tolerance replayed on identical inputs
    matched_subpairs: set[tuple[str, str]] = field(default_factory=set)
    unpaired_subpairs: set[tuple[str, str]] = field(default_factory=set)
    reference_inputs: tuple[tuple, dict] | None = None
    # filled by :func:`weights`: port parameters built from the reference through a layout op (transpose, …)
    layouts: list[str] = field(default_factory=list)
    # the whole port model, where a reference tensor the culprit lacks may sit in another module
    port_model: Any = None
    reference_model: Any = None
    # ``model_check(make)``: the whole port run again with the culprit replaced by ``make()``, its output's
    # max_abs against the reference's, after and before: how far a module's fix takes the whole model
    model_check: Callable[[Callable], tuple[float, float]] | None = None
    # the port call's inputs no reference input pairs with, fed the port's own values in the replay
    own_inputs: list[str] = field(default_factory=list)

    def port_path(self, sub: str = "", attr: str = "") -> str:
        r"""The dotted name of an attribute of the port (``port`` stands for the top level)."""
        return ".".join(p for p in (self.port_name, sub, attr) if p) or "port"

    def reference_path(self, sub: str = "") -> str:
        return ".".join(p for p in (self.reference_name, sub) if p) or "reference"


def verify_hint(c: Culprit, make: Callable[[], Callable], hint: Hint) -> Hint:
    r"""Build the fixed port (``make()``, e.g. a patched deep copy), run it on the port's inputs and record
    the before/after error: ``verified`` is True when it then matches the reference, False when it does not,
    and stays None when it could not be tried (no replay, or the copy or the call raised)."""
    if c.check is None:
        return hint
    try:
        ok, after = c.check(make())
    except Exception as exc:  # could not be tried (a module that cannot be copied, a fix the call rejects)
        hint.evidence["verify_error"] = f"{type(exc).__name__}: {exc}"[:200]
        return hint
    hint.verified = bool(ok)
    hint.evidence["max_abs_before"] = float((c.reference_output - c.port_output).abs().max())
    hint.evidence["max_abs_after"] = after
    if ok and c.run_check is not None:
        try:
            in_run, left = c.run_check(make())
        except Exception:  # the port's own inputs cannot be re-run: said as not tried
            in_run, left = None, None
        hint.evidence["in_run"] = in_run
        if in_run is not True:
            hint.evidence["in_run_max_abs"] = left
            return hint  # a fix for the reference's inputs only: not ranked as the fix
    if ok:
        hint.score = max(hint.score, 0.99)
        if c.model_check is not None:
            try:
                after, before = c.model_check(make)
            except Exception:  # the whole model cannot be re-run here: the fix stays said at its module
                return hint
            hint.evidence["model_max_abs_after"], hint.evidence["model_max_abs_before"] = after, before
    return hint


def patched_copy(module: Any, changes: dict[str, Any]) -> Any:
    r"""A deep copy of ``module`` with ``{"sub.attr": value}`` set (a missing parameter is added as one)."""
    import torch

    clone = copy.deepcopy(module)
    for path, value in changes.items():
        owner_path, _, attr = path.rpartition(".")
        owner = clone.get_submodule(owner_path) if owner_path else clone
        if isinstance(value, torch.nn.Parameter) or (
            isinstance(value, torch.Tensor) and attr in owner._parameters
        ):
            owner._parameters[attr] = torch.nn.Parameter(value.detach().clone(), requires_grad=False)
        elif isinstance(value, torch.Tensor) and attr in owner._buffers:
            owner._buffers[attr] = value.detach().clone()
        else:
            setattr(owner, attr, value)
    return clone
