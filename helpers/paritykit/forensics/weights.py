r"""Diff two checkpoints tensor by tensor without loading either one whole.

Safetensors inputs (single files, sharded ``*.index.json`` sets, diffusers model and pipeline folders) are
read header first: keys, shapes and dtypes come from the JSON headers alone, so ``keys_only=True`` never
touches a tensor and never imports torch or numpy. Values are then streamed one tensor pair at a time: the two
byte ranges are compared raw first (most tensors of a fine-tune or a merge are untouched, and ``memcmp`` is
far cheaper than any float maths), and only pairs whose bytes differ are decoded in fixed-size chunks to
accumulate L2, L1, cosine and max-abs. Peak anonymous memory is a few chunk buffers per worker, whatever the
file size.

Pickled checkpoints (``.ckpt``/``.pt``/``.bin`` …) go through :func:`paritykit.base.io.load_state_dict` (the
safe loader), so they are in memory as a whole; the same chunked comparison then runs on the loaded tensors.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.files import save_figure
from paritykit.base.io import shard_set
from paritykit.base.naming import Rule, natural_key, rename_all
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table
from paritykit.forensics.safetensors_header import TensorInfo, read_safetensors_header
from paritykit.forensics.weights_values import compare_all

METRICS = ("l2", "l1", "cosine", "max_abs")
GROUP_BY = ("component", "kind", "both")
KINDS = ("self-attention", "cross-attention", "feed-forward", "norm", "proj", "embedding", "conv", "other")


# ----------------------------------------------------------------------------------------------- sources
@dataclass
class _Entry:
    r"""One tensor of a checkpoint: either a byte range in a safetensors file or a tensor already in
    memory."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    info: TensorInfo | None = None
    tensor: Any = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Checkpoint:
    path: str
    entries: dict[str, _Entry]
    streamed: bool


def _entries_from_header(path: Path, prefix: str = "") -> dict[str, _Entry]:
    header = read_safetensors_header(path)
    return {
        prefix + name: _Entry(prefix + name, info.dtype, info.shape, info=info)
        for name, info in header.tensors.items()
    }


def _entries_from_state_dict(path: Path, prefix: str = "") -> dict[str, _Entry]:
    from paritykit.base.io import load_state_dict

    state = load_state_dict(path)
    entries = {}
    for name, tensor in state.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries[prefix + name] = _Entry(prefix + name, dtype, tuple(tensor.shape), tensor=tensor)
    return entries


def _safetensors_in(folder: Path) -> Path | None:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return indexes[0]
    for preferred in ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json"):
        if indexes and (folder / preferred).is_file():
            return folder / preferred  # the full-precision set, not a variant such as .fp16
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return files[0]
    for preferred in ("diffusion_pytorch_model.safetensors", "model.safetensors"):
        if (folder / preferred).is_file():
            return folder / preferred
    if not indexes and shard_set(folder) is not None:
        return folder  # shards without an index: one checkpoint, read_safetensors_header merges them
    if len(files) > 1 or len(indexes) > 1:
        names = ", ".join(p.name for p in (indexes or files)[:4])
        raise ParityKitError(f"{folder}: holds several checkpoints ({names}); name the file to compare")
    return None


def _has_pickled_weights(folder: Path) -> bool:
    return any(
        next(folder.glob(pattern), None)
        for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.bin.index.json")
    )


def open_checkpoint(path: str | os.PathLike) -> _Checkpoint:
    r"""Index a checkpoint's tensors; safetensors sources stay on disk, pickles are loaded by the safe loader.

    A diffusers pipeline folder (``model_index.json``) yields ``<component>.<key>`` names for every component
    subfolder holding weights, so two pipelines are compared component by component.
    """
    path = Path(path)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / "model_index.json").is_file():
            entries: dict[str, _Entry] = {}
            streamed = True
            for sub in sorted(p for p in path.iterdir() if p.is_dir()):
                found = _safetensors_in(sub)
                if found is not None:
                    entries.update(_entries_from_header(found, prefix=f"{sub.name}."))
                elif _has_pickled_weights(sub):
                    entries.update(_entries_from_state_dict(sub, prefix=f"{sub.name}."))
                    streamed = False
            if not entries:
                raise ParityKitError(f"{path}: pipeline folder has no component weights")
            return _Checkpoint(str(path), entries, streamed)
        found = _safetensors_in(path)
        if found is not None:
            return _Checkpoint(str(path), _entries_from_header(found), True)
        return _Checkpoint(str(path), _entries_from_state_dict(path), False)
    if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        return _Checkpoint(str(path), _entries_from_header(path), True)
    return _Checkpoint(str(path), _entries_from_state_dict(path), False)


