r"""Evidence at a culprit: why two aligned modules differ, each cause checked and, where possible, verified.

:mod:`paritykit.search` finds *where* a port parts from its reference; this module says *why*, from the two
module objects and the inputs and outputs captured at that call. One small function per kind of evidence, each
taking a :class:`Culprit` and returning :class:`~paritykit.diagnose.Hint` s that state their evidence:

- :func:`module_config` (``module-config``): public scalar / tuple / string attributes, ``extra_repr()`` fields
  and buffers of the two modules (and of the aligned pairs inside them) that differ.
- :func:`activation` (``activation``): which known elementwise function each side computes on the captured
  input (exact GELU, tanh-GELU, quick-GELU, SiLU, ReLU, …).
- :func:`norm_eps` (``norm-eps``): the epsilon that makes the reference's norm reproduce the port's output.
- :func:`attention_scale` (``attention-scale``): the softmax scale that reproduces the other side's output.
- :func:`weights` (``weights``): port parameters that hold a different reference slice than their name implies
  (``to_q`` = chunk 1 of a fused qkv), found by :func:`paritykit.convert.infer_conversion_map`.
- :func:`reduced_precision` (``bf16-cast`` / ``fp16-cast``): the reference re-run on inputs rounded to that
  dtype, or under autocast in it, reproduces the port's output.

Every candidate fix is tried on a deep copy of the port module (:attr:`Culprit.check`): ``verified=True`` with
the before/after error when the copy then matches the reference. :func:`culprit_evidence` runs them all; when none finds
anything it says so plainly (``no-signature``), listing what was ruled out.
"""

from __future__ import annotations

import ast
import copy
import enum
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.diagnose import Hint

