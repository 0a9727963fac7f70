r"""What triage's walk measures between two recorded calls, outside the walk itself: repeated timesteps, the
decoder's input put in a call, a result's map from its decoder output, how a module's bisect reads at a place,
and the finding a bisect becomes."""

from __future__ import annotations

from typing import Any

from paritykit.base.report import format_cosine, format_number
from paritykit.tracing.recording import Call, batch_of, in_form_of
from paritykit.triage.report import Finding, Place
from paritykit.triage.roles import with_values

# how an affine fit names the reference's side in its words
THE_REFERENCES = "the reference's"


def command_and_files(built: Any) -> dict[str, Any]:
    r"""A built command (:class:`paritykit.triage.reproduce.Commands`) as a finding's ``command`` and
    ``files`` keywords."""
    command, files = built
    return {"command": command, "files": files}


def plain_draw(x: Any, seeds: tuple[int, ...]) -> str | None:
    r"""``"torch.randn(…, dtype=D) after torch.manual_seed(S)"`` when that draw, in the dtype of ``x``,
    reproduces ``x`` exactly (its first call's noise), for the first of ``seeds`` and of float32, float64,
    float16, bfloat16 that does; ``None`` when none does (a draw on another device, a generator of its own, a
    scaled or shifted noise)."""
    import torch

    wanted = x.detach().cpu()
    for seed in dict.fromkeys(seeds):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            seeded = torch.Generator().manual_seed(seed)
            drawn = torch.randn(tuple(wanted.shape), generator=seeded, dtype=dtype)
            if torch.equal(drawn.to(wanted.dtype), wanted):
                name = str(dtype).removeprefix("torch.")
                return f"torch.randn(…, dtype={name}) after torch.manual_seed({seed})"
    return None


def repeats(t_ref: list[float], t_port: list[float]) -> tuple[str, int] | None:
    r"""``("reference" | "port", k)`` when that side's timesteps are the other's with each one repeated ``k``
    times in a row (a denoiser called once per guidance half); ``None`` otherwise."""
    for side, many, once in (("reference", t_ref, t_port), ("port", t_port, t_ref)):
        if not once or len(many) <= len(once) or len(many) % len(once):
            continue
        k = len(many) // len(once)
        if all(many[i * k + j] == once[i] for i in range(len(once)) for j in range(k)):
            return side, k
    return None


def per_step_calls(t_ref: list[float], t_port: list[float]) -> tuple[int, int] | None:
    r"""``(k_ref, k_port)`` when the two sides call their denoiser a different number of times per step
    (each side's timesteps come in runs of ``k``: one call per guidance half) over the same number of steps,
    whatever the values; ``None`` otherwise."""
    from paritykit.schedule.load import repeated

    k_ref, k_port = repeated(t_ref), repeated(t_port)
    if k_ref == k_port or len(t_ref) // k_ref != len(t_port) // k_port:
        return None
    return k_ref, k_port


def rounded_to(reference: list[float], port: list[float]) -> str | None:
    r"""The half-precision dtype (``bfloat16``, ``float16``) the port's values are the reference's rounded to,
    every one of them, when they are not already equal; ``None`` otherwise."""
    import torch

    if not reference or len(reference) != len(port):
        return None
    a, b = torch.tensor(reference, dtype=torch.float64), torch.tensor(port, dtype=torch.float64)
    if torch.equal(a, b):
        return None
    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(a.to(dtype).double(), b) or torch.equal(a.float().to(dtype).double(), b):
            return str(dtype).removeprefix("torch.")
    return None


