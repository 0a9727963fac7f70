r"""Schedule families: which closed form (linspace/leading/trailing spacing, Karras, exponential, flow shift)
a timestep or sigma list follows, with its fitted parameters."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from paritykit.base.report import format_number
from paritykit.schedule.load import (
    FAMILY_FIT,
    SIGMA_ATOL,
    SIGMA_RTOL,
    dedupe,
    timestep_atol,
)


# ============================================================================================================
# closed-form families a list may follow
# ============================================================================================================
def spacing_lists(n: int, train_steps: int) -> dict[str, list[float]]:
    r"""The timesteps diffusers' ``timestep_spacing`` values give for ``n`` steps (``steps_offset`` 0)."""
    import numpy as np

    ratio = train_steps // n if n else 1
    return {
        "leading": [float(v) for v in (np.arange(n) * ratio)[::-1]],
        "trailing": [float(v) for v in np.round(np.arange(train_steps, 0, -train_steps / n)) - 1],
        "linspace": [float(v) for v in np.linspace(0, train_steps - 1, n)[::-1]],
    }


def lists_close(
    a: Sequence[float], b: Sequence[float], kind: str, like: Sequence[float] | None = None
) -> bool:
    r"""Whether two lists agree value for value; timesteps at the scale of ``like`` (the whole list a value
    comes from, where single values are compared), else of ``b``."""
    if len(a) != len(b):
        return False
    if kind == "timesteps":
        atol = timestep_atol(b if like is None else like)
        return all(abs(x - y) <= atol for x, y in zip(a, b))
    return all(abs(x - y) <= SIGMA_ATOL + SIGMA_RTOL * abs(y) for x, y in zip(a, b))


@dataclass
class Family:
    r"""A closed form a list follows; ``generate(n)`` gives the same family at ``n`` steps."""

    name: str
    params: dict[str, float] = field(default_factory=dict)
    generate: Callable[[int], list[float]] | None = field(default=None, repr=False)
    # other closed forms the same list fits equally well (a list of whole numbers may be float linspace)
    alternatives: list[Callable[[int], list[float]]] = field(default_factory=list, repr=False)
    detail: str = ""

    def describe(self) -> str:
        extra = ", ".join(
            [*(f"{k} {format_number(v)}" for k, v in self.params.items()), *filter(None, [self.detail])]
        )
        return f"{self.name} ({extra})" if extra else self.name


def timestep_family(ts: Sequence[float], train_steps: int) -> Family | None:
    r"""Which spacing a timestep list follows: exact families first, then one with a constant offset."""
    n = len(ts)
    if n < 2:
        return None
    lists = spacing_lists(n, train_steps)
    integral = all(v == round(v) for v in ts)
    matching = [
        name
        for name, values in lists.items()
        if lists_close(ts, values, "timesteps")
        or lists_close(ts, [float(round(v)) for v in values], "timesteps")
    ]
    if matching:
        name = matching[0]
        # an integer list is read as the rounded family: at other counts it stays integer
        exact = not integral

        def generate(m: int, name=name, exact=exact) -> list[float]:
            vals = spacing_lists(m, train_steps)[name]
            return vals if exact else [float(round(v)) for v in vals]

        family = Family(
            f"{name} spacing" + ("" if exact or name != "linspace" else ", integer"), {}, generate
        )
        if not exact and name == "linspace":
            family.alternatives.append(lambda m, name=name: spacing_lists(m, train_steps)[name])
        if len(matching) > 1:
            # at this count several spacings give this list (every one of them at n = train_steps): the
            # recording cannot tell them apart, so none is named alone
            family.name = " / ".join(matching) + " spacing"
            family.detail = f"they give the same list at {n} of {train_steps} training steps"
            for other in matching[1:]:
                family.alternatives.append(lambda m, other=other: spacing_lists(m, train_steps)[other])
        return family
    for name, values in lists.items():
        shift = ts[-1] - values[-1]
        if shift and lists_close(ts, [v + shift for v in values], "timesteps"):

            def generate(m: int, name=name, shift=shift) -> list[float]:
                return [v + shift for v in spacing_lists(m, train_steps)[name]]

            return Family(f"{name} spacing + offset", {"offset": shift}, generate)
    return None


