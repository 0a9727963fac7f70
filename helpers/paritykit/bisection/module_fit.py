r"""Find the constructor setting of a configurable module that makes it produce a wanted tensor.

Research code often computes inline what a port delegates to a library module (a sinusoidal timestep
embedding, a positional add). When the port's module is configured differently from what the reference
computes (``flip_sin_to_cos``, a frequency shift, a scale), nothing is aligned with it, so bisect can only say
"this parent's own forward differs". :func:`fit_module` searches the module's constructor arguments, bounded
and read from its signature and its current attribute values, for a setting whose output on the captured
input reproduces the tensor the reference fed onward.

The search is honest by construction: the module is first rebuilt with its *current* values, and the search
goes on only when that rebuild reproduces the module's own output exactly (so the values read back are the
ones it was built with); each candidate changes one or two arguments and keeps the module's weights.
"""

from __future__ import annotations

import inspect
import itertools
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paritykit.base.report import format_number
from paritykit.bisection.results import shown_name

if TYPE_CHECKING:
    from paritykit.bisection.searcher import Searcher
    from paritykit.tracing.trace import Record

# a bounded search: at most this many candidate settings are built and run
MAX_TRIALS = 64
_SCALARS = (bool, int, float, str)


@dataclass
class ModuleFit:
    r"""A constructor setting that reproduces the wanted tensor.

    ``changes`` maps each argument to ``(current, fitted)``; ``before`` / ``after`` are the max abs errors of
    the current and the fitted module against the wanted tensor; ``trials`` counts the settings tried.
    """

    module_type: str
    changes: dict[str, tuple[Any, Any]]
    before: float
    after: float
    trials: int
    fitted: Any = field(default=None, repr=False)

    def fix(self, path: str) -> str:
        """One line: the attribute assignments (constructor arguments) that make the fix."""
        where = path or "(top level)"
        return "; ".join(f"{where}.{name} = {new!r}" for name, (_, new) in self.changes.items())

    def to_dict(self) -> dict[str, Any]:
        return {
            "module_type": self.module_type,
            "changes": {k: {"current": a, "fitted": b} for k, (a, b) in self.changes.items()},
            "before": self.before,
            "after": self.after,
            "trials": self.trials,
        }


def constructor_values(module: Any, tuples: bool = False) -> tuple[dict[str, Any], list[str]] | None:
    r"""The module's constructor arguments with the values it holds now (attribute, else ``config`` entry,
    else the signature default), and the names whose values were read from the module (so may be varied).
    ``None`` when a required argument cannot be read or is not a plain scalar (with ``tuples``, a tuple of
    plain scalars counts as plain)."""
    try:
        signature = inspect.signature(type(module).__init__)
    except (TypeError, ValueError):
        return None
    config = getattr(module, "config", None)
    values: dict[str, Any] = {}
    readable: list[str] = []
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if hasattr(module, name) and _plain(getattr(module, name), tuples):
            values[name] = getattr(module, name)
            readable.append(name)
        elif isinstance(config, dict) and name in config and _plain(config[name], tuples):
            values[name] = config[name]
            readable.append(name)
        elif param.default is not inspect.Parameter.empty:
            values[name] = param.default
        else:
            return None
    return values, readable


def _plain(value: Any, tuples: bool = False) -> bool:
    if tuples and isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, _SCALARS)


def literal_options(module: Any, name: str) -> list[str]:
    """The string values a ``Literal[...]`` annotation allows for ``name`` (empty when unannotated)."""
    try:
        hints = typing.get_type_hints(type(module).__init__)
    except Exception:  # unresolvable forward references: no annotation to read
        return []
    options: list[str] = []
    for arg in typing.get_args(hints.get(name)) or ((hints.get(name),) if hints.get(name) else ()):
        if typing.get_origin(arg) is typing.Literal:
            options += [a for a in typing.get_args(arg) if isinstance(a, str)]
    return options


