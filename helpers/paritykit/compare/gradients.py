r"""Training parity: one forward + backward on the reference and on the port, parameter gradients compared.

A port whose forward matches can still train differently: a detached branch, a parameter used twice, a
LayerNorm ``eps`` or a scale that barely moves the output but moves the gradient. :func:`compare_gradients`
runs one training step's forward and backward on each side from the same inputs and the same RNG state and
compares every aligned parameter's gradient with :func:`paritykit.compare_tensors`.

Both models are left as they were: their existing ``.grad`` values are restored and the global RNG state is
untouched afterwards."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.errors import ParityKitError, UserCodeError
from paritykit.base.inputs import split_inputs
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table

#: diagnoses run on the first this-many failing gradients (one bug usually fails many parameters alike)
HINTED_FAILURES = 5

#: ``alignment`` may be None (same names), a {reference name: port name} mapping, [(regex, repl), …] rules
#: applied to reference names, a callable converting a reference state dict into the port's naming, or a
#: ``paritykit.forensics.conversion.results.ConversionMap`` (a ``paritykit.bisection.align.Alignment`` is
# accepted too).
ParameterAlignment = (
    None | Mapping[str, str] | Sequence[tuple[str, str]] | Callable[[dict[str, Any]], dict[str, Any]]
)


@dataclass
class GradientPair:
    r"""One aligned parameter: the reference name, the port name and the comparison of their gradients."""

    reference: str
    port: str
    status: str  # "pass" | "fail" | "shape_mismatch" | "no_grad_reference" | "no_grad_port"
    comparison: Any = None  # a paritykit.compare.TensorComparison when both sides have a gradient

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reference": self.reference, "port": self.port, "status": self.status}
        c = self.comparison
        if c is not None:
            out.update(
                max_abs=_num(c.max_abs),
                mean_abs=_num(c.mean_abs),
                cosine=_num(c.cosine),
                mismatch_fraction=_num(c.mismatch_fraction),
                atol=c.atol,
                rtol=c.rtol,
                shape_reference=list(c.shape_a),
                shape_port=list(c.shape_b),
                hints=[h.to_dict() for h in c.hints],
            )
        return out


@dataclass
class GradientComparison:
    r"""Gradients of one training step on the reference and on the port, per aligned parameter.

    ``exit_code`` is 0 when the losses and every aligned gradient match, else 1. A parameter left unaligned
    counts against the verdict only if it received a non-zero gradient (an unused parameter is harmless).
    """

    pairs: list[GradientPair]
    loss_reference: float
    loss_port: float
    loss_passed: bool
    only_reference: list[str] = field(default_factory=list)
    only_port: list[str] = field(default_factory=list)
    unaligned_with_gradient: list[str] = field(default_factory=list)
    how_aligned: str = "names"
    atol: float | None = None
    rtol: float | None = None

    @property
    def failures(self) -> list[GradientPair]:
        return [p for p in self.pairs if not p.passed]

    @property
    def first_failure(self) -> GradientPair | None:
        failures = self.failures
        return failures[0] if failures else None

    @property
    def passed(self) -> bool:
        return self.loss_passed and not self.failures and not self.unaligned_with_gradient

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        first = self.first_failure
        return {
            "kind": "gradients",
            "passed": self.passed,
            "verdict": "match" if self.passed else "diverge",
            "how_aligned": self.how_aligned,
            "loss": {"reference": self.loss_reference, "port": self.loss_port, "passed": self.loss_passed},
            "aligned": len(self.pairs),
            "failed": [p.reference for p in self.failures],
            "first_failure": first.to_dict() if first else None,
            "atol": self.atol,
            "rtol": self.rtol,
            "only_reference": self.only_reference,
            "only_port": self.only_port,
            "unaligned_with_gradient": self.unaligned_with_gradient,
            "parameters": [p.to_dict() for p in self.pairs],
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        # failures first, so a bounded table never hides them
        ordered = self.failures + [p for p in self.pairs if p.passed]
        rows = []
        for p in ordered:
            c = p.comparison
            rows.append(
                [
                    p.reference,
                    p.port if p.port != p.reference else "=",
                    p.status,
                    None if c is None else _num(c.max_abs),
                    None if c is None else _num(c.mean_abs),
                    None if c is None else _num(c.cosine),
                ]
            )
        n_fail = len(self.failures)
        summary = f"{len(self.pairs)} aligned parameters ({self.how_aligned}), {n_fail} differ"
        lines = [
            "gradients after one forward + backward",
            render_table(
                ["reference", "port", "status", "max_abs", "mean_abs", "cosine"],
                rows,
                limit=limit,
                summary=summary,
            ),
            f"loss: reference {format_number(self.loss_reference)}, port {format_number(self.loss_port)}"
            + ("" if self.loss_passed else " — DIFFERENT"),
        ]
        for label, names in (
            ("reference parameters with no counterpart", self.only_reference),
            ("port parameters with no counterpart", self.only_port),
        ):
            if names:
                shown = ", ".join(names[:10]) + (f", … {len(names) - 10} more" if len(names) > 10 else "")
                lines.append(f"{label}: {shown}")
        if self.unaligned_with_gradient:
            lines.append(
                f"unaligned parameters that received a gradient: {', '.join(self.unaligned_with_gradient)}"
            )
        first = self.first_failure
        if first is not None and first.comparison is not None:
            for h in first.comparison.hints[:3]:
                lines.append(f"hint for {first.reference}: [{h.id}] {h.message}")
        lines.append("MATCH" if self.passed else "DIVERGE")
        return "\n".join(lines)


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def _clone_inputs(value: Any) -> Any:
    """A private copy of the inputs per side, so an in-place op on one side cannot leak into the other."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, Mapping):
        return {k: _clone_inputs(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_clone_inputs(v) for v in value)
    if isinstance(value, list):
        return [_clone_inputs(v) for v in value]
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an uncopyable object is passed as is
        return value


def _run_side(model: Any, args, kwargs, loss_fn: Callable, seed: int, side: str):
    r"""One forward + backward; returns (loss value, {name: grad clone or None}); restores prior grads."""
    import torch

    params = dict(model.named_parameters())
    saved = {name: p.grad for name, p in params.items()}
    for p in params.values():
        p.grad = None
    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(seed)
            try:
                output = model(*args, **kwargs)
                loss = loss_fn(output)
            except Exception as exc:  # noqa: BLE001 - the user's model or loss raised
                raise UserCodeError(f"{side} forward or loss_fn raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ParityKitError(
                    f"loss_fn must return a scalar tensor for the {side} output, got {type(loss)}"
                )
            if not loss.requires_grad:
                raise ParityKitError(
                    f"the {side} loss does not require grad: are the parameters frozen or the forward under"
                    " no_grad?"
                )
            loss.backward()
        grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in params.items()}
        return loss.detach().clone(), grads
    finally:
        for name, p in params.items():
            p.grad = saved[name]


