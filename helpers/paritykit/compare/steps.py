r"""Per-step error curves of two denoising runs.

A question a port meets after its components pass (the other, "does the output look the same?", is
:mod:`paritykit.compare.images`):

* **How does the error evolve over the denoising loop?** :func:`step_curve` reads the ``after_step_{i}``
  checkpoints that :func:`paritykit.save_checkpoints` wrote for each side, measures every step, and classifies
  the growth as ``bounded``, ``polynomial`` (with its exponent) or ``exponential``. Given the scheduler's
  sigmas it also shows the ``1/σ`` amplification of Euler / flow-matching steps (``v = (x - x0) / σ``), which
  turns a tiny early difference into a large late one.

torch, numpy and matplotlib are imported inside the functions that need them, so importing this module is
cheap."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.files import check_sides, refuse_overwriting_an_input, same_path_warning, save_figure
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, format_cosine, format_number, render_table

# --- growth classification thresholds (quoted by `paritykit steps --help`)
# -------------------------------------
#: bounded when the fitted error grows less than this factor from the first to the last step ...
BOUNDED_MAX_GROWTH = 2.0
#: ... or when, over the last half of the steps, it grows less than this factor (the error has levelled off).
BOUNDED_MAX_LATE_GROWTH = 1.25
#: exponential needs a per-step factor of at least this in the fit of log(error) against step ...
EXPONENTIAL_MIN_FACTOR = 1.1
#: ... a fit that explains log(error) this well (R²) ...
EXPONENTIAL_MIN_R2 = 0.9
#: ... and that fits at least as well as a power law log(error) ~ p·log(step + 1).

GROWTH_HELP = (
    "Growth: fit log(max_abs) against the step. 'bounded' when the fitted error grows less than"
    f" {BOUNDED_MAX_GROWTH:g}x over the run or less than {BOUNDED_MAX_LATE_GROWTH:g}x over its last half;"
    f" 'exponential' when it grows by at least {EXPONENTIAL_MIN_FACTOR:g}x per step, that fit has R^2 >="
    f" {EXPONENTIAL_MIN_R2:g} and it beats a power law in the step; otherwise 'polynomial' (error ~ step^p,"
    " the fitted exponent p reported). All-zero errors are 'bounded'; fewer than 3 non-zero steps give"
    " 'unknown'."
)

# after_step_<i> from a pipeline's checkpoints, step_<i> from paritykit.record_loop
_STEP_NAME = re.compile(r"^(?:after_)?step_(\d+)$")
TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".npy", ".npz")


# ============================================================================================================
# growth classification
# ============================================================================================================
@dataclass
class GrowthFit:
    r"""How an error series grows with the step, from least-squares fits of ``log(error)``.

    Attributes:
        growth: ``"bounded"``, ``"polynomial"``, ``"exponential"`` or ``"unknown"`` (see :data:`GROWTH_HELP`).
        per_step_factor: ``exp(slope)`` of ``log(error)`` against the step index.
        total_growth: fitted error at the last step over fitted error at the first step.
        late_growth: the same over the last half of the steps.
        power_exponent: ``p`` of the power-law fit ``error ~ (step + 1) ** p``.
        r2_exponential / r2_power: how well each fit explains ``log(error)``.
        points: number of steps with a finite, non-zero error used by the fits.
        reason: why the class was chosen, in one sentence.
    """

    growth: str
    per_step_factor: float | None = None
    total_growth: float | None = None
    late_growth: float | None = None
    power_exponent: float | None = None
    r2_exponential: float | None = None
    r2_power: float | None = None
    points: int = 0
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": self.growth,
            "per_step_factor": self.per_step_factor,
            "total_growth": self.total_growth,
            "late_growth": self.late_growth,
            "power_exponent": self.power_exponent,
            "r2_exponential": self.r2_exponential,
            "r2_power": self.r2_power,
            "points": self.points,
            "reason": self.reason,
            "thresholds": {
                "bounded_max_growth": BOUNDED_MAX_GROWTH,
                "bounded_max_late_growth": BOUNDED_MAX_LATE_GROWTH,
                "exponential_min_factor": EXPONENTIAL_MIN_FACTOR,
                "exponential_min_r2": EXPONENTIAL_MIN_R2,
            },
        }


def _line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b, r2)`` (r2 = 1 when ``y`` is constant)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    b = sxy / sxx if sxx > 0 else 0.0
    a = my - b * mx
    if syy <= 1e-24:
        return a, b, 1.0
    resid = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    return a, b, max(0.0, 1.0 - resid / syy)


def classify_growth(errors: Sequence[float | None], steps: Sequence[int] | None = None) -> GrowthFit:
    r"""Classify how a per-step error series grows: ``bounded``, ``polynomial`` (with its exponent) or
    ``exponential``.

    Fits ``log(error)`` against the step (exponential model) and against ``log(step + 1)`` (power law), using
    the steps whose error is finite and non-zero.

    * ``bounded``: the exponential fit grows less than :data:`BOUNDED_MAX_GROWTH` (2×) from first to last
      step, or less than :data:`BOUNDED_MAX_LATE_GROWTH` (1.25×) over the last half of the steps (it levelled
      off). A shrinking error is bounded; so is an all-zero series.
    * ``exponential``: per-step factor ≥ :data:`EXPONENTIAL_MIN_FACTOR` (1.1×), R² ≥
      :data:`EXPONENTIAL_MIN_R2` (0.9), and the exponential fit is at least as good as the power law.
    * ``polynomial``: anything else that grows — error ~ step^p, ``power_exponent`` is the fitted p (so a
      ``step^2.74`` curve is never called linear).
    * ``unknown``: fewer than 3 usable steps, or a non-finite error at the last step.

    Args:
        errors: one error per step (``None``/NaN for steps that could not be measured).
        steps: the step indices (default ``0, 1, 2, …``).
    """
    steps = list(range(len(errors))) if steps is None else list(steps)
    if errors and (errors[-1] is None or not math.isfinite(errors[-1])):
        return GrowthFit("unknown", reason="the last step's error is not finite")
    points = [(s, e) for s, e in zip(steps, errors) if e is not None and math.isfinite(e) and e > 0]
    if errors and all(e == 0 for e in errors):
        return GrowthFit("bounded", total_growth=1.0, late_growth=1.0, reason="every step is identical")
    if len(points) < 3:
        return GrowthFit("unknown", points=len(points), reason="fewer than 3 steps with a non-zero error")

    xs = [float(s) for s, _ in points]
    ys = [math.log(e) for _, e in points]
    _, slope, r2_exp = _line_fit(xs, ys)
    _, power, r2_pow = _line_fit([math.log(x + 1.0) for x in xs], ys)
    span = xs[-1] - xs[0]
    total = math.exp(min(slope * span, 700.0))
    half = points[len(points) // 2 :] if len(points) >= 6 else points
    _, late_slope, _ = _line_fit([float(s) for s, _ in half], [math.log(e) for _, e in half])
    late = math.exp(min(late_slope * (half[-1][0] - half[0][0]), 700.0))
    factor = math.exp(min(slope, 700.0))
    fit = GrowthFit(
        "polynomial",
        per_step_factor=factor,
        total_growth=total,
        late_growth=late,
        power_exponent=power,
        r2_exponential=r2_exp,
        r2_power=r2_pow,
        points=len(points),
    )
    if total < BOUNDED_MAX_GROWTH or late < BOUNDED_MAX_LATE_GROWTH:
        fit.growth = "bounded"
        if total >= BOUNDED_MAX_GROWTH:
            fit.reason = (
                f"the fitted error grows {total:.3g}x over the run but only {late:.3g}x over its last half"
            )
        elif total < 1:
            fit.reason = f"the fitted error shrinks to {total:.3g}x of its first value over the run"
        else:
            fit.reason = f"the fitted error grows only {total:.3g}x over the run"
    elif factor >= EXPONENTIAL_MIN_FACTOR and r2_exp >= EXPONENTIAL_MIN_R2 and r2_exp >= r2_pow:
        fit.growth = "exponential"
        fit.reason = f"the error grows {factor:.3g}x per step (R² {r2_exp:.3f} vs power law {r2_pow:.3f})"
    else:
        fit.reason = f"the error grows like step^{power:.2f} (R² {r2_pow:.3f}), {total:.3g}x over the run"
    return fit


# ============================================================================================================
# step curves
# ============================================================================================================
@dataclass
class StepPoint:
    r"""Error between the two runs after one denoising step."""

    step: int
    status: str  # "pass" | "fail" | "shape_mismatch"
    max_abs: float | None
    mean_abs: float | None
    cosine: float | None
    sigma: float | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def inv_sigma(self) -> float | None:
        if self.sigma is None:
            return None
        return math.inf if self.sigma == 0 else 1.0 / self.sigma

    @property
    def max_abs_times_sigma(self) -> float | None:
        """The error with the ``1/σ`` amplification factored out."""
        if self.sigma is None or self.max_abs is None:
            return None
        return self.max_abs * self.sigma

    def to_dict(self) -> dict[str, Any]:
        out = {
            "step": self.step,
            "status": self.status,
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
            "cosine": self.cosine,
        }
        if self.sigma is not None:
            out.update(
                sigma=self.sigma, inv_sigma=self.inv_sigma, max_abs_times_sigma=self.max_abs_times_sigma
            )
        return out


@dataclass
class StepCurve:
    r"""Per-step error between two denoising runs; one object renders as a table, as JSON and as a plot.

    ``exit_code`` is 0 when the last step is within tolerance (and both runs have the same steps), else 1.
    """

    a: str
    b: str
    key: str
    points: list[StepPoint]
    growth: GrowthFit
    atol: float | None = None
    rtol: float | None = None
    sigma_scaled_growth: GrowthFit | None = None
    sigmas_source: str | None = None
    only_a: list[int] = field(default_factory=list)
    only_b: list[int] = field(default_factory=list)
    first_failing_step: int | None = None
    hints: list[dict[str, Any]] = field(default_factory=list)
    plot_path: str | None = None
    dtypes: tuple[str, str] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def last(self) -> StepPoint:
        return self.points[-1]

    @property
    def passed(self) -> bool:
        return self.last.passed and not self.only_a and not self.only_b

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def amplification_explains_growth(self) -> bool | None:
        """True when the error grows but, with ``1/σ`` factored out, it is bounded (pitfall 13)."""
        if self.sigma_scaled_growth is None:
            return None
        return (
            self.growth.growth in ("polynomial", "exponential")
            and self.sigma_scaled_growth.growth == "bounded"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "steps",
            "a": self.a,
            "b": self.b,
            "key": self.key,
            "passed": self.passed,
            "verdict": "match" if self.passed else "diverge",
            "last_step": self.last.to_dict(),
            "first_failing_step": self.first_failing_step,
            "atol": self.atol,
            "rtol": self.rtol,
            "growth": self.growth.to_dict(),
            "sigmas": self.sigmas_source,
            "sigma_scaled_growth": self.sigma_scaled_growth.to_dict() if self.sigma_scaled_growth else None,
            "amplification_explains_growth": self.amplification_explains_growth(),
            "hints": self.hints,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "steps": [p.to_dict() for p in self.points],
            "plot": self.plot_path,
            "dtype_a": self.dtypes[0] if self.dtypes else None,
            "dtype_b": self.dtypes[1] if self.dtypes else None,
            "warnings": list(self.warnings),
            "environment": environment_stamp(
                device="cpu", dtype=None if not self.dtypes else "/".join(dict.fromkeys(self.dtypes))
            ),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        with_sigma = self.sigmas_source is not None
        headers = ["step", "status", "max_abs", "mean_abs", "cosine"]
        if with_sigma:
            headers += ["sigma", "1/sigma", "max_abs*sigma"]
        rows = []
        for p in self.points:
            row = [str(p.step), p.status, p.max_abs, p.mean_abs, format_cosine(p.cosine)]
            if with_sigma:
                row += [p.sigma, p.inv_sigma, p.max_abs_times_sigma]
            rows.append(row)
        lines = [f"steps: {self.a} vs {self.b} (key {self.key!r}, {len(self.points)} steps)"]
        lines += self._answer()
        if limit and len(rows) > limit:
            # the last steps matter most: keep both ends, elide the middle
            tail = max(1, limit // 2)
            head = limit - tail
            hidden = len(rows) - limit
            gap = ["…", f"{hidden} more"] + [""] * (len(headers) - 2)
            rows = rows[:head] + [gap] + rows[-tail:]
            lines.append(render_table(headers, rows, limit=None))
            lines.append("(raise --limit, or use --json for every step)")
        else:
            lines.append(render_table(headers, rows, limit=limit))
        if self.sigma_scaled_growth is not None:
            s = self.sigma_scaled_growth
            lines.append(f"with 1/sigma factored out (max_abs*sigma): {s.growth} — {s.reason}")
            if self.amplification_explains_growth():
                lines.append(
                    "the growth is what 1/sigma amplification does to a fixed early difference: "
                    "look for the first step's cause (noise/latent dtype, timestep dtype), not a loop bug"
                )
        if self.only_a or self.only_b:
            lines.append(f"steps only in A: {self.only_a or '-'}; only in B: {self.only_b or '-'}")
        if self.hints:
            lines.append(f"hints at step {self.first_failing_step}:")
            lines += [f"  [{h.get('id')}] {h.get('message')}" for h in self.hints]
        if self.plot_path:
            lines.append(f"plot: {self.plot_path}")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _answer(self) -> list[str]:
        r"""The verdict first: the last step against tolerance (and the first failing step), then how the
        error grows."""
        last = self.last
        tol = f"atol {format_number(self.atol)}, rtol {format_number(self.rtol)}"
        verdict = "within tolerance" if last.passed else "OUTSIDE tolerance"
        g = self.growth
        label = f"polynomial (step^{g.power_exponent:.2f})" if g.growth == "polynomial" else g.growth
        return [
            f"last step {last.step}: max_abs {format_number(last.max_abs)} — {verdict} ({tol})"
            + ("" if self.first_failing_step is None else f"; first failing step {self.first_failing_step}"),
            f"growth: {label} — {g.reason}",
        ]

    def plot(self, path: str | Path) -> Path:
        r"""Write the curve as a PNG (log y): max_abs and mean_abs per step, ``max_abs·σ`` and ``1/σ`` with
        sigmas."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = Path(path)
        fig = Figure(figsize=(7.5, 4.5), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        steps = [p.step for p in self.points]

        def positive(values):
            return [v if v is not None and math.isfinite(v) and v > 0 else float("nan") for v in values]

        series = positive([p.max_abs for p in self.points])
        any_data = any(not math.isnan(v) for v in series)
        ax.plot(steps, series, marker="o", label="max |a-b|")
        ax.plot(steps, positive([p.mean_abs for p in self.points]), marker=".", label="mean |a-b|")
        if self.sigmas_source is not None:
            ax.plot(
                steps, positive([p.max_abs_times_sigma for p in self.points]), ls="--", label="max |a-b| · σ"
            )
            twin = ax.twinx()
            twin.plot(steps, positive([p.inv_sigma for p in self.points]), color="grey", ls=":", label="1/σ")
            twin.set_yscale("log")
            twin.set_ylabel("1/σ (amplification)")
            twin.legend(loc="lower right")
        if self.atol:
            ax.axhline(self.atol, color="red", lw=0.8, ls="--", label=f"atol {self.atol:.1e}")
        if any_data:
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "identical at every step (zero error)", ha="center", transform=ax.transAxes)
        ax.set_xlabel("step")
        ax.set_ylabel(f"error in {self.key!r}")
        ax.set_title(f"{self.key}: growth {self.growth.growth}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left")
        fig.tight_layout()
        save_figure(fig, path, format="png")
        self.plot_path = str(path)
        return path