# ------------------------------------------------------------------------------------ groups and kinds
# (prefix, component) — first match wins, so longer, more specific prefixes come first.
_COMPONENT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model_ema.", "ema"),
    ("first_stage_model.", "vae"),
    ("cond_stage_model.", "text_encoder"),
    ("conditioner.embedders.0.", "text_encoder"),
    ("conditioner.embedders.1.", "text_encoder_2"),
    ("conditioner.", "conditioner"),
    ("model.diffusion_model.", "diffusion_model"),
    ("control_model.", "controlnet"),
    # Flux / SD3-style single-file transformers (original naming)
    ("double_blocks.", "transformer"),
    ("single_blocks.", "transformer"),
    ("joint_blocks.", "transformer"),
    ("img_in.", "transformer"),
    ("txt_in.", "transformer"),
    ("time_in.", "transformer"),
    ("vector_in.", "transformer"),
    ("guidance_in.", "transformer"),
    ("final_layer.", "transformer"),
    ("x_embedder.", "transformer"),
    ("context_embedder.", "transformer"),
    # stand-alone text encoders and autoencoders
    ("text_model.", "text_encoder"),
    ("shared.", "text_encoder"),
    ("encoder.block.", "text_encoder"),
    ("encoder.final_layer_norm.", "text_encoder"),
    ("encoder.", "vae"),
    ("decoder.", "vae"),
    ("quant_conv.", "vae"),
    ("post_quant_conv.", "vae"),
)
# diffusers pipeline components (saved or merged with their folder name as prefix)
_DIFFUSERS_COMPONENTS = {
    "vae",
    "unet",
    "transformer",
    "prior",
    "decoder",
    "controlnet",
    "image_encoder",
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "movq",
    "vqvae",
    "audio_encoder",
}
_LDM_SCHEDULE = re.compile(
    r"^(betas|alphas_cumprod(_prev)?|sqrt_\w+|posterior_\w+|log_one_minus_alphas_cumprod|logvar|model_ema\.(decay|num_updates))$"
)


def component_of(key: str) -> str:
    r"""Which part of a checkpoint a key belongs to: ``vae``, ``text_encoder``, ``diffusion_model``, ``ema`` …

    Recognises LDM/SD (``first_stage_model``, ``cond_stage_model``, ``model.diffusion_model``, ``model_ema``),
    SDXL (``conditioner.embedders.N``), diffusers pipeline prefixes (``vae.``, ``unet.``, ``transformer.`` …)
    and Flux-style single files. Anything else is ``model``."""
    if _LDM_SCHEDULE.match(key):
        return "schedule"
    head = key.split(".", 1)[0]
    if head in _DIFFUSERS_COMPONENTS and "." in key and not key.startswith(("encoder.", "decoder.")):
        return head
    for prefix, component in _COMPONENT_PREFIXES:
        if key.startswith(prefix):
            return component
    return "model"


