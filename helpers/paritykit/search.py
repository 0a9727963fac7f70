r"""Name the module where a port parts from its reference, and say why.

Both models run once under :func:`paritykit.trace.capture`; :func:`paritykit.align.align_modules` pairs their
modules. Then, from the top level down, every aligned module is tested:

* **replay** (primary): the reference module's captured inputs are fed to the aligned port module *and* to the
  reference module, and the two outputs are compared. A module that fails on identical inputs is itself wrong,
  whatever happened upstream. Arguments are matched by path, else by order and shape, so ``forward(x, c)``
  replays into ``forward(hidden_states, conditioning_embedding)``.
* **error jump** (fallback, when replay is impossible: no models, no matching signature, a non-reproducible
  reference call): the module is blamed when its inputs agree within tolerance but its outputs do not, or
  when its relative output error is more than ``ratio`` (10) times its relative input error.

The culprit is the deepest aligned call that fails while none of its aligned children does. When it has
aligned children and all of them pass, the divergence is in its own ``forward`` (``inline``). At the culprit,
input-aware hints come first: ``remix`` (each side's output fitted as a linear combination of the module's
tensor inputs and its children's outputs; different coefficients mean one knob may stand for two concepts)
and ``constant-scale``, then the core hints of :func:`paritykit.diagnose.diagnose`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.align import Alignment, align_modules
from paritykit.errors import ParityKitError
from paritykit.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table

JUMP_RATIO = 10.0
# a least-squares fit "explains" an output when its relative residual is below this
FIT_RESIDUAL = 1e-3
# coefficients closer than this are the same mixture
COEF_TOLERANCE = 5e-3
_FIT_SAMPLES = 1 << 18
_MAX_FIT_COLUMNS = 8


# ------------------------------------------------------------------------------------------------ results


@dataclass
class ModuleTest:
    r"""The verdict on one aligned call: ``status`` is ``pass``, ``fail`` or ``untestable``."""

    reference: str
    port: str
    test: str  # replay | jump | output
    status: str
    max_abs: float | None = None
    cosine: float | None = None
    input_error: float | None = None
    output_error: float | None = None
    note: str = ""
    comparison: Any = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "reference": self.reference,
            "port": self.port,
            "test": self.test,
            "status": self.status,
            "max_abs": self.max_abs,
            "cosine": self.cosine,
        }
        if self.test == "jump":
            out["input_error"] = self.input_error
            out["output_error"] = self.output_error
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class ModuleFinding:
    r"""A named divergence: the culprit, or the first aligned module whose captured outputs differ."""

    reference: str
    port: str
    how_aligned: str
    test: str
    max_abs: float | None
    cosine: float | None
    inline: bool = False
    hints: list[Any] = field(default_factory=list)
    confidence: str = "high"
    children_passed: int = 0
    note: str = ""
    op: OpDivergence | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "reference": self.reference,
            "port": self.port,
            "how_aligned": self.how_aligned,
            "confidence": self.confidence,
            "test": self.test,
            "max_abs": self.max_abs,
            "cosine": self.cosine,
            "inline": self.inline,
            "children_passed": self.children_passed,
            "hints": [h.to_dict() for h in self.hints],
            "note": self.note,
        }
        if self.op is not None:
            out["op"] = self.op.to_dict()
        return out


@dataclass
class OpDivergence:
    r"""The first op inside the culprit whose result differs while its inputs still agree (``--ops``)."""

    index: int
    port_op: str
    port_args: str
    shape: list[int]
    reference_op: str | None = None
    reference_args: str | None = None
    max_abs: float | None = None
    port_ops: int = 0
    reference_ops: int = 0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "note": self.note,
            "index": self.index,
            "port_op": self.port_op,
            "port_args": self.port_args,
            "shape": self.shape,
            "reference_op": self.reference_op,
            "reference_args": self.reference_args,
            "max_abs": self.max_abs,
            "port_ops": self.port_ops,
            "reference_ops": self.reference_ops,
        }

    def render(self) -> str:
        text = f"  first differing op: port op #{self.index} {self.port_op}({self.port_args}) -> {self.shape}"
        if self.reference_op:
            text += (
                f"\n    closest reference op: {self.reference_op}({self.reference_args}), "
                f"max_abs {format_number(self.max_abs)}"
            )
        if self.note:
            text += f"\n    {self.note}"
        return text


@dataclass
class BisectReport:
    r"""What ``paritykit bisect`` prints; one object, two faces (``to_dict`` and ``render``)."""

    verdict: str
    culprit: ModuleFinding | None
    first_output_divergence: ModuleFinding | None
    output: Any
    alignment: Alignment
    tested: list[ModuleTest] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    # every independent culprit in execution order (``all_culprits=True``); else just ``[culprit]``
    culprits: list[ModuleFinding] = field(default_factory=list)
    allow_masked: bool = False
    # with all_culprits: the final output once every culprit is replaced by the reference's behaviour
    output_after: Any = None
    all_note: str = ""
    # commands to run next when the culprit is a block the traces did not look inside (paritykit.zoom)
    next_steps: list[str] = field(default_factory=list)
    # settings that differ between aligned modules, over the whole models (paritykit.evidence.config_differences)
    config_differences: list[Any] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.verdict == "masked" and self.allow_masked:
            return 0
        return 0 if self.verdict == "match" else 1

    def to_dict(self) -> dict[str, Any]:
        al = self.alignment.to_dict()
        return {
            "verdict": self.verdict,
            "culprit": self.culprit.to_dict() if self.culprit else None,
            "first_output_divergence": (
                self.first_output_divergence.to_dict() if self.first_output_divergence else None
            ),
            "aligned": al["aligned"],
            "unaligned_reference": al["unaligned_reference"],
            "unaligned_port": al["unaligned_port"],
            "output": _comparison_summary(self.output),
            "alignment": {"by": al["by"], "pairs": al["pairs"]},
            "tested": [t.to_dict() for t in self.tested],
            "culprits": [c.to_dict() for c in self.culprits],
            "output_after_substitution": _comparison_summary(self.output_after),
            "matches_after_substitution": (
                None if self.output_after is None else bool(self.output_after.passed)
            ),
            "split_work": al["split_work"],
            "environment": self.environment,
            "next_steps": self.next_steps,
            "config_differences": [d.to_dict() for d in self.config_differences],
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        out = _comparison_summary(self.output) or {}
        lines = [
            f"verdict: {self.verdict} (final output max_abs {format_number(out.get('max_abs'))}, "
            f"cosine {format_number(out.get('cosine'), 6)})"
        ]
        if out.get("status") == "shape_mismatch":
            lines.append(
                f"final output shapes differ: reference {out['shape_reference']} vs port {out['shape_port']}"
            )
        if self.verdict == "masked":
            lines.append(
                "masked: the final output is within tolerance, but the aligned module below fails on identical "
                "inputs" + (" (accepted: --allow-masked)" if self.allow_masked else "")
            )
        if len(self.culprits) > 1:
            for i, finding in enumerate(self.culprits, 1):
                lines += _render_finding(f"culprit {i}", finding)
        elif self.culprit:
            lines += _render_finding("culprit", self.culprit)
        if self.all_note:
            lines.append(self.all_note)
        if not self.culprit and self.verdict == "diverge":
            lines.append("culprit: none found (no aligned module fails; see the table of tested modules)")
        if self.first_output_divergence:
            f = self.first_output_divergence
            lines.append(
                f"first aligned module whose outputs differ: {_shown(f.reference)} <-> {_shown(f.port)} "
                f"(max_abs {format_number(f.max_abs)}; errors there may be inherited from upstream)"
            )
        rows = [
            [_shown(t.reference), _shown(t.port), t.test, t.status, t.max_abs, t.cosine, t.note]
            for t in self.tested
        ]
        if rows:
            lines.append("")
            lines.append(
                render_table(
                    ["reference", "port", "test", "status", "max_abs", "cosine", "note"], rows, limit=limit
                )
            )
        lines.append("")
        lines.append(self.alignment.summary())
        lines += [s.render() for s in self.alignment.split_work]
        al = self.alignment
        for side, names in (("reference", al.unaligned_reference), ("port", al.unaligned_port)):
            if names:
                lines.append(
                    f"unaligned {side} ({len(names)}): {', '.join(_shown(n) for n in names[:10])}"
                    + (" …" if len(names) > 10 else "")
                )
        if self.next_steps:
            lines += [
                "",
                "the traces hold this block's outputs only; to look inside it, run the first command where the "
                "reference runs, the second where the port runs, the third where both folders are:",
            ]
            lines += [f"  {command}" for command in self.next_steps]
        return "\n".join(lines)


# evidence ids that explain an inline culprit by something other than its forward code
_NOT_FORWARD_CODE = frozenset({"weights", "module-config", "attention-scale", "norm-eps"})


def _render_finding(label: str, f: ModuleFinding) -> list[str]:
    low = "" if f.confidence == "high" else f", {f.confidence} confidence"
    lines = [
        f"{label}: reference {_shown(f.reference)}  <->  port {_shown(f.port)}",
        f"  aligned by {f.how_aligned}{low}; found by {f.test}; max_abs {format_number(f.max_abs)}, "
        f"cosine {format_number(f.cosine, 6)}",
    ]
    if f.inline and any(h.id in ("module-fit", "inline-reference") for h in f.hints):
        lines.append(
            f"  inline: its {f.children_passed} aligned submodule call(s) all pass; the difference enters through "
            "a port module the reference has no module for (it computes that step inline): see the hints"
        )
    elif f.inline:
        lines.append(
            f"  inline: its {f.children_passed} aligned submodule call(s) all pass, so the difference is in this "
            "module's own forward code, not in a submodule"
            if not any(h.id in _NOT_FORWARD_CODE for h in f.hints)
            else f"  inline: its {f.children_passed} aligned submodule call(s) all pass; the hints below name "
            "the difference (settings or weights this module holds, which replaying its children cannot see)"
        )
    elif f.children_passed == 0:
        lines.append("  no aligned submodules: the module's own computation or configuration differs")
    if f.note:
        lines.append(f"  note: {f.note}")
    for hint in f.hints:
        if hint.verified and hint.fix:
            lines.append(f"  fix (verified): {hint.fix}")
    for i, hint in enumerate(f.hints, 1):
        lines.append(f"  hint {i}: [{hint.id}] {hint.message}")
    if f.op is not None:
        lines.append(f.op.render())
    return lines


def _shown(name: str) -> str:
    return name if name else "(top level)"


def _comparison_summary(cmp: Any) -> dict[str, Any] | None:
    if cmp is None:
        return None
    return {
        "status": cmp.status,
        "max_abs": cmp.max_abs,
        "cosine": cmp.cosine,
        "shape_reference": list(cmp.shape_a),
        "shape_port": list(cmp.shape_b),
        "atol": cmp.atol,
        "rtol": cmp.rtol,
    }


# ------------------------------------------------------------------------------------------ tensor helpers


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def flatten_tensors(value: Any, prefix: str = "output") -> list[tuple[str, Any]]:
    """``(path, tensor)`` for every tensor in a nested value (tuples, lists, dicts, ``BaseOutput``)."""
    if _is_tensor(value):
        return [(prefix, value)]
    out: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += flatten_tensors(v, f"{prefix}.{k}")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            out += flatten_tensors(v, f"{prefix}.{i}")
    return out


def _pair_leaves(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> list[tuple[int, int]] | None:
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


def _pair_inputs(ref: list, port: list) -> tuple[list, list[tuple[int, int]] | None]:
    """Input leaves paired as :func:`_pair_leaves` does; when that fails, the reference's repeated tensors are
    taken once (``attn(h, h, h)`` in self-attention against a port's ``attn(hidden_states)``)."""
    pairs = _pair_leaves(ref, port)
    if pairs is not None or len(ref) <= len(port):
        return ref, pairs
    unique: list[tuple[str, Any]] = []
    for path, tensor in ref:
        if not any(t is tensor or (t.shape == tensor.shape and bool((t == tensor).all())) for _, t in unique):
            unique.append((path, tensor))
    if len(unique) == len(ref):
        return ref, None
    return unique, _pair_leaves(unique, port)


def _pair_with_extras(ref: list, port: list) -> tuple[list[tuple[int, int]] | None, list[int]]:
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


def _rel_error(a: Any, b: Any) -> float:
    import torch

    a64, b64 = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    if not bool(finite.all()):
        return math.inf
    denom = float(a64.norm())
    diff = float((a64 - b64).norm())
    if denom == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / denom


def _module_device(module: Any) -> Any:
    import torch

    for tensor in (*module.parameters(), *module.buffers()):
        # weights offloaded by accelerate sit on "meta"; its hook moves inputs to the execution device itself
        if tensor.device.type != "meta":
            return tensor.device
    hook = getattr(module, "_hf_hook", None)
    return torch.device(getattr(hook, "execution_device", None) or "cpu")


# ------------------------------------------------------------------------------------------------- search


class _Bisector:
    """Tests aligned calls (each at most once) and walks down from the top level to the culprit."""

    def __init__(
        self,
        ref_trace: Any,
        port_trace: Any,
        alignment: Alignment,
        *,
        reference: Any = None,
        port: Any = None,
        atol: float | None,
        rtol: float | None,
        ratio: float,
    ):
        self.rt = ref_trace
        self.pt = port_trace
        self.alignment = alignment
        self.ref_modules = dict(reference.named_modules()) if reference is not None else {}
        self.port_modules = dict(port.named_modules()) if port is not None else {}
        self.atol = atol
        self.rtol = rtol
        self.ratio = ratio
        self.results: dict[str, ModuleTest] = {}
        self.why_not_replayed: dict[str, str] = {}
        self.replays: dict[str, tuple[list, list]] = {}
        # replays that fed some port inputs from the port's own capture (no reference counterpart): their paths
        self.own_inputs: dict[str, list[str]] = {}
        self.children_of: dict[str, list[Any]] = {}
        for record in ref_trace.records:
            self.children_of.setdefault(record.parent, []).append(record)

    # pairing ---------------------------------------------------------------------------------------
    def port_record(self, ref_record: Any) -> Any:
        pair = self.alignment.pair_of(ref_record.module)
        if pair is None or pair.layout:
            return None
        port_module = pair.port
        name = port_module if ref_record.call == 0 else f"{port_module}#{ref_record.call}"
        return self.pt[name] if name in self.pt else None

    def frontier(self, record: Any) -> list[Any]:
        """The nearest aligned calls below ``record`` (unaligned calls in between are looked through)."""
        out = []
        for child in self.children_of.get(record.name, []):
            if self.port_record(child) is not None:
                out.append(child)
            else:
                out += self.frontier(child)
        return out

    # tests -----------------------------------------------------------------------------------------
    def compare(self, a: Any, b: Any, name: str, diagnose: bool = False) -> Any:
        from paritykit.compare import compare_tensors

        return compare_tensors(a, b, atol=self.atol, rtol=self.rtol, name=name, diagnose=diagnose)

    def compare_leaves(self, a: list, b: list, name: str) -> Any:
        """Worst comparison over paired output leaves (``None`` when the outputs cannot be paired)."""
        pairs = _pair_leaves(a, b)
        if pairs is None:
            return None
        worst = None
        for i, j in pairs:
            cmp = self.compare(a[i][1], b[j][1], f"{name}:{a[i][0]}")
            if worst is None or (worst.passed and not cmp.passed):
                worst = cmp
            elif not cmp.passed and not worst.passed and (cmp.max_abs or 0) > (worst.max_abs or 0):
                worst = cmp
        return worst

    def test(self, ref_record: Any) -> ModuleTest:
        if ref_record.name in self.results:
            return self.results[ref_record.name]
        port_record = self.port_record(ref_record)
        result = self.replay(ref_record, port_record)
        if result is None:
            result = self.jump(ref_record, port_record)
        self.results[ref_record.name] = result
        return result

    def adapt_inputs(
        self, ref_record: Any, port_record: Any, device: Any = None, replace: dict[str, Any] | None = None
    ) -> tuple[tuple, dict] | None:
        """The port call's own arguments with the reference's tensors put in place of its tensors; the port's
        extra inputs (no reference counterpart) stay its own, or ``replace[path]`` where given."""
        from paritykit.trace import _unpack

        if not ref_record.replayable or not port_record.replayable:
            return None
        ref_leaves = list(ref_record.inputs.items())
        port_leaves = list(port_record.inputs.items())
        if not port_leaves:
            return None
        ref_leaves, pairs = _pair_inputs(ref_leaves, port_leaves)
        extra: list[int] = []
        if pairs is None:
            # the port call may take inputs the reference computes inside the module (rotary cos/sin passed
            # as ``image_rotary_emb``): the reference's inputs go in, the extras are the port's own captured
            pairs, extra = _pair_with_extras(ref_leaves, port_leaves)
            if pairs is None:
                return None
            self.own_inputs[ref_record.name] = [port_leaves[j][0] for j in extra]
        port_keys = list(port_record.input_keys.values())
        swap = {}
        for j in extra:
            tensor = (replace or {}).get(port_leaves[j][0], port_leaves[j][1])
            swap[port_keys[j]] = tensor.to(device, copy=True) if device is not None else tensor.clone()
        for i, j in pairs:
            tensor = ref_leaves[i][1]
            own = port_leaves[j][1]
            if tensor.is_floating_point() and own.is_floating_point():
                tensor = tensor.to(own.dtype)
            # a copy: an in-place op in the port module must not change the trace
            swap[port_keys[j]] = tensor.to(device, copy=True) if device is not None else tensor.clone()
        if len(swap) != len(port_keys):
            return None
        args, kwargs = _unpack(port_record.inputs_skeleton, lambda key: swap[key])
        return tuple(args), dict(kwargs)

    def run_replay(self, ref_record: Any, port_record: Any) -> tuple[list, list] | str:
        """Outputs of both modules on the reference's captured inputs, or the reason replay is impossible."""
        port_module = self.port_modules.get(port_record.module)
        if port_module is None:
            return "no port model to replay on"
        if not ref_record.replayable:
            return "reference inputs not replayable"
        adapted = self.adapt_inputs(ref_record, port_record, _module_device(port_module))
        if adapted is None:
            return "signatures differ (inputs cannot be paired by path, order or shape)"
        ref_module = self.ref_modules.get(ref_record.module)
        if ref_module is not None:
            args, kwargs = ref_record.call_inputs()
            device = _module_device(ref_module)
            args = tuple(a.to(device, copy=True) if _is_tensor(a) else a for a in args)
            kwargs = {k: v.to(device, copy=True) if _is_tensor(v) else v for k, v in kwargs.items()}
            try:
                ref_out = flatten_tensors(ref_module(*args, **kwargs))
            except Exception as exc:  # e.g. state its parent sets up before calling it
                return f"reference call failed on its own captured inputs ({type(exc).__name__})"
            # A reference call that does not reproduce its own captured output (randomness, hidden state)
            # cannot be replayed meaningfully.
            captured = list(ref_record.outputs.items())
            check = self.compare_leaves(captured, ref_out, ref_record.name)
            if check is None or not check.passed:
                return "the reference call does not reproduce its captured output"
        else:
            ref_out = list(ref_record.outputs.items())
        try:
            port_out = flatten_tensors(port_module(*adapted[0], **adapted[1]))
        except Exception as exc:  # the port's own signature rejects the reference's inputs
            return f"port call failed on reference inputs ({type(exc).__name__})"
        return ref_out, port_out

    def replay(self, ref_record: Any, port_record: Any) -> ModuleTest | None:
        outcome = self.run_replay(ref_record, port_record)
        if isinstance(outcome, str):
            self.why_not_replayed[ref_record.name] = outcome
            return None
        ref_out, port_out = outcome
        cmp = self.compare_leaves(ref_out, port_out, ref_record.name)
        if cmp is None:
            self.why_not_replayed[ref_record.name] = "outputs cannot be paired"
            return None
        self.replays[ref_record.name] = (ref_out, port_out)
        own = self.own_inputs.get(ref_record.name)
        return ModuleTest(
            ref_record.name,
            port_record.name,
            "replay",
            "pass" if cmp.passed else "fail",
            cmp.max_abs,
            cmp.cosine,
            comparison=cmp,
            note=f"port inputs the reference has no counterpart for taken from the port's own run: {', '.join(own)}"
            if own
            else "",
        )

    def jump(self, ref_record: Any, port_record: Any) -> ModuleTest:
        note = self.why_not_replayed.get(ref_record.name, "")
        out_cmp = self.compare_leaves(
            list(ref_record.outputs.items()), list(port_record.outputs.items()), ref_record.name
        )
        if out_cmp is None:
            return ModuleTest(
                ref_record.name,
                port_record.name,
                "jump",
                "untestable",
                note=_join(note, _unpaired_shapes(ref_record, port_record)),
            )
        base = ModuleTest(
            ref_record.name,
            port_record.name,
            "jump",
            "pass",
            out_cmp.max_abs,
            out_cmp.cosine,
            note=note,
            comparison=out_cmp,
        )
        if out_cmp.passed:
            return base
        ref_in = list(ref_record.inputs.items())
        port_in = list(port_record.inputs.items())
        ref_in, pairs = _pair_inputs(ref_in, port_in) if ref_in and port_in else (ref_in, None)
        if pairs is None:
            base.status = "untestable"
            base.note = _join(note, "inputs cannot be paired")
            return base
        in_pass = all(self.compare(ref_in[i][1], port_in[j][1], "input").passed for i, j in pairs)
        in_err = max(_rel_error(ref_in[i][1], port_in[j][1]) for i, j in pairs)
        out_pairs = _pair_leaves(list(ref_record.outputs.items()), list(port_record.outputs.items())) or []
        ref_outs, port_outs = list(ref_record.outputs.values()), list(port_record.outputs.values())
        out_err = max((_rel_error(ref_outs[i], port_outs[j]) for i, j in out_pairs), default=math.inf)
        base.input_error, base.output_error = in_err, out_err
        if in_pass:
            base.status = "fail"
            base.note = _join(note, "inputs agree within tolerance, outputs do not")
        elif in_err == 0 or out_err / in_err > self.ratio:
            base.status = "fail"
            base.note = _join(
                note,
                f"output error {format_number(out_err)} > {self.ratio:g} x input error {format_number(in_err)}",
            )
        else:
            base.note = _join(note, "error inherited from the inputs")
        return base

    # search ----------------------------------------------------------------------------------------
    def descend(self, record: Any) -> tuple[Any, int]:
        """Deepest failing call under a failing ``record``; returns (call, number of aligned children passed)."""
        found, passed = self._failing_below(record)
        return found if found is not None else (record, passed)

    def _failing_below(self, record: Any) -> tuple[tuple[Any, int] | None, int]:
        # Untestable children (no aligned partner to replay) are looked through, not counted as passed.
        passed = 0
        for child in self.frontier(record):
            result = self.test(child)
            if result.status == "fail":
                return self.descend(child), passed
            if result.status == "untestable":
                found, _ = self._failing_below(child)
                if found is not None:
                    return found, passed
            else:
                passed += 1
        return None, passed


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _unpaired_shapes(ref_record: Any, port_record: Any) -> str:
    """Why two calls' outputs cannot be compared, with both sides' shapes (a shape mismatch, usually)."""

    def shapes(record: Any) -> str:
        return ", ".join(str(list(t.shape)) for t in record.outputs.values()) or "no tensor"

    return f"outputs cannot be paired: reference {shapes(ref_record)} vs port {shapes(port_record)}"


# -------------------------------------------------------------------------------------------- diagnoses


def _fit(columns: Any, target: Any) -> tuple[list[float], float]:
    import torch

    solution = torch.linalg.lstsq(columns, target.unsqueeze(1)).solution.squeeze(1)
    norm = float(target.norm())
    residual = float((columns @ solution - target).norm()) / norm if norm else 0.0
    return [float(w) for w in solution], residual


def remix_hint(ref_out: Any, port_out: Any, candidates: Sequence[tuple[str, Any]]) -> Any:
    r"""Fit each side's output as a linear combination of candidate tensors (the module's tensor inputs and its
    children's outputs, broadcast to the output's shape); a ``remix`` hint when both fit and the mixtures differ.

    One candidate that fits both sides with different factors gives an input-aware ``constant-scale`` hint.
    """
    import torch

    from paritykit.diagnose import Hint

    if not (ref_out.is_floating_point() and port_out.is_floating_point()) or ref_out.shape != port_out.shape:
        return None
    shape = ref_out.shape
    n = ref_out.numel()
    step = max(1, n // _FIT_SAMPLES)
    columns, names = [], []
    for name, tensor in candidates:
        if not _is_tensor(tensor) or not tensor.is_floating_point():
            continue
        try:
            full = torch.broadcast_to(tensor.detach().cpu(), shape)
        except RuntimeError:
            continue
        column = full.reshape(-1)[::step].double()
        if float(column.norm()) == 0:
            continue
        if columns:
            # Drop columns the earlier ones already explain: collinear columns make coefficients meaningless.
            basis = torch.stack(columns, 1)
            _, residual = _fit(basis, column)
            if residual < 1e-6:
                continue
        columns.append(column)
        names.append(name)
        if len(columns) == _MAX_FIT_COLUMNS:
            break
    if not columns:
        return None
    matrix = torch.stack(columns, 1)
    y_ref = ref_out.detach().cpu().reshape(-1)[::step].double()
    y_port = port_out.detach().cpu().reshape(-1)[::step].double()
    w_ref, r_ref = _fit(matrix, y_ref)
    w_port, r_port = _fit(matrix, y_port)
    if r_ref > FIT_RESIDUAL or r_port > FIT_RESIDUAL:
        return None
    if max(abs(a - b) for a, b in zip(w_ref, w_port)) <= COEF_TOLERANCE:
        return None
    evidence = {
        "inputs": names,
        "reference": w_ref,
        "port": w_port,
        "residual_reference": r_ref,
        "residual_port": r_port,
    }
    ref_v, port_v = torch.tensor(w_ref, dtype=torch.float64), torch.tensor(w_port, dtype=torch.float64)
    k = float(ref_v @ port_v) / float(ref_v @ ref_v) if float(ref_v @ ref_v) else 0.0
    if k and float((port_v - k * ref_v).abs().max()) <= COEF_TOLERANCE * max(1.0, abs(k)):
        # Every coefficient scaled by one factor: a single output scale, not a different mixture.
        evidence["k"] = k
        terms = ", ".join(names)
        return Hint(
            "constant-scale",
            f"on identical inputs the port's output is {_coef(k)} x the reference's (coefficients "
            f"({', '.join(_coef(w) for w in w_ref)}) vs ({', '.join(_coef(w) for w in w_port)}) of ({terms})): "
            "an output scale read from a different place (a default instead of the config, or one knob used for "
            "two concepts)",
            evidence,
            score=0.96,
        )
    mix = ", ".join(names)
    return Hint(
        "remix",
        f"reference mixes ({', '.join(_coef(w) for w in w_ref)}), port ({', '.join(_coef(w) for w in w_port)}) "
        f"of ({mix}): one knob may mean two concepts",
        evidence,
        score=0.97,
    )


def _coef(w: float) -> str:
    value = round(w, 3)
    return repr(0.0 if value == 0 else value)


def culprit_hints(
    ref_out: Any, port_out: Any, candidates: Sequence[tuple[str, Any]], core: Sequence[Any]
) -> list:
    """Input-aware hints first, then the core detectors' hints (one hint per id, best first)."""
    hints = []
    extra = remix_hint(ref_out, port_out, candidates)
    if extra is not None:
        hints.append(extra)
    seen = {h.id for h in hints}
    for hint in sorted(core, key=lambda h: -h.score):
        if hint.id not in seen:
            hints.append(hint)
            seen.add(hint.id)
    return hints


# ----------------------------------------------------------------------------------------------- --ops

# Ops that only rearrange values: a result of one of them agrees whenever its input does.
_LAYOUT_OPS = frozenset(
    "view reshape transpose permute chunk split unbind contiguous flatten unflatten squeeze unsqueeze expand "
    "expand_as view_as narrow movedim t __getitem__ clone detach split_with_sizes".split()
)


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if getattr(func, "__objclass__", None) is not None:
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{name}" if module and not module.startswith("torch._C") else f"torch.{name}"


def _describe(value: Any, depth: int = 0) -> str:
    import torch

    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.nn.Parameter):
        return f"Parameter{list(value.shape)}"
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}" if value.dim() else f"tensor({value.item():.6g})"
    if isinstance(value, (tuple, list)) and depth < 2:
        inner = ", ".join(_describe(v, depth + 1) for v in value[:6])
        return f"({inner}{', …' if len(value) > 6 else ''})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def _describe_call(args: tuple, kwargs: dict) -> str:
    parts = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= 240 else text[:237] + "…"


