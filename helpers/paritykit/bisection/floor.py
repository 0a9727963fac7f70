r"""The reference's own float noise as the floor of every comparison.

Research code computes parts in float64 (a timestep sinusoid, a rotary table) where diffusers computes in
float32; two correct implementations then differ by float32 rounding, which a fixed tolerance can read as a
bug. The floor measures that rounding instead of guessing it, two ways per side: a float64 copy of the model
run on its inputs in float64 (the float32 value's distance from the float64 one), and the float32 model run
on its inputs each moved by one float32 rounding step (how far rounding the inputs alone moves the value:
code that computes in float32 whatever the model's dtype, such as a sinusoid of ``t = 999``, keeps its
float32 error in a float64 copy). The larger of the two, at every captured call, is that side's float32 error
there. Two sides that differ by at most :data:`NOISE` times the larger of their errors
differ by float noise: no culprit, no first divergence, no ``differ``. A replayed module is measured the same
way on the inputs it was replayed on (:func:`module_floor`), so its floor is its own computation's, not what
its inputs carried in.

Conversely, a module whose difference is :data:`FAR` times its floor or more is a real difference even when
what follows hides it at the output (``masked``), whatever its alignment confidence.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import first_line
from paritykit.base.inputs import map_tensors
from paritykit.base.report import format_number

if TYPE_CHECKING:
    from paritykit.tracing.trace import Record, Trace

# a difference within this multiple of the reference's float32 error is float noise
NOISE = 4.0
# a difference this many times the floor or more is a real one, whatever the alignment's confidence
FAR = 100.0
# a value that moves by more than this share of its own scale did not move by rounding: no floor there
MAX_RELATIVE = 1e-3
# the float64 copies of both models, next to the float32 ones, must leave this share of free memory
MEMORY_SHARE = 0.5


def as_float64(value: Any) -> Any:
    r"""``value`` with every floating-point tensor (at any depth) in float64 and every complex one in
    complex128; integers, masks and everything else as they are."""
    import torch

    def widen(t: Any) -> Any:
        if t.is_complex():
            return t.to(torch.complex128)
        return t.to(torch.float64) if t.is_floating_point() else t

    return map_tensors(value, widen)


# each float64 copy -> the module it copies, so user code told "which side is this model" can say
_ORIGINALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def float64_copy(module: Any) -> Any:
    r"""A float64 copy of ``module`` (parameters and floating-point buffers; the original is untouched).
    diffusers' warning that some modules should stay in float32 is silenced: the copy is meant to be
    float64 throughout, and the warning would be printed for every measured module."""
    from paritykit.base.quiet import quiet_diffusers

    with quiet_diffusers():
        widened = copy.deepcopy(module).double()
    _ORIGINALS[widened] = module
    return widened


def original_of(module: Any) -> Any:
    r"""The module a :func:`float64_copy` was made from; ``module`` itself for any other."""
    try:
        return _ORIGINALS.get(module, module)
    except TypeError:  # not weakly referenceable: not a copy of ours
        return module


def max_difference(a: Any, b: Any) -> float | None:
    r"""The largest absolute difference between two tensors, in float64; ``None`` when they cannot be
    compared (shapes differ, not floating point)."""
    import torch

    if a is None or b is None or tuple(a.shape) != tuple(b.shape):
        return None
    if not (a.is_floating_point() or a.is_complex()) or not (b.is_floating_point() or b.is_complex()):
        return None
    if a.numel() == 0:
        return 0.0
    diff = (a.detach().to("cpu", torch.complex128 if a.is_complex() else torch.float64)) - b.detach().to(
        "cpu", torch.complex128 if b.is_complex() else torch.float64
    )
    value = float(diff.abs().max())
    return value if value == value else None  # NaN: not measurable


def leaves_error(float32: list[tuple[str, Any]], float64: list[tuple[str, Any]]) -> float | None:
    r"""The largest float32 error over two leaf lists of one call (paired by path): ``None`` when no leaf
    pairs, or when a leaf moved by more than :data:`MAX_RELATIVE` of its own scale (not rounding: a step
    function of its input, a value drawn at random, an input edited in place)."""
    other = dict(float64)
    errors = []
    for path, tensor in float32:
        error = max_difference(tensor, other.get(path))
        if error is None:
            continue
        scale = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
        if error > MAX_RELATIVE * scale:
            return None
        errors.append(error)
    return max(errors) if errors else None


def rounded_inputs(value: Any, seed: int = 0) -> Any:
    r"""``value`` with every floating-point tensor moved by one rounding step of its dtype, element by
    element, up or down at random (seeded): what rounding the inputs alone could have done."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def move(v: Any) -> Any:
        if not v.is_floating_point() or v.numel() == 0:
            return v
        if bool((v == v.round()).all()):
            # whole numbers (a timestep 999, an index): moved away from zero, so truncating or rounding them
            # finds the same integer; the product t * freq still moves by a rounding step
            return v + v.abs() * torch.sign(v) * torch.finfo(v.dtype).eps
        sign = torch.randint(0, 2, v.shape, generator=generator).to(v.device, v.dtype) * 2 - 1
        return v + v * sign * torch.finfo(v.dtype).eps

    return map_tensors(value, move)


