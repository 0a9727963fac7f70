r"""What module alignment (:mod:`paritykit.bisection.align`) knows of one side: the modules it executed, in
completion order, their classes, parameters and output shapes, and its weights: the tensors of a model, or the
hashes a trace folder holds in their place."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paritykit.tracing.trace import Record, Trace


@dataclass
class Side:
    """What alignment needs to know about one model: executed modules in completion order, classes, output
    shapes, weights."""

    order: list[str]
    types: dict[str, str]
    params: dict[str, dict[str, list[int]]]
    out_shapes: dict[str, tuple | None]
    state_dict: Mapping[str, Any] | None
    # each executed module's first call record (its captured inputs tell two streams apart)
    first_calls: dict[str, Any] = field(default_factory=dict)
    # a trace folder's weights: {name: (shape, dtype, hash)} in place of the tensors (state_dict is None)
    weight_keys: dict[str, tuple] | None = None
    # the hashes of this model's weights taken earlier (another zoom level), shared while the weights hold
    _hashed: dict[bool, dict[str, tuple]] = field(default_factory=dict)
    # the trace the calls come from (the calls inside a call), when there is one
    trace: Any = None

    def residual_child(self, name: str) -> str | None:
        r"""The module whose call inside ``name``'s first call returns what ``name`` adds to its input: the
        first call's first floating-point output equals its first floating-point input plus that child's
        output (relative L2 error at most :data:`RESIDUAL_AGREE`), measured on the captured tensors; ``None``
        where no child's does or the calls are not at hand."""
        from paritykit.compare.tensors import relative_error

        record = self.first_calls.get(name)
        if record is None or self.trace is None:
            return None
        try:
            x = next((t for t in record.inputs.values() if t.is_floating_point()), None)
            y = next((t for t in record.outputs.values() if t.is_floating_point()), None)
            if x is None or y is None or tuple(x.shape) != tuple(y.shape):
                return None
            for child in self.trace.children(record):
                z = next((t for t in child.outputs.values() if t.is_floating_point()), None)
                if z is not None and tuple(z.shape) == tuple(y.shape):
                    if relative_error(x + z, y) <= RESIDUAL_AGREE:
                        return child.module
        except Exception:  # a trace folder with a missing shard: no measurement
            return None
        return None

    def keys(self, layers_only: bool = False) -> dict[str, tuple] | None:
        r"""``{name: (shape, dtype, hash)}`` of this side's informative weights, from the tensors or from
        the trace folder's fingerprints; ``None`` when neither is at hand."""
        if not self.state_dict:
            return self.weight_keys
        if layers_only not in self._hashed:
            from paritykit.forensics.conversion.layer_order import value_keys

            self._hashed[layers_only] = value_keys(self.state_dict, layers_only=layers_only)
        return self._hashed[layers_only]

    @property
    def position(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.order)}

    def parameterless(self, name: str) -> bool:
        prefix = name + "." if name else ""
        return not any(k == name or k.startswith(prefix) for k in self._keys)

    def __post_init__(self) -> None:
        keys = []
        for module, params in self.params.items():
            keys += [f"{module}.{p}" if module else p for p in params]
        self._keys = keys


# a residual wrapper of a child: its output is its input plus the child's, within this (relative L2)
RESIDUAL_AGREE = 1e-5


def side_of(model: Any, trace: Trace | None) -> Side:
    from paritykit.tracing.trace import module_table

    table = trace.modules if trace is not None and trace.modules else (module_table(model) if model else {})
    if trace is not None and len(trace):
        # Completion order: a container comes after its children, where its own (inline) work happens.
        order, out_shapes, first_calls = [], {}, {}
        for record in trace.completion_order():
            if record.call == 0:
                order.append(record.module)
                out_shapes[record.module] = _first_output_shape(record)
                first_calls[record.module] = record
    else:
        order = list(table)
        out_shapes, first_calls = {name: None for name in order}, {}
    state_dict, weight_keys, hashed = None, None, {}
    if model is not None:
        from paritykit.tracing.split_traces import ModelWeights

        weights = ModelWeights(model)
        # weights offloaded by accelerate sit on "meta" in state_dict(): they are read through the hooks, one
        # tensor per access, and never all at once (the mapping stays lazy)
        state_dict = weights if weights.offloaded else dict(model.state_dict())
        hashed = _hashes_of(model, state_dict) if not weights.offloaded else {}
    elif trace is not None:
        state_dict = trace.weights()
        if state_dict is None:  # a trace folder holds the weights' hashes, not a copy
            weight_keys = trace.weight_keys()
    types = {name: info.type for name, info in table.items()}
    for record in trace.records if trace is not None else ():
        types.setdefault(record.module, record.type)
    params = {name: info.params for name, info in table.items()}
    return Side(order, types, params, out_shapes, state_dict, first_calls, weight_keys, hashed, trace)


# model -> (what its weights were: each tensor's name, address and version; their hashes). Zoom aligns one
# level at a time, a Side each: the weights are hashed once while none moves or changes.
_HASHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hashes_of(model: Any, state_dict: Mapping[str, Any]) -> dict[bool, dict[str, tuple]]:
    from paritykit.tracing.trace import version_of

    state = tuple(
        (k, v.data_ptr(), version_of(v), v.dtype, tuple(v.shape)) if hasattr(v, "data_ptr") else (k, id(v))
        for k, v in state_dict.items()
    )
    if any(len(s) > 2 and s[2] is None for s in state):
        return {}  # an inference tensor keeps no version counter: hashed again each time
    try:
        held = _HASHED.get(model)
    except TypeError:  # a model that cannot be weakly referenced: hashed again each time
        return {}
    if held is None or held[0] != state:
        held = (state, {})
        _HASHED[model] = held
    return held[1]


def _first_output_shape(record: Record) -> tuple | None:
    keys = record.output_keys
    if not keys:
        return None
    first = next(iter(keys.values()))
    try:
        return tuple(record._tensors.get(first).shape)
    except Exception:  # a trace folder with a missing shard still aligns by names and types
        return None


def replayed_distance(module: Any, record: Any) -> float:
    r"""How far ``module``, run on the captured positional inputs of ``record`` (a call of the other side),
    lands from that call's captured output (relative error); ``inf`` when it cannot run there or the outputs
    do not compare. Which member of a wrapper chain a port module computes like, measured."""
    import math

    import torch

    from paritykit.base.inputs import to_device
    from paritykit.bisection.leaves import module_device
    from paritykit.compare.tensors import relative_error
    from paritykit.tracing.recording import output_tensor

    if module is None or record is None or not record.replayable:
        return math.inf
    args, _ = record.call_inputs()
    try:
        with torch.no_grad():
            got = module(*to_device(args, module_device(module)))
    except Exception:  # noqa: BLE001 - a signature that does not take these inputs measures nothing
        return math.inf
    got = output_tensor(got)
    want = record.output
    if not isinstance(got, torch.Tensor) or want is None or got.shape != want.shape:
        return math.inf
    return relative_error(got.detach().to(want.device, want.dtype), want)