def _linear_residual(ys: Sequence[float]) -> float:
    r"""Largest deviation of ``ys`` from its least-squares line in the index, as a share of its range."""
    n = len(ys)
    mx = (n - 1) / 2
    my = sum(ys) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    slope = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx
    span = max(ys) - min(ys)
    if span == 0:
        return 0.0
    return max(abs(y - (my + slope * (i - mx))) for i, y in enumerate(ys)) / span


def _golden(f: Callable[[float], float], lo: float, hi: float, iters: int = 60) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(iters):
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def _best(f: Callable[[float], float], grid: Sequence[float]) -> float:
    i = min(range(len(grid)), key=lambda k: f(grid[k]))
    return _golden(f, grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)])


def _shift(u: float, s: float) -> float:
    return s * u / (1 + (s - 1) * u)


def _unshift(sigma: float, s: float) -> float:
    return sigma / (s - (s - 1) * sigma)


def flow_start(u_start: float, train_steps: int) -> str:
    r"""Where a flow schedule's unshifted range starts, in words: 1, or ``1 − 1/T`` (the first sigma of the
    training table ``1 − linspace(1, 1/T, T)``, where a research flow UniPC starts), or the number."""
    if abs(u_start - 1) <= 1e-5:
        return "1"
    if abs(u_start - (1 - 1 / train_steps)) <= 1e-5:
        return f"1 − 1/{train_steps}"
    return format_number(u_start)


def flow_end(
    u_end: float, n: int, shift: float, train_steps: int, u_start: float = 1.0
) -> tuple[str, Callable[[int], float]]:
    r"""Where a shifted flow schedule's *unshifted* linear range ends, as a rule for every step count.

    ``1/n``: ``linspace(1, 0, n + 1)`` without its final 0 (Flux's ``get_schedule``; diffusers' pipelines pass
    it as ``sigmas=np.linspace(1, 1/n, n)``). ``shift(1/T)``: the smallest sigma of the shifted training
    table, which is then shifted again (SD3's reference sampler reads its end from that table; diffusers'
    ``FlowMatchEulerDiscreteScheduler.set_timesteps(n)`` with a static shift does the same). ``1/T``: the
    unshifted table's end. Else a fixed end."""
    start = flow_start(u_start, train_steps)
    rules = (
        (f"({start})/n", u_start / n, lambda m: u_start / m),
        ("1/n", 1 / n, lambda m: 1 / m),
        (f"shift(1/{train_steps}) (the shift applied twice)", _shift(1 / train_steps, shift), None),
        (f"1/{train_steps}", 1 / train_steps, None),
    )
    for name, value, rule in rules:
        if abs(shift - 1) < 1e-3 and name.startswith("shift("):
            continue  # an unshifted schedule cannot tell "shifted twice" from 1/T
        if name.startswith("(") and abs(u_start - 1) <= 1e-5:
            continue  # from 1, (1)/n is 1/n
        if abs(u_end - value) <= 2e-4 * value:
            return name, rule or (lambda m, value=value: value)
    return format_number(u_end), lambda m: u_end