# LDM ResBlocks name their layers by position: in_layers.0 is the norm, in_layers.2 the conv
_LDM_POSITIONS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("norm", re.compile(r"(^|\.)(in|out)_layers\.0\.")),
    ("conv", re.compile(r"(^|\.)(in|out)_layers\.[23]\.|(^|\.)(skip_connection|nin_shortcut|op)\.")),
    ("conv", re.compile(r"(^|diffusion_model\.)(input_blocks\.0\.0|out\.2)\.")),
    ("norm", re.compile(r"(^|diffusion_model\.)out\.0\.")),
)
# roles of one name component, tried in this order (a norm inside an attention block is a norm)
_ROLES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("norm", re.compile(r"norm|^ln(_\w+)?$|^layer_?norm|^(\w+_)?mod(ulation)?$|^adaln", re.I)),
    ("cross-attention", re.compile(r"^(attn2|cross_?attn\w*|crossattention|encdecattention)$", re.I)),
    (
        "self-attention",
        re.compile(
            r"^(attn1?|self_?attn|selfattention|attention|\w+_attn|attn_\d+|to_(q|k|v|out|add_out)|"
            r"(add_)?[qkv]_proj|o_proj|out_proj|qkv|[qkv]|query|key|value|in_proj_(weight|bias))$",
            re.I,
        ),
    ),
    (
        "feed-forward",
        re.compile(
            r"^(ff|ffn|ff_net|ff_context|mlp|\w+_mlp|mlp_\w+|feed_?forward|fc\d*|c_fc|densereludense|"
            r"intermediate)$",
            re.I,
        ),
    ),
    ("embedding", re.compile(r"emb|^shared$|^cls_token$|^(time|vector|guidance|txt|img)_in$", re.I)),
    ("proj", re.compile(r"^proj_(in|out)$", re.I)),
    ("conv", re.compile(r"conv|^(skip_connection|nin_shortcut|op|downsample|upsample)$", re.I)),
)
# components that say nothing by themselves: their parent module decides (ff.net.0.proj is feed-forward)
_GENERIC = re.compile(
    r"^(\d+|proj|projection|linear|lin|dense|net|output|weight|bias|scale|gamma|beta|running_(mean|var)|"
    r"num_batches_tracked)$",
    re.I,
)
_GENERIC_PROJ = re.compile(r"^(proj|projection|linear|lin|dense)$", re.I)


def kind_of(key: str, shape: Sequence[int] = ()) -> str:
    r"""What a parameter is: self-attention, cross-attention, feed-forward, norm, proj, embedding, conv,
    other.

    Decided by the role of the module that holds it, read from the leaf upwards: the first name component
    with a role wins (``…attentions.0.transformer_blocks.0.ff.net.0.proj`` is feed-forward, ``…norm1`` is a
    norm, ``proj_in``/``proj_out`` are proj, ``to_q`` under ``attn2`` is cross-attention), so research and
    diffusers names of one tensor get one kind. Components that name nothing (``proj``, ``net``, ``0``)
    defer to their parent; LDM ResBlock positions (``in_layers.0``) are read as the layers they are; an
    otherwise unnamed 4-D weight is a conv."""
    for kind, pattern in _LDM_POSITIONS:
        if pattern.search(key):
            return kind
    parts = key.split(".")
    generic_proj = False
    for depth in range(len(parts) - 1, -1, -1):
        part = parts[depth]
        if _GENERIC.match(part):
            generic_proj = generic_proj or bool(_GENERIC_PROJ.match(part))
            continue
        for kind, pattern in _ROLES:
            if pattern.search(part):
                if kind == "self-attention" and any(_ROLES[1][1].search(p) for p in parts[:depth]):
                    return "cross-attention"
                return kind
    if generic_proj:
        return "proj"
    return "conv" if len(shape) == 4 else "other"


def _group_name(key: str, shape: Sequence[int], group_by: str) -> str:
    if group_by == "component":
        return component_of(key)
    if group_by == "kind":
        return kind_of(key, shape)
    return f"{component_of(key)}/{kind_of(key, shape)}"


# ---------------------------------------------------------------------------------------- the report
@dataclass
class ChangedTensor:
    r"""One tensor whose values differ. ``dot``/``norm_a``/``norm_b``/``sq_diff`` are the raw sums behind the
    metrics, kept so a group's distance is the metric of the concatenated group, not a sum of per-tensor
    values."""

    key: str
    group: str
    shape: tuple[int, ...]
    l2: float
    l1: float
    cosine: float
    max_abs: float
    dot: float = 0.0
    norm_a: float = 0.0
    norm_b: float = 0.0

    def metric(self, name: str) -> float:
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "group": self.group,
            "l2": self.l2,
            "cosine": self.cosine,
            "max_abs": self.max_abs,
            "l1": self.l1,
            "shape": list(self.shape),
        }