def module_floor(module: Any, args: tuple, kwargs: dict, outputs: list[tuple[str, Any]]) -> float | None:
    r"""``module``'s float32 error on these inputs: the larger distance of its float32 ``outputs`` from a
    float64 copy's on the same inputs in float64, and from its own outputs on the inputs moved by one
    rounding step. A run that fails (an op without a float64 kernel, code that hard-codes ``.float()``)
    leaves the other; ``None`` when neither runs."""
    from paritykit.bisection.leaves import flatten_tensors

    moved_args, moved_kwargs = rounded_inputs((args, kwargs))
    errors = []
    for run in (
        lambda: float64_copy(module)(*as_float64(args), **as_float64(kwargs)),
        lambda: module(*moved_args, **moved_kwargs),
    ):
        try:
            errors.append(leaves_error(outputs, flatten_tensors(run())))
        except Exception:
            continue
    errors = [e for e in errors if e is not None]
    return max(errors) if errors else None


def within(difference: float | None, floor: float | None) -> bool:
    r"""Whether a difference is float noise against a floor (both measured as max abs)."""
    return difference is not None and floor is not None and difference <= NOISE * floor


def far_above(difference: float | None, floor: float | None) -> bool:
    r"""Whether a difference is :data:`FAR` times its floor or more (a floor of 0 makes any difference
    far)."""
    return difference is not None and floor is not None and difference > 0 and difference >= FAR * floor


@dataclass
class FloatFloor:
    r"""Both sides' float64 runs and rounded-inputs runs, captured: the float32 error of any captured call on
    either side. The floor is the reference's (:meth:`of`).

    ``reason`` says why a run is missing: why there is no floor at all (every run ``None``), or which side's
    float64 run failed (its rounded-inputs run is then that side's only measure)."""

    ref64: Trace | None = None
    port64: Trace | None = None
    reason: str = ""
    # each side's float32 run on its inputs moved by one rounding step (:func:`rounded_inputs`)
    ref_moved: Trace | None = None
    port_moved: Trace | None = None

    @property
    def measured(self) -> bool:
        r"""Whether the reference's float32 error was measured (the floor), by either run."""
        return self.ref64 is not None or self.ref_moved is not None

    def side_error(self, record: Record, side: str, what: str = "outputs") -> float | None:
        r"""One side's float32 error at one captured call (its ``outputs`` or ``inputs``): the larger of its
        distance from the float64 run and from the run on rounded inputs."""
        runs = (self.ref64, self.ref_moved) if side == "reference" else (self.port64, self.port_moved)
        errors = []
        for trace in runs:
            if trace is None or record.name not in trace:
                continue
            try:
                mine, other = getattr(record, what), getattr(trace[record.name], what)
                errors.append(leaves_error(list(mine.items()), list(other.items())))
            except Exception:  # a trace folder with a missing shard
                continue
        errors = [e for e in errors if e is not None]
        return max(errors) if errors else None

    def of(self, ref_record: Record, port_record: Record, what: str = "outputs") -> float | None:
        r"""The floor at a pair of calls: the reference's float32 error there. ``port_record`` is not read:
        the port's error is never the floor."""
        return self.side_error(ref_record, "reference", what)

    def errors(self, ref_record: Record, port_record: Record) -> tuple[float | None, float | None]:
        return self.side_error(ref_record, "reference"), self.side_error(port_record, "port")