def sigma_family(sigmas: Sequence[float], train_steps: int = 1000) -> Family | None:
    r"""Karras (with its rho), exponential, or flow-matching (with its fitted shift and the rule its unshifted
    range ends by, :func:`flow_end`), else ``None``.

    Trailing zeros are set aside (``final sigma 0``) and regenerated.
    """
    tail = 0
    while tail < len(sigmas) and sigmas[len(sigmas) - 1 - tail] == 0:
        tail += 1
    pos = list(sigmas[: len(sigmas) - tail])
    if len(pos) < 3 or min(pos) <= 0 or any(b >= a for a, b in zip(pos, pos[1:])):
        return None
    zeros = [0.0] * tail
    smax, smin = pos[0], pos[-1]

    def lin(a: float, b: float, m: int) -> list[float]:
        return [a + (b - a) * i / (m - 1) for i in range(m)] if m > 1 else [a]

    # flow matching: sigma = shift(u, s) with u spaced linearly from u0 (1, or 1 − 1/T) to an end; s fitted by
    # least squares over the linearity of the unshifted times
    if 0.5 < smax <= 1 + 1e-5:

        def resid(log_s: float) -> float:
            return _linear_residual([_unshift(p, math.exp(log_s)) for p in pos])

        log_s = _best(resid, [math.log(v) for v in (0.1, 0.3, 0.5, 1, 2, 3, 5, 8, 12, 20, 40)])
        if resid(log_s) <= FAMILY_FIT:
            s = math.exp(log_s)
            u0 = _unshift(smax, s)
            start = flow_start(u0, train_steps)
            if start != format_number(u0):  # a named start: the exact value, not the fitted one
                u0 = 1.0 if start == "1" else 1 - 1 / train_steps
            end, end_at = flow_end(_unshift(smin, s), len(pos), s, train_steps, u0)
            if not end.startswith(
                "shift("
            ):  # the unshifted times are known: solve each for the shift exactly
                u = [u0 + (end_at(len(pos)) - u0) * i / (len(pos) - 1) for i in range(len(pos))]
                each = [p * (1 - x) / (x * (1 - p)) for p, x in zip(pos, u) if 0 < x < 1 and p < 1]
                if each and max(each) - min(each) <= 1e-6 * max(each):
                    s = sum(each) / len(each)
            s = round(s, 4) if abs(round(s, 4) - s) <= 1e-6 * s else s  # a float32 list carries ~1e-7

            def generate(m: int) -> list[float]:
                return [_shift(u, s) for u in lin(u0, end_at(m), m)] + zeros

            name = "flow-matching, shifted" if abs(s - 1) > 1e-3 else "flow-matching, linear"
            return Family(name, {"shift": s}, generate, detail=f"unshifted t from {start} to {end}")
    if _linear_residual([math.log(p) for p in pos]) <= FAMILY_FIT:

        def generate(m: int) -> list[float]:
            return [math.exp(v) for v in lin(math.log(smax), math.log(smin), m)] + zeros

        return Family("exponential", {"sigma_min": smin, "sigma_max": smax}, generate)

    def resid_rho(rho: float) -> float:
        return _linear_residual([p ** (1 / rho) for p in pos])

    rho = _best(resid_rho, [1, 2, 3, 4, 5, 6, 7, 8, 10, 14, 20, 30])
    if resid_rho(rho) <= FAMILY_FIT:
        rho = float(round(rho)) if resid_rho(float(round(rho))) <= FAMILY_FIT else rho

        def generate(m: int) -> list[float]:
            a, b = smax ** (1 / rho), smin ** (1 / rho)
            return [v**rho for v in lin(a, b, m)] + zeros

        return Family("Karras", {"rho": rho, "sigma_min": smin, "sigma_max": smax}, generate)
    return vp_sigma_family(pos, train_steps, tail)


# ------------------------------------------------------------------------------------------ VP (DDPM) sigmas
def vp_training_sigmas(beta_start: float, beta_end: float, kind: str, train_steps: int) -> list[float]:
    r"""``sqrt((1 - ᾱ_t) / ᾱ_t)`` for t = 0 … T-1, with the betas ``linear`` (DDPM) or ``scaled_linear``
    (Stable Diffusion: linear in sqrt(β))."""
    import numpy as np

    if kind == "scaled_linear":
        betas = np.linspace(beta_start**0.5, beta_end**0.5, train_steps, dtype=np.float64) ** 2
    else:
        betas = np.linspace(beta_start, beta_end, train_steps, dtype=np.float64)
    alphas = np.cumprod(1.0 - betas)
    return list(((1 - alphas) / alphas) ** 0.5)


def _vp_at(table: list[float], timesteps: list[float]) -> list[float]:
    import numpy as np

    return list(np.interp(timesteps, np.arange(len(table)), table))