# a fitted constant "reproduces" an output when the relative error left is at most this (near float precision)
FIT_REL = 1e-5
# …and at most this share of the error before the fit
FIT_GAIN = 0.01
# attributes that never change a module's numbers
_IGNORED = frozenset({"training", "inplace", "dump_patches", "call_super_init"})
# names that mean the same setting in different code bases
_SYNONYMS = {
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
_EPS_NAMES = ("eps", "epsilon", "variance_epsilon")
_SCALE_NAMES = ("scale", "scaling", "softmax_scale")


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
        check: ``check(fn) -> (matches, max_abs)``: ``fn`` run on the port's inputs, every output leaf compared
            with the reference's within the bisect tolerances.
        subpairs: aligned ``(reference, port)`` module names inside the culprit, relative to it.
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
    subpairs: list[tuple[str, str]] = field(default_factory=list)
    reference_inputs: tuple[tuple, dict] | None = None
    # filled by :func:`weights`: port parameters built from the reference through a layout op (transpose, …)
    layouts: list[str] = field(default_factory=list)

    def port_path(self, sub: str = "", attr: str = "") -> str:
        r"""The dotted name of an attribute of the port (``port`` stands for the top level)."""
        return ".".join(p for p in (self.port_name, sub, attr) if p) or "port"

    def reference_path(self, sub: str = "") -> str:
        return ".".join(p for p in (self.reference_name, sub) if p) or "reference"


# ------------------------------------------------------------------------------------------------ helpers


def _rel(x: Any, y: Any) -> float:
    r"""||x - y|| / ||y|| in float64 (inf for a shape mismatch or a non-finite value)."""
    import torch

    if x is None or y is None or tuple(x.shape) != tuple(y.shape):
        return math.inf
    x64, y64 = x.detach().double().cpu(), y.detach().double().cpu()
    diff = float(torch.linalg.vector_norm(x64 - y64))
    den = float(torch.linalg.vector_norm(y64))
    if not math.isfinite(diff):
        return math.inf
    return diff / den if den else (0.0 if diff == 0 else math.inf)


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if value != 0 and 1e-4 <= abs(value) < 1e5 else f"{value:g}"
    return repr(value)


def _verify(c: Culprit, make: Callable[[], Callable], hint: Hint) -> Hint:
    r"""Build the fixed port (``make()``, e.g. a patched deep copy), run it on the port's inputs and record the
    before/after error: ``verified`` is True when it then matches the reference, False when it does not, and
    stays None when it could not be tried (no replay, or the copy or the call raised)."""
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
    if ok:
        hint.score = max(hint.score, 0.99)
    return hint


def _patched(module: Any, changes: dict[str, Any]) -> Any:
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


# ------------------------------------------------------------------------------------------ module config


def _plain(value: Any) -> Any:
    r"""``value`` when it is a configuration value (number, string, bool, None, enum, short tuple of those)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (tuple, list)) and len(value) <= 8:
        items = [_plain(v) for v in value]
        if all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
            return tuple(items)
    return _SKIP


_SKIP = object()


def _repr_fields(module: Any) -> dict[str, Any]:
    r"""``key=value`` fields of ``extra_repr()`` that parse as Python literals."""
    try:
        text = module.extra_repr()
    except Exception:
        return {}
    out = {}
    for key, raw in re.findall(r"(\w+)=((?:\([^)]*\))|[^,]+)", text):
        try:
            out[key] = _plain(ast.literal_eval(raw.strip()))
        except (ValueError, SyntaxError):
            out[key] = raw.strip()
    return {k: v for k, v in out.items() if v is not _SKIP}


def config_of(module: Any) -> dict[str, tuple[str, Any]]:
    r"""A module's own configuration: ``{canonical name: (attribute name, value)}``.

    Public attributes holding numbers, strings, bools, enums or short tuples of them, plus ``extra_repr()``
    fields; synonyms share one canonical name (``variance_epsilon`` and ``eps`` are both ``eps``).
    """
    out: dict[str, tuple[str, Any]] = {}
    slots = module._parameters.keys() | module._buffers.keys() | module._modules.keys()
    for key, value in _repr_fields(module).items():
        if key not in slots:  # ``bias=False`` in a repr says a parameter is absent: compared as a parameter
            out[_SYNONYMS.get(key, key)] = (key, value)
    for key, value in vars(module).items():
        if key.startswith("_") or key in _IGNORED:
            continue
        plain = _plain(value)
        if plain is not _SKIP:
            out[_SYNONYMS.get(key, key)] = (key, plain)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


@dataclass
class SettingDifference:
    r"""One setting that differs between two aligned modules: ``port.<attr>`` is ``port_value``."""

    reference: str
    port: str
    name: str
    attr: str
    reference_value: Any
    port_value: Any
    kind: str = "attribute"  # attribute | buffer | parameter

    def describe(self, reference_class: str = "") -> str:
        what = f"{reference_class} " if reference_class else ""
        if self.kind == "attribute":
            return f"reference {what}{self.name}={_num(self.reference_value)}, port {self.attr}={_num(self.port_value)}"
        if self.kind == "parameter":
            return f"reference {what}has parameter {self.attr}, the port's is None"
        return f"{self.kind} {self.attr}: {self.reference_value} (reference) vs {self.port_value} (port)"

    def to_dict(self) -> dict[str, Any]:
        out = {
            "reference": self.reference,
            "port": self.port,
            "name": self.name,
            "attr": self.attr,
            "kind": self.kind,
            "reference_value": self.reference_value,
            "port_value": self.port_value,
        }
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()}


def _tensor_summary(t: Any, name: str = "") -> str:
    flat = t.detach().double().flatten()
    head = ", ".join(f"{float(v):.4g}" for v in flat[:3])
    text = f"[{head}{', …' if flat.numel() > 3 else ''}] shape {list(t.shape)}"
    theta = _rope_theta(flat) if "freq" in name else None
    return text + (f" (rotary theta {theta:.6g})" if theta else "")


def _rope_theta(inv_freq: Any) -> float | None:
    r"""The base of a rotary table ``inv_freq[i] = theta ** (-i / n)``, if the buffer is one."""
    import torch

    n = inv_freq.numel()
    if n < 2 or not bool((inv_freq > 0).all()) or float(inv_freq[0]) != 1.0:
        return None
    theta = float(inv_freq[1]) ** -n
    expected = theta ** (-torch.arange(n, dtype=torch.float64) / n)
    return theta if torch.allclose(inv_freq, expected, rtol=1e-4) else None


def settings_diff(
    reference: Any, port: Any, reference_name: str = "", port_name: str = ""
) -> list[SettingDifference]:
    r"""Settings that differ between two modules: common configuration names, then same-named buffers, then
    parameters the reference has and the port lacks (``elementwise_affine=False``)."""
    import torch

    out = []
    ref_cfg, port_cfg = config_of(reference), config_of(port)
    for name in sorted(ref_cfg.keys() & port_cfg.keys()):
        (_, a), (attr, b) = ref_cfg[name], port_cfg[name]
        if not _same(a, b):
            out.append(SettingDifference(reference_name, port_name, name, attr, a, b))
    ref_bufs = dict(reference.named_buffers(recurse=False))
    for key, b in port.named_buffers(recurse=False):
        a = ref_bufs.get(key)
        if a is None or a.shape != b.shape or not (a.is_floating_point() and b.is_floating_point()):
            continue
        if not torch.allclose(a.double().cpu(), b.double().cpu(), rtol=1e-6, atol=0.0):
            out.append(
                SettingDifference(
                    reference_name,
                    port_name,
                    key,
                    key,
                    _tensor_summary(a, key),
                    _tensor_summary(b, key),
                    "buffer",
                )
            )
    for key, a in reference.named_parameters(recurse=False):
        if a is not None and key in port._parameters and port._parameters[key] is None:
            out.append(SettingDifference(reference_name, port_name, key, key, "present", "None", "parameter"))
    return out


def config_differences(
    reference: Any, port: Any, pairs: Sequence[tuple[str, str]]
) -> list[SettingDifference]:
    r"""Every setting that differs over aligned ``(reference, port)`` module pairs of two whole models."""
    ref_modules, port_modules = dict(reference.named_modules()), dict(port.named_modules())
    out = []
    for ref_name, port_name in pairs:
        a, b = ref_modules.get(ref_name), port_modules.get(port_name)
        if a is not None and b is not None:
            out += settings_diff(a, b, ref_name, port_name)
    return out


def _fix_value(d: SettingDifference, reference: Any) -> Any:
    if d.kind == "attribute":
        value = d.reference_value
        return tuple(value) if isinstance(value, tuple) else value
    owner = reference.get_submodule(d.reference) if d.reference else reference
    return getattr(owner, d.attr)


def module_config(c: Culprit) -> list[Hint]:
    r"""``module-config``: the culprit's settings (and those of the aligned pairs inside it) that differ.

    Fixes are tried on a copy of the port (the attribute set to the reference's value, a differing buffer or a
    missing parameter copied from the reference): all differences together, then without each one that is not
    needed, so a verified fix names only the settings that matter (the rest do not change this output).
    """
    if c.reference is None or c.port is None:
        return []
    diffs = settings_diff(c.reference, c.port)
    for ref_sub, port_sub in c.subpairs:
        try:
            a, b = c.reference.get_submodule(ref_sub), c.port.get_submodule(port_sub)
        except AttributeError:
            continue
        diffs += settings_diff(a, b, ref_sub, port_sub)
    if not diffs:
        return []
    edits = [(".".join(p for p in (d.port, d.attr) if p), _fix_value(d, c.reference)) for d in diffs]
    if len(diffs) > 1 and c.check is not None:
        needed = _needed(c, edits)
        if needed is not None:  # the fewest differences that together make the module match
            diffs, edits = [diffs[k] for k in needed], [edits[k] for k in needed]
    hints = [_config_hint(c, d) for d in diffs]
    if len(diffs) > 1:
        # the settings usually go together (affine on = a flag and two parameters): try them as one fix first
        combined = Hint(
            "module-config",
            f"{len(diffs)} settings differ: "
            + "; ".join(h.message.removesuffix(_CONFIG_EVIDENCE) for h in hints)
            + _CONFIG_EVIDENCE,
            {"differences": [d.to_dict() for d in diffs]},
            score=0.8,
            fix="; ".join(h.fix for h in hints if h.fix),
        )
        if _verify(c, lambda: _patched(c.port, dict(edits)), combined).verified:
            return [combined]
    for hint, (path, value) in zip(hints, edits):
        _verify(c, lambda p=path, v=value: _patched(c.port, {p: v}), hint)
        if hint.verified is False:
            hint.message += " - setting it alone does not make the module match"
            hint.score = 0.6
    return hints


_CONFIG_EVIDENCE = " (evidence: the two modules' configuration)"


def _needed(c: Culprit, edits: list[tuple[str, Any]]) -> list[int] | None:
    r"""Indices of the edits that matter: all of them make the port match, and dropping any one does not."""

    def matches(keep: list[int]) -> bool:
        try:
            return c.check(_patched(c.port, dict(edits[k] for k in keep)))[0]
        except Exception:
            return False

    keep = list(range(len(edits)))
    if not matches(keep):
        return None
    for k in list(keep):
        trial = [j for j in keep if j != k]
        if trial and matches(trial):
            keep = trial
    return keep


def _config_hint(c: Culprit, d: SettingDifference) -> Hint:
    cls = type(c.reference.get_submodule(d.reference) if d.reference else c.reference).__name__
    if d.kind == "attribute":
        fix = f"{c.port_path(d.port, d.attr)} = {_fix_value(d, c.reference)!r}"
    else:
        fix = f"copy {d.kind} {c.reference_path(d.reference)}.{d.attr} into {c.port_path(d.port, d.attr)}"
    return Hint(
        "module-config", d.describe(cls) + _CONFIG_EVIDENCE, {"difference": d.to_dict()}, score=0.8, fix=fix
    )


# ------------------------------------------------------------------------------------------- activations

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
            err = _rel(fn(x.to(y.dtype)), y)
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


def activation(c: Culprit) -> list[Hint]:
    r"""``activation``: for parameterless modules, name the known function each side computes on its input;
    for modules with parameters, :func:`inner_activation`."""
    if c.reference is None or c.port is None:
        return []
    if any(True for _ in c.reference.parameters()) or any(True for _ in c.port.parameters()):
        return inner_activation(c)  # an MLP: look for the activation inside it
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
        + " (evidence: each side's output refitted "
        "from the same input)",
        {"reference": ref_names, "port": port_names, "reference_fit": ref_err, "port_fit": port_err},
        score=0.9,
        fix=f"{c.port_path()} = {ctor}",
    )
    return [_verify(c, lambda: fn, hint)]


def _leaf_calls(module: Any, run: Callable[[Callable], Any], only_parameterless: bool) -> list[tuple]:
    r"""Run ``module`` through ``run`` with hooks on its leaf submodules: ``(name, input, output)`` per call with
    one tensor in and one tensor out, in execution order."""
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
    r"""``activation`` inside a culprit with parameters (an MLP): a parameterless reference submodule computes a
    known function ``f`` of its input ``x``; the port computes a different known function ``g`` of that same
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
                f"reference {c.reference_path(name)} computes {ref_name} (relative error {ref_err:.1e} on its "
                f"captured input); the port computes {' or '.join(names[:2])} ({err:.1e}) of that same tensor in "
                f"{c.port_path(port_name)} and {ref_names[0]} nowhere (evidence: submodule outputs of both sides "
                f"refitted from the reference activation's input; not verified: the fix is code, "
                f"{functions[ref_names[0]][1]})",
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


# ---------------------------------------------------------------------------------------------- fits


def _attr_of(module: Any, names: Sequence[str]) -> str | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return name
    return None


def _fit_constant(
    run: Callable[[float], Any], target: Any, candidates: Sequence[float], refine: bool
) -> tuple[float, float, list[float]]:
    r"""The candidate (then refined in log space) whose output is closest to ``target``; also every candidate
    that fits to :data:`FIT_REL` (several eps values below the data's variance are indistinguishable)."""
    scored = []
    for value in candidates:
        try:
            scored.append((_rel(run(value), target), value))
        except Exception:
            continue
    if not scored:
        return math.nan, math.inf, []
    scored.sort()
    best_err, best = scored[0]
    if refine and best_err > FIT_REL and best > 0 and best_err < 0.5:
        # golden-section search in log space around the best candidate, one new evaluation per step
        def cost(u: float) -> float:
            return _rel(run(math.exp(u)), target)

        golden = (math.sqrt(5) - 1) / 2
        lo, hi = math.log(best / 4), math.log(best * 4)
        m1, m2 = hi - golden * (hi - lo), lo + golden * (hi - lo)
        f1, f2 = cost(m1), cost(m2)
        for _ in range(30):
            if f1 < f2:
                hi, m2, f2 = m2, m1, f1
                m1 = hi - golden * (hi - lo)
                f1 = cost(m1)
            else:
                lo, m1, f1 = m1, m2, f2
                m2 = lo + golden * (hi - lo)
                f2 = cost(m2)
        err, value = min((f1, math.exp(m1)), (f2, math.exp(m2)))
        if err < best_err:
            best_err, best = err, value
    fitting = sorted(v for e, v in scored if e <= FIT_REL)
    return best, best_err, fitting


def norm_eps(c: Culprit) -> list[Hint]:
    r"""``norm-eps``: the epsilon with which the reference's norm reproduces the port's output."""
    if c.reference is None or c.run_reference is None or "norm" not in type(c.reference).__name__.lower():
        return []
    attr = _attr_of(c.reference, _EPS_NAMES)
    if attr is None:
        return []
    ref_eps = float(getattr(c.reference, attr))
    before = _rel(c.reference_output, c.port_output)

    def run(eps: float) -> Any:
        return c.run_reference(_patched(c.reference, {attr: eps}))

    candidates = sorted(
        {10.0**-k for k in range(0, 15)} | {m * 10.0**-k for m in (2, 5) for k in range(1, 13)}
    )
    best, err, fitting = _fit_constant(run, c.port_output, candidates, refine=False)
    if not before > 0 or err > FIT_REL or err >= FIT_GAIN * before or not fitting:
        return []
    shown = _num(best) if len(fitting) == 1 else f"any eps in [{_num(fitting[0])}, {_num(fitting[-1])}]"
    port_attr = _attr_of(c.port, _EPS_NAMES) if c.port is not None else None
    hint = Hint(
        "norm-eps",
        f"the reference norm reproduces the port's output with {shown} (relative error {err:.1e}, "
        f"{before:.1e} with its own eps={_num(ref_eps)}) (evidence: eps fitted on the captured input)",
        {"fitted_eps": best, "fitting": fitting, "reference_eps": ref_eps, "fit_error": err, "error": before},
        score=0.88,
        fix=f"{c.port_path(attr=port_attr or 'eps')} = {ref_eps!r}",
    )
    if port_attr is not None:
        _verify(c, lambda: _patched(c.port, {port_attr: ref_eps}), hint)
    return [hint]


def _is_attention(module: Any) -> bool:
    return module is not None and "attention" in type(module).__name__.lower()


def _scale_candidates(module: Any, current: float) -> list[float]:
    dims = set()
    for name in ("head_dim", "attention_head_size", "dim_head"):
        if isinstance(getattr(module, name, None), int):
            dims.add(getattr(module, name))
    heads = next((getattr(module, n) for n in ("heads", "num_heads", "num_attention_heads") if
                  isinstance(getattr(module, n, None), int)), None)  # fmt: skip
    for name in ("inner_dim", "embed_dim", "all_head_size", "dim"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            dims.add(value)
            if heads:
                dims.add(value // heads)
    values = {1.0, current, current * 2, current / 2, current**2, math.sqrt(abs(current))}
    for d in dims:
        if d > 0:
            values |= {d**-0.5, 1.0 / d, d**0.5}
    return sorted(v for v in values if v > 0)


def attention_scale(c: Culprit) -> list[Hint]:
    r"""``attention-scale``: the softmax scale that makes one side reproduce the other's output.

    With a scale attribute on the port, the port's copy is refitted to the reference output (the fix is that
    value, verified); else, with one on the reference, the reference is refitted to the port's output.
    """
    if not (_is_attention(c.reference) or _is_attention(c.port)):
        return []
    before = _rel(c.port_output, c.reference_output)
    port_attr = _attr_of(c.port, _SCALE_NAMES) if c.port is not None else None
    if port_attr is not None and c.run_port is not None:
        current = float(getattr(c.port, port_attr))

        def run(s: float) -> Any:
            return c.run_port(_patched(c.port, {port_attr: s}))

        best, err, _ = _fit_constant(run, c.reference_output, _scale_candidates(c.port, current), refine=True)
        if (
            before > 0
            and err <= FIT_REL
            and err < FIT_GAIN * before
            and not math.isclose(best, current, rel_tol=1e-4)
        ):
            hint = Hint(
                "attention-scale",
                f"the port's attention reproduces the reference output with scale {_num(best)} (relative error "
                f"{err:.1e}); it uses {port_attr}={_num(current)} (evidence: softmax scale fitted on the "
                "captured input)",
                {"fitted_scale": best, "port_scale": current, "fit_error": err, "error": before},
                score=0.9,
                fix=f"{c.port_path(attr=port_attr)} = {best!r}",
            )
            return [_verify(c, lambda: _patched(c.port, {port_attr: best}), hint)]
        return []
    ref_attr = _attr_of(c.reference, _SCALE_NAMES) if c.reference is not None else None
    if ref_attr is None or c.run_reference is None:
        return []
    current = float(getattr(c.reference, ref_attr))

    def run_ref(s: float) -> Any:
        return c.run_reference(_patched(c.reference, {ref_attr: s}))

    best, err, _ = _fit_constant(run_ref, c.port_output, _scale_candidates(c.reference, current), refine=True)
    if (
        not before > 0
        or err > FIT_REL
        or err >= FIT_GAIN * before
        or math.isclose(best, current, rel_tol=1e-4)
    ):
        return []
    return [
        Hint(
            "attention-scale",
            f"the port computes attention with softmax scale {_num(best)} where the reference uses "
            f"{_num(current)} (evidence: the reference refitted to the port's output, relative error {err:.1e})",
            {"fitted_scale": best, "reference_scale": current, "fit_error": err, "error": before},
            score=0.88,
            fix=f"use softmax scale {current!r} in {c.port_path()}",
        )
    ]


# ------------------------------------------------------------------------------------------------ weights

# the order a fused projection holds its parts in, by the role word in a split module's name
_ROLES = {
    3: (
        ("q", "query", "to_q", "q_proj", "wq"),
        ("k", "key", "to_k", "k_proj", "wk"),
        ("v", "value", "to_v", "v_proj", "wv"),
    ),  # fmt: skip
    2: (("k", "key", "to_k", "k_proj", "wk"), ("v", "value", "to_v", "v_proj", "wv")),
}


def _implied_index(target: str, count: int) -> int | None:
    r"""The chunk a split parameter's name implies (``to_k.weight`` is chunk 1 of 3), if its name says."""
    words = set(re.split(r"[._]", target.rpartition(".")[0] or target)) | set(target.split("."))
    roles = _ROLES.get(count)
    if roles is None:
        return None
    hits = [i for i, names in enumerate(roles) if words & set(names)]
    return hits[0] if len(hits) == 1 else None


def _state(module: Any) -> dict[str, Any]:
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point() and v.ndim > 0}


def weights(c: Culprit) -> list[Hint]:
    r"""``weights``: port parameters built from another reference slice than their name implies.

    The two modules' state dicts go through :func:`paritykit.convert.infer_conversion_map` (the value matching
    of ``paritykit weights map``); a split parameter whose chunk index differs from the one its role word
    implies is a conversion bug. The fix loads each from its implied slice, through the same rule runtime.
    """
    if c.reference is None or c.port is None:
        return []
    from paritykit.convert import apply_rules_to_state_dict, infer_conversion_map

    # keyed by their names in the whole models, as `paritykit weights map` sees them (and names them)
    ref_prefix, port_prefix = _prefix(c.reference_name), _prefix(c.port_name)
    ref_sd = {ref_prefix + k: v for k, v in _state(c.reference).items()}
    port_sd = {port_prefix + k: v for k, v in _state(c.port).items()}
    if not ref_sd or not port_sd:
        return []
    cmap = infer_conversion_map(ref_sd, port_sd)
    ambiguous = {a.target for a in cmap.ambiguous}
    entries = [e for e in cmap.mapping if e.target not in ambiguous]
    c.layouts = [
        f"{e.target} ({e.describe()})" for e in entries if any(st["op"] in _LAYOUT_OPS for st in _steps(e))
    ]
    rules, lines = [], []
    for entry in entries:
        found = _misassigned(entry, ref_sd)
        if found is not None:
            rules.append(found[0])
            lines.append(found[1])
    if rules:
        message = "conversion bug: " + "; ".join(lines)
    else:
        # a layout op (transpose, reordered rows) the names do not call for is only a slip when undoing it
        # makes the module match, so these come back only verified
        rules = [r for r in (_without_layout(e, ref_sd, port_sd) for e in entries) if r is not None]
        if not rules:
            return _unmatched(c, cmap, ref_sd)
        message = "conversion slip: " + "; ".join(
            f"port {r['target']} is reference {r['sources'][0]} after {r['layout']}" for r in rules
        )
    fixed = apply_rules_to_state_dict(rules, {k: ref_sd[k] for k in {r["sources"][0] for r in rules}})
    hint = Hint(
        "weights",
        message + " (evidence: parameter values matched as in `paritykit weights map`)",
        {"rules": [{k: v for k, v in r.items() if k != "pattern"} for r in rules]},
        score=0.95,
        fix="; ".join(f"load {r['target']} from {r['sources'][0]}" + _describe(r) for r in rules),
    )
    patch = {k.removeprefix(port_prefix): v.to(port_sd[k].dtype) for k, v in fixed.items()}
    _verify(c, lambda: _patched(c.port, patch), hint)
    if "layout" in rules[0] and not hint.verified:
        return _unmatched(c, cmap, ref_sd)
    return [hint]


_LAYOUT_OPS = ("transpose", "permute", "swap_halves", "permute_rows")


def _describe(rule: dict[str, Any]) -> str:
    from paritykit.convert import describe_op

    text = describe_op(rule["op"], rule["args"])
    return f" ({text})" if text else ""


def _rule(source: str, target: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    op, args = (
        ("identity", {}) if not steps else (steps[0]["op"], {k: v for k, v in steps[0].items() if k != "op"})
    )
    if len(steps) > 1:
        args["then"] = steps[1:]
    return {"pattern": re.escape(source), "sources": [source], "target": target, "op": op, "args": args}


def _steps(entry: Any) -> list[dict[str, Any]]:
    main = {"op": entry.op, **{k: v for k, v in entry.args.items() if k != "then"}}
    return ([main] if entry.op != "identity" else []) + list(entry.args.get("then", []))


def _misassigned(entry: Any, ref_sd: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    r"""The corrected rule and a sentence when a port parameter holds another role's tensor than its name says:
    a chunk of a fused projection other than the one its role implies, or a whole tensor of another role
    (``to_k`` loaded from ``v_proj``)."""
    if len(entry.sources) != 1:
        return None
    source = entry.sources[0]
    steps = _steps(entry)
    if entry.op == "chunk" and "count" in entry.args:
        count, index = entry.args["count"], entry.args["index"]
        implied = _implied_index(entry.target, count)
        if implied is None or implied == index:
            return None
        size = entry.args["stop"] - entry.args["start"]
        steps[0] = dict(steps[0], index=implied, start=implied * size, stop=(implied + 1) * size)
        return _rule(source, entry.target, steps), (
            f"port {entry.target} holds chunk {index}/{count} of reference {source} "
            f"(its name implies chunk {implied}/{count})"
        )
    want, have = _implied_index(entry.target, 3), _implied_index(source, 3)
    if entry.op == "chunk" or want is None or have is None or want == have:
        return None
    leaf = source.rsplit(".", 1)[-1]
    others = [k for k in ref_sd if k.rsplit(".", 1)[-1] == leaf and _implied_index(k, 3) == want
              and k.count(".") == source.count(".") and _same_but_role(k, source)]  # fmt: skip
    if len(others) != 1:
        return None
    return _rule(others[0], entry.target, steps), (
        f"port {entry.target} holds reference {source} (its name implies {others[0]})"
    )


def _same_but_role(a: str, b: str) -> bool:
    r"""Whether two names differ only in their role segment (``attn.k_proj.weight`` / ``attn.v_proj.weight``)."""
    diff = [(x, y) for x, y in zip(a.split("."), b.split(".")) if x != y]
    return len(diff) == 1


def _without_layout(entry: Any, ref_sd: dict[str, Any], port_sd: dict[str, Any]) -> dict[str, Any] | None:
    r"""The rule for ``entry`` with its layout steps (transpose, row reorders) dropped, when the shapes allow."""
    if len(entry.sources) != 1:
        return None
    steps = _steps(entry)
    kept = [s for s in steps if s["op"] not in _LAYOUT_OPS]
    if len(kept) == len(steps):
        return None
    rule = _rule(entry.sources[0], entry.target, kept)
    rule["layout"] = " + ".join(s["op"] for s in steps if s["op"] in _LAYOUT_OPS)
    from paritykit.convert import apply_rules_to_state_dict

    # the shape must come out right without the layout step (a transposed square matrix, a reordered row set)
    try:
        out = apply_rules_to_state_dict([rule], {entry.sources[0]: ref_sd[entry.sources[0]]})
    except Exception:
        return None
    return rule if tuple(out[entry.target].shape) == tuple(port_sd[entry.target].shape) else None


def _prefix(name: str) -> str:
    return name + "." if name else ""


def _unmatched(c: Culprit, cmap: Any, ref_sd: dict[str, Any]) -> list[Hint]:
    r"""Port parameters that equal no reference tensor (nor a slice, transpose or cast of one), and reference
    parameters with information (not constant) that no port parameter uses: dropped in the conversion."""
    dropped = [k for k in cmap.unused_source if _informative(ref_sd[k])]
    if not cmap.unmapped_target and not dropped:
        return []
    parts = []
    if cmap.unmapped_target:
        names = ", ".join(cmap.unmapped_target[:6])
        parts.append(f"port parameters {names} equal no reference tensor of {c.reference_path()} by value")
    if dropped:
        names = ", ".join(dropped[:6])
        parts.append(f"reference parameters {names} (not constant) are used by no port parameter")
    return [
        Hint(
            "weights",
            "; ".join(parts)
            + " (evidence: parameter values matched as in `paritykit weights map`): the conversion "
            "drops or alters them, or the port lacks the layer that uses them",
            {"unmatched_port": list(cmap.unmapped_target), "unused_reference": dropped},
            score=0.85,
        )
    ]


def _informative(t: Any) -> bool:
    flat = t.detach().reshape(-1)
    return flat.numel() > 1 and bool((flat != flat[0]).any())


# --------------------------------------------------------------------------------------- reduced precision

# a rerun in reduced precision "reproduces" the port when it leaves at most this share of the error
CAST_GAIN = 0.1


def reduced_precision(c: Culprit) -> list[Hint]:
    r"""``bf16-cast`` / ``fp16-cast``: the reference module re-run with its inputs rounded to that dtype, or
    under ``torch.autocast`` in it, reproduces the port's output far more closely than its own output does.

    An activation approximation, an eps change or swapped weights leave the error where it was after such a
    rerun, so those look-alikes get no cast hint.
    """
    import torch

    if c.reference is None or c.run_reference is None:
        return []
    before = _rel(c.reference_output, c.port_output)
    if not before > 0:
        return []
    device = next((t.device.type for t in (*c.reference.parameters(), *c.reference.buffers())), "cpu")
    for dtype_name, hint_id in (("bfloat16", "bf16-cast"), ("float16", "fp16-cast")):
        dtype = getattr(torch, dtype_name)

        def rounded(*args: Any, _dtype: Any = dtype, **kwargs: Any) -> Any:
            def r(v: Any) -> Any:
                return (
                    v.to(_dtype).to(v.dtype)
                    if hasattr(v, "is_floating_point") and v.is_floating_point()
                    else v
                )

            return c.reference(*(r(a) for a in args), **{k: r(v) for k, v in kwargs.items()})

        def autocast(*args: Any, _dtype: Any = dtype, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device, dtype=_dtype):
                return c.reference(*args, **kwargs)

        for how, fn in ((f"with its inputs rounded to {dtype_name}", rounded),
                        (f"under torch.autocast({dtype_name})", autocast)):  # fmt: skip
            try:
                out = c.run_reference(fn)
            except Exception:  # autocast unsupported for this dtype on this device
                continue
            err = _rel(out.to(c.port_output.dtype), c.port_output)
            if err <= CAST_GAIN * before:
                return [
                    Hint(
                        hint_id,
                        f"the reference module re-run {how} reproduces the port's output (relative error "
                        f"{err:.1e}, against {before:.1e} as it is) (evidence: the rerun): the port computes this "
                        f"module or its input in {dtype_name}",
                        {"rerun_error": err, "error": before, "dtype": dtype_name, "rerun": how},
                        score=0.92,
                    )
                ]
    return []


# -------------------------------------------------------------------------------------------- the whole


EVIDENCE: tuple[tuple[str, Callable[[Culprit], list[Hint]]], ...] = (
    ("module config", module_config),
    ("activation", activation),
    ("norm eps", norm_eps),
    ("attention scale", attention_scale),
    ("weight slices", weights),
    ("reduced precision", reduced_precision),
)


def rank(hints: Sequence[Hint]) -> list[Hint]:
    r"""Verified fixes first, then by score; one hint per fix."""
    seen, out = set(), []
    for h in sorted(hints, key=lambda h: (h.verified is not True, -h.score)):
        key = h.fix or (h.id, h.message)  # two detectors proposing one fix: the first says it
        if key not in seen:
            seen.add(key)
            out.append(h)
    return out


def culprit_evidence(c: Culprit, tensor_hints: Sequence[Hint] = ()) -> list[Hint]:
    r"""Run every evidence function at a culprit; with nothing found anywhere, one ``no-signature`` hint.

    Args:
        c: the culprit.
        tensor_hints: what the tensor-level detectors (:func:`paritykit.diagnose.diagnose`, remix) found.
    Returns:
        Hints, verified fixes first.
    """
    import torch

    found: list[Hint] = []
    ran: list[str] = []
    failed: list[str] = []
    with torch.no_grad():
        for name, fn in EVIDENCE:
            if name == "norm eps" and any(
                h.id == "module-config" and h.evidence.get("difference", {}).get("name") == "eps"
                for h in found
            ):
                continue  # the eps is named already; a fit would only repeat it
            try:
                found += fn(c)
                ran.append(name)
            except Exception as exc:  # one broken check must not hide the others, nor count as passed
                failed.append(f"{name} ({type(exc).__name__}: {str(exc)[:80]})")
    hints = rank([*found, *tensor_hints])
    verified = [h for h in hints if h.verified]
    if verified:
        return verified  # a fix that makes the module match explains all of it; the rest would only distract
    if hints:
        return hints
    return [no_signature(c, ran, failed)]


def no_signature(c: Culprit, ran: Sequence[str], failed: Sequence[str] = ()) -> Hint:
    r"""The plain statement when no detector has evidence, with what was ruled out and what could not run."""
    ruled_out = [*ran, "tensor signatures"]
    checked_all = (
        c.reference is not None and c.port is not None and "module config" in ran and "weight slices" in ran
    )
    if checked_all and c.layouts:
        message = (
            "no known signature; module config is identical and every parameter holds the reference tensor its "
            f"name implies, some through a layout op ({', '.join(c.layouts[:3])}): if that layout is not what "
            "the port's forward expects, it is the cause; otherwise the forward code differs"
        )
    elif checked_all:
        message = (
            "no known signature; module config and weights are identical (every parameter holds the reference "
            "tensor its name implies), so the forward code differs"
        )
    elif c.reference is None or c.port is None:
        message = (
            "no known signature in the output tensors; module objects were not available, so configuration "
            "and weights were not checked"
        )
    else:
        message = "no known signature; not every check could run, so the cause is unknown"
    message += f" (ruled out: {', '.join([*ran, 'tensor signatures (casts, transposes, scales, offsets)'])}"
    message += f"; could not run: {', '.join(failed)})" if failed else ")"
    return Hint("no-signature", message, {"ruled_out": ruled_out, "not_run": list(failed)}, score=0.1)
