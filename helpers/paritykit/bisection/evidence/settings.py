r"""Settings evidence (``module-config``): public attributes, ``extra_repr()`` fields and buffers of two
aligned modules that differ, each fix replayed on a copy."""

from __future__ import annotations

import ast
import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paritykit.base.report import format_value
from paritykit.bisection.evidence.culprit import (
    NOT_SETTINGS,
    SYNONYMS,
    Culprit,
    patched_copy,
    verify_hint,
)
from paritykit.compare.diagnose import Hint


def _plain(value: Any) -> Any:
    r"""``value`` when it is a configuration value (number, string, bool, None, enum, short tuple of
    those)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return _EnumText(value)
    if isinstance(value, (tuple, list)) and len(value) <= 8:
        items = [_plain(v) for v in value]
        if all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
            return tuple(items)
    return _SKIP


_SKIP = object()


class _EnumText(str):
    r"""An enum setting as ``Class.NAME``, which also equals the plain string of its name or value
    (``LTXRopeType.INTERLEAVED`` and a port's ``"interleaved"`` are one setting)."""

    def __new__(cls, value: enum.Enum) -> _EnumText:
        text = super().__new__(cls, f"{type(value).__name__}.{value.name}")
        text.aliases = {value.name.lower(), str(value.value).lower()}
        return text

    def same(self, other: Any) -> bool:
        if isinstance(other, _EnumText):
            return str(self) == str(other) or bool(self.aliases & other.aliases)
        return isinstance(other, str) and other.lower() in self.aliases


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
            out[SYNONYMS.get(key, key)] = (key, value)
    for key, value in vars(module).items():
        if key.startswith("_") or key in NOT_SETTINGS:
            continue
        plain = _plain(value)
        if plain is not _SKIP:
            out[SYNONYMS.get(key, key)] = (key, plain)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _EnumText) or isinstance(b, _EnumText):
        return a.same(b) if isinstance(a, _EnumText) else b.same(a)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if {a, b} == {False, None} and not (a is False and b is False):
        return True  # a flag off and an optional part absent (conv_shortcut=False against None): one setting
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
            return (
                f"reference {what}{self.name}={format_value(self.reference_value)}, port"
                f" {self.attr}={format_value(self.port_value)}"
            )
        if self.kind == "parameter":
            return f"reference {what}has parameter {self.attr}, the port's is None"
        if self.kind == "state":
            return (
                f"state {self.attr} (a tensor set in __init__ that forward reads): {self.reference_value}"
                f" (reference) vs {self.port_value} (port)"
            )
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
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _tensor_summary(t: Any, name: str = "") -> str:
    from paritykit.bisection.rotary import read_rotary

    form = read_rotary(t) if t.dim() >= 2 else None
    if form is not None:
        return f"{form.describe()} shape {list(t.shape)}"
    if t.is_complex():
        t = _real_view(t)
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


def _names_class(value: Any, module: Any) -> bool:
    r"""``value`` is only a name of ``module``'s class (a ``name``/``type`` string two implementations spell
    differently): a difference of class names alone is no setting."""
    if not isinstance(value, str):
        return False
    spelled = re.sub(r"[^a-z0-9]", "", value.lower())
    return bool(spelled) and any(
        spelled == re.sub(r"[^a-z0-9]", "", cls.__name__.lower()) for cls in type(module).__mro__
    )


_CONV_AXES = {"kernel_size": 1, "stride": 1, "padding": 0, "dilation": 1, "output_padding": 0}


def _per_frame(reference: Any, port: Any, ref_cfg: dict, port_cfg: dict) -> tuple[dict, dict]:
    r"""Two convolutions of which one has an extra leading axis that does nothing (kernel 1, stride 1, no
    padding: a video model's ``Conv3d`` with kernel ``(1, k, k)`` against the port's ``Conv2d`` applied per
    frame) compare their settings without that axis; the configs as they are otherwise."""
    import torch

    conv = torch.nn.modules.conv._ConvNd
    if not (isinstance(reference, conv) and isinstance(port, conv)):
        return ref_cfg, port_cfg
    ref_dims, port_dims = len(reference.kernel_size), len(port.kernel_size)
    if abs(ref_dims - port_dims) != 1:
        return ref_cfg, port_cfg
    wide = reference if ref_dims > port_dims else port
    if any(tuple(getattr(wide, k, (v,)))[0] != v for k, v in _CONV_AXES.items() if hasattr(wide, k)):
        return ref_cfg, port_cfg

    def narrowed(cfg: dict) -> dict:
        return {
            name: (attr, value[1:] if name in _CONV_AXES and isinstance(value, tuple) else value)
            for name, (attr, value) in cfg.items()
        }

    return (narrowed(ref_cfg), port_cfg) if wide is reference else (ref_cfg, narrowed(port_cfg))


