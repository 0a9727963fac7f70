r"""Tensor leaves of module calls: flattening nested inputs and outputs, pairing two sides' leaves by path,
order and shape, rebuilding a call from them, and the compared tensor of a model's final output."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.inputs import is_tensor
from paritykit.compare.tensors import relative_error


def flatten_tensors(value: Any, prefix: str = "output") -> list[tuple[str, Any]]:
    """``(path, tensor)`` for every tensor in a nested value (tuples, lists, dicts, ``BaseOutput``, and
    dataclass instances as research code returns them: audiocraft's ``Output(sample=…)``)."""
    if is_tensor(value):
        return [(prefix, value)]
    out: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += flatten_tensors(v, f"{prefix}.{k}")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            out += flatten_tensors(v, f"{prefix}.{i}")
    elif _is_dataclass_instance(value):
        for name in _field_names(value):
            out += flatten_tensors(getattr(value, name), f"{prefix}.{name}")
    return out


def _is_dataclass_instance(value: Any) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _field_names(value: Any) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(value)]


def output_leaves(value: Any) -> list[tuple[str, Any]]:
    r"""A replayed call's output as :func:`flatten_tensors` gives it, each tensor detached and on the CPU:
    models run where they live, and what the engine analyses of their calls is on the CPU, beside the
    captured records (one place, by design)."""
    return [(path, t.detach().cpu()) for path, t in flatten_tensors(value)]