def runs(indices: list[int]) -> str:
    r"""Call indices as runs: ``0-3, 7, 9-10``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def head(values: list[float | None], count: int = 6) -> str:
    shown = ", ".join(format_number(v, 6) for v in values[:count])
    return f"[{shown}{', …' if len(values) > count else ''}] ({len(values)})"


def first_tensor(call: Call) -> Any:
    return next((v for v in map(batch_of, call.named.values()) if v is not None), None)


def with_first_tensor(call: Call, value: Any) -> tuple[tuple, dict] | None:
    if value is None:
        return None
    name = next((k for k, v in call.named.items() if batch_of(v) is not None), None)
    if name is None or tuple(batch_of(call.named[name]).shape) != tuple(value.shape):
        return None
    return with_values(call, {name: in_form_of(call.named[name], value)})


def unclamped_affine(result: Any, decoded: Any) -> Any:
    r"""``result ≈ a · decoded + b`` over the elements strictly between the result's own extremes (a clamp to
    [0, 1] leaves its clipped elements at them); ``None`` when the shapes differ or too few are left."""
    import torch

    from paritykit.triage.fits import fit_linear

    if decoded is None or tuple(result.shape) != tuple(decoded.shape):
        return None
    r = result.detach().double()
    inside = (r > r.min()) & (r < r.max())
    if int(inside.sum()) < 16:
        return None
    values = decoded.detach().double()[inside]
    return fit_linear(r[inside], {"decoder output": values, "offset": torch.ones_like(values)})


def module_differs(report: Any, seen_differing: bool) -> bool:
    r"""Whether a module's bisect on one call's inputs puts the place's difference in that module, for every
    place that bisects a module (the denoiser, the decoder).

    Args:
        report: the module's :class:`~paritykit.bisection.results.BisectReport`.
        seen_differing: whether the recorded run saw this module's output differ while its inputs agreed.

    Returns:
        ``diverge``: yes; ``match``: no; ``masked`` (the output within bisect's tolerance while a submodule
        inside fails on identical inputs): yes when the run saw the output differ (the submodule explains
        it), no otherwise, and the rule-out line says what was masked (:func:`_masked_words`).
    """
    if report.verdict == "masked":
        return seen_differing
    return report.verdict != "match"


def masked_words(report: Any) -> str:
    if report.verdict != "masked":
        return ""
    inside = report.culprit or report.first_output_divergence
    where = f" ({inside.port or '(top)'})" if inside is not None else ""
    return f" (bisect: masked: a submodule{where} differs beyond tolerance inside it, not at its output)"


def identity(fit: Any) -> bool:
    scale, *shifts = fit.coefficients
    return abs(scale - 1) < 1e-6 and all(abs(s) < 1e-6 for s in shifts)


def bisect_finding(place: Place, call: int | None, report: Any, kept: list[str] | None = None) -> Finding:
    r"""A bisect report as triage's finding at ``place``; ``kept``: the port's arguments left its own (no
    reference input paired with them), said, and never called identical inputs."""
    culprit = report.culprit or report.first_output_divergence
    if culprit is None:
        return Finding(
            place,
            call,
            f"the port's {place} differs ({report.verdict}) but no module was named",
            details=report.to_dict(),
        )
    hints = list(culprit.hints)
    verified = next(
        (
            h
            for h in hints
            if getattr(h, "verified", None)
            and getattr(h, "fix", None)
            and h.evidence.get("in_run", True) is True  # a fix on the reference's inputs only is no fix here
        ),
        None,
    )
    first = hints[0].render() if hints else (culprit.note or "no cause named")
    # bisect named no culprit: the first module whose outputs differ is where the difference shows, not a
    # module that fails on its own (round 18: a Linear fed a differing table was called the culprit)
    named = report.culprit is not None
    evidence = [
        (
            f"{'culprit' if named else 'no culprit named; first aligned module whose outputs differ'}:"
            f" reference {culprit.reference or '(top)'} <-> port {culprit.port or '(top)'}"
            f" ({culprit.test}; max_abs {format_number(culprit.max_abs)}, cosine"
            f" {format_cosine(culprit.cosine)})"
        ),
        f"first hint: {first}",
    ]
    if getattr(culprit, "in_run", None) is not None:
        evidence.insert(
            1,
            f"in the run its outputs differ by max_abs {format_number(culprit.in_run)}, against"
            f" {format_number(culprit.max_abs)} on identical inputs: most of that difference reaches it with"
            " its inputs",
        )
    divergence = report.first_output_divergence
    if divergence is not None and divergence is not culprit and divergence.reference != culprit.reference:
        replayed = divergence.replayed
        own = (
            "not replayed"
            if replayed is None
            else f"it {'passes' if replayed[0] == 'pass' else 'fails'} on"
            f" {'the reference inputs it could be given' if replayed[2] else 'identical inputs'} (max_abs"
            f" {format_number(replayed[1])})"
        )
        evidence.append(
            f"first aligned module whose outputs differ: {divergence.reference or '(top)'} <->"
            f" {divergence.port or '(top)'} (max_abs {format_number(divergence.max_abs)}; {own})"
        )
    evidence += _further_culprits(report, culprit)
    fed = f" fed the reference's call-{call} inputs" if call is not None else " fed the reference's input"
    if kept:
        fed += f" but its own {', '.join(kept)} (no reference input paired with them)"
    later = " (not necessarily the first to differ in the run)"
    if not named:
        said = "bisect named no culprit; the first aligned module whose outputs differ"
    elif kept:
        said = "bisect's culprit, a module that differs on the inputs it was fed" + later
    elif getattr(culprit, "test", "replay") != "jump":  # replayed, or the top level fed the same inputs
        said = "bisect's culprit, a module that differs on identical inputs" + later
    else:  # found by comparing both runs' captured outputs: never fed identical inputs
        said = f"bisect's culprit, a module whose outputs differ in the two runs ({culprit.test}: not"
        said += " replayed on identical inputs)" + later
    return Finding(
        place,
        call,
        f"the port's {place},{fed}, differs from the reference's (bisect: {report.verdict}); {said}:"
        f" {culprit.port or '(top level)'}",
        evidence=evidence,
        fix=verified.fix if verified else None,
        fix_scope=verified.fix_scope() if verified else "",
        verified=verified is not None,
        details=report.to_dict(),
    )


# a rerun of the same module on the same recorded inputs is the same computation: beyond this relative
# difference from what the run recorded, the module handed over is not the one that ran
RERUN_MOVES = 1e-4


def rerun_moves(module: Any, call: Any) -> float | None:
    r"""How far ``module`` run again on ``call``'s recorded inputs lands from ``call``'s recorded output
    (relative), when beyond :data:`RERUN_MOVES`; ``None`` when it reproduces it, or when it cannot be run or
    compared (the bisect that follows says why)."""
    import torch

    from paritykit.base.inputs import map_tensors
    from paritykit.compare.tensors import relative_error
    from paritykit.tracing.recording import output_tensor

    recorded = output_tensor(call.output)
    if module is None or recorded is None or not recorded.is_floating_point():
        return None
    args, kwargs = map_tensors((call.args, call.kwargs), lambda t: t.clone())
    try:
        with torch.no_grad():
            again = output_tensor(module(*args, **kwargs))
    except Exception:  # the bisect runs it again and reports the failure in its own words
        return None
    if again is None or tuple(again.shape) != tuple(recorded.shape):
        return None
    moved = relative_error(again.to(recorded.device, recorded.dtype), recorded)
    return moved if moved > RERUN_MOVES else None


def _further_culprits(report: Any, first: Any) -> list[str]:
    r"""With bisect's every-culprit search (triage ``--all``): the culprits after the first, each found with
    the ones before it given the reference's outputs, by name (a module that differs on the inputs it was
    then fed), with the fixes verified there; then what the output does with all of them so given (the only
    count of culprits that is established)."""
    culprits = [c for c in getattr(report, "culprits", []) if c is not first]
    if not culprits:
        # where the search stopped short of a second culprit, it says why
        return [report.all_note] if getattr(report, "all_note", "") else []
    named = [f"{c.port or '(top)'} (max_abs {format_number(c.max_abs)})" for c in culprits[:6]]
    more = f" and {len(culprits) - 6} more" if len(culprits) > 6 else ""
    lines = [
        "further culprits, each found with the ones before it given the reference's outputs (each differs on"
        " the inputs it was then fed; the SPEC's `paritykit bisect --all` gives their hints): "
        + ", ".join(named)
        + more
    ]
    for c in culprits:
        fixed = next(
            (h for h in c.hints if h.verified and h.fix and h.evidence.get("in_run", True) is True), None
        )
        if fixed is not None:
            lines.append(f"fix (verified) at {c.port or '(top)'}: {fixed.fix}{fixed.fix_scope()}")
    if report.all_note:
        lines.append(report.all_note)
    return lines