def _step_files(folder: str | Path) -> dict[int, Path]:
    folder = Path(folder)
    if not folder.exists():
        raise ParityKitError(f"{folder}: no such checkpoint folder")
    if not folder.is_dir():
        raise ParityKitError(
            f"{folder}: not a folder (expected after_step_<i> checkpoints from save_checkpoints)"
        )
    found: dict[int, Path] = {}
    if (folder / "paritykit.json").is_file():
        from paritykit.base.io import read_manifest

        for entry in read_manifest(folder)["checkpoints"]:
            match = _STEP_NAME.match(str(entry.get("name", "")))
            if match:
                found[int(match.group(1))] = folder / entry["file"]
    else:  # a folder of after_step_<i> tensor files (or sub-folders) written some other way
        for entry in folder.iterdir():
            stem = entry.name
            suffix = next((s for s in TENSOR_SUFFIXES if stem.endswith(s)), None)
            if suffix:
                stem = stem[: -len(suffix)]
            elif not entry.is_dir():
                continue
            match = _STEP_NAME.match(stem)
            if match:
                found[int(match.group(1))] = entry
    if not found:
        raise ParityKitError(
            f"{folder}: no after_step_<i> checkpoints (save them with paritykit.save_checkpoints)"
        )
    return dict(sorted(found.items()))