def _align(
    ref_grads: dict[str, Any], port_names: list[str], alignment: ParameterAlignment
) -> tuple[dict[str, Any], dict[str, str], str]:
    r"""Bring the reference gradients into the port's naming.

    Returns ``(gradients keyed by port name, {port name: reference name(s)}, how)``.
    """
    if alignment is None:
        return dict(ref_grads), {n: n for n in ref_grads}, "names"
    if hasattr(alignment, "rules") and hasattr(
        alignment, "mapping"
    ):  # a paritykit.forensics.conversion.results.ConversionMap
        from paritykit.forensics.conversion.emit import apply_rules_to_state_dict

        conversion = alignment

        def alignment(state_dict):
            return apply_rules_to_state_dict(conversion, state_dict)

    if callable(alignment) and not isinstance(alignment, Mapping):
        present = {n: g for n, g in ref_grads.items() if g is not None}
        try:
            converted = dict(alignment(dict(present)))
        except Exception as exc:  # noqa: BLE001 - the user's conversion raised
            raise UserCodeError(
                f"alignment conversion raised {type(exc).__name__} on the reference gradients: {exc}"
            ) from exc
        return converted, {n: "(converted)" for n in converted}, "conversion"
    if isinstance(alignment, Mapping):
        unknown = [k for k in alignment if k not in ref_grads]
        if unknown:
            raise ParityKitError(
                f"alignment names reference parameters that do not exist: {', '.join(unknown[:5])}"
            )
        missing = [v for v in alignment.values() if v not in port_names]
        if missing:
            raise ParityKitError(
                f"alignment names port parameters that do not exist: {', '.join(missing[:5])}"
            )
        out = {alignment[k]: ref_grads[k] for k in alignment}
        return out, {v: k for k, v in alignment.items()}, "mapping"
    from paritykit.base.naming import rename_all

    rules = [tuple(r) for r in alignment]
    if any(len(r) != 2 for r in rules):
        raise ParityKitError("alignment rules must be (regex, replacement) pairs")
    renamed = rename_all(list(ref_grads), rules)
    return {renamed[k]: g for k, g in ref_grads.items()}, {v: k for k, v in renamed.items()}, "rules"