def _log_ops(module: Any, args: tuple, kwargs: dict) -> list[tuple[str, str, list, list]]:
    """Every torch call made while ``module`` runs: (name, arguments, input tensors, [(output, copy)])."""
    import torch
    from torch.overrides import TorchFunctionMode

    ops: list[tuple[str, str, list, list]] = []

    class OpLogger(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            outputs = [t for _, t in flatten_tensors(out)]
            if outputs:
                inputs = [t for _, t in flatten_tensors((args, kwargs)) if isinstance(t, torch.Tensor)]
                # identities follow the data flow; copies keep values as they were when produced
                ops.append(
                    (
                        _op_name(func),
                        _describe_call(args, kwargs),
                        inputs,
                        [(t, t.detach().clone()) for t in outputs],
                    )
                )
            return out

    with OpLogger():
        module(*args, **kwargs)
    return ops


def op_divergence(
    ref_module: Any,
    port_module: Any,
    ref_call: tuple[tuple, dict],
    port_call: tuple[tuple, dict],
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> OpDivergence | None:
    r"""Re-run one module on both sides under an op logger (a ``TorchFunctionMode``) and return the first port
    op whose result matches no reference value while none of its inputs is already off.

    A port result matches when some reference op result (or module input) has its shape and agrees within
    tolerance. Layout-only ops (views, transposes, chunks) take the state of their inputs.
    """
    import torch

    from paritykit.compare import compare_tensors

    ref_ops = _log_ops(ref_module, *ref_call)
    port_ops = _log_ops(port_module, *port_call)
    known: dict[tuple, list[tuple[str, str, Any]]] = {}
    for _, tensor in flatten_tensors(ref_call):
        known.setdefault(tuple(tensor.shape), []).append(("input", "", tensor))
    for name, args, _, outs in ref_ops:
        for _, value in outs:
            known.setdefault(tuple(value.shape), []).append((name, args, value))

    def agrees(a: Any, b: Any) -> bool:
        if not (a.is_floating_point() and b.is_floating_point()):
            return a.dtype == b.dtype and bool(torch.equal(a, b))
        # judged at the reference's precision, so a cast to a lower one is the op that differs
        return compare_tensors(a, b.to(a.dtype), atol=atol, rtol=rtol, diagnose=False).passed

    def swapped(a: Any, b: Any) -> bool:
        """B is A with the halves of its last dim swapped: a converted shift/scale layout, not a difference."""
        if not (a.is_floating_point() and b.is_floating_point()) or a.dim() == 0 or a.shape[-1] % 2:
            return False
        first, second = a.chunk(2, dim=-1)
        return agrees(torch.cat([second, first], dim=-1), b)

    off: set[int] = set()
    for index, (name, args, inputs, outs) in enumerate(port_ops):
        if any(id(t) in off for t in inputs):
            off.update(id(live) for live, _ in outs)
            continue
        if name.rsplit(".", 1)[-1] in _LAYOUT_OPS:
            continue
        for _, value in outs:
            candidates = known.get(tuple(value.shape), [])
            if any(agrees(ref_value, value) or swapped(ref_value, value) for _, _, ref_value in candidates):
                continue
            best = None
            for ref_name, ref_args, ref_value in candidates:
                if ref_name == "input" or not (ref_value.is_floating_point() and value.is_floating_point()):
                    continue
                err = float((ref_value.double() - value.double()).abs().max())
                if best is None or err < best[2]:
                    best = (ref_name, ref_args, err)
            return OpDivergence(
                index,
                name,
                args,
                list(value.shape),
                reference_op=best[0] if best else None,
                reference_args=best[1] if best else None,
                max_abs=best[2] if best else None,
                port_ops=len(port_ops),
                reference_ops=len(ref_ops),
            )
    return _skipped_step(ref_ops, port_ops, agrees)


def _skipped_step(ref_ops: list, port_ops: list, agrees: Callable) -> OpDivergence | None:
    """Every port result equals some reference value, yet the outputs differ: the port returns a value the
    reference processes further (a missing scale, a skipped step). Name the reference op it skips."""
    if not port_ops or not ref_ops:
        return None
    last_name, last_args, _, last_outs = port_ops[-1]
    final = last_outs[0][1]
    for j, (_, _, _, outs) in enumerate(ref_ops):
        if not any(v.shape == final.shape and agrees(v, final) for _, v in outs):
            continue
        produced = {id(live) for live, _ in outs}
        for name, args, inputs, _ in ref_ops[j + 1 :]:
            if any(id(t) in produced for t in inputs):
                return OpDivergence(
                    len(port_ops) - 1,
                    last_name,
                    last_args,
                    list(final.shape),
                    reference_op=name,
                    reference_args=args,
                    port_ops=len(port_ops),
                    reference_ops=len(ref_ops),
                    note="the port returns this value as it is; the reference goes on with the op above",
                )
    return None


# ------------------------------------------------------------------------------------------------- API


def first_divergence(
    ref_trace: Any,
    port_trace: Any,
    alignment: Alignment,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    confidence: Sequence[str] = ("high", "medium", "low"),
) -> ModuleFinding | None:
    r"""The first aligned call, in completion order, whose *captured* outputs differ between the two traces.

    This is where the error first becomes visible, not necessarily where it is made (it may come in with the
    inputs); :func:`bisect` finds the latter. Only pairs aligned with one of ``confidence`` take part.
    """
    from paritykit.compare import compare_tensors

    for record in ref_trace.completion_order():
        pair = alignment.pair_of(record.module)
        if pair is None or pair.layout or pair.confidence not in confidence:
            continue
        port_name = pair.port
        port_call = port_name if record.call == 0 else f"{port_name}#{record.call}"
        if port_call not in port_trace:
            continue
        other = port_trace[port_call]
        a, b = list(record.outputs.items()), list(other.outputs.items())
        pairs = _pair_leaves(a, b)
        if pairs is None:
            continue
        for i, j in pairs:
            cmp = compare_tensors(a[i][1], b[j][1], atol=atol, rtol=rtol, name=record.name)
            if not cmp.passed:
                return ModuleFinding(
                    record.name,
                    port_call,
                    pair.how,
                    "output",
                    cmp.max_abs,
                    cmp.cosine,
                    hints=list(cmp.hints),
                    confidence=pair.confidence,
                )
    return None


def bisect_traces(
    ref_trace: Any,
    port_trace: Any,
    alignment: Alignment | None = None,
    *,
    reference: Any = None,
    port: Any = None,
    rules: Sequence[tuple[str, str]] = (),
    select_output: Callable[[str, Any], Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    ratio: float = JUMP_RATIO,
    ops: bool = False,
    environment: dict[str, Any] | None = None,
    allow_masked: bool = False,
    all_culprits: bool = False,
) -> BisectReport:
    r"""Find the culprit from two traces (e.g. written in two environments by ``paritykit trace``).

    With ``port`` (and ideally ``reference``) given, calls are replayed; without them every test is an error
    jump over the captured tensors. ``ops=True`` re-runs a replayed culprit under an op logger on both sides
    and names the first op whose result differs (:func:`op_divergence`).

    When the final output matches, the search still runs: an aligned module (medium or high confidence) that
    fails on identical inputs makes the verdict ``masked`` (exit 1 unless ``allow_masked``).
    ``all_culprits=True`` (needs ``port``) replaces each culprit's output in the port by the reference's and
    searches again, until the port's output matches or no further culprit is found (:func:`every_culprit`).
    """
    import torch

    if alignment is None:
        alignment = align_modules(reference, port, ref_trace, port_trace, rules=rules)
    ref_root, port_root = ref_trace.root, port_trace.root
    if ref_root is None or port_root is None:
        raise ParityKitError("both traces must include the top-level call (capture the whole model)")
    ref_final = _select("reference", ref_root.output_value(), select_output)
    port_final = _select("port", port_root.output_value(), select_output)
    from paritykit.compare import compare_tensors

    output = compare_tensors(ref_final, port_final, atol=atol, rtol=rtol, name="output")
    searcher = _Bisector(
        ref_trace, port_trace, alignment, reference=reference, port=port, atol=atol, rtol=rtol, ratio=ratio
    )
    # A matching output makes a pair aligned on weak evidence no basis for a "differs" claim.
    trusted = ("high", "medium", "low") if not output.passed else ("high",)
    first = first_divergence(ref_trace, port_trace, alignment, atol=atol, rtol=rtol, confidence=trusted)
    culprit = None
    verdict = "match" if output.passed else "diverge"
    with torch.no_grad():
        call, passed = searcher.descend(ref_root)
        if not output.passed:
            culprit = _finding(searcher, call, passed, output, ops=ops)
        else:
            hidden = (call, passed) if call is not ref_root and _masking(searcher) else _masked_call(searcher)
            if hidden is not None:
                verdict = "masked"
                culprit = _finding(searcher, *hidden, output, ops=ops)
    tested = list(searcher.results.values())
    report = BisectReport(
        verdict=verdict,
        culprit=culprit,
        first_output_divergence=first,
        output=output,
        alignment=alignment,
        tested=tested,
        environment=environment if environment is not None else environment_stamp(),
        culprits=[culprit] if culprit is not None else [],
        allow_masked=allow_masked,
    )
    if reference is not None and port is not None:
        from paritykit.evidence import config_differences

        pairs = [(p.reference, p.port) for p in alignment.one_to_one]
        report.config_differences = config_differences(reference, port, pairs)
    if all_culprits and culprit is not None:
        every_culprit(report, searcher, ref_final, select_output=select_output, ops=ops)
    return report


# captured-output differences confirmed by replay when looking for a masked divergence
MAX_MASKED_CHECKS = 32


def _masked_call(searcher: _Bisector) -> tuple[Any, int] | None:
    """With a matching output and passing top-level blocks, a module deeper down may still fail (its error
    shrunk by what follows, inside a passing parent). Candidates are aligned calls (medium or high confidence)
    whose captured outputs differ, deepest first; the first that also fails on replay is the culprit."""
    from paritykit.compare import compare_tensors

    checks = 0
    for record in searcher.rt.completion_order():
        pair = searcher.alignment.pair_of(record.module)
        port_record = searcher.port_record(record) if record.parent is not None else None
        if pair is None or pair.confidence == "low" or port_record is None:
            continue
        a, b = list(record.outputs.items()), list(port_record.outputs.items())
        leaves = _pair_leaves(a, b) or []
        if all(
            compare_tensors(a[i][1], b[j][1], atol=searcher.atol, rtol=searcher.rtol, diagnose=False).passed
            for i, j in leaves
        ):
            continue
        checks += 1
        if searcher.test(record).status == "fail":
            return searcher.descend(record)
        if checks >= MAX_MASKED_CHECKS:
            break
    return None


def _masking(searcher: _Bisector) -> bool:
    """Whether a failing test sits on a pair aligned with medium or high confidence."""
    for test in searcher.results.values():
        pair = searcher.alignment.pair_of(test.reference.split("#", 1)[0])
        if test.status == "fail" and pair is not None and pair.confidence != "low":
            return True
    return False


def _select(side: str, output: Any, select_output: Callable | None) -> Any:
    if select_output is not None:
        from paritykit.errors import UserCodeError

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


def _finding(
    searcher: _Bisector, call: Any, children_passed: int, output: Any, ops: bool = False
) -> ModuleFinding:
    alignment = searcher.alignment
    port_call = searcher.port_record(call)
    pair = alignment.pair_of(call.module)
    if call.parent is None:
        # Nothing below the top level fails: the top level's own forward differs.
        return ModuleFinding(
            call.name,
            port_call.name if port_call else "",
            pair.how if pair else "names",
            "output",
            output.max_abs,
            output.cosine,
            inline=children_passed > 0,
            children_passed=children_passed,
            hints=_with_inline(
                searcher,
                call,
                port_call,
                children_passed,
                output.max_abs,
                _hints_at(searcher, call, port_call, None, output),
            ),
            note=_untested_inside(alignment, call.module),
        )
    result = searcher.results[call.name]
    op = None
    if ops and result.test == "replay":
        ref_module = searcher.ref_modules.get(call.module)
        port_module = searcher.port_modules.get(port_call.module)
        adapted = searcher.adapt_inputs(call, port_call, _module_device(port_module))
        if ref_module is not None and adapted is not None:
            op = op_divergence(
                ref_module, port_module, call.call_inputs(), adapted, atol=searcher.atol, rtol=searcher.rtol
            )
    return ModuleFinding(
        call.name,
        port_call.name,
        pair.how,
        result.test,
        result.max_abs,
        result.cosine,
        inline=children_passed > 0,
        children_passed=children_passed,
        hints=_with_extra_inputs(
            searcher,
            call,
            port_call,
            result.max_abs,
            _with_inline(
                searcher,
                call,
                port_call,
                children_passed,
                result.max_abs,
                _hints_at(searcher, call, port_call, result, None),
            ),
        ),
        confidence=pair.confidence,
        note=_join(result.note, _untested_inside(alignment, call.module)),
        op=op,
    )


def _with_extra_inputs(
    searcher: _Bisector, call: Any, port_call: Any, before: float | None, hints: list
) -> list:
    """At a culprit replayed with some port inputs taken from the port's own run (the reference computes them
    inside the module), the port modules producing them and a verified constructor fit of those
    (:func:`paritykit.module_fit.extra_input_hints`); a verified fix goes first."""
    if call.name not in searcher.own_inputs or any(h.verified for h in hints):
        return hints
    from paritykit.module_fit import extra_input_hints

    extra = extra_input_hints(searcher, call, port_call, before)
    verified = [h for h in extra if h.verified]
    if not verified:
        return [*hints, *extra]
    # the difference is traced to the port module the fit changed: "the forward code differs" no longer stands
    rest = [h for h in extra if not h.verified]
    return [*verified, *(h for h in hints if h.id != "no-signature"), *rest]


def _with_inline(
    searcher: _Bisector, call: Any, port_call: Any, children_passed: int, before: float | None, hints: list
) -> list:
    """At an inline culprit, the evidence of the first differing child input goes first
    (:func:`paritykit.module_fit.inline_reference_hints`); a "forward code differs" hint then no longer
    stands, since the difference was traced to a port module the reference has no counterpart for."""
    if children_passed == 0 or port_call is None:
        return hints
    if any(h.verified for h in hints):
        return hints  # a fix verified at the culprit (paritykit.evidence) explains all of it
    from paritykit.module_fit import inline_reference_hints

    extra = inline_reference_hints(searcher, call, port_call, before)
    if not extra:
        return hints
    seen = {h.id for h in extra}
    if not seen & {"inline-reference", "module-fit"}:
        # only where the difference shows (inside the culprit's own forward): the causes found so far lead
        return [*hints, *(h for h in extra if h.id not in {g.id for g in hints})]
    # "the forward code differs" no longer stands once the difference is traced to a port module; a cause
    # named at the culprit (an activation refitted inside it) leads an unverified locating hint
    causes = [h for h in hints if h.id != "no-signature" and h.id not in seen]
    return [*(h for h in extra if h.verified), *causes, *(h for h in extra if not h.verified)]


# ------------------------------------------------------------------------------------- every culprit (--all)

MAX_CULPRITS = 8


def every_culprit(
    report: BisectReport,
    searcher: _Bisector,
    ref_final: Any,
    *,
    select_output: Callable | None = None,
    ops: bool = False,
) -> None:
    r"""Extend ``report.culprits`` to every independent culprit, in execution order.

    Each culprit found so far is given the reference's behaviour in the port (a forward hook returning the
    reference call's captured output, adapted to the port's output structure); the port runs again on its
    captured inputs and the search restarts. It stops when the port's output matches
    (``report.output_after``), when no new culprit is found, or when a culprit cannot be substituted.
    """
    import torch

    from paritykit.compare import compare_tensors
    from paritykit.trace import capture

    port, port_root = searcher.port_modules.get(""), searcher.pt.root
    if port is None or port_root is None or not port_root.replayable:
        report.all_note = "--all: not searched further (needs the port model and its captured inputs)"
        return
    args, kwargs = _to_device(port_root.call_inputs(), _module_device(port))
    handles: list[Any] = []
    try:
        while len(report.culprits) < MAX_CULPRITS:
            last = report.culprits[-1]
            if not last.reference:
                report.all_note = "--all: stopped at the top level's own forward (nothing to substitute)"
                return
            handle = _substitute(searcher, last.reference.split("#", 1)[0])
            if handle is None:
                report.all_note = (
                    f"--all: stopped: the reference output of {_shown(last.reference)} cannot be put in place of "
                    "the port's (outputs do not pair)"
                )
                return
            handles.append(handle)
            with torch.no_grad(), capture(port) as trace:
                port(*args, **kwargs)
            port_final = _select("port", trace.root.output_value(), select_output)
            output = compare_tensors(
                ref_final, port_final, atol=searcher.atol, rtol=searcher.rtol, name="output"
            )
            report.output_after = output
            again = _Bisector(
                searcher.rt,
                trace,
                searcher.alignment,
                reference=None,
                port=None,
                atol=searcher.atol,
                rtol=searcher.rtol,
                ratio=searcher.ratio,
            )
            again.ref_modules, again.port_modules = searcher.ref_modules, searcher.port_modules
            with torch.no_grad():
                call, passed = again.descend(searcher.rt.root)
                if output.passed:
                    # a matching output still hides the next masked culprit, if any
                    hidden = (
                        (call, passed) if call.parent is not None and _masking(again) else _masked_call(again)
                    )
                    if hidden is None:
                        break
                    call, passed = hidden
                if call.name in {c.reference for c in report.culprits}:
                    break
                report.culprits.append(_finding(again, call, passed, output, ops=ops))
            report.tested += [t for t in again.results.values() if t.reference not in searcher.results]
    finally:
        for handle in handles:
            handle.remove()
    order = {r.name: i for i, r in enumerate(searcher.rt.records)}
    report.culprits.sort(key=lambda c: order.get(c.reference, 1 << 30))
    after = report.output_after
    if after is not None:
        state = "matches" if after.passed else f"still differs (max_abs {format_number(after.max_abs)})"
        report.all_note = _join(
            report.all_note,
            f"with the {len(report.culprits)} culprit(s) given the reference's outputs, the port's output {state}",
        )


def _substitute(searcher: _Bisector, reference: str) -> Any:
    """Hook the aligned port module so it returns the reference's captured output for the call whose captured
    inputs are nearest its own (so replays of its parents see the substitution too)."""
    pair = searcher.alignment.pair_of(reference)
    module = searcher.port_modules.get(pair.port) if pair is not None else None
    calls = searcher.rt.calls(reference)
    if module is None or not calls:
        return None

    def hook(mod: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        leaves = flatten_tensors((args, kwargs), "input")
        best = min(calls, key=lambda record: _distance(list(record.inputs.items()), leaves))
        replaced = _replace_leaves(output, list(best.outputs.items()))
        return output if replaced is None else replaced

    probe = _replace_leaves(searcher.pt[pair.port].output_value(), list(calls[0].outputs.items()))
    if probe is None:
        return None
    return module.register_forward_hook(hook, with_kwargs=True)


def _distance(ref_leaves: list, port_leaves: list) -> float:
    pairs = _pair_leaves(ref_leaves, port_leaves)
    if not pairs:
        return math.inf
    total = 0.0
    for i, j in pairs:
        a, b = ref_leaves[i][1], port_leaves[j][1]
        if a.is_floating_point() and b.is_floating_point():
            total += float((a.double().cpu() - b.detach().double().cpu()).abs().max()) if a.numel() else 0.0
        elif not torch_equal(a, b):
            total += 1.0
    return total


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a.cpu(), b.detach().cpu()))


def _replace_leaves(value: Any, ref_leaves: list) -> Any:
    """``value`` with its tensors replaced by the paired reference tensors (same dtype and device), or ``None``."""
    port_leaves = flatten_tensors(value)
    pairs = _pair_leaves(ref_leaves, port_leaves)
    if pairs is None:
        return None
    swap = {}
    for i, j in pairs:
        path, own = port_leaves[j]
        swap[path] = ref_leaves[i][1].to(device=own.device, dtype=own.dtype)
    return _rebuild(value, swap, "output")


def _rebuild(value: Any, swap: dict[str, Any], prefix: str) -> Any:
    import copy

    if _is_tensor(value):
        return swap.get(prefix, value)
    if isinstance(value, dict):
        out = copy.copy(value)
        for k, v in value.items():
            out[k] = _rebuild(v, swap, f"{prefix}.{k}")
        return out
    if isinstance(value, (tuple, list)):
        items = [_rebuild(v, swap, f"{prefix}.{i}") for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _untested_inside(alignment: Alignment, module: str) -> str:
    """Name the correspondences under ``module`` that replay cannot check one-to-one (they may hide the bug)."""
    prefix = module + "." if module else ""
    groups = sorted({p.reference for p in alignment.pairs if p.group and p.reference.startswith(prefix)})
    layouts = [p for p in alignment.pairs if p.layout and p.reference.startswith(prefix)]
    notes = []
    if groups:
        notes.append(f"fused<->split parameters not replayed one-to-one: {', '.join(groups[:4])}")
    if layouts:
        shown = ", ".join(f"{p.reference} ({p.layout})" for p in layouts[:4])
        notes.append(f"outputs reordered by the weight conversion, not compared: {shown}")
    return "; ".join(notes)


def _hints_at(searcher: _Bisector, call: Any, port_call: Any, result: ModuleTest | None, output: Any) -> list:
    """Evidence at the culprit (:func:`paritykit.evidence.culprit_evidence`: configuration, activation,
    fitted constants, weight slices, each fix verified on a copy of the port), with the input-aware and
    tensor-level hints on its first differing output pair (its inputs and its children's outputs as mixing
    candidates)."""
    from paritykit.diagnose import diagnose
    from paritykit.evidence import culprit_evidence

    replayed = result is not None and result.test == "replay"
    if replayed:
        ref_leaves, port_leaves = searcher.replays[call.name]
    else:
        ref_leaves = list(call.outputs.items())
        port_leaves = list(port_call.outputs.items()) if port_call is not None else []
    pairs = _pair_leaves(ref_leaves, port_leaves) or []
    worst = next(
        (
            (i, j)
            for i, j in pairs
            if not searcher.compare(ref_leaves[i][1], port_leaves[j][1], call.name).passed
        ),
        None,
    )
    if worst is None:
        return []
    i, j = worst
    a, b = ref_leaves[i][1], port_leaves[j][1]
    candidates = list(call.inputs.items())
    for child in searcher.frontier(call):
        child_out = child.output
        if child_out is not None:
            candidates.append((f"{child.name} output", child_out))
    tensor_hints = culprit_hints(a, b, candidates, diagnose(a, b))
    context = _culprit_context(searcher, call, port_call, ref_leaves, (i, j), replayed)
    return culprit_evidence(context, tensor_hints)


def _culprit_context(
    searcher: _Bisector, call: Any, port_call: Any, ref_leaves: list, leaf: tuple[int, int], replayed: bool
) -> Any:
    """The culprit as :mod:`paritykit.evidence` sees it: modules, outputs, and ways to re-run either side."""
    from paritykit.evidence import Culprit

    i, j = leaf
    ref_module = searcher.ref_modules.get(call.module)
    port_module = searcher.port_modules.get(port_call.module) if port_call is not None else None
    ref_out = ref_leaves[i][1]
    port_out = searcher.replays[call.name][1][j][1] if replayed else list(port_call.outputs.items())[j][1]

    def ref_inputs() -> tuple[tuple, dict] | None:
        if ref_module is None or not call.replayable:
            return None
        args, kwargs = call.call_inputs()
        device = _module_device(ref_module)
        args = tuple(a.to(device, copy=True) if _is_tensor(a) else a for a in args)
        return args, {k: v.to(device, copy=True) if _is_tensor(v) else v for k, v in kwargs.items()}

    def port_inputs() -> tuple[tuple, dict] | None:
        if port_module is None or port_call is None:
            return None
        return searcher.adapt_inputs(call, port_call, _module_device(port_module))

    def leaf_of(fn: Callable, inputs: tuple[tuple, dict] | None, index: int) -> Any:
        if inputs is None:
            raise ValueError("the call cannot be re-run")
        return flatten_tensors(fn(*inputs[0], **inputs[1]))[index][1]

    def check(fn: Callable) -> tuple[bool, float]:
        inputs = port_inputs()
        if inputs is None:
            raise ValueError("the port call cannot be re-run")
        cmp = searcher.compare_leaves(ref_leaves, flatten_tensors(fn(*inputs[0], **inputs[1])), call.name)
        return (cmp is not None and cmp.passed), (cmp.max_abs if cmp is not None else math.inf)

    ref_prefix = call.module + "." if call.module else ""
    port_prefix = port_call.module + "." if port_call is not None and port_call.module else ""
    subpairs = [
        (p.reference[len(ref_prefix) :], p.port[len(port_prefix) :])
        for p in searcher.alignment.one_to_one
        if p.reference.startswith(ref_prefix)
        and p.port.startswith(port_prefix)
        and p.reference != call.module
        and (p.reference or p.port)
    ]
    # fits and verification compare against the replayed outputs: only a replay fed both sides the same inputs
    can_run = replayed
    return Culprit(
        reference_name=call.module,
        port_name=port_call.module if port_call is not None else "",
        reference=ref_module,
        port=port_module,
        reference_output=ref_out,
        port_output=port_out,
        run_reference=(lambda fn: leaf_of(fn, ref_inputs(), i))
        if ref_module is not None and can_run
        else None,
        run_port=(lambda fn: leaf_of(fn, port_inputs(), j)) if port_module is not None and can_run else None,
        check=check if port_module is not None and can_run else None,
        subpairs=subpairs,
        reference_inputs=ref_inputs() if can_run else None,
    )


def _to_device(value: Any, device: Any) -> Any:
    if _is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return tuple(inputs[0]), dict(inputs[1])
    raise ParityKitError("inputs must be (args, kwargs) or a kwargs dict")


def bisect(
    reference: Any,
    port: Any,
    inputs: Any,
    *,
    rules: Sequence[tuple[str, str]] = (),
    port_inputs: Callable[[tuple, dict], Any] | None = None,
    select_output: Callable[[str, Any], Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    ratio: float = JUMP_RATIO,
    ops: bool = False,
    environment: dict[str, Any] | None = None,
    levels: str = "auto",
    allow_masked: bool = False,
    all_culprits: bool = False,
) -> BisectReport:
    r"""Run both models on the same inputs and name the module where the port parts from the reference.

    Args:
        reference: the reference ``nn.Module`` (put it in eval mode first; dropout defeats replay).
        port: the port ``nn.Module``.
        inputs: ``(args, kwargs)`` or a kwargs dict, fed to both.
        rules: ``[(regex, repl), …]`` renaming reference module names into the port's naming.
        port_inputs: ``port_inputs(args, kwargs) -> (args, kwargs) | kwargs`` adapting the inputs to the port.
        select_output: ``select_output(side, output) -> Tensor`` picking the comparable tensor of each side
            (``side`` is ``"reference"`` or ``"port"``); default: the first tensor of the output.
        atol, rtol: tolerances (default: :func:`paritykit.compare.default_tolerances` of the dtypes).
        ratio: error-jump threshold (output error over input error) where replay is impossible.
        ops: also name the first op inside a replayed culprit whose result differs.
        allow_masked: accept the ``masked`` verdict (exit code 0).
        all_culprits: after each culprit, give it the reference's output in the port and search again, so
            ``culprits`` lists every independent one in execution order.
        levels: ``full`` captures every module at once; ``zoom`` captures one level of blocks at a time
            (:mod:`paritykit.zoom`); ``auto`` zooms when the reference has more than 300 modules or its
            weights are offloaded by accelerate.

    Returns:
        A :class:`BisectReport`: ``verdict`` (``match``/``diverge``/``masked``), ``culprit`` (and ``culprits``),
        ``first_output_divergence``,
        the alignment, every module tested, ``exit_code``.
    """
    args, kwargs = _split_inputs(inputs)
    if port_inputs is not None:
        from paritykit.errors import UserCodeError

        try:
            adapted = port_inputs(args, kwargs)
        except Exception as exc:
            raise UserCodeError(f"port_inputs raised {type(exc).__name__}: {exc}") from exc
        port_args, port_kwargs = _split_inputs(adapted)
    else:
        port_args, port_kwargs = args, kwargs
    return run_and_search(
        reference,
        port,
        (args, kwargs),
        (port_args, port_kwargs),
        rules=rules,
        select_output=select_output,
        atol=atol,
        rtol=rtol,
        ratio=ratio,
        ops=ops,
        environment=environment,
        levels=levels,
        allow_masked=allow_masked,
        all_culprits=all_culprits,
    )


def run_and_search(
    reference: Any,
    port: Any,
    ref_call: tuple[tuple, dict],
    port_call: tuple[tuple, dict],
    *,
    run: Callable[[Any, tuple, dict], Any] | None = None,
    levels: str = "auto",
    all_culprits: bool = False,
    **search: Any,
) -> BisectReport:
    r"""Run both sides on their inputs under capture and search the two traces (by levels when ``levels``
    asks for it). ``run(model, args, kwargs)`` replaces the plain call (a spec guards user code with it);
    ``search`` holds :func:`bisect_traces`' options."""
    import torch

    from paritykit.trace import capture
    from paritykit.zoom import use_zoom, zoom_bisect

    # --all substitutes modules anywhere in the port and re-runs it whole: it needs every module captured
    if not all_culprits and use_zoom(levels, reference):
        return zoom_bisect(reference, port, ref_call, port_call, run=run, **search)
    call = run or (lambda model, args, kwargs: model(*args, **kwargs))
    with torch.no_grad():
        with capture(reference) as ref_trace:
            call(reference, *ref_call)
        with capture(port) as port_trace:
            call(port, *port_call)
    return bisect_traces(
        ref_trace, port_trace, reference=reference, port=port, all_culprits=all_culprits, **search
    )