def vp_sigma_family(pos: Sequence[float], train_steps: int, tail: int = 0) -> Family | None:
    r"""A VP (DDPM) schedule's sigmas: a beta schedule (``linear`` or ``scaled_linear``, β_start and β_end
    fitted by least squares on log σ) read at the timesteps of a spacing (``leading`` / ``trailing`` /
    ``linspace``, with an offset), each combination fitted and the best kept when it reproduces the list."""
    n = len(pos)
    if n < 3 or pos[0] < 1.0:
        return None
    logs = [math.log(p) for p in pos]
    best: tuple[float, str, str, float, float, int] | None = None
    for kind in ("scaled_linear", "linear"):
        for spacing in ("leading", "trailing", "linspace"):
            for offset in (0, 1):
                timesteps = [min(t + offset, train_steps - 1) for t in spacing_lists(n, train_steps)[spacing]]

                def squares(v: Sequence[float], kind=kind, timesteps=timesteps) -> float:
                    got = _vp_at(
                        vp_training_sigmas(math.exp(v[0]), math.exp(v[1]), kind, train_steps), timesteps
                    )
                    return sum((math.log(max(g, 1e-30)) - want) ** 2 for g, want in zip(got, logs))

                lb0, lb1 = _nelder_mead(squares, [math.log(1e-3), math.log(1.2e-2)])
                b0, b1 = _snap_beta(math.exp(lb0)), _snap_beta(math.exp(lb1))
                got = _vp_at(vp_training_sigmas(b0, b1, kind, train_steps), timesteps)
                residual = max(abs(math.log(max(g, 1e-30)) - want) for g, want in zip(got, logs))
                if best is None or residual < best[0]:
                    best = (residual, kind, spacing, b0, b1, offset)
    if best is None or best[0] > 1e-3:
        return None
    residual, kind, spacing, b0, b1, offset = best
    zeros = [0.0] * tail

    def generate(m: int) -> list[float]:
        ts = [min(t + offset, train_steps - 1) for t in spacing_lists(m, train_steps)[spacing]]
        return _vp_at(vp_training_sigmas(b0, b1, kind, train_steps), ts) + zeros

    detail = f"{kind} betas, {spacing} spacing" + (f", steps offset {offset}" if offset else "")
    return Family("VP (DDPM) sigmas", {"beta_start": b0, "beta_end": b1}, generate, detail=detail)


def _nelder_mead(f: Callable[[Sequence[float]], float], start: list[float], iters: int = 200) -> list[float]:
    r"""A small Nelder–Mead minimiser (2 parameters here; no scipy at run time)."""
    simplex = [list(start)] + [
        [v + (0.5 if i == j else 0.0) for j, v in enumerate(start)] for i in range(len(start))
    ]
    values = [f(p) for p in simplex]
    for _ in range(iters):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centre = [sum(p[j] for p in simplex[:-1]) / (len(simplex) - 1) for j in range(len(start))]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centre, worst)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centre, worst)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centre, worst)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, p)] for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
        if max(values) - min(values) < 1e-14:
            break
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


def _snap_beta(value: float) -> float:
    r"""β as written in configs (0.00085, 0.012, 0.0001, 0.02) when within 0.5 % of one."""
    for candidate in (float(f"{value:.2g}"), float(f"{value:.1g}")):
        if abs(candidate - value) <= 5e-3 * value:
            return candidate
    return value


def flow_timestep_family(ts: Sequence[float], train_steps: int) -> Family | None:
    r"""A flow-matching schedule given as timesteps: ``t = scale · sigma`` with the sigmas one of
    :func:`sigma_family`'s closed forms, ``scale`` the training length (timesteps in [0, T]) or 1 (a list
    of sigmas read as timesteps)."""
    if not ts or ts[0] <= 0:
        return None
    for scale in (float(train_steps), 1.0):
        if abs(ts[0] / scale - 1) > 1e-5:
            continue
        family = sigma_family([t / scale for t in ts], train_steps)
        if family is None or not family.name.startswith("flow"):
            continue
        inner = family.generate

        def generate(m: int, inner=inner, scale=scale) -> list[float]:
            return [scale * v for v in inner(m)] if inner is not None else []

        unit = (
            f"timesteps = {format_number(scale)} × sigma"
            if scale != 1.0
            # a list in [0, 1] reads as flow sigmas as well as continuous times: the list cannot tell which
            else "the values read as sigmas; a continuous time t in [0, 1] reads the same, and which of the"
            " two the denoiser expects is not read from the list"
        )
        detail = f"{family.detail}; {unit}" if family.detail else unit
        return Family(family.name, dict(family.params), generate, detail=detail)
    return None


def family_of(kind: str, values: Sequence[float] | None, train_steps: int) -> Family | None:
    if values is None:
        return None
    values = dedupe(values)
    if kind == "timesteps":
        return timestep_family(values, train_steps) or flow_timestep_family(values, train_steps)
    return sigma_family(values, train_steps)