def _parameters_of_aligned_modules(reference: Any, port: Any, alignment: Any) -> dict[str, str]:
    r"""{reference parameter: port parameter} from one-to-one aligned modules: each module's own parameters
    (not its children's) paired by local name and shape. Fused <-> split groups are left out."""
    ref_modules, port_modules = dict(reference.named_modules()), dict(port.named_modules())
    mapping: dict[str, str] = {}
    for pair in alignment.one_to_one:
        ref_mod, port_mod = ref_modules.get(pair.reference), port_modules.get(pair.port)
        if ref_mod is None or port_mod is None:
            continue
        port_params = dict(port_mod.named_parameters(recurse=False))
        for local, param in ref_mod.named_parameters(recurse=False):
            other = port_params.get(local)
            if other is not None and other.shape == param.shape:
                mapping[f"{pair.reference}.{local}" if pair.reference else local] = (
                    f"{pair.port}.{local}" if pair.port else local
                )
    return mapping


def compare_gradients(
    reference: Any,
    port: Any,
    inputs: Any,
    loss_fn: Callable[[Any], Any],
    alignment: ParameterAlignment = None,
    *,
    port_inputs: Any = None,
    port_loss_fn: Callable[[Any], Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
) -> GradientComparison:
    r"""Run one forward + backward on each model and compare the parameter gradients per aligned parameter.

    Args:
        reference: the reference ``torch.nn.Module`` (its train/eval mode is used as is: call ``.eval()`` to
            turn dropout off, or rely on the shared seed when both sides draw the same random numbers).
        port: the port's module.
        inputs: what both models are called with — a kwargs dict, ``(args, kwargs)``, a tuple/list of
            positional arguments, or a single positional value. Each side gets its own copy.
        loss_fn: ``loss_fn(output) -> scalar tensor``, e.g. ``lambda out: F.mse_loss(out.sample, target)``.
        alignment: how reference parameters correspond to port parameters:

            * ``None`` — identical names;
            * a mapping ``{reference name: port name}`` — only the listed parameters are compared;
            * a list of ``(regex, replacement)`` rules applied in order to every reference name (the ``--map``
              spelling of :mod:`paritykit.base.naming`);
            * a callable ``convert(state_dict) -> state_dict`` — the weight conversion (e.g. the module
              ``paritykit weights map --emit-rules`` writes) applied to the reference *gradients* — or the
              :class:`paritykit.forensics.conversion.results.ConversionMap` that ``infer_conversion_map``
              returned. Valid for conversions that only rename, split, concatenate, transpose, permute,
              reshape or cast (all that ``weights map`` infers); a conversion that scales values would need
              the inverse scale on gradients;
            * a :class:`paritykit.bisection.align.Alignment` from ``align_modules(reference, port)`` — each
              one-to-one module pair's own parameters are paired by local name (``weight`` ↔ ``weight``);
              parameters of fused ↔ split groups stay unaligned (use the ConversionMap form for those).

            Except with an explicit mapping, a parameter left without a partner fails the check when it
            received a non-zero gradient.
        port_inputs: the port's own inputs when its signature differs: a value in any ``inputs`` form, or a
            callable ``(args, kwargs) -> inputs`` adapting the reference's.
        port_loss_fn: the port's loss when its output differs in type (default: ``loss_fn``).
        atol, rtol: tolerance per gradient (default: from the dtypes, see :func:`paritykit.compare_tensors`).
        seed: the RNG seed set (inside a forked RNG state) before each side's forward.

    Returns:
        A :class:`GradientComparison`; ``exit_code`` 0 when the losses and all aligned gradients match.
    """
    import torch

    from paritykit.compare.diagnose import diagnose
    from paritykit.compare.tensors import compare_tensors

    for side, model in (("reference", reference), ("port", port)):
        if not isinstance(model, torch.nn.Module):
            raise ParityKitError(f"{side} must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = split_inputs(inputs)
    if port_inputs is None:
        p_args, p_kwargs = args, kwargs
    elif callable(port_inputs):
        try:
            p_args, p_kwargs = split_inputs(port_inputs(_clone_inputs(args), _clone_inputs(kwargs)))
        except Exception as exc:  # noqa: BLE001 - the user's adapter raised
            raise UserCodeError(f"port_inputs raised {type(exc).__name__}: {exc}") from exc
    else:
        p_args, p_kwargs = split_inputs(port_inputs)

    loss_ref, grads_ref = _run_side(
        reference, _clone_inputs(args), _clone_inputs(kwargs), loss_fn, seed, "reference"
    )
    loss_port, grads_port = _run_side(
        port, _clone_inputs(p_args), _clone_inputs(p_kwargs), port_loss_fn or loss_fn, seed, "port"
    )

    port_names = list(grads_port)
    if hasattr(alignment, "one_to_one") and hasattr(
        alignment, "unaligned_port"
    ):  # paritykit.bisection.align.Alignment
        mapping = _parameters_of_aligned_modules(reference, port, alignment)
        aligned_ref, origin, _ = _align(grads_ref, port_names, mapping)
        how = "modules"
    else:
        aligned_ref, origin, how = _align(grads_ref, port_names, alignment)

    pairs: list[GradientPair] = []
    failed_so_far = 0
    for port_name in port_names:
        if port_name not in aligned_ref:
            continue
        g_ref, g_port = aligned_ref[port_name], grads_port[port_name]
        ref_name = origin.get(port_name, port_name)
        if g_ref is None and g_port is None:
            continue  # unused on both sides
        if g_ref is None or g_port is None:
            status = "no_grad_reference" if g_ref is None else "no_grad_port"
            pairs.append(GradientPair(ref_name, port_name, status))
            continue
        cmp = compare_tensors(
            g_ref, g_port, atol=atol, rtol=rtol, name=f"{ref_name} -> {port_name}", diagnose=False
        )
        pairs.append(GradientPair(ref_name, port_name, cmp.status, cmp))
        failed_so_far += cmp.status == "fail"
        if cmp.status == "fail" and failed_so_far <= HINTED_FAILURES:
            cmp.hints = diagnose(g_ref, g_port)

    # parameters that found no partner on the other side (reference names where there are any)
    if how == "conversion":
        only_reference = [n for n in aligned_ref if n not in grads_port]
        ref_unaligned = [n for n in only_reference if _nonzero(aligned_ref[n])]
    else:
        compared = {origin[n] for n in aligned_ref if n in grads_port}
        only_reference = [n for n in grads_ref if n not in compared]
        ref_unaligned = [n for n in only_reference if _nonzero(grads_ref[n])]
    only_port = [n for n in port_names if n not in aligned_ref]
    unaligned_with_gradient: list[str] = []
    if how != "mapping":  # a mapping deliberately lists only what to compare
        unaligned_with_gradient = ref_unaligned + [n for n in only_port if _nonzero(grads_port[n])]

    loss_cmp = compare_tensors(
        loss_ref.reshape(()), loss_port.reshape(()), atol=atol, rtol=rtol, name="loss", diagnose=False
    )
    used = next((p.comparison for p in pairs if p.comparison is not None), None)
    return GradientComparison(
        pairs=pairs,
        loss_reference=float(loss_ref),
        loss_port=float(loss_port),
        loss_passed=loss_cmp.passed,
        only_reference=only_reference,
        only_port=only_port,
        unaligned_with_gradient=unaligned_with_gradient,
        how_aligned=how,
        atol=atol if used is None else used.atol,
        rtol=rtol if used is None else used.rtol,
    )


def _nonzero(grad: Any) -> bool:
    return grad is not None and bool(grad.ne(0).any())


__all__ = ["GradientComparison", "GradientPair", "compare_gradients"]
