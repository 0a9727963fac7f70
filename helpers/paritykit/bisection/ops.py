r"""The first op whose result differs inside a replayed culprit (``--ops``): both sides re-run under torch's
dispatch logger."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paritykit.bisection.leaves import flatten_tensors
from paritykit.bisection.results import OpDivergence

# Ops that only rearrange values: a result of one of them agrees whenever its input does.
_LAYOUT_OPS = frozenset(
    "view reshape transpose permute chunk split unbind contiguous flatten unflatten squeeze unsqueeze expand "
    "expand_as view_as narrow movedim t __getitem__ clone detach split_with_sizes".split()
)


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if getattr(func, "__objclass__", None) is not None:
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{name}" if module and not module.startswith("torch._C") else f"torch.{name}"


def _describe(value: Any, depth: int = 0) -> str:
    import torch

    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.nn.Parameter):
        return f"Parameter{list(value.shape)}"
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}" if value.dim() else f"tensor({value.item():.6g})"
    if isinstance(value, (tuple, list)) and depth < 2:
        inner = ", ".join(_describe(v, depth + 1) for v in value[:6])
        return f"({inner}{', …' if len(value) > 6 else ''})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def _describe_call(args: tuple, kwargs: dict) -> str:
    parts = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= 240 else text[:237] + "…"


def _log_ops(module: Any, args: tuple, kwargs: dict) -> list[tuple[str, str, list, list]]:
    """Every torch call made while ``module`` runs: (name, arguments, input tensors, [(output, copy)])."""
    import torch
    from torch.overrides import TorchFunctionMode

    ops: list[tuple[str, str, list, list]] = []

    class OpLogger(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            outputs = [t for _, t in flatten_tensors(out)]
            if outputs:
                inputs = [t for _, t in flatten_tensors((args, kwargs)) if isinstance(t, torch.Tensor)]
                # identities follow the data flow; copies keep values as they were when produced
                ops.append(
                    (
                        _op_name(func),
                        _describe_call(args, kwargs),
                        inputs,
                        [(t, t.detach().clone()) for t in outputs],
                    )
                )
            return out

    with OpLogger():
        module(*args, **kwargs)
    return ops


def op_divergence(
    ref_module: Any,
    port_module: Any,
    ref_call: tuple[tuple, dict],
    port_call: tuple[tuple, dict],
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> OpDivergence | None:
    r"""Re-run one module on both sides under an op logger (a ``TorchFunctionMode``) and return the first port
    op whose result matches no reference value while none of its inputs is already off.

    A port result matches when some reference op result (or module input) has its shape and agrees within
    tolerance. Layout-only ops (views, transposes, chunks) take the state of their inputs.
    """
    import torch

    from paritykit.compare.tensors import compare_tensors

    ref_ops = _log_ops(ref_module, *ref_call)
    port_ops = _log_ops(port_module, *port_call)
    known: dict[tuple, list[tuple[str, str, Any]]] = {}
    # the same values by every shape but the last dim: a fused projection's result (qkv) holds the split
    # ones' (to_q) as chunks of its last dim, and the other way round
    by_rows: dict[tuple, list[Any]] = {}
    for _, tensor in flatten_tensors(ref_call):
        known.setdefault(tuple(tensor.shape), []).append(("input", "", tensor))
    for name, args, _, outs in ref_ops:
        for _, value in outs:
            known.setdefault(tuple(value.shape), []).append((name, args, value))
            if value.dim():
                by_rows.setdefault(tuple(value.shape[:-1]), []).append(value)

    def agrees(a: Any, b: Any) -> bool:
        if not (a.is_floating_point() and b.is_floating_point()):
            return a.dtype == b.dtype and bool(torch.equal(a, b))
        # judged at the reference's precision, so a cast to a lower one is the op that differs
        return compare_tensors(a, b.to(a.dtype), atol=atol, rtol=rtol, diagnose=False).passed

    def swapped(a: Any, b: Any) -> bool:
        """B is A with the halves of its last dim swapped: a converted shift/scale layout, not a
        difference."""
        if not (a.is_floating_point() and b.is_floating_point()) or a.dim() == 0 or a.shape[-1] % 2:
            return False
        first, second = a.chunk(2, dim=-1)
        return agrees(torch.cat([second, first], dim=-1), b)

    def fused(value: Any) -> bool:
        """``value`` is a chunk of a fused reference result, or fuses reference results, on its last dim."""
        if not value.dim() or not value.is_floating_point():
            return False
        width = value.shape[-1]
        for ref_value in by_rows.get(tuple(value.shape[:-1]), []):
            other = ref_value.shape[-1]
            if other > width and other % width == 0 and ref_value.is_floating_point():
                if any(agrees(chunk, value) for chunk in ref_value.split(width, dim=-1)):
                    return True
        for parts in (2, 3, 4):
            if width % parts == 0 and width > parts:
                chunks = value.split(width // parts, dim=-1)
                if all(any(agrees(r, c) for _, _, r in known.get(tuple(c.shape), [])) for c in chunks):
                    return True
        return False

    off: set[int] = set()
    for index, (name, args, inputs, outs) in enumerate(port_ops):
        if any(id(t) in off for t in inputs):
            off.update(id(live) for live, _ in outs)
            continue
        if name.rsplit(".", 1)[-1] in _LAYOUT_OPS:
            continue
        for _, value in outs:
            candidates = known.get(tuple(value.shape), [])
            if any(agrees(ref_value, value) or swapped(ref_value, value) for _, _, ref_value in candidates):
                continue
            if fused(value):
                continue
            best = None
            for ref_name, ref_args, ref_value in candidates:
                if ref_name == "input" or not (ref_value.is_floating_point() and value.is_floating_point()):
                    continue
                err = float((ref_value.double() - value.double()).abs().max())
                if best is None or err < best[2]:
                    best = (ref_name, ref_args, err)
            return OpDivergence(
                index,
                name,
                args,
                list(value.shape),
                reference_op=best[0] if best else None,
                reference_args=best[1] if best else None,
                max_abs=best[2] if best else None,
                port_ops=len(port_ops),
                reference_ops=len(ref_ops),
            )
    return _skipped_step(ref_ops, port_ops, agrees)


def _skipped_step(ref_ops: list, port_ops: list, agrees: Callable) -> OpDivergence | None:
    """Every port result equals some reference value, yet the outputs differ: the port returns a value the
    reference processes further (a missing scale, a skipped step). Name the reference op it skips."""
    if not port_ops or not ref_ops:
        return None
    last_name, last_args, _, last_outs = port_ops[-1]
    final = last_outs[0][1]
    for j, (_, _, _, outs) in enumerate(ref_ops):
        if not any(v.shape == final.shape and agrees(v, final) for _, v in outs):
            continue
        produced = {id(live) for live, _ in outs}
        for name, args, inputs, _ in ref_ops[j + 1 :]:
            if any(id(t) in produced for t in inputs):
                return OpDivergence(
                    len(port_ops) - 1,
                    last_name,
                    last_args,
                    list(final.shape),
                    reference_op=name,
                    reference_args=args,
                    port_ops=len(port_ops),
                    reference_ops=len(ref_ops),
                    note="the port returns this value as it is; the reference goes on with the op above",
                )
    return None