def _load_step_tensor(path: Path, key: str):
    if path.suffix == ".safetensors" and path.is_file():
        # read only the one tensor: checkpoints often hold more (noise_pred, timesteps, …)
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                if key in f.keys():
                    return f.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ParityKitError(f"{path}: not a readable safetensors file ({exc})") from None
    from paritykit.base.io import load_tensors

    tensors = load_tensors(path)
    stem = path.name
    for suffix in TENSOR_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    for name in (f"{stem}/{key}", key):
        if name in tensors:
            return tensors[name]
    tails = [n for n in tensors if n.rsplit("/", 1)[-1] == key]
    if len(tails) == 1:
        return tensors[tails[0]]
    if list(tensors) == [stem]:  # a bare tensor saved as after_step_<i>.pt / .npy: it is the key's value
        return tensors[stem]
    have = ", ".join(n.rsplit("/", 1)[-1] for n in tensors) or "nothing"
    raise ParityKitError(
        f"{path}: no tensor {key!r} in this checkpoint (it has: {have}); choose one with --key"
    )


def load_sigmas(source: Any) -> list[float]:
    r"""Read a sigma schedule: a list/array/tensor, or a file (``.json`` list or ``{"sigmas": [...]}``,
    ``.txt``/ ``.csv`` numbers, ``.npy``, or a tensor file holding one tensor or one named ``sigmas``)."""
    label = str(source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ParityKitError(f"{path}: no such sigmas file")
        suffix = path.suffix.lower()
        try:
            if suffix == ".json":
                data = json.loads(path.read_text())
                if isinstance(data, dict):
                    data = data.get("sigmas")
                values = data
            elif suffix in (".txt", ".csv", ""):
                values = [float(t) for t in re.split(r"[\s,;]+", path.read_text().strip()) if t]
            elif suffix == ".npy":
                import numpy as np

                values = np.load(path, allow_pickle=False)
            else:
                from paritykit.base.io import load_tensors

                tensors = load_tensors(path)
                named = [n for n in tensors if n.rsplit("/", 1)[-1] == "sigmas"]
                if len(tensors) == 1:
                    values = next(iter(tensors.values()))
                elif len(named) == 1:
                    values = tensors[named[0]]
                else:
                    raise ParityKitError(
                        f"{path}: holds {len(tensors)} tensors; expected one, or one named 'sigmas'"
                    )
        except ParityKitError:
            raise
        except (ValueError, OSError, json.JSONDecodeError) as exc:
            raise ParityKitError(f"{path}: cannot read sigmas ({exc})") from None
    else:
        values = source
    try:
        if hasattr(values, "detach"):
            values = values.detach().double().cpu().reshape(-1).tolist()
        elif hasattr(values, "tolist"):
            values = values.reshape(-1).tolist()
        sigmas = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ParityKitError(f"{label}: sigmas must be a flat list of numbers") from None
    if not sigmas or any(not math.isfinite(s) or s < 0 for s in sigmas):
        raise ParityKitError(f"{label}: sigmas must be a non-empty list of finite, non-negative numbers")
    return sigmas


def step_curve(
    a_dir: str | Path,
    b_dir: str | Path,
    *,
    key: str = "latents",
    sigmas: Any = None,
    atol: float | None = None,
    rtol: float | None = None,
    plot: str | Path | None = None,
) -> StepCurve:
    r"""Measure two denoising runs step by step from their ``after_step_{i}`` checkpoints.

    Each folder is what :func:`paritykit.save_checkpoints` wrote (one ``after_step_{i}.safetensors`` per
    step); the tensor ``key`` is compared at every step present on both sides, one step in memory at a time.

    Args:
        a_dir: the reference run's checkpoint folder.
        b_dir: the port's checkpoint folder.
        key: which tensor of each checkpoint to compare (default ``latents``).
        sigmas: the noise level of each step — a list/array/tensor or a ``.json``/``.txt``/``.npy``/tensor
            file; step ``i`` uses ``sigmas[i]`` (the σ the model ran at in that step; a trailing extra entry,
            e.g. the final 0 of ``scheduler.sigmas``, is ignored). Adds ``1/σ`` and ``max_abs·σ`` columns and
            the growth of the σ-scaled error: if that is bounded, the growth is ``1/σ`` amplification of an
            early difference.
        atol, rtol: tolerance for the per-step verdict (default: from the dtypes, as in ``paritykit
        compare``).
        plot: if given, also write the PNG there.

    Returns:
        A :class:`StepCurve`: ``exit_code`` 0 when the last step is within tolerance, else 1. The growth class
        and its thresholds are described by :func:`classify_growth`.
    """
    check_sides(a_dir, b_dir)
    from paritykit.compare.tensors import compare_tensors

    refuse_overwriting_an_input("--plot", plot, sigmas)
    files_a, files_b = _step_files(a_dir), _step_files(b_dir)
    common = [s for s in files_a if s in files_b]
    if not common:
        raise ParityKitError(f"{a_dir} and {b_dir}: no after_step_<i> checkpoint in common")
    sigma_values = load_sigmas(sigmas) if sigmas is not None else None
    if sigma_values is not None and len(sigma_values) <= common[-1]:
        raise ParityKitError(
            f"{sigmas}: {len(sigma_values)} sigmas, but the runs reach step {common[-1]} "
            f"(need at least {common[-1] + 1})"
        )

    points: list[StepPoint] = []
    first_fail: int | None = None
    hints: list[dict[str, Any]] = []
    used_atol, used_rtol = atol, rtol
    for step in common:
        ta = _load_step_tensor(files_a[step], key)
        tb = _load_step_tensor(files_b[step], key)
        cmp = compare_tensors(ta, tb, atol=atol, rtol=rtol, name=f"after_step_{step}/{key}", diagnose=False)
        used_atol, used_rtol = cmp.atol, cmp.rtol
        dtypes = (str(cmp.dtype_a).replace("torch.", ""), str(cmp.dtype_b).replace("torch.", ""))
        sigma = sigma_values[step] if sigma_values is not None else None
        if cmp.status == "shape_mismatch":
            point = StepPoint(step, "shape_mismatch", None, None, None, sigma)
        else:
            point = StepPoint(
                step, cmp.status, _float(cmp.max_abs), _float(cmp.mean_abs), _float(cmp.cosine), sigma
            )
        points.append(point)
        if first_fail is None and not point.passed:
            first_fail = step
            if point.status != "shape_mismatch":
                from paritykit.compare.diagnose import diagnose

                hints = [h.to_dict() for h in diagnose(ta, tb)]

    curve = StepCurve(
        a=str(a_dir),
        b=str(b_dir),
        key=key,
        points=points,
        growth=classify_growth([p.max_abs for p in points], [p.step for p in points]),
        atol=used_atol,
        rtol=used_rtol,
        sigmas_source=(
            None if sigmas is None else (str(sigmas) if isinstance(sigmas, (str, Path)) else "given")
        ),
        only_a=[s for s in files_a if s not in files_b],
        only_b=[s for s in files_b if s not in files_a],
        first_failing_step=first_fail,
        hints=hints,
        dtypes=dtypes,
        warnings=list(filter(None, [same_path_warning(a_dir, b_dir)])),
    )
    if sigma_values is not None:
        curve.sigma_scaled_growth = classify_growth(
            [p.max_abs_times_sigma for p in points], [p.step for p in points]
        )
    if plot is not None:
        curve.plot(plot)
    return curve


def _float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)