def fits_twice(*models: Any) -> tuple[bool, str]:
    r"""Whether float64 copies of ``models`` fit in free memory (twice their float32 size each), with words
    saying why not."""
    import os

    import torch

    size, on = 0, None
    for model in models:
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type == "meta":
                return False, "weights offloaded (meta tensors): no float64 copy"
            size += tensor.numel() * 8
            on = tensor.device if tensor.device.type == "cuda" else on
    try:  # the copies are made where the models live: the GPU's free memory, else the machine's
        free = (
            torch.cuda.mem_get_info(on)[0]
            if on is not None
            else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        )
    except (ValueError, OSError, AttributeError, RuntimeError):
        return True, ""
    if size > MEMORY_SHARE * free:
        where = f"{on}'s free memory" if on is not None else "the free memory"
        return False, (
            f"float64 copies of both models need {size / 2**30:.1f} GiB, more than half {where}"
            f" ({free / 2**30:.1f} GiB)"
        )
    return True, ""


def measure(
    reference: Any,
    port: Any,
    ref_call: tuple[tuple, dict],
    port_call: tuple[tuple, dict],
    run: Any = None,
    outputs: tuple[Any, Any] | None = None,
) -> FloatFloor:
    r"""Run float64 copies of both models on their inputs in float64, and the models on rounded inputs,
    captured; a :class:`FloatFloor` with the reason when that is not possible (memory, an op with no float64
    kernel) or not meaningful: given ``outputs`` (each side's captured output), a side run again on its
    inputs must reproduce it, else what moves is randomness inside its forward, not rounding. ``ref_call``
    and ``port_call`` must be clean copies (a model may edit its inputs in place)."""
    import torch

    from paritykit.bisection.leaves import flatten_tensors
    from paritykit.tracing.trace import capture

    ok, why = fits_twice(reference, port)
    call = run or (lambda model, args, kwargs: model(*args, **kwargs))
    wide: list[Trace | None] = []
    moved: list[Trace | None] = []
    reasons = [] if ok else [why]
    sides = (("reference", reference, ref_call), ("port", port, port_call))
    for index, (side, model, (args, kwargs)) in enumerate(sides):
        if outputs is not None:
            with torch.no_grad():
                again = flatten_tensors(call(model, *map_tensors((args, kwargs), lambda t: t.clone())))
            first = flatten_tensors(outputs[index])
            if not first or not again:
                return FloatFloor(reason=f"the {side}'s output holds no tensor paritykit reads")
            if leaves_error(first, again) != 0.0:
                return FloatFloor(
                    reason=f"the {side} run again does not reproduce its own output (randomness inside its"
                    " forward, or inputs it edits in place): what moves is not rounding"
                )

        def captured(
            make: Any, inputs: tuple, failure: str, side: str = side, index: int = index
        ) -> Trace | None:
            try:
                run_model = make()
                with torch.no_grad(), capture(run_model) as trace:
                    result = call(run_model, *inputs)
            except Exception as exc:
                reasons.append(f"the {side} does not run {failure} ({first_line(_own(exc))})")
                return None
            if outputs is not None:
                off = _beyond_rounding(outputs[index], result)
                if off is not None:
                    reasons.append(
                        f"the {side} differs {failure} from its own run by {format_number(off)} (relative)"
                        " at the output: more than rounding moves (noise drawn in the run's dtype, or"
                        " dtype-dependent code), so that run measures no float error"
                    )
                    return None
            return trace

        fresh = map_tensors((args, kwargs), lambda t: t.clone())
        wide.append(
            captured(lambda m=model: float64_copy(m), as_float64(fresh), "in float64") if ok else None
        )
        rounded = rounded_inputs(map_tensors(fresh, lambda t: t.clone()))
        moved.append(captured(lambda m=model: m, rounded, "on rounded inputs"))
    return FloatFloor(wide[0], wide[1], reason="; ".join(reasons), ref_moved=moved[0], port_moved=moved[1])


