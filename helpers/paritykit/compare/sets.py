r"""Comparing many tensors at once: named sets, checkpoint folders, nested model outputs
(``assert_parity``)."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import ParityKitError
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table
from paritykit.compare.tensors import TensorComparison, as_tensor, compare_tensors

if TYPE_CHECKING:
    import torch


@dataclass
class SetComparison:
    r"""Named tensors of A against those of B: pairs in A's order, names present on one side only.

    ``first_divergence`` is the first pair (in order) that is not ``pass``; with checkpoint folders the order
    is execution order, so it names where the two runs part ways.
    """

    pairs: list[TensorComparison] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    value_diffs: list[dict[str, Any]] = field(default_factory=list)
    atol: float | None = None
    rtol: float | None = None
    source_a: str | None = None
    source_b: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> str | None:
        return next((p.name for p in self.pairs if not p.passed), None)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.pairs) and not (self.only_a or self.only_b or self.value_diffs)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def pair(self, name: str) -> TensorComparison:
        return next(p for p in self.pairs if p.name == name)

    def counts(self) -> dict[str, int]:
        statuses = [p.status for p in self.pairs]
        return {
            "pairs": len(self.pairs),
            "pass": statuses.count("pass"),
            "fail": statuses.count("fail"),
            "shape_mismatch": statuses.count("shape_mismatch"),
            "only_a": len(self.only_a),
            "only_b": len(self.only_b),
            "value_diffs": len(self.value_diffs),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.source_a,
            "b": self.source_b,
            "tolerance": {
                "atol": self.atol,
                "rtol": self.rtol,
                "default": "per dtype, torch.testing's table",
            },
            "passed": self.passed,
            "summary": self.counts(),
            "pairs": [p.to_dict() for p in self.pairs],
            "only_a": list(self.only_a),
            "only_b": list(self.only_b),
            "value_diffs": list(self.value_diffs),
            "first_divergence": self.first_divergence,
            "warnings": list(self.warnings),
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        headers = ["name", "status", "max_abs", "mean_abs", "cosine", "mismatch", "head A", "head B"]
        c = self.counts()
        summary = (
            f"{c['pairs']} pairs: {c['pass']} pass, {c['fail']} fail, {c['shape_mismatch']} shape mismatch"
        )
        if any(p.passed_by_oracle for p in self.pairs):
            summary += " (pass* = outside tolerance, within the fp64-oracle rule)"
        first = self.first_divergence
        others = [f"{len(names)} only in {side}" for side, names in (("A", self.only_a), ("B", self.only_b))]
        others = [p for p in [*others, f"{len(self.value_diffs)} values differ"] if not p.startswith("0 ")]
        if first is not None:
            worst = self.pair(first)
            differ = c["fail"] + c["shape_mismatch"]
            answer = f"verdict: {differ} of {c['pairs']} pairs differ; first divergence: {first}"
            if getattr(worst, "max_abs", None) is not None:
                answer += f" (max_abs {format_number(worst.max_abs)})"
            answer += f"; also {', '.join(others)}" if others else ""
        elif self.passed:
            answer = f"verdict: all {c['pairs']} pairs match"
        else:
            answer = f"verdict: differ ({', '.join(others) or 'see below'})"
        lines = [
            answer,
            render_table(headers, [p.table_row() for p in self.pairs], limit=limit, summary=summary),
        ]
        for p in self.pairs:
            if p.status == "shape_mismatch":
                lines.append(
                    f"shape mismatch: {p.name}: A {p.shape_a} vs B {p.shape_b}"
                    + (f"; {p.note}" if p.note else "")
                )
            elif p.note:
                lines.append(f"note: {p.name}: {p.note}")
        for label, names in (("only in A", self.only_a), ("only in B", self.only_b)):
            if names:
                shown = names if not limit else names[:limit]
                more = f", … {len(names) - len(shown)} more" if len(shown) < len(names) else ""
                lines.append(f"{label} ({len(names)}): {', '.join(shown)}{more}")
        for diff in self.value_diffs[: limit or None]:
            lines.append(f"value differs: {diff['name']}: A={diff['a']} B={diff['b']}")
        if first is not None:
            lines += ["", f"first divergence: {first}", self.pair(first).render()]
        elif self.passed:
            lines.append("all tensors match")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


class OutputComparison(SetComparison):
    r"""Two nested outputs compared leaf by leaf; pair names are paths such as ``sample`` or
    ``[0].hidden[2]``."""


def _batch_alignment(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    r"""Tile the smaller side along dim 0 when the shapes differ only by a repeated batch dimension."""
    small_is_a = a.numel() < b.numel()
    small, big = (a, b) if small_is_a else (b, a)
    if small.ndim == big.ndim and small.ndim > 0 and small.shape[1:] == big.shape[1:] and small.shape[0] > 0:
        if big.shape[0] % small.shape[0]:
            return None
        times = big.shape[0] // small.shape[0]
        tiled = small.repeat(times, *([1] * (small.ndim - 1)))
    elif small.ndim + 1 == big.ndim and tuple(small.shape) == tuple(big.shape[1:]):
        times = big.shape[0]
        tiled = small.unsqueeze(0).repeat(times, *([1] * small.ndim))
    else:
        return None
    side = "A" if small_is_a else "B"
    note = f"{side} {tuple(small.shape)} repeated {times}× along dim 0 to {tuple(big.shape)} (--broadcast)"
    return (tiled, b, note) if small_is_a else (a, tiled, note)


def compare_tensor_sets(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    rules: Sequence[tuple[str, str]] = (),
    broadcast: bool = False,
    only: str | None = None,
    diagnose: bool = True,
) -> SetComparison:
    r"""Compare two sets of named tensors: what ``paritykit compare`` prints.

    Args:
        a, b: name -> tensor, in order (A's order orders the report; checkpoint folders load in execution
        order). atol, rtol: tolerances for every pair (default: per dtype pair).
        rules: ``(regex, replacement)`` renaming rules applied to A's names (see
            :mod:`paritykit.base.naming`).
        broadcast: align shapes that differ only by a repeated batch dimension by tiling the smaller side.
        only: a glob (``fnmatch``) on the (renamed) names; other tensors are left out.
        diagnose: attach hints to failing pairs.

    A one-tensor A against a one-tensor B is compared whatever their names (a file against a file).
    """
    from paritykit.base.naming import rename_all

    renamed = rename_all(list(a), rules) if rules else {name: name for name in a}
    a_named = {renamed[name]: (name, value) for name, value in a.items()}
    b_names = list(b)
    if only is not None:
        matches = [n for n in [*a_named, *b_names] if fnmatch.fnmatchcase(n, only)]
        if not matches:
            sample = ", ".join(list(dict.fromkeys([*a_named, *b_names]))[:3])
            raise ParityKitError(f"--only {only!r} matches no tensor name (names look like: {sample})")
        a_named = {n: v for n, v in a_named.items() if fnmatch.fnmatchcase(n, only)}
        b_names = [n for n in b_names if fnmatch.fnmatchcase(n, only)]

    report = SetComparison(atol=atol, rtol=rtol)
    if len(a) == 1 and len(b) == 1 and a_named and b_names and next(iter(a_named)) != b_names[0]:
        (name, (original, value)), name_b = next(iter(a_named.items())), b_names[0]
        name_a = original if original != name else None
        report.pairs.append(
            _compare_pair(
                name, value, b[name_b], atol, rtol, broadcast, diagnose, name_a=name_a, name_b=name_b
            )
        )
        return report

    for name, (original, value) in a_named.items():
        if name not in b:
            report.only_a.append(name)
            continue
        name_a = original if original != name else None
        report.pairs.append(
            _compare_pair(name, value, b[name], atol, rtol, broadcast, diagnose, name_a=name_a)
        )
    report.only_b = [n for n in b_names if n not in a_named]
    return report


def _compare_pair(
    name, a, b, atol, rtol, broadcast, diagnose, *, name_a=None, name_b=None
) -> TensorComparison:
    a, b = as_tensor(a, name), as_tensor(b, name)
    note = None
    if a.shape != b.shape:
        aligned = _batch_alignment(a, b)
        if aligned is not None and broadcast:
            a, b, note = aligned
        elif aligned is not None:
            note = "shapes differ only by a repeated batch dimension: --broadcast would tile the smaller side"
    result = compare_tensors(
        a, b, atol=atol, rtol=rtol, name=name, diagnose=diagnose, name_b=name_b, note=note
    )
    result.name_a = name_a
    return result


def compare_paths(
    a: str,
    b: str,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    maps: Sequence[str] = (),
    only: str | None = None,
    broadcast: bool = False,
) -> SetComparison:
    r"""Load two tensor files/folders/checkpoint folders and compare them (what ``paritykit compare`` runs).

    Names come from :func:`paritykit.base.io.load_named_tensors`, as in ``weights diff``: a checkpoint file or
    model folder gives its state dict's keys (wrappers unwrapped, no file stem), so ``a.safetensors`` and
    ``port/unet`` pair up by key. ``maps`` are ``'REGEX=REPL'`` strings applied to A's names.
    """
    from paritykit.base.files import check_sides, same_path_warning
    from paritykit.base.io import load_named_tensors
    from paritykit.base.naming import parse_map_options

    check_sides(a, b)
    rules = parse_map_options(maps)
    for label, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not value >= 0:
            raise ParityKitError(f"{label} must be a non-negative number (got {value})")
    sides = []
    for path in (a, b):
        tensors = load_named_tensors(path)  # the naming `weights diff` uses too, so one --map fits both
        if not tensors:
            raise ParityKitError(f"{path}: holds no tensors")
        sides.append(tensors)
    if Path(a).is_file():  # a folder of checkpoints is in execution order already; a file's keys are sorted
        sides[0] = {name: sides[0][name] for name in run_order(list(sides[0]))}
    report = compare_tensor_sets(
        sides[0], sides[1], atol=atol, rtol=rtol, rules=rules, only=only, broadcast=broadcast
    )
    report.source_a, report.source_b = str(a), str(b)
    report.warnings += filter(None, [same_path_warning(a, b)])
    return report


_STAGE = re.compile(r"^(text_encoding|preloop|(?:after_)?step_(\d+)|post_loop)/")


def run_order(names: Sequence[str]) -> list[str]:
    r"""``<checkpoint>/<key>`` names in the order a run writes them: ``text_encoding``, ``preloop``,
    ``after_step_{i}`` (or ``step_{i}``) by ``i``, ``post_loop``; names are left as they are unless every one
    starts with such a checkpoint, so "first divergence" is the first in time, not alphabetically."""
    matches = [_STAGE.match(n) for n in names]
    if not names or not all(matches):
        return list(names)

    def key(i: int) -> tuple[int, int, int]:
        m = matches[i]
        stage = {"text_encoding": 0, "preloop": 1, "post_loop": 3}.get(m.group(1), 2)
        return stage, int(m.group(2) or 0), i

    return [names[i] for i in sorted(range(len(names)), key=key)]


def _is_tensor_like(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return False
    return isinstance(value, (np.ndarray, np.generic))


def _join(path: str, key: str) -> str:
    if key.startswith("["):
        return f"{path}{key}"
    return f"{path}.{key}" if path else key


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    r"""Leaves of nested outputs by path: mappings (incl. diffusers ``BaseOutput``), dataclasses,
    sequences."""
    if _is_tensor_like(value):
        out[path] = value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(item, _join(path, str(key)), out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _flatten(getattr(value, f.name), _join(path, f.name), out)
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for key in value._fields:
            _flatten(getattr(value, key), _join(path, key), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(item, _join(path, f"[{i}]"), out)
    else:
        out[path] = value


def _scalar_tensor(value: Any) -> Any:
    import torch

    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return None


def compare_outputs(
    a: Any,
    b: Any,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    diagnose: bool = True,
) -> OutputComparison:
    r"""Compare two nested outputs (tuples, lists, dicts, dataclasses, diffusers ``BaseOutput``) leaf by leaf.

    Leaves are matched by path; tensors and numbers are compared with :func:`compare_tensors`, other values
    with ``==``. Paths present on one side only land in ``only_a`` / ``only_b``.
    """
    flat_a: dict[str, Any] = {}
    flat_b: dict[str, Any] = {}
    _flatten(a, "", flat_a)
    _flatten(b, "", flat_b)
    report = OutputComparison(atol=atol, rtol=rtol)
    for path, va in flat_a.items():
        name = path or "output"
        if path not in flat_b:
            report.only_a.append(name)
            continue
        vb = flat_b[path]
        ta = va if _is_tensor_like(va) else _scalar_tensor(va)
        tb = vb if _is_tensor_like(vb) else _scalar_tensor(vb)
        if ta is not None and tb is not None:
            report.pairs.append(compare_tensors(ta, tb, atol=atol, rtol=rtol, name=name, diagnose=diagnose))
        elif ta is not None or tb is not None:
            report.value_diffs.append({"name": name, "a": _describe(va), "b": _describe(vb)})
        elif type(va) is not type(vb) or va != vb:
            report.value_diffs.append({"name": name, "a": _describe(va), "b": _describe(vb)})
    report.only_b = [path or "output" for path in flat_b if path not in flat_a]
    return report


def _describe(value: Any) -> str:
    if _is_tensor_like(value):
        return f"{type(value).__name__}{tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def assert_parity(a: Any, b: Any, **tolerances: Any) -> TensorComparison | OutputComparison:
    r"""``assert`` for pytest: raises ``AssertionError`` with the readable report when B does not match A.

    Args:
        a, b: tensors, or nested outputs (compared with :func:`compare_outputs`).
        tolerances: ``atol``, ``rtol`` (and for tensors ``oracle``, ``equal_nan``), passed through.

    Returns:
        The comparison, for further checks when it passed.
    """
    # pytest hides this frame, so a failure starts at the user's assert_parity line and then the report.
    __tracebackhide__ = True
    if _is_tensor_like(a) and _is_tensor_like(b):
        result: TensorComparison | OutputComparison = compare_tensors(a, b, name="output", **tolerances)
    else:
        result = compare_outputs(a, b, **tolerances)
    if not result.passed:
        raise AssertionError("B does not match A (parity check failed)\n" + result.render(limit=None))
    return result