def candidate_values(module: Any, name: str, value: Any) -> list[Any]:
    """A few alternative values for one argument: the other boolean, the other literals, simple numbers."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, str):
        return [o for o in literal_options(module, name) if o != value]
    if isinstance(value, (int, float)):
        out = [0, 1, -value, 2 * value, value / 2] + ([1 / value] if value else [])
        if isinstance(value, int):
            out = [int(v) for v in out if float(v).is_integer()]
        return [v for v in dict.fromkeys(out) if v != value]
    return []


def settings_for(module: Any, values: dict[str, Any], readable: list[str]) -> list[dict[str, Any]]:
    """One-argument changes first, then pairs of boolean changes; at most :data:`MAX_TRIALS`."""
    # `inplace` changes no value a module computes, only whether it overwrites its input
    readable = [n for n in readable if n != "inplace"]
    singles = [(n, v) for n in readable for v in candidate_values(module, n, values[n])]
    out = [{n: v} for n, v in singles]
    flags = [n for n in readable if isinstance(values[n], bool)]
    out += [{a: not values[a], b: not values[b]} for a, b in itertools.combinations(flags, 2)]
    return out[:MAX_TRIALS]


def rebuild(module: Any, kwargs: dict[str, Any]) -> Any:
    try:
        new = type(module)(**kwargs)
        new.load_state_dict(module.state_dict(), strict=True)
    except Exception:  # a setting the class rejects, or one that changes parameter shapes
        return None
    return placed_like(module, new)


def placed_like(old: Any, new: Any) -> Any:
    """``new`` on ``old``'s device and float dtype, in its train/eval mode."""
    for tensor in (*old.parameters(), *old.buffers()):
        from paritykit.base.quiet import quiet_diffusers

        with quiet_diffusers():  # a rebuilt diffusers module cast back to the old one's dtype, on purpose
            new = new.to(device=tensor.device, dtype=tensor.dtype if tensor.is_floating_point() else None)
        break
    return new.train(old.training)


def _first_tensor(value: Any) -> Any:
    from paritykit.bisection.leaves import flatten_tensors

    leaves = flatten_tensors(value)
    return leaves[0][1] if leaves else None


def _run(module: Any, call: tuple[tuple, dict]) -> Any:
    import torch

    from paritykit.base.inputs import map_tensors

    # on copies: the call's tensors are a trace's captured values (an in-place activation would rewrite them)
    args, kwargs = map_tensors(call, lambda t: t.clone())
    try:
        with torch.no_grad():
            return _first_tensor(module(*args, **kwargs))
    except Exception:  # a candidate setting whose forward fails is no fit
        return None