def _evaluating_dropout(module: Any) -> bool:
    import torch

    return isinstance(module, torch.nn.modules.dropout._DropoutNd) and not module.training


def settings_diff(
    reference: Any, port: Any, reference_name: str = "", port_name: str = ""
) -> list[SettingDifference]:
    r"""Settings that differ between two modules: common configuration names, then same-named buffers, then
    parameters the reference has and the port lacks (``elementwise_affine=False``)."""
    import torch

    out = []
    ref_cfg, port_cfg = _per_frame(reference, port, config_of(reference), config_of(port))
    for name in sorted(ref_cfg.keys() & port_cfg.keys()):
        (_, a), (attr, b) = ref_cfg[name], port_cfg[name]
        if name == "p" and _evaluating_dropout(reference) and _evaluating_dropout(port):
            continue  # a dropout rate does nothing in eval mode (round 33: f5-tts's p=0.1 against 0)
        if name == "padding":
            a, b = _padding_as_numbers(reference, a), _padding_as_numbers(port, b)
        if _two_meanings(a, b):
            continue  # round 35 (make-a-video): RMSNorm's dim=-1 (an axis), diffusers' dim=(16,) (a shape)
        if not _same(a, b) and not (_names_class(a, reference) and _names_class(b, port)):
            out.append(SettingDifference(reference_name, port_name, name, attr, a, b))
    # buffers, and tensors set in __init__ as plain attributes (research code keeps rotary tables so):
    # constructed state the forward reads, compared by name
    held = (
        ("buffer", dict(reference.named_buffers(recurse=False)), dict(port.named_buffers(recurse=False))),
        ("state", _plain_tensors(reference), _plain_tensors(port)),
    )
    for kind, ref_tensors, port_tensors in held:
        for key, b in port_tensors.items():
            a = ref_tensors.get(key)
            if a is None or a.shape != b.shape or not _comparable_kinds(a, b):
                continue
            if not torch.allclose(_comparable(a), _comparable(b), rtol=1e-6, atol=0.0):
                out.append(
                    SettingDifference(
                        reference_name,
                        port_name,
                        key,
                        key,
                        _tensor_summary(a, key),
                        _tensor_summary(b, key),
                        kind,
                    )
                )
    for key, a in reference.named_parameters(recurse=False):
        if a is not None and key in port._parameters and port._parameters[key] is None:
            out.append(SettingDifference(reference_name, port_name, key, key, "present", "None", "parameter"))
    return out