@dataclass
class GroupStats:
    identical: int = 0
    changed: int = 0
    only_a: int = 0
    only_b: int = 0
    shape_mismatch: int = 0
    dtype_mismatch: int = 0
    distance: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class WeightsDiff:
    r"""Result of :func:`weights_diff`: rendered as per-group lines plus the largest changes, or as JSON.

    Keys are in B's naming (``rules`` rename A's keys). ``identical`` counts common tensors whose values are
    equal (with ``keys_only``: whose shape and dtype agree, values unread).
    """

    a: str
    b: str
    metric: str = "l2"
    group_by: str = "component"
    keys_only: bool = False
    tensors_a: int = 0
    tensors_b: int = 0
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    shape_mismatch: list[dict[str, Any]] = field(default_factory=list)
    dtype_mismatch: list[dict[str, Any]] = field(default_factory=list)
    identical: int = 0
    changed: list[ChangedTensor] = field(default_factory=list)
    groups: dict[str, GroupStats] = field(default_factory=dict)
    renamed: int = 0
    bytes_compared: int = 0
    seconds: float = 0.0
    plot: str | None = None

    @property
    def no_shared_names(self) -> bool:
        r"""Both sides hold tensors, yet no name is common: a naming difference, not a weight difference."""
        common = self.identical + len(self.changed) + len(self.shape_mismatch) + len(self.dtype_mismatch)
        return not common and bool(self.only_a) and bool(self.only_b)

    def hint(self) -> str | None:
        if not self.no_shared_names:
            return None
        return (
            "no tensor name is shared: the two sides name their tensors differently. Infer the renames from"
            " the values with `paritykit weights map A B`, then pass them here as --map 'REGEX=REPL' (applied"
            " to A)."
        )

    @property
    def exit_code(self) -> int:
        differs = self.only_a or self.only_b or self.shape_mismatch or self.dtype_mismatch or self.changed
        return 1 if differs else 0

    def largest_changes(self) -> list[ChangedTensor]:
        def order(item: ChangedTensor) -> tuple[int, float]:
            value = item.metric(self.metric)
            if value is None or math.isnan(value):
                return (0, 0.0)
            return (1, value if self.metric == "cosine" else -value)

        return sorted(self.changed, key=order)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "metric": self.metric,
            "group_by": self.group_by,
            "values_compared": not self.keys_only,
            "tensors_a": self.tensors_a,
            "tensors_b": self.tensors_b,
            "only_a": list(self.only_a),
            "only_b": list(self.only_b),
            "shape_mismatch": list(self.shape_mismatch),
            "dtype_mismatch": list(self.dtype_mismatch),
            "identical": self.identical,
            "changed": [c.to_dict() for c in self.largest_changes()],
            "groups": {name: stats.to_dict() for name, stats in self.groups.items()},
            "renamed": self.renamed,
            "bytes_compared": self.bytes_compared,
            "seconds": round(self.seconds, 3),
            "plot": self.plot,
            "hint": self.hint(),
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        lines = [f"A: {self.a} ({self.tensors_a} tensors)", f"B: {self.b} ({self.tensors_b} tensors)", ""]
        same_label = "headers match" if self.keys_only else "identical"
        headers = ["group", same_label, "changed", "only A", "only B", "shape", "dtype"]
        if not self.keys_only:
            headers.append(self.metric)
        rows = []
        for name, stats in self.groups.items():
            row = [name, stats.identical, stats.changed, stats.only_a, stats.only_b, stats.shape_mismatch]
            row.append(stats.dtype_mismatch)
            if not self.keys_only:
                row.append(_cosine(stats.distance) if self.metric == "cosine" else stats.distance)
            rows.append(row)
        lines.append(render_table(headers, rows, limit=None))
        if self.changed:
            lines += ["", f"largest changes by {self.metric}:"]
            table = [
                (c.key, c.group, c.l2, _cosine(c.cosine), c.max_abs)
                + ((c.l1,) if self.metric == "l1" else ())
                for c in self.largest_changes()
            ]
            extra = ["l1"] if self.metric == "l1" else []
            lines.append(
                render_table(["key", "group", "l2", "cosine", "max_abs", *extra], table, limit=limit)
            )
        mismatches = [("shape", m) for m in self.shape_mismatch] + [("dtype", m) for m in self.dtype_mismatch]
        if mismatches:
            lines += ["", "mismatches:"]
            rows = [(what, m["key"], _fmt(m["a"]), _fmt(m["b"])) for what, m in mismatches]
            lines.append(render_table(["what", "key", "A", "B"], rows, limit=limit))
        for label, keys in (("only in A", self.only_a), ("only in B", self.only_b)):
            if keys:
                shown = keys if not limit else keys[:limit]
                more = f" … {len(keys) - len(shown)} more" if len(keys) > len(shown) else ""
                lines += ["", f"{label} ({len(keys)}): " + ", ".join(shown) + more]
        if self.hint():
            lines += ["", f"hint: {self.hint()}"]
        if self.plot:
            lines += ["", f"plot: {self.plot}"]
        lines += ["", self.summary()]
        return "\n".join(lines)

    def summary(self) -> str:
        if not self.exit_code:
            what = "keys, shapes and dtypes match" if self.keys_only else "identical"
            return f"{what}: {self.identical} tensors ({self.seconds:.2f} s)"
        parts = []
        if not self.keys_only:
            parts.append(f"{len(self.changed)} changed")
        parts += [
            f"{len(self.only_a)} only in A",
            f"{len(self.only_b)} only in B",
            f"{len(self.shape_mismatch)} shape mismatch",
            f"{len(self.dtype_mismatch)} dtype mismatch",
            f"{self.identical} {'with matching headers' if self.keys_only else 'identical'}",
        ]
        return ", ".join(parts) + f" ({self.seconds:.2f} s)"


