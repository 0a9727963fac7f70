r"""Where the repair search runs (``Site``): a port module, the inputs it is replayed on, the outputs it
should give, and how a candidate is checked — at a culprit, or at an unaligned port module that produces a
differing input of an inline culprit (checked there, then verified by replaying the culprit)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paritykit.bisection.leaves import flatten_tensors, output_leaves


@dataclass
class Site:
    r"""One place to repair.

    Args:
        name: the port module's dotted name in the port model (``""`` for the top level).
        reference_name: the reference module (or call) it is compared with, for messages.
        module: the port module (never changed: edits go to a working copy).
        inputs: ``inputs() -> (args, kwargs)``: fresh copies of what the module is replayed on.
        wanted: the reference's outputs as ``(path, tensor)`` leaves; empty at a site whose output the
            reference never computes as such (an extra input of the culprit): ``verify`` alone decides there.
        got: the port module's outputs on those inputs, as leaves.
        compare: ``compare(wanted, leaves)`` -> the worst leaf comparison (``.passed``, ``.max_abs``) or None.
        faithful: port parameter names (relative to ``module``) that hold exactly the tensor of the aligned
            reference module: editing them cannot be the fix, so the parameter edits skip them.
        held: port parameter name -> the reference tensor (or equal chunk of one) it holds value for value.
            An edit of such a parameter says how the port's forward *uses* it differently (tier ``uses``,
            tried last), not that the weights are wrong.
        verify: for a producer site, ``verify(edited_module) -> comparison``: the culprit replayed with the
            edited producer in place; ``None`` at a culprit (the local check is the verification).
    """

    name: str
    reference_name: str
    module: Any
    inputs: Callable[[], tuple[tuple, dict]]
    wanted: list[tuple[str, Any]]
    got: list[tuple[str, Any]]
    compare: Callable[[list, list], Any]
    faithful: frozenset[str] = frozenset()
    held: dict[str, str] = field(default_factory=dict)
    verify: Callable[[Any], Any] | None = None
    # culprit | producer | untestable (an aligned child of the culprit no test could see)
    role: str = "culprit"
    sizes: tuple[int, ...] = field(default=())
    # the nearest enclosing diffusers model (a ConfigMixin) when the module has no config of its own:
    # (that model, its path, the module's path inside it); its string settings are tried by rebuilding it
    ancestor: tuple[Any, str, str] | None = None

    def __post_init__(self) -> None:
        from paritykit.bisection.leaves import pair_layouts

        # dim orders that put the port's output leaves in the reference's layout, by path (none when alike)
        found = pair_layouts(self.wanted, self.got) if self.wanted else None
        self.orders: dict[str, tuple[int, ...]] = found[2] if found is not None else {}
        if not self.sizes:
            dims = {int(d) for _, t in [*self.wanted, *self.got] for d in t.shape}
            args, kwargs = self.inputs()
            dims |= {int(d) for _, t in flatten_tensors((args, kwargs), "input") for d in t.shape}
            self.sizes = tuple(sorted(dims))

    @property
    def before(self) -> float:
        cmp = self.compare(self.wanted, self.got) if self.wanted else self.verify(self.module)
        return cmp.max_abs if cmp is not None and cmp.max_abs is not None else math.inf

    def as_wanted(self, leaves: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        r"""Port output leaves in the reference's layout: each permuted by its path's dim order."""
        from paritykit.bisection.leaves import in_layout

        return in_layout(leaves, self.orders)

    def failing(self) -> list[tuple[int, int]]:
        r"""``(wanted index, got index)`` of the output leaves that differ (none at a site with no wanted
        outputs of its own)."""
        from paritykit.bisection.leaves import pair_leaves

        out = []
        got = self.as_wanted(self.got)
        for i, j in pair_leaves(self.wanted, got) or []:
            cmp = self.compare([self.wanted[i]], [got[j]])
            if cmp is None or not cmp.passed:
                out.append((i, j))
        return out

    def path(self, sub: str = "") -> str:
        r"""A dotted name in the port model."""
        return ".".join(p for p in (self.name, sub) if p) or "(top level)"


def faithful_parameters(reference: Any, port: Any, subpairs: list[tuple[str, str]]) -> frozenset[str]:
    r"""Port parameters (names relative to ``port``) equal, value for value, to the parameter of the same leaf
    name in the aligned reference module (``subpairs``: ``(reference, port)`` names relative to the two
    modules; the modules themselves count as aligned). A layout the shapes allow (a 1x1 conv kernel for a
    linear weight) counts as equal."""
    import torch

    if reference is None or port is None:
        return frozenset()
    port_to_ref = {p: r for r, p in subpairs}
    port_to_ref.setdefault("", "")
    ref_modules = dict(reference.named_modules())
    out = set()
    for name, param in port.named_parameters():
        owner, _, leaf = name.rpartition(".")
        ref_owner = port_to_ref.get(owner)
        ref_module = ref_modules.get(ref_owner) if ref_owner is not None else None
        ref_param = getattr(ref_module, "_parameters", {}).get(leaf) if ref_module is not None else None
        if ref_param is None or ref_param.numel() != param.numel():
            continue
        if torch.equal(
            ref_param.detach().reshape(-1).cpu(), param.detach().reshape(-1).to(ref_param.dtype).cpu()
        ):
            out.add(name)
    return frozenset(out)


# reference tensors above this many elements in all are not indexed for ``held_parameters``
MAX_INDEXED = 1 << 26


def held_parameters(reference: Any, port: Any) -> dict[str, str]:
    r"""Port parameters equal, value for value, to a reference parameter or to one of its equal chunks along
    dim 0 or 1 (2 to 4 chunks; any reshape: a 1x1 kernel holds a linear weight): ``{port name: reference
    name}``, the reference name with ``[chunk i/k dim d]`` for a chunk."""
    if reference is None or port is None:
        return {}
    ref = [(n, p.detach()) for n, p in reference.named_parameters() if p.is_floating_point()]
    if sum(p.numel() for _, p in ref) > MAX_INDEXED:
        return {}
    index: dict[tuple, tuple[str, tuple]] = {}
    # a constant tensor (a fresh norm's ones, a zero bias) says nothing about where a port value came from
    ref = [(n, p) for n, p in ref if p.numel() > 1 and bool((p.reshape(-1) != p.reshape(-1)[0]).any())]
    for name, p in ref:
        index.setdefault(_key(p), (name, tuple(p.shape)))
        for dim in range(min(p.ndim, 2)):
            for count in (2, 3, 4):
                if p.shape[dim] % count == 0 and p.shape[dim] > count - 1:
                    for i, part in enumerate(p.chunk(count, dim=dim)):
                        index.setdefault(
                            _key(part), (f"{name} [chunk {i}/{count} dim {dim}]", tuple(part.shape))
                        )
    out = {}
    for name, p in port.named_parameters():
        if p.is_floating_point():
            hit = index.get(_key(p.detach()))
            if hit is not None:
                # another shape: which dim is which was the conversion's choice, not the reference's
                out[name] = hit[0] if hit[1] == tuple(p.shape) else f"{hit[0]}, shape {list(hit[1])}"
    return out


def _key(t: Any) -> tuple:
    import torch

    flat = t.reshape(-1).to(torch.float32).cpu().contiguous()
    return (flat.numel(), hash(flat.numpy().tobytes()))


def call_leaves(module: Any, inputs: tuple[tuple, dict]) -> list[tuple[str, Any]] | None:
    r"""The output leaves of ``module(*args, **kwargs)`` on copies of the inputs (they are a trace's captured
    values, which an edit that makes an activation in-place would rewrite), or ``None`` when the call
    raises."""
    import torch

    from paritykit.base.inputs import map_tensors

    args, kwargs = map_tensors(inputs, lambda t: t.clone())
    try:
        with torch.no_grad():
            return output_leaves(module(*args, **kwargs))
    except Exception:  # an edit the module's forward rejects is no repair
        return None