def _two_meanings(a: Any, b: Any) -> bool:
    r"""One name holding an axis on one side (a negative int) and a shape on the other (a tuple of sizes):
    two settings that share a name, not one setting with two values."""

    def axis(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v < 0

    def shape(v: Any) -> bool:
        return isinstance(v, tuple) and bool(v) and all(isinstance(x, int) and x > 0 for x in v)

    return (axis(a) and shape(b)) or (shape(a) and axis(b))


def _padding_as_numbers(module: Any, padding: Any) -> Any:
    r"""A convolution's ``padding='valid'`` or ``'same'`` as the numbers it pads by (``'same'`` only where
    it pads each side alike: stride 1 and an even ``dilation * (kernel - 1)``), so ``'same'`` against
    ``(1, 1)`` for a 3x3 kernel is no difference; ``padding`` as it is otherwise."""
    kernel, dilation = getattr(module, "kernel_size", None), getattr(module, "dilation", None)
    if not isinstance(padding, str) or not isinstance(kernel, tuple) or not isinstance(dilation, tuple):
        return padding
    if padding == "valid":
        return tuple(0 for _ in kernel)
    total = [d * (k - 1) for k, d in zip(kernel, dilation)]
    if padding == "same" and all(t % 2 == 0 for t in total) and set(getattr(module, "stride", (1,))) == {1}:
        return tuple(t // 2 for t in total)
    return padding


def _plain_tensors(module: Any) -> dict[str, Any]:
    r"""A module's tensors held as plain attributes (not parameters, not buffers)."""
    import torch

    return {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_") and isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
    }


def _comparable_kinds(a: Any, b: Any) -> bool:
    r"""Both floating point, or both complex."""
    return (a.is_floating_point() and b.is_floating_point()) or (a.is_complex() and b.is_complex())


def _comparable(t: Any) -> Any:
    return (_real_view(t) if t.is_complex() else t).double().cpu()


def _real_view(t: Any) -> Any:
    import torch

    return torch.view_as_real(t.resolve_conj())


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
    r"""``module-config``: the culprit's settings (and those of the aligned pairs inside it that did not match
    on identical inputs) that differ.

    Fixes are tried on a copy of the port (the attribute set to the reference's value, a differing buffer or a
    missing parameter copied from the reference): all differences together, then without each one that is not
    needed, so a verified fix names only the settings that matter (the rest do not change this output).
    """
    if c.reference is None or c.port is None:
        return []
    diffs = settings_diff(c.reference, c.port)
    for ref_sub, port_sub in c.subpairs:
        if (ref_sub, port_sub) in c.matched_subpairs:
            continue  # it computes the reference's output on the reference's inputs: no setting there matters
        if (ref_sub, port_sub) in c.unpaired_subpairs:
            # fed other layouts (round 29: a space-to-depth 1x1 conv folded into a strided 2x2 one): their
            # kernel, stride and widths differ by the fold, not by a slip
            continue
        try:
            a, b = c.reference.get_submodule(ref_sub), c.port.get_submodule(port_sub)
        except AttributeError:
            continue
        diffs += settings_diff(a, b, ref_sub, port_sub)
    if not diffs:
        return _settings_by_words(c)
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
        if verify_hint(c, lambda: patched_copy(c.port, dict(edits)), combined).verified:
            return [combined]
    for hint, (path, value) in zip(hints, edits):
        verify_hint(c, lambda p=path, v=value: patched_copy(c.port, {p: v}), hint)
        if hint.verified is False:
            hint.message += " - setting it alone does not make the module match"
            hint.score = 0.6
    return hints


_CONFIG_EVIDENCE = " (evidence: the two modules' configuration)"


def _needed(c: Culprit, edits: list[tuple[str, Any]]) -> list[int] | None:
    r"""Indices of the edits that matter: all of them make the port match, and dropping any one does not."""

    def matches(keep: list[int]) -> bool:
        try:
            return c.check(patched_copy(c.port, dict(edits[k] for k in keep)))[0]
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


# numeric settings of other names tried as a fix, at most this many
WORD_PAIRS = 12


def _words(path: str) -> list[str]:
    return [w for w in re.split(r"[._]", path.lower()) if w]


def _numbers(module: Any) -> list[tuple[str, str, float]]:
    r"""``(module path, attribute, value)`` of every float setting in ``module`` and below (not bools or
    ints: those are sizes and flags, which other evidence reads)."""
    out = []
    for path, sub in module.named_modules():
        for _, (attr, value) in config_of(sub).items():
            if isinstance(value, float) and math.isfinite(value):
                out.append((path, attr, value))
    return out


def _settings_by_words(c: Culprit) -> list[Hint]:
    r"""Float settings the two sides name otherwise (round 34, karras3d: the port block's
    ``resnet_mp_add_t=0.25`` against the research block's ``res_mp_add.t=0.3``, which its constructor never
    passed the config's value): pairs whose full names end in the same word and share another, with other
    values. Each is set to the reference's value on a copy of the port, and only a pair that then makes the
    module match is said: verified, or nothing."""
    if c.check is None:
        return []
    ref_numbers = _numbers(c.reference)
    pairs = []
    for port_path, port_attr, b in _numbers(c.port):
        port_words = _words(f"{port_path}.{port_attr}")
        for ref_path, ref_attr, a in ref_numbers:
            ref_words = _words(f"{ref_path}.{ref_attr}")
            if math.isclose(a, b, rel_tol=1e-9) or port_words[-1] != ref_words[-1]:
                continue
            if len(set(port_words[:-1]) & set(ref_words[:-1])) >= 1:
                pairs.append((ref_path, ref_attr, a, port_path, port_attr, b))
    hints = []
    for ref_path, ref_attr, a, port_path, port_attr, b in pairs[:WORD_PAIRS]:
        where = ".".join(x for x in (port_path, port_attr) if x)
        hint = Hint(
            "module-config",
            f"reference {c.reference_path(ref_path)}.{ref_attr}={format_value(a)}, port"
            f" {c.port_path(port_path, port_attr)}={format_value(b)} (settings of other names, paired by"
            " their name words and tried)" + _CONFIG_EVIDENCE,
            {"reference": ref_path, "attr": ref_attr, "port": port_path, "port_attr": port_attr},
            score=0.8,
            fix=f"{c.port_path(port_path, port_attr)} = {a!r}",
        )
        if verify_hint(c, lambda w=where, v=a: patched_copy(c.port, {w: v}), hint).verified:
            hints.append(hint)
    return hints