def _cosine(value: float) -> str:
    # near-identical weights have cosines like 0.9999987: three significant digits would print 1
    return "nan" if math.isnan(value) else f"{value:.7f}"


def _fmt(value: Any) -> str:
    return str(list(value)) if isinstance(value, (list, tuple)) else str(value)


def _aggregate(changed: list[ChangedTensor], metric: str) -> float:
    if not changed:
        return 1.0 if metric == "cosine" else 0.0
    if metric == "l2":
        return math.sqrt(sum(c.l2 * c.l2 for c in changed))
    if metric == "l1":
        return sum(c.l1 for c in changed)
    if metric == "max_abs":
        values = [c.max_abs for c in changed]
        return math.nan if any(math.isnan(v) for v in values) else max(values)
    denom = math.sqrt(sum(c.norm_a for c in changed) * sum(c.norm_b for c in changed))
    return sum(c.dot for c in changed) / denom if denom > 0 else 1.0


def weights_diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    rules: Sequence[Rule] = (),
    metric: str = "l2",
    group_by: str = "component",
    keys_only: bool = False,
    progress: bool | None = None,
    workers: int | None = None,
) -> WeightsDiff:
    r"""Diff two checkpoints tensor by tensor, streaming values one pair at a time.

    Args:
        a: reference checkpoint: ``.safetensors``, sharded ``*.index.json``, diffusers model or pipeline
            folder, or a pickled ``.ckpt``/``.pt``/``.pth``/``.bin`` (read by the safe loader).
        b: checkpoint to compare against it.
        rules: ``(regex, repl)`` rules renaming A's keys into B's naming, applied in order.
        metric: ``l2``, ``l1``, ``cosine`` or ``max_abs``: the one summed per group, sorted by and plotted.
        group_by: ``component`` (vae, text_encoder, diffusion_model, ema …), ``kind`` (self-attention,
            cross-attention, feed-forward, norm, proj, embedding, conv, other) or ``both``.
        keys_only: compare keys, shapes and dtypes from the headers only (no tensor is read).
        progress: show a tqdm bar on stderr; ``None`` = only when stderr is a terminal.
        workers: threads comparing tensor pairs (default: one per usable core; numpy releases the GIL).

    Returns:
        A :class:`WeightsDiff`; ``exit_code`` 0 when every tensor is identical, 1 otherwise.
    """
    if metric not in METRICS:
        raise ParityKitError(f"--metric {metric!r}: expected one of {', '.join(METRICS)}")
    if group_by not in GROUP_BY:
        raise ParityKitError(f"--group-by {group_by!r}: expected one of {', '.join(GROUP_BY)}")
    started = time.perf_counter()
    ckpt_a, ckpt_b = open_checkpoint(a), open_checkpoint(b)
    renamed = rename_all(ckpt_a.entries, rules) if rules else {k: k for k in ckpt_a.entries}
    entries_a = {new: ckpt_a.entries[old] for old, new in renamed.items()}
    entries_b = ckpt_b.entries

    report = WeightsDiff(
        a=ckpt_a.path,
        b=ckpt_b.path,
        metric=metric,
        group_by=group_by,
        keys_only=keys_only,
        tensors_a=len(entries_a),
        tensors_b=len(entries_b),
        renamed=sum(old != new for old, new in renamed.items()),
    )

    def group(key: str, entry: _Entry) -> GroupStats:
        name = _group_name(key, entry.shape, group_by)
        return report.groups.setdefault(name, GroupStats())

    pairs: list[tuple[str, _Entry, _Entry]] = []
    for key in sorted(entries_a.keys() | entries_b.keys(), key=natural_key):
        ea, eb = entries_a.get(key), entries_b.get(key)
        if eb is None:
            report.only_a.append(key)
            group(key, ea).only_a += 1
        elif ea is None:
            report.only_b.append(key)
            group(key, eb).only_b += 1
        elif ea.shape != eb.shape:
            report.shape_mismatch.append({"key": key, "a": list(ea.shape), "b": list(eb.shape)})
            group(key, eb).shape_mismatch += 1
        else:
            if ea.dtype != eb.dtype:
                report.dtype_mismatch.append({"key": key, "a": ea.dtype, "b": eb.dtype})
                group(key, eb).dtype_mismatch += 1
            pairs.append((key, ea, eb))

    if keys_only:
        for key, ea, eb in pairs:
            if ea.dtype == eb.dtype:
                report.identical += 1
                group(key, eb).identical += 1
        report.groups = dict(sorted(report.groups.items(), key=lambda item: natural_key(item[0])))
        report.seconds = time.perf_counter() - started
        return report

    # read in file order so a cold cache or a spinning disk sees sequential reads, then report in key order
    def file_order(index: int) -> tuple[str, int, int]:
        info = pairs[index][1].info
        return (str(info.file), info.start, index) if info is not None else ("", 0, index)

    order = sorted(range(len(pairs)), key=file_order)
    computed = compare_all([pairs[i] for i in order], progress=progress, workers=workers)
    results: list[dict[str, float] | None] = [None] * len(pairs)
    for index, values in zip(order, computed):
        results[index] = values
    for (key, ea, eb), values in zip(pairs, results):
        stats = group(key, eb)
        report.bytes_compared += (ea.info.nbytes if ea.info else 0) + (eb.info.nbytes if eb.info else 0)
        if values is None:
            if ea.dtype == eb.dtype:
                report.identical += 1
                stats.identical += 1
            continue
        stats.changed += 1
        report.changed.append(
            ChangedTensor(
                key=key,
                group=_group_name(key, eb.shape, group_by),
                shape=eb.shape,
                l2=values["l2"],
                l1=values["l1"],
                cosine=values["cosine"],
                max_abs=values["max_abs"],
                dot=values["dot"],
                norm_a=values["norm_a"],
                norm_b=values["norm_b"],
            )
        )
    for name, stats in report.groups.items():
        stats.distance = _aggregate([c for c in report.changed if c.group == name], metric)
    report.groups = dict(sorted(report.groups.items(), key=lambda item: natural_key(item[0])))
    report.seconds = time.perf_counter() - started
    return report