def pair_leaves(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> list[tuple[int, int]] | None:
    """Index pairs matching two leaf lists: by path when the paths agree, else in order with equal shapes,
    else by unique shape. ``None`` when no consistent pairing exists."""
    if not a or not b:
        return None
    paths_a = [p for p, _ in a]
    paths_b = [p for p, _ in b]
    if paths_a == paths_b and all(ta.shape == tb.shape for (_, ta), (_, tb) in zip(a, b)):
        return list(zip(range(len(a)), range(len(b))))
    if len(a) == len(b) and all(ta.shape == tb.shape for (_, ta), (_, tb) in zip(a, b)):
        return list(zip(range(len(a)), range(len(b))))
    pairs = []
    used: set[int] = set()
    for j, (_, tb) in enumerate(b):
        hits = [i for i, (_, ta) in enumerate(a) if ta.shape == tb.shape and i not in used]
        if len(hits) != 1:
            return None
        used.add(hits[0])
        pairs.append((hits[0], j))
    return pairs


# tensors of more dims than this are never re-laid out (6! = 720 dim orders at most)
MAX_LAYOUT_DIMS = 6


def dim_orders(shape: tuple, target: tuple) -> list[tuple[int, ...]]:
    """The dim orders (arguments of ``permute``) that turn a tensor of ``shape`` into one of ``target``, the
    identity excepted."""
    shape, target = tuple(shape), tuple(target)
    if len(shape) != len(target) or len(shape) > MAX_LAYOUT_DIMS or sorted(shape) != sorted(target):
        return []
    identity = tuple(range(len(shape)))
    return [
        order
        for order in itertools.permutations(identity)
        if order != identity and tuple(shape[d] for d in order) == target
    ]


def pair_layouts(
    a: list[tuple[str, Any]], b: list[tuple[str, Any]], same_shape: bool = False
) -> tuple[list[tuple[int, int]], list[tuple[str, Any]], dict[str, tuple[int, ...]]] | None:
    r"""Pair two leaf lists as :func:`pair_leaves` does, and where that fails, up to a dim permutation: a leaf
    of ``b`` with no leaf of its shape in ``a`` is permuted into the layout of an ``a`` leaf (``[B, L, H, D]``
    read as ``[B, H, L, D]``), the dim order chosen that brings it closest to that leaf when several fit; one
    that no dim order fits is viewed as the one ``a`` leaf it equals up to size-1 dims, where the sizes tell
    the dims apart (:class:`Viewed`).

    With ``same_shape``, leaves of one shape are also read in another layout where only that makes them
    agree (:func:`_same_shape_layouts`): for comparing two sides' captured calls, never for judging whether
    an edit reproduces the reference (a transposed output is a difference there).

    Returns ``(pairs, b_leaves, orders)``: index pairs, ``b`` with the permuted leaves in place, and the dim
    order applied to each permuted leaf by its path; ``None`` when no consistent pairing exists.
    """
    pairs = pair_leaves(a, b)
    if pairs is not None:
        return _same_shape_layouts(a, b, pairs) if same_shape else (pairs, b, {})
    if not a or not b:
        return None
    shapes_a = {tuple(t.shape) for _, t in a}
    moved, orders = list(b), {}
    for j, (path, tensor) in enumerate(b):
        if tuple(tensor.shape) in shapes_a:
            continue
        best = None
        for _, target in a:
            for order in dim_orders(tensor.shape, target.shape):
                error = relative_error(tensor.permute(order), target)
                if best is None or error < best[0]:
                    best = (error, order)
        if best is None:
            view = _singleton_view(tensor, [t for _, t in a]) or _batch_broadcast(tensor, [t for _, t in a])
            if view is None:
                return None
            moved[j], orders[path] = (path, _laid_out(tensor, view)), view
            continue
        moved[j] = (path, tensor.permute(best[1]))
        orders[path] = best[1]
    pairs = pair_leaves(a, moved)
    return (pairs, moved, orders) if pairs is not None else None


class Viewed(tuple):
    r"""A layout that is a view to this shape, size-1 dims added or dropped (a research model that runs 2-D
    convolutions as 3-D ones over one frame: ``[B, C, 1, H, W]`` against the port's ``[B, C, H, W]``), in
    place of a dim order."""


def _singleton_view(tensor: Any, targets: list[Any]) -> Viewed | None:
    r"""The one target shape that ``tensor``'s is up to size-1 dims, as a :class:`Viewed`; ``None`` when no
    target's or several targets' are."""

    def core(shape: tuple) -> tuple:
        return tuple(d for d in shape if d != 1)

    mine = core(tuple(tensor.shape))
    found = {tuple(t.shape) for t in targets if t.numel() == tensor.numel() and core(tuple(t.shape)) == mine}
    return Viewed(found.pop()) if len(found) == 1 and _sizes_tell_dims_apart(mine) else None


class Broadcast(tuple):
    r"""A layout that is one row for the whole batch against one per sample: a research model fed one
    timestep ``(1,)`` for a batch of 2 (DiffWave's ``diffusion_step``) computes ``[1, D]`` time features where
    the port computes ``[2, D]``, every row alike. The one row is read as every row (``expand``), or every
    row, all equal, as the one (the first)."""


def _batch_broadcast(tensor: Any, targets: list[Any]) -> Broadcast | None:
    r"""The one target shape that ``tensor``'s is with the batch dim 1 on one side: ``tensor`` of batch 1
    against a target of batch B (read expanded), or of batch B with every row equal against a target of
    batch 1 (read as its first row); ``None`` otherwise."""
    import torch

    shape = tuple(tensor.shape)
    if not shape:
        return None
    found = {
        tuple(t.shape)
        for t in targets
        if t.dim() == len(shape)
        and tuple(t.shape[1:]) == shape[1:]
        and 1 in (t.shape[0], shape[0])
        and t.shape[0] != shape[0]
    }
    if len(found) != 1:
        return None
    target = found.pop()
    if shape[0] > 1 and not bool(torch.equal(tensor, tensor[:1].expand_as(tensor))):
        return None  # rows that differ are no one row per batch
    return Broadcast(target)


def viewed_as(tensor: Any, target: Any) -> tuple[Any, str]:
    r"""``tensor`` viewed in ``target``'s shape where the two differ by size-1 dims alone and the sizes tell
    the dims apart (a port returning ``[B, L]`` for the research's ``[B, 1, L]``), with a line saying so;
    ``(tensor, "")`` otherwise."""
    if tuple(tensor.shape) == tuple(target.shape) or _singleton_view(tensor, [target]) is None:
        return tensor, ""
    return tensor.reshape(target.shape), (
        f"the outputs' shapes differ by size-1 dims alone (reference {list(target.shape)}, port"
        f" {list(tensor.shape)}): compared with the port's viewed as the reference's"
    )


def _sizes_tell_dims_apart(shape: tuple) -> bool:
    r"""Whether a layout is read off the sizes past the first dim: each size once, or one pair of equal
    sizes side by side (``H = W``). Where three dims share a size (``C = H = W``), a channels-last port
    has the same shape as a viewed channels-first reference, and a view could compare the wrong elements."""
    rest = shape[1:]
    repeated = [i for i in range(len(rest)) if rest.count(rest[i]) > 1]
    return not repeated or (len(repeated) == 2 and repeated[1] == repeated[0] + 1)


# a same-shape dim permutation is taken for a leaf only when it brings the relative error to at most this, and
# to at most 1/LAYOUT_GAIN of the error as laid out: values that agree once read in the other layout
LAYOUT_AGREE = 1e-2
LAYOUT_GAIN = 100.0


def same_shape_orders(shape: tuple) -> list[tuple[int, ...]]:
    """The dim orders that keep ``shape`` (dims of equal size exchanged), the identity and any order moving
    dim 0 (the batch) excepted: ``[B, C, L]`` read as ``[B, L, C]`` when ``C == L``."""
    shape = tuple(shape)
    if len(shape) > MAX_LAYOUT_DIMS or len(shape) < 3:
        return []
    return [order for order in dim_orders(shape, shape) if order[0] == 0]


def _same_shape_layouts(
    a: list[tuple[str, Any]], b: list[tuple[str, Any]], pairs: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[tuple[str, Any]], dict[str, tuple[int, ...]]]:
    r"""Pairs of equal shapes whose values agree only when ``b``'s leaf is read with equal-sized dims
    exchanged (a channels-first ``[B, C, L]`` against a channels-last ``[B, L, C]`` with ``C == L``): that
    leaf permuted into ``a``'s layout, by measurement (:data:`LAYOUT_AGREE`, :data:`LAYOUT_GAIN`)."""
    moved, orders = list(b), {}
    for i, j in pairs:
        path, tensor = b[j]
        target = a[i][1]
        if not tensor.is_floating_point() or not target.is_floating_point():
            continue
        candidates = same_shape_orders(tensor.shape)
        if not candidates:
            continue
        as_laid = relative_error(tensor, target)
        if as_laid <= LAYOUT_AGREE:
            continue
        best = min((relative_error(tensor.permute(o), target), o) for o in candidates)
        if best[0] <= LAYOUT_AGREE and best[0] * LAYOUT_GAIN <= as_laid:
            moved[j] = (path, tensor.permute(best[1]))
            orders[path] = best[1]
    return pairs, moved, orders


def in_layout(leaves: list[tuple[str, Any]], orders: dict[str, tuple[int, ...]]) -> list[tuple[str, Any]]:
    """``leaves`` with each leaf whose path ``orders`` names permuted by its dim order (as
    :func:`pair_layouts`
    found it)."""
    return [(path, _laid_out(t, orders[path]) if path in orders else t) for path, t in leaves]


def _laid_out(t: Any, order: tuple[int, ...]) -> Any:
    if isinstance(order, Broadcast):
        return t.expand(order) if t.shape[0] == 1 else t[: order[0]]
    return t.reshape(order) if isinstance(order, Viewed) else t.permute(order)


def last_axis_order(source: Any, target: Any, rtol: float = 1e-5) -> list[int] | None:
    r"""``order`` where ``target`` is ``source[..., order]``, every element within ``rtol`` of the largest
    value (float noise), and ``order`` moves some positions (features laid out in another order along the last
    axis, round 35: lerobot's observation features step-major against interleaved); ``None`` otherwise, or
    when a position of ``target`` matches two of ``source``'s (then no order is told)."""
    import torch

    if not is_tensor(source) or not is_tensor(target) or source.shape != target.shape or source.dim() < 2:
        return None
    if not source.is_floating_point() or not target.is_floating_point():
        return None
    n = source.shape[-1]
    rows = source.numel() // max(n, 1)
    if n < 2 or n > 4096 or rows > 4096:
        return None
    a = source.detach().reshape(-1, n).t().cpu().double()
    b = target.detach().reshape(-1, n).t().cpu().double()
    tol = rtol * max(float(a.abs().max()), 1e-30)
    hits = torch.cdist(b, a, p=float("inf")) <= tol  # hits[j, i]: target position j holds source position i
    if not bool((hits.sum(1) == 1).all()):
        return None
    order = hits.float().argmax(1).tolist()
    if sorted(order) != list(range(n)) or order == list(range(n)):
        return None
    return order


def layout_note(orders: dict[str, tuple[int, ...]]) -> str:
    """Words for the dim orders :func:`pair_layouts` applied to the port's leaves."""
    if not orders:
        return ""
    shown = ", ".join(
        f"{path} one row read for the batch as {list(order)}"
        if isinstance(order, Broadcast)
        else f"{path} viewed as {list(order)}"
        if isinstance(order, Viewed)
        else f"{path} permuted {tuple(order)}"
        for path, order in orders.items()
    )
    return f"compared up to the port's layout: {shown}"


def pair_inputs(ref: list, port: list) -> tuple[list, list[tuple[int, int]] | None]:
    """Input leaves paired as :func:`pair_leaves` does; when that fails, the reference's repeated tensors are
    taken once (``attn(h, h, h)`` in self-attention against a port's ``attn(hidden_states)``)."""
    pairs = pair_leaves(ref, port)
    if pairs is not None or len(ref) <= len(port):
        return ref, pairs
    unique: list[tuple[str, Any]] = []
    for path, tensor in ref:
        if not any(t is tensor or (t.shape == tensor.shape and bool((t == tensor).all())) for _, t in unique):
            unique.append((path, tensor))
    if len(unique) == len(ref):
        return ref, None
    return unique, pair_leaves(unique, port)


def pair_with_extras(ref: list, port: list) -> tuple[list[tuple[int, int]] | None, list[int]]:
    """Each reference input leaf paired with the one port leaf of its shape, when the port takes more inputs
    than the reference; the port leaves left over (their indices) keep the port's own captured values."""
    if not ref or len(port) <= len(ref):
        return None, []
    pairs = []
    for i, (_, tensor) in enumerate(ref):
        hits = [j for j, (_, t) in enumerate(port) if t.shape == tensor.shape]
        if len(hits) != 1 or any(j == hits[0] for _, j in pairs):
            return None, []
        pairs.append((i, hits[0]))
    used = {j for _, j in pairs}
    return pairs, [j for j in range(len(port)) if j not in used]


def module_device(module: Any) -> Any:
    import torch

    for tensor in (*module.parameters(), *module.buffers()):
        # weights offloaded by accelerate sit on "meta"; its hook moves inputs to the execution device itself
        if tensor.device.type != "meta":
            return tensor.device
    hook = getattr(module, "_hf_hook", None)
    return torch.device(getattr(hook, "execution_device", None) or "cpu")


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a.cpu(), b.detach().cpu()))