# the most a rounding error may move a run's output, relative to it, by the output's precision: beyond it,
# what moved is not rounding (a float64 run draws other random numbers, a branch on the dtype)
ROUNDING_AT_MOST = {2: 1e-1, 4: 1e-2, 8: 1e-2}


def _beyond_rounding(own: Any, other: Any) -> float | None:
    r"""The relative error of ``other`` (a run in float64 or on rounded inputs) against ``own`` (the run
    itself) at the first output tensor, when it exceeds :data:`ROUNDING_AT_MOST`; ``None`` when it does not
    or cannot be measured."""
    from paritykit.bisection.leaves import flatten_tensors
    from paritykit.compare.tensors import relative_error

    mine, theirs = flatten_tensors(own), flatten_tensors(other)
    if not mine or not theirs or not mine[0][1].is_floating_point():
        return None
    reference = mine[0][1]
    error = relative_error(theirs[0][1].to(reference.dtype).to(reference.device), reference)
    limit = ROUNDING_AT_MOST.get(reference.element_size(), 1e-2)
    return error if error > limit else None


def _own(exc: BaseException) -> BaseException:
    r"""The exception the model raised, without the user-code wrapper a SPEC run adds (the same words
    whether the run came through a SPEC or not)."""
    from paritykit.base.errors import UserCodeError

    return exc.__cause__ if isinstance(exc, UserCodeError) and exc.__cause__ is not None else exc


def precision_line(
    difference: float,
    floor: float,
    where: str,
    errors: tuple[float | None, float | None],
    dtype: str = "float32",
) -> str:
    r"""One line: the difference at ``where`` against the reference's rounding error there in its own
    ``dtype`` (the floor), with the port's own error when measured and which side computes in higher
    precision."""
    _, port_error = errors
    line = (
        f"float noise: {where} differs by {format_number(difference)}; the reference's {dtype} error there"
        f" {format_number(floor)}"
    )
    if port_error is not None:
        line += f" (the port's {format_number(port_error)})"
        if port_error * NOISE < floor:
            line += "; the port computes it in higher precision than the reference"
    return line


# the floor's state when every run it asks for ran: the one state a text report need not repeat
FLOOR_MEASURED = "measured: the reference run again in float64 and on rounded inputs"


def floor_state(floor: FloatFloor | None) -> str:
    r"""How the floor was measured, in words for the report: ``off``; the whole reference run again (in
    float64 and on rounded inputs, or on rounded inputs only, with why); or only at failing replays, with
    why there is no whole run. Only the reference's runs make the floor, so only their failures are said."""
    if floor is None:
        return "off"
    own = [r for r in floor.reason.split("; ") if r and not r.startswith("the port ")]
    if floor.ref64 is not None and floor.ref_moved is not None:
        return FLOOR_MEASURED
    if floor.ref_moved is not None:
        why = own[0].removeprefix("the reference ") if own else "has no float64 run"
        return f"measured on the reference's rounded inputs only (it {why})"
    reason = "; ".join(own) or floor.reason
    return f"replays only: {reason}" if reason else "replays only"
