r"""Port inputs the reference computes inside a module: rotary cos/sin a port passes as
``image_rotary_emb`` while the reference builds its table in its own forward. The unaligned port modules that
produce exactly those inputs are found, and a configurable one is fitted by replaying the culprit with what
each candidate setting produces (:func:`extra_input_hints`); the repair search replays with an edited
producer (:func:`replay_with_extras`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from paritykit.base.report import format_number
from paritykit.bisection.module_fit import constructor_values, rebuild, settings_for

if TYPE_CHECKING:
    from paritykit.bisection.searcher import Searcher
    from paritykit.tracing.trace import Record

# ------------------------------------------------------------------- port inputs the reference computes
# bounded refinement of one numeric argument: a log grid of factors around the current value, then a search
GRID = tuple(10 ** (k / 4) for k in range(-12, 13))
REFINE_STEPS = 24


def extra_input_hints(
    searcher: Searcher, call: Record, port_call: Record | None, before: float | None
) -> list[Any]:
    r"""Evidence for a culprit whose replay fed the port some inputs from the port's own run, because the
    reference computes them inside the module (rotary cos/sin a port passes as ``image_rotary_emb``).

    The unaligned port modules whose outputs are exactly those inputs are named; each configurable one is
    searched (its constructor arguments: flags, literals, and numbers on a bounded log grid refined and
    rounded) for a setting with which the culprit, replayed on the reference's inputs and that module's new
    output, matches the reference. A match is a verified ``module-fit`` fix; otherwise an
    ``inline-reference`` hint names the producing modules.
    """
    from paritykit.compare.diagnose import Hint

    extras = extra_inputs(searcher, call, port_call)
    if not extras:
        return []
    producers = extra_producers(searcher, extras)
    hints = []
    for record, feeds in producers:
        module = searcher.port_modules.get(record.module)
        if module is None or not record.replayable:
            continue
        found = _fit_by_replay(searcher, call, port_call, module, record, feeds)
        if found is None:
            continue
        changes, after, trials = found
        text = ", ".join(f"{k}={new!r} (now {old!r})" for k, (old, new) in changes.items())
        where = record.module or "(top level)"
        hints.append(
            Hint(
                "module-fit",
                f"port {where} ({record.type}) computes {', '.join(feeds.values())} of {port_call.name},"
                f" an input the reference's {call.name} is not given; built with {text} it makes"
                f" {port_call.name} match the reference (replayed on the reference's inputs: max_abs"
                f" {format_number(before)} -> {format_number(after.max_abs)}, {trials} constructor settings"
                " tried)",
                {
                    "module": record.module,
                    "module_type": record.type,
                    "changes": {k: {"current": a, "fitted": b} for k, (a, b) in changes.items()},
                    "inputs": list(feeds.values()),
                    "culprit_before": before,
                    "culprit_after": after.max_abs,
                    "trials": trials,
                },
                score=0.99,
                verified=True,
                # a key with a dot is a full path (a coupled flag on the consuming module)
                fix="; ".join(
                    f"{k if '.' in k else f'{where}.{k}'} = {new!r}" for k, (_, new) in changes.items()
                ),
            )
        )
        break
    if producers:
        names = ", ".join(f"{r.module} ({r.type})" for r, _ in producers)
        fed = ", ".join(sorted({p for _, feeds in producers for p in feeds.values()}))
        hints.append(
            Hint(
                "inline-reference",
                f"port {port_call.name} takes {fed} from {names} (that module's captured output is exactly"
                f" the input); the reference's {call.name} is given no such input and no reference module is"
                " aligned with that one; the culprit was replayed with the port's own values of those inputs,"
                " so the difference is in them or in the culprit's forward"
                + ("" if hints else "; no constructor setting of that module made the culprit match"),
                {"producers": [r.module for r, _ in producers], "inputs": fed.split(", ")},
                score=0.9,
            )
        )
    return hints


def extra_inputs(searcher: Searcher, call: Record, port_call: Record | None) -> dict[str, Any]:
    """The port inputs a culprit's replay took from the port's own run (path -> captured tensor); empty when
    there are none or the port module is not at hand."""
    paths = searcher.own_input_paths(call, port_call)
    if not paths:
        return {}
    captured = dict(port_call.inputs.items())
    return {p: captured[p] for p in paths if p in captured}


def extra_producers(searcher: Searcher, extras: dict[str, Any]) -> list[tuple[Any, dict[str, str]]]:
    """Unaligned port calls with an output exactly equal to an extra input: (record, {output path: input})."""
    import torch

    out = []
    for record in searcher.port_trace.records:
        if record.call != 0 or searcher.alignment.reference_of(record.module) is not None:
            continue
        feeds = {}
        for key, value in record.outputs.items():
            for path, tensor in extras.items():
                if value.shape == tensor.shape and value.dtype == tensor.dtype and torch.equal(value, tensor):
                    feeds[key] = path
                    break
        if feeds:
            out.append((record, feeds))
    return out


def _fit_by_replay(
    searcher: Searcher,
    call: Record,
    port_call: Record | None,
    module: Any,
    record: Record,
    feeds: dict[str, str],
) -> tuple[dict[str, tuple[Any, Any]], Any, int] | None:
    """The fewest constructor changes of ``module`` that make the culprit's replay match, or ``None``."""
    from paritykit.bisection.leaves import output_leaves

    read = constructor_values(module)
    if read is None:
        return None
    values, readable = read
    inputs = record.call_inputs()
    rebuilt = rebuild(module, values)
    if rebuilt is None:
        return None
    own = output_leaves(_call(rebuilt, inputs))
    # the rebuild must reproduce the module's captured outputs: the values read back are the ones it runs with
    if any(not _same(dict(own).get(k), t) for k, t in record.outputs.items() if k in feeds):
        return None
    trials = 0

    def attempt(change: dict[str, Any]) -> Any:
        nonlocal trials
        trials += 1
        candidate = rebuild(module, {**values, **change})
        return (
            None
            if candidate is None
            else replay_with_extras(searcher, call, port_call, candidate, inputs, feeds)
        )

    for change in settings_for(module, values, readable):
        cmp = attempt(change)
        if cmp is not None and cmp.passed:
            return {k: (values[k], v) for k, v in change.items()}, cmp, trials
    for name in readable:
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, float) or value == 0:
            continue
        fitted = _refine(lambda v, n=name: attempt({n: v}), value)
        for v in _rounded(fitted):
            cmp = attempt({name: v})
            if cmp is not None and cmp.passed:
                return {name: (value, v)}, cmp, trials
    return _fit_coupled_flag(searcher, port_call, values, readable, attempt, trials)