def _error(a: Any, b: Any) -> float:
    if b is None or a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def fit_module(
    module: Any,
    call: tuple[tuple, dict],
    target: Any,
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> ModuleFit | None:
    r"""Search ``module``'s constructor arguments for a setting whose output on ``call`` matches ``target``.

    Args:
        module: a configured ``nn.Module`` (its weights are kept; only constructor arguments change).
        call: ``(args, kwargs)`` the module was called with.
        target: the tensor the module should have produced (what the reference fed onward).
        atol, rtol: tolerances of the match (default: by dtype).

    Returns:
        The :class:`ModuleFit` with the fewest changes that matches, or ``None`` (no readable configuration,
        the rebuild with current values does not reproduce the module, or no setting matches).
    """
    from paritykit.compare.tensors import compare_tensors

    read = constructor_values(module)
    if read is None:
        return None
    values, readable = read
    own = _run(module, call)
    if own is None or not own.is_floating_point():
        return None
    rebuilt = rebuild(module, values)
    if rebuilt is None or _error(own, _run(rebuilt, call)) != 0:
        return None
    before = _error(target, own)
    trials = 0
    for change in settings_for(module, values, readable):
        trials += 1
        candidate = rebuild(module, {**values, **change})
        if candidate is None:
            continue
        out = _run(candidate, call)
        if out is None or out.shape != target.shape:
            continue
        if compare_tensors(target, out.to(target.dtype), atol=atol, rtol=rtol, diagnose=False).passed:
            return ModuleFit(
                type(module).__name__,
                {k: (values[k], v) for k, v in change.items()},
                before,
                _error(target, out),
                trials,
                fitted=candidate,
            )
    return None


# ---------------------------------------------------------------------------------- the inline reference


@dataclass
class InlineInput:
    r"""Where an inline culprit's difference first shows: the first aligned child whose captured inputs
    differ, the two input tensors, and the unaligned port calls whose output is exactly that port input."""

    child: Any
    port_child: Any
    reference_input: Any
    port_input: Any
    producers: list[Any]
    # aligned children before ``child`` that could not be tested one-to-one (they may hold the difference)
    untested: list[str] = field(default_factory=list)
    # when the differing input has no reference argument by value: which port inputs and reference arguments
    # are left unpaired (the two tensors then need not share a shape)
    unpaired: str = ""


def first_differing_input(searcher: Searcher, call: Record) -> InlineInput | None:
    """The first aligned child (execution order) of ``call`` whose captured inputs differ between the
    sides."""
    from paritykit.bisection.floor import within
    from paritykit.bisection.leaves import pair_layouts

    floor = (
        searcher.float_floor if searcher.float_floor is not None and searcher.float_floor.measured else None
    )
    untested = []
    for child in searcher.frontier(call):
        result = searcher.results.get(child.name)
        if result is not None and result.status == "untestable":
            untested.append(child.name)
        port_child = searcher.port_record(child)
        ref_in, port_in = list(child.inputs.items()), list(port_child.inputs.items())
        # inputs no reference argument gives by value (a rotary table built another way): the first
        # unexplained port input against the reference argument left over
        found = pair_layouts(ref_in, port_in)
        unpaired = searcher.unpaired_inputs(child, port_child) if found is None else None
        if unpaired is not None and unpaired.any_paired:
            a, b = ref_in[unpaired.reference[0]][1], port_in[unpaired.port[0]][1]
            producers = []
            for j in unpaired.port:
                producers += [r for r in _producers(searcher, call, port_in[j][1]) if r not in producers]
            return InlineInput(child, port_child, a, b, producers, untested, unpaired.words)
        pairs, port_in, _ = found or (None, port_in, {})
        noise = floor.of(child, port_child, "inputs") if floor is not None else None
        order = searcher.input_layouts.get(child.name)  # a replay read the reference's inputs this way
        for i, j in pairs or ():
            a, b = ref_in[i][1], port_in[j][1]
            if not (a.is_floating_point() and b.is_floating_point()):
                continue
            if order is not None and a.ndim == len(order) and tuple(a.permute(order).shape) == tuple(b.shape):
                a = a.permute(order)
            cmp = searcher.compare(a, b, f"{child.name}:{ref_in[i][0]}")
            if not cmp.passed and not within(cmp.max_abs, noise):
                return InlineInput(child, port_child, a, b, _producers(searcher, call, b), untested)
    return None


def _producers(searcher: Searcher, call: Record, tensor: Any) -> list[Any]:
    """Unaligned port calls inside the culprit whose output is exactly ``tensor`` (nearest producer last)."""

    port_call = searcher.port_record(call) if call.parent is not None else searcher.port_trace.root
    prefix = port_call.module + "." if port_call is not None and port_call.module else ""
    return [
        record
        for record in searcher.port_trace.records
        if record.module.startswith(prefix)
        and searcher.alignment.reference_of(record.module) is None
        and _returns(record, tensor)
    ]


def _returns(record: Record, tensor: Any) -> bool:
    r"""Whether one of a call's captured outputs is exactly ``tensor``."""
    import torch

    return any(
        value.shape == tensor.shape and value.dtype == tensor.dtype and bool(torch.equal(value, tensor))
        for value in record.outputs.values()
    )


def _aligned_feeder(searcher: Searcher, found: InlineInput) -> Any:
    r"""The first aligned port call (other than the child) whose output is exactly the child's differing port
    input; ``None`` when there is none."""
    for record in searcher.port_trace.records:
        if record.name == found.port_child.name or searcher.alignment.reference_of(record.module) is None:
            continue
        if _returns(record, found.port_input):
            return record
    return None


def _feeder_words(searcher: Searcher, found: InlineInput, feeder: Record, held: str) -> str:
    r"""What the reference feeds the same child, measured: the output of ``held`` too (then the difference
    comes with that output, whatever its cause), or something else (the wiring differs)."""
    ref_feeder = next((r for r in searcher.ref_trace.records if r.module == held), None)
    if ref_feeder is None:
        return "the reference's own input there was not captured as any module's output"
    if _returns(ref_feeder, found.reference_input):
        test = searcher.results.get(ref_feeder.name)
        how = f" ({held} <-> {feeder.name} {test.status}s on identical inputs)" if test is not None else ""
        return (
            f"the reference feeds it {shown_name(held)}'s output too (compared exactly): the wiring agrees,"
            f" and the difference arrives with that output{how}"
        )
    pair = searcher.alignment.pair_of(held)
    paired = f"paired by {pair.how}, {pair.confidence} confidence" if pair is not None else "paired"
    return (
        f"the reference feeds it something other than {shown_name(held)}'s output (compared exactly); lead:"
        f" the call is wired to another input on one side, or {shown_name(held)} and {feeder.name} ({paired})"
        " are not one computation"
    )


def inline_reference_hints(
    searcher: Searcher, call: Record, port_call: Record | None, before: float | None
) -> list[Any]:
    r"""Evidence for an inline culprit (a parent whose aligned children all pass on replay): the tensor
    diagnoses of the first differing child input, the unaligned port modules that produced it, and a module
    fit of those modules, verified by replaying the culprit with the fitted module in a copy of the port.

    Args:
        searcher: the bisect search state (traces, alignment, models).
        call: the culprit's reference call; ``port_call`` its port call.
        before: the culprit's error before any fix (max abs).

    Returns:
        Hints, a verified fix first; empty when no child input differs.
    """
    from paritykit.compare.diagnose import Hint, diagnose

    found = first_differing_input(searcher, call)
    if found is None:
        return []
    cmp = searcher.compare(found.reference_input, found.port_input, found.child.name)
    where = (
        f"the first aligned submodule whose inputs differ is {found.child.name} <-> {found.port_child.name} "
    )
    where += f"({found.unpaired})" if found.unpaired else f"(max_abs {format_number(cmp.max_abs)})"
    where += _input_relation(found)
    rotary, tables = _rotary_words(searcher, call, found)
    if found.producers:
        names = ", ".join(f"{r.module} ({r.type})" for r in found.producers)
        hint_id = "inline-reference"
        message = (
            f"{where}; the port computes that input in {names}, which no reference module is aligned with"
            " (evidence: the port module's captured output is exactly that input); what the reference does"
            f" there, inside {shown_name(call.name)}, is not measured"
        )
    elif (feeder := _aligned_feeder(searcher, found)) is not None:
        hint_id = "inline-input"
        held = searcher.alignment.reference_of(feeder.module) or ""
        message = f"{where}; the port feeds it the output of {feeder.name}, aligned with the reference's"
        message += f" {shown_name(held)}: " + _feeder_words(searcher, found, feeder, held)
    elif found.untested:
        hint_id = "inline-input"
        message = (
            f"{where}; no captured port module call returns that input exactly, and"
            f" {', '.join(found.untested)} before it could not be tested one-to-one"
        )
    else:
        hint_id = "inline-input"
        message = f"{where}; no captured port module call returns that input exactly"
    message = rotary + message + tables
    hints = list(_fit_producers(searcher, call, port_call, found, before))
    hints.append(
        Hint(
            hint_id,
            message,
            {
                "child": found.child.name,
                "port_child": found.port_child.name,
                "producers": [r.module for r in found.producers],
                "untested": found.untested,
                "max_abs": cmp.max_abs,
            },
            score=0.9,
        )
    )
    for hint in [] if found.unpaired else diagnose(found.reference_input, found.port_input):
        hints.append(
            Hint(
                hint.id,
                f"at the input of {found.child.name}: {hint.message}",
                {**hint.evidence, "at": f"input of {found.child.name}"},
                score=hint.score,
            )
        )
    return hints


def _fit_producers(
    searcher: Searcher, call: Record, port_call: Record | None, found: InlineInput, before: float | None
) -> list:
    from paritykit.compare.diagnose import Hint

    hints = []
    for record in reversed(found.producers):
        module = searcher.port_modules.get(record.module)
        if module is None or not record.replayable:
            continue
        fit = fit_module(
            module, record.call_inputs(), found.reference_input, atol=searcher.atol, rtol=searcher.rtol
        )
        if fit is None:
            continue
        after = replay_with_module(searcher, call, port_call, record.module, fit.fitted)
        changes = ", ".join(f"{k}={new!r} (now {old!r})" for k, (old, new) in fit.changes.items())
        verified = after is not None and after.passed
        hints.append(
            Hint(
                "module-fit",
                f"port {record.module} ({fit.module_type}) built with {changes} reproduces the tensor the"
                f" reference feeds {found.child.name} (max_abs {format_number(fit.before)} ->"
                f" {format_number(fit.after)}, {fit.trials} constructor settings tried)"
                + (
                    f"; replaying the culprit with it: max_abs {format_number(before)} ->"
                    f" {format_number(after.max_abs)}"
                    if after is not None
                    else ""
                ),
                {
                    **fit.to_dict(),
                    "module": record.module,
                    "culprit_before": before,
                    "culprit_after": after.max_abs if after is not None else None,
                },
                score=0.99 if verified else 0.8,
                verified=verified if after is not None else None,
                fix=fit.fix(record.module),
            )
        )
        break
    return hints


def replay_with_module(
    searcher: Searcher, call: Record, port_call: Record | None, path: str, fitted: Any
) -> Any:
    """Replay the culprit on a copy of its port module with ``fitted`` in place of the module at ``path``;
    the comparison against the reference's captured outputs, or ``None`` when it cannot be run."""
    import copy

    import torch

    from paritykit.bisection.leaves import module_device, output_leaves

    owner = port_call.module if port_call is not None else ""
    module = searcher.port_modules.get(owner)
    if module is None:
        return None
    local = path[len(owner) + 1 :] if owner else path
    clone = copy.deepcopy(module)
    parent_name, _, leaf = local.rpartition(".")
    parent = clone.get_submodule(parent_name) if parent_name else clone
    setattr(parent, leaf, copy.deepcopy(fitted))
    adapted = searcher.adapt_inputs(call, port_call, module_device(module)) if port_call is not None else None
    if adapted is None and port_call is not None and port_call.replayable:
        adapted = port_call.call_inputs()
    if adapted is None:
        return None
    try:
        with torch.no_grad():
            out = output_leaves(clone(*adapted[0], **adapted[1]))
    except Exception:  # the fitted module changes what the parent can consume
        return None
    return searcher.compare_leaves(list(call.outputs.items()), out, call.name)


def _rotary_words(searcher: Searcher, call: Record, found: InlineInput) -> tuple[str, str]:
    r"""When both sides hold rotary tables, what differs (θ, bands, layout, position scale), said first, and
    each side's form read back from the values, said last. The tables are read from the reference culprit's
    and the port producers' held tensors, else from the differing child's captured arguments (tables computed
    inline and passed down)."""
    from paritykit.bisection.rotary import compare_tables, rotary_tables

    reference = searcher.ref_modules.get(call.module)
    ref_tables = rotary_tables(reference) if reference is not None and found.producers else []
    port_tables = [
        (f"{r.module}.{name}", form)
        for r in found.producers
        if (module := searcher.port_modules.get(r.module)) is not None
        for name, form in rotary_tables(module)
    ]
    where = ""
    if ref_tables and port_tables:
        compared = compare_tables(ref_tables, port_tables)
    else:
        compared = passed_tables(searcher, found.child, found.port_child)
        where = f" passed to {shown_name(found.child.name)}"
    if compared is None:
        return "", ""
    tables = f" (rotary tables{where} read from their values: {compared.forms})"
    return (f"{compared.lead}; " if compared.lead else ""), tables


def passed_tables(searcher: Searcher, child: Record, port_child: Record) -> Any:
    r"""The rotary tables passed to an aligned call on each side (its captured arguments, named by each
    side's ``forward``), compared (:func:`paritykit.bisection.rotary.compare_tables`); None when a side passes
    none."""
    from paritykit.bisection.relations import named_inputs
    from paritykit.bisection.rotary import compare_tables, rotary_in_leaves

    return compare_tables(
        rotary_in_leaves(named_inputs(searcher.ref_modules.get(child.module), child)),
        rotary_in_leaves(named_inputs(searcher.port_modules.get(port_child.module), port_child)),
        f" passed to {shown_name(child.name)}",
    )


def _input_relation(found: Any) -> str:
    r"""How the port's differing input relates to the reference's (values moved, a scale such as a timestep
    in other units, rows added), derived from the two captured values: one place, told apart by bug."""
    import torch

    from paritykit.bisection.value_relations import relate

    a, b = found.reference_input, found.port_input
    if found.unpaired or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return ""
    relations = relate(a, b)
    if not relations:
        return ""
    return f"; there, {relations[0].words} (residual {format_number(relations[0].residual)})"
