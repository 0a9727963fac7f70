r"""Activation evidence (``activation``): which known elementwise function each side computes on the captured
input."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from paritykit.bisection.evidence.culprit import (
    FIT_REL,
    Culprit,
    verify_hint,
)
from paritykit.compare.diagnose import Hint
from paritykit.compare.tensors import relative_error

# inner_activation looks inside culprits of at most this many modules (an MLP, a feed-forward block)
INNER_ACTIVATION_MODULES = 12


def _known_functions() -> dict[str, tuple[Callable, str]]:
    import torch
    import torch.nn.functional as F

    return {
        "exact GELU": (F.gelu, "torch.nn.GELU()"),
        "tanh-GELU": (lambda x: F.gelu(x, approximate="tanh"), "torch.nn.GELU(approximate='tanh')"),
        "quick-GELU": (lambda x: x * torch.sigmoid(1.702 * x), "x * torch.sigmoid(1.702 * x)"),
        "SiLU": (F.silu, "torch.nn.SiLU()"),
        "ReLU": (F.relu, "torch.nn.ReLU()"),
        "Mish": (F.mish, "torch.nn.Mish()"),
        "sigmoid": (torch.sigmoid, "torch.nn.Sigmoid()"),
        "tanh": (torch.tanh, "torch.nn.Tanh()"),
        "LeakyReLU(0.01)": (F.leaky_relu, "torch.nn.LeakyReLU()"),
        "ELU": (F.elu, "torch.nn.ELU()"),
        "softplus": (F.softplus, "torch.nn.Softplus()"),
        "identity": (lambda x: x, "torch.nn.Identity()"),
    }


def identify_function(x: Any, y: Any) -> tuple[list[str], float]:
    r"""The known elementwise functions ``f`` with ``f(x) == y`` to near float precision (best first).

    Several names come back when they agree on this input (ReLU and identity on positive values).
    """
    import torch

    if x is None or y is None or tuple(x.shape) != tuple(y.shape) or not y.is_floating_point():
        return [], math.inf
    fits = []
    with torch.no_grad():
        for name, (fn, _) in _known_functions().items():
            err = relative_error(fn(x.to(y.dtype)), y)
            if err <= FIT_REL:
                fits.append((err, name))
    fits.sort()
    return [n for _, n in fits], (fits[0][0] if fits else math.inf)


def _single_input(c: Culprit) -> Any:
    if c.reference_inputs is None:
        return None
    args, kwargs = c.reference_inputs
    tensors = [a for a in (*args, *kwargs.values()) if hasattr(a, "shape")]
    return tensors[0] if len(tensors) == 1 else None


# diffusers' projection-and-activation classes by the function they compute on their projection's output:
# the class, and its constructor's words (dim_in, dim_out, bias filled in)
_DIFFUSERS_ACTIVATIONS = {
    "quick-GELU": ("ApproximateGELU", "ApproximateGELU({i}, {o}, bias={b})"),
    "exact GELU": ("GELU", "GELU({i}, {o}, bias={b})"),
    "tanh-GELU": ("GELU", "GELU({i}, {o}, approximate='tanh', bias={b})"),
    "SiLU": ("LinearActivation", "LinearActivation({i}, {o}, bias={b}, activation='silu')"),
}


# diffusers' FeedForward(activation_fn=…) word that builds each of those classes
_FEED_FORWARD_KEYS = {
    "quick-GELU": "geglu-approximate",
    "exact GELU": "gelu",
    "tanh-GELU": "gelu-approximate",
    "SiLU": "linear-silu",
}


def activation(c: Culprit) -> list[Hint]:
    r"""``activation``: for parameterless modules, name the known function each side computes on its input;
    for a projection and its activation in one module, :func:`fused_activation`; for other modules with
    parameters, :func:`inner_activation`."""
    if c.reference is None or c.port is None:
        return []
    if any(True for _ in c.reference.parameters()) or any(True for _ in c.port.parameters()):
        return fused_activation(c) or inner_activation(c)  # an MLP: look for the activation inside it
    x = _single_input(c)
    if x is None:
        return []
    ref_names, ref_err = identify_function(x, c.reference_output)
    port_names, port_err = identify_function(x, c.port_output)
    if not ref_names or set(ref_names) & set(port_names):
        return []
    ref_name = " or ".join(ref_names[:2])
    port_name = " or ".join(port_names[:2]) if port_names else "none of the known functions"
    fn, ctor = _known_functions()[ref_names[0]]
    hint = Hint(
        "activation",
        f"reference computes {ref_name} (relative error {ref_err:.1e} on its captured input), port computes "
        f"{port_name}"
        + (f" ({port_err:.1e})" if port_names else "")
        + " (evidence: each side's output refitted from the same input)",
        {"reference": ref_names, "port": port_names, "reference_fit": ref_err, "port_fit": port_err},
        score=0.9,
        fix=f"{c.port_path()} = {ctor}",
    )
    return [verify_hint(c, lambda: fn, hint)]


def _leaf_calls(module: Any, run: Callable[[Callable], Any], only_parameterless: bool) -> list[tuple]:
    r"""Run ``module`` through ``run`` with hooks on its leaf submodules: ``(name, input, output)`` per call
    with one tensor in and one tensor out, in execution order."""
    calls: list[tuple] = []
    handles = []

    def hook(name: str) -> Callable:
        def record(_m: Any, args: tuple, out: Any) -> None:
            if len(args) == 1 and hasattr(args[0], "shape") and hasattr(out, "shape"):
                calls.append((name, args[0].detach(), out.detach()))

        return record

    for name, sub in module.named_modules():
        if not name or any(True for _ in sub.children()):
            continue
        if only_parameterless and any(True for _ in sub.parameters(recurse=False)):
            continue
        handles.append(sub.register_forward_hook(hook(name)))
    # the port's fused modules (a GELU with its projection) hold the activation's output one level up
    if not only_parameterless:
        for name, sub in module.named_modules():
            if name and any(True for _ in sub.children()):
                handles.append(sub.register_forward_hook(hook(name)))
    try:
        run(module)
    finally:
        for h in handles:
            h.remove()
    return calls


def inner_activation(c: Culprit) -> list[Hint]:
    r"""``activation`` inside a culprit with parameters (an MLP): a parameterless reference submodule computes
    a known function ``f`` of its input ``x``; the port computes a different known function ``g`` of that same
    ``x`` in one of its submodules, and ``f(x)`` nowhere."""
    if c.reference is None or c.port is None or c.run_reference is None or c.run_port is None:
        return []
    if not any(True for _ in c.reference.parameters()):
        return []  # a parameterless culprit is :func:`activation`'s
    if sum(1 for _ in c.reference.modules()) > INNER_ACTIVATION_MODULES:
        return []  # a block, not an MLP: a rerun with every leaf refitted would cost a forward per culprit
    functions = _known_functions()
    port_calls = None
    for name, x, y in _leaf_calls(c.reference, c.run_reference, only_parameterless=True):
        ref_names, ref_err = identify_function(x, y)
        if not ref_names or "identity" in ref_names:
            continue  # dropout and friends say nothing about the activation
        if port_calls is None:
            port_calls = _leaf_calls(c.port, c.run_port, only_parameterless=False)
        fits = []
        for port_name, _px, out in port_calls:
            names, err = identify_function(x, out)
            names = [n for n in names if n != "identity"]
            if set(names) & set(ref_names):
                fits = []  # the port computes the reference's function of x somewhere: no case to make
                break
            if names:
                fits.append((port_name, names, err))
        if not fits:
            continue
        port_name, names, err = fits[0]
        ref_name = " or ".join(ref_names[:2])
        return [
            Hint(
                "activation",
                f"reference {c.reference_path(name)} computes {ref_name} (relative error {ref_err:.1e} on its"
                f" captured input); the port computes {' or '.join(names[:2])} ({err:.1e}) of that same"
                f" tensor in {c.port_path(port_name)} and {ref_names[0]} nowhere (evidence: submodule outputs"
                " of both sides refitted from the reference activation's input; not verified: the fix is"
                f" code, {functions[ref_names[0]][1]})",
                {
                    "reference": ref_names,
                    "port": names,
                    "reference_fit": ref_err,
                    "port_fit": err,
                    "reference_module": c.reference_path(name),
                    "port_module": c.port_path(port_name),
                },
                score=0.85,
            )
        ]
    return []


def _projection(module: Any) -> tuple[str, Any] | None:
    r"""``(name, Linear)`` of the one ``Linear`` a projection-and-activation module holds beside
    parameterless children only (diffusers' ``GELU.proj``; research code's ``Sequential(Linear, SiLU)``), or
    ``None``."""
    import torch

    children = list(module.named_children())
    linears = [(n, m) for n, m in children if isinstance(m, torch.nn.Linear)]
    rest = [m for _, m in children if not isinstance(m, torch.nn.Linear)]
    if len(linears) != 1 or any(True for m in rest for _ in m.parameters()):
        return None
    return linears[0]


def fused_activation(c: Culprit) -> list[Hint]:
    r"""``activation`` in a module that is one projection and an activation of its output (research code's
    ``ApproximateGELU``, diffusers' ``GELU``): the function each side applies to its projection's output,
    read from the values; when they differ, the diffusers class that computes the reference's function,
    holding the port's projection, is put in the port module's place and verified by replay."""
    import copy

    ref_found, port_found = _projection(c.reference), _projection(c.port)
    if ref_found is None or port_found is None or c.run_reference is None or c.run_port is None:
        return []
    (ref_name, _), (port_name, port_proj) = ref_found, port_found
    ref_inner = [
        out for name, _x, out in _leaf_calls(c.reference, c.run_reference, False) if name == ref_name
    ]
    port_inner = [out for name, _x, out in _leaf_calls(c.port, c.run_port, False) if name == port_name]
    if len(ref_inner) != 1 or len(port_inner) != 1:
        return []
    ref_names, ref_err = identify_function(ref_inner[0], c.reference_output)
    port_names, port_err = identify_function(port_inner[0], c.port_output)
    if not ref_names or not port_names or set(ref_names) & set(port_names):
        return []
    message = (
        f"reference {c.reference_path()} computes {ref_names[0]} of its projection's output (relative error"
        f" {ref_err:.1e}), port {c.port_path()} computes {port_names[0]} ({port_err:.1e}) (evidence: each"
        " side's output refitted from its own projection's output)"
    )
    hint = Hint(
        "activation",
        message,
        {
            "reference": ref_names,
            "port": port_names,
            "reference_fit": ref_err,
            "port_fit": port_err,
            # a class put in the port module's place: a change of code, after any setting that does the same
            "code_change": True,
        },
        score=0.9,
    )
    found = _DIFFUSERS_ACTIVATIONS.get(ref_names[0])
    if found is None:
        hint.message += f"; diffusers has no projection class for {ref_names[0]} here (not verified)"
        return [hint]
    import diffusers.models.activations as activations

    name, words = found
    bias = port_proj.bias is not None
    dims = {"i": port_proj.in_features, "o": port_proj.out_features, "b": bias}
    if name == "LinearActivation":
        replacement = activations.LinearActivation(dims["i"], dims["o"], bias=bias, activation="silu")
    elif name == "GELU":
        approximate = "tanh" if ref_names[0] == "tanh-GELU" else "none"
        replacement = activations.GELU(dims["i"], dims["o"], approximate=approximate, bias=bias)
    else:
        replacement = getattr(activations, name)(dims["i"], dims["o"], bias=bias)
    replacement.proj = copy.deepcopy(port_proj)
    replacement.to(port_proj.weight.device, port_proj.weight.dtype)
    hint.fix = f"{c.port_path()} = diffusers.models.activations.{words.format(**dims)} holding its proj"
    key = _FEED_FORWARD_KEYS.get(ref_names[0])
    parent = c.port_name.rsplit(".net.", 1)[0] if ".net." in c.port_name else None
    if key and parent and c.port_model is not None:
        try:
            in_feed_forward = type(c.port_model.get_submodule(parent)).__name__ == "FeedForward"
        except AttributeError:
            in_feed_forward = False
        if in_feed_forward:  # the config word that builds that class, where the port's FeedForward made it
            hint.fix += f" (its FeedForward {parent} builds it with activation_fn={key!r})"
    return [verify_hint(c, lambda: replacement.eval(), hint)]