def _fit_coupled_flag(
    searcher: Searcher,
    port_call: Record | None,
    values: dict[str, Any],
    readable: list[str],
    attempt: Any,
    trials: int,
) -> tuple[dict[str, tuple[Any, Any]], Any, int] | None:
    """A flag the producer and its consumer both hold under one name (``interleaved`` on a rotary module and
    on the attention processor that unpacks its output): a layout is set on both sides or the pair breaks, so
    the flag is flipped on both together. The consumer's attribute is restored after each trial."""
    consumer = searcher.port_modules[port_call.module]
    holders = {port_call.module: consumer}
    if getattr(consumer, "processor", None) is not None:
        holders[f"{port_call.module}.processor" if port_call.module else "processor"] = consumer.processor
    for name in readable:
        value = values[name]
        if not isinstance(value, bool):
            continue
        for path, holder in holders.items():
            if getattr(holder, name, None) is not value:
                continue
            try:
                setattr(holder, name, not value)
                cmp = attempt({name: not value})
            finally:
                setattr(holder, name, value)
            trials += 1
            if cmp is not None and cmp.passed:
                return {name: (value, not value), f"{path}.{name}": (value, not value)}, cmp, trials
    return None


def _refine(attempt: Any, value: float) -> float | None:
    """The value (log-grid minimum, then a golden-section search between its neighbours) of least error."""
    import math

    def err(v: float) -> float:
        cmp = attempt(v)
        return math.inf if cmp is None or cmp.max_abs is None else float(cmp.max_abs)

    errors = [err(value * f) for f in GRID]
    best = min(range(len(GRID)), key=errors.__getitem__)
    if not math.isfinite(errors[best]):
        return None
    lo = math.log(value * GRID[max(best - 1, 0)])
    hi = math.log(value * GRID[min(best + 1, len(GRID) - 1)])
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(REFINE_STEPS):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if err(math.exp(a)) < err(math.exp(b)):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2)


def _rounded(value: float | None) -> list[float]:
    """Round numbers near ``value`` (1 to 3 significant digits): configured constants are written round."""
    if value is None:
        return []
    return list(dict.fromkeys(float(f"{value:.{d}g}") for d in (1, 2, 3)))


def replay_with_extras(
    searcher: Searcher,
    call: Record,
    port_call: Record | None,
    candidate: Any,
    inputs: tuple[tuple, dict],
    feeds: dict[str, str],
) -> Any:
    """The culprit's port module replayed on the reference's inputs, with ``candidate``'s outputs as the
    extra inputs it feeds; compared with the reference's captured outputs."""
    import torch

    from paritykit.bisection.leaves import module_device, output_leaves

    produced = dict(output_leaves(_call(candidate, inputs)))
    if any(k not in produced for k in feeds):
        return None
    port_module = searcher.port_modules[port_call.module]
    adapted = searcher.adapt_inputs(
        call, port_call, module_device(port_module), replace={p: produced[k] for k, p in feeds.items()}
    )
    if adapted is None:
        return None
    try:
        with torch.no_grad():
            out = output_leaves(port_module(*adapted[0], **adapted[1]))
    except Exception:  # a setting whose output the port module cannot consume is no fit
        return None
    return searcher.compare_leaves(list(call.outputs.items()), out, call.name)


def _call(module: Any, inputs: tuple[tuple, dict]) -> Any:
    import torch

    try:
        with torch.no_grad():
            return module(*inputs[0], **inputs[1])
    except Exception:  # a candidate setting whose forward fails produces nothing
        return None


def _same(a: Any, b: Any) -> bool:
    import torch

    return a is not None and a.shape == b.shape and bool(torch.equal(a, b))