def replace_leaves(value: Any, ref_leaves: list) -> Any:
    """``value`` with its tensors replaced by the paired reference tensors (same dtype and device), or
    ``None``."""
    port_leaves = flatten_tensors(value)
    found = pair_layouts(ref_leaves, port_leaves)
    # up to a view (size-1 dims) only: the reference's tensor takes the port's own shape
    if found is None or not all(isinstance(order, Viewed) for order in found[2].values()):
        return None
    swap = {}
    for i, j in found[0]:
        path, own = port_leaves[j]
        swap[path] = ref_leaves[i][1].reshape(own.shape).to(device=own.device, dtype=own.dtype)
    return rebuild_leaves(value, swap, "output")


def rebuild_leaves(value: Any, swap: dict[str, Any], prefix: str) -> Any:
    import copy

    if is_tensor(value):
        return swap.get(prefix, value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = rebuild_leaves(v, swap, f"{prefix}.{k}")
        return out
    if isinstance(value, (tuple, list)):
        items = [rebuild_leaves(v, swap, f"{prefix}.{i}") for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if _is_dataclass_instance(value):
        import dataclasses

        fields = {n: rebuild_leaves(getattr(value, n), swap, f"{prefix}.{n}") for n in _field_names(value)}
        try:
            return dataclasses.replace(value, **fields)
        except (TypeError, ValueError):  # a field its __init__ does not take: set on a copy
            out = copy.copy(value)
            for name, v in fields.items():
                object.__setattr__(out, name, v)
            return out
    return value


def final_output(side: str, output: Any, select_output: Callable | None) -> Any:
    r"""The tensor of a model's output that is compared: ``select_output(side, output)`` when given (a user's
    function: its exception becomes one line naming it), else the output's first tensor."""
    if select_output is not None:
        from paritykit.base.errors import UserCodeError

        try:
            return select_output(side, output)
        except ParityKitError:
            raise
        except Exception as exc:
            raise UserCodeError(f"select_output({side!r}, …) raised {type(exc).__name__}: {exc}") from exc
    leaves = flatten_tensors(output)
    if not leaves:
        raise ParityKitError(f"the {side} model returned no tensor; give select_output(side, output)")
    return leaves[0][1]