# ------------------------------------------------------------------------------------------------ plot
def plot_weights_diff(report: WeightsDiff, path: str | os.PathLike) -> Path:
    r"""One histogram panel per group of the chosen metric over changed tensors, saved as PNG.

    Distances span many orders of magnitude, so positive values are binned on a log10 axis; the count axis
    is linear unless counts are large, so a group with one small change still shows its bar. Sets
    ``report.plot`` to the path written."""
    from matplotlib import pyplot as plt

    path = Path(path)
    fig = draw_weights_diff(report)
    try:
        save_figure(fig, path, dpi=100)
    finally:
        plt.close(fig)
    report.plot = str(path)
    return path


def draw_weights_diff(report: WeightsDiff):
    r"""The figure :func:`plot_weights_diff` saves (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = [name for name, stats in report.groups.items() if stats.changed] or ["(no changed tensors)"]
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        values = [c.metric(report.metric) for c in report.changed if c.group == name]
        values = [v for v in values if v is not None and math.isfinite(v)]
        stats = report.groups.get(name)
        label = report.metric
        if values and min(values) > 0 and report.metric != "cosine":
            values = [math.log10(v) for v in values]
            label = f"log10 {report.metric}"
        if values:
            counts, _, _ = ax.hist(values, bins=min(30, max(5, len(values))), color="tab:blue")
            if max(counts) > 50:
                ax.set_yscale("log")
            else:
                ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
        else:
            ax.text(0.5, 0.5, "no changed tensors", ha="center", va="center", transform=ax.transAxes)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        distance = format_number(stats.distance) if stats else "-"
        ax.set_title(f"{name}: {report.metric}={distance} ({len(values)} changed)", fontsize=9)
        ax.set_xlabel(label)
        ax.set_ylabel("tensors")
    fig.tight_layout()
    return fig
