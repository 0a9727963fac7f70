r"""Inputs shaped for a diffusers model class, read from its ``forward`` signature and its config.

A component test feeds the same inputs to the reference and to the port, and the port's class decides what
they look like: a UNet takes ``(sample (B, C, H, W), timestep, encoder_hidden_states (B, L, D))``, Flux takes
a token sequence ``(B, N, C)`` with position ids, a video VAE a ``(B, C, F, H, W)`` clip. ``model_inputs``
reads the signature and the config, builds a few candidate layouts in order of likelihood (image, video,
token sequence, 1-D signal; each context width the config names), and keeps the first that the model runs.
The trial runs on the ``meta`` device, so it costs no memory and no weights; only when a model cannot run
there (data-dependent control flow) is the trial repeated on the CPU.

``tiny_config`` shrinks a class's default config (one layer per stack, two heads, narrower channels) so that
a model class can be built and run in a test on a laptop CPU; ``survey`` says, class by class, whether that
worked and whether inputs were found, and why not (benchmarks/model_inputs.py lists every class).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from paritykit.base.errors import ParityKitError

# names of layer counts in diffusers configs: shrunk to one
_LAYER_COUNT = re.compile(
    r"(^|_)(layers|blocks|depth|res_blocks|layers_per_block|n_layers|hidden_layers|num_layers)$"
)
_NOT_LAYER_COUNT = re.compile(r"(types|channels|dim|size|indices|idx)$")
# names of head counts: shrunk to two (one for key/value heads, which must divide them)
_HEAD_COUNT = re.compile(r"(^|_)(num_attention_heads|num_heads|n_heads|attention_heads|heads)$")
_KV_HEAD_COUNT = re.compile(r"(^|_)(num_key_value_heads|n_kv_heads|kv_heads)$")
_HEAD_DIM = ("attention_head_dim", "head_dim", "dim_head", "attention_head_dim_")
# group counts of the norms: channel lists stay multiples of them
_GROUPS = ("norm_num_groups", "groups", "num_groups", "resnet_groups")
# the model's width when it is named instead of derived from heads x head dim
_WIDTH = ("dim", "hidden_size", "d_model", "inner_dim", "hidden_dim", "embed_dim", "model_dim")
# the base width of convolutional models, other channel counts derived from it by multipliers
_BASE_WIDTH = ("base_dim", "base_channels", "model_channels", "ch", "hidden_channels", "dim")
# per-resolution channel lists: scaled so the first is one group of the norm
_CHANNEL_LIST = re.compile(r"(^|_)(block_out_channels|channels|channel_list|block_channels)$")

SEQUENCE_LENGTH = 16  # image tokens for models that take a token sequence
CONTEXT_LENGTH = 4  # text tokens
FRAMES = (1, 5, 9)  # a clip's frame counts tried: 1 + 4k and 1 + 8k cover the common temporal strides


def init_defaults(model_class: type) -> dict[str, Any]:
    r"""The keyword defaults of ``model_class.__init__``: its default config."""
    parameters = inspect.signature(model_class.__init__).parameters.values()
    return {
        p.name: p.default
        for p in parameters
        if p.default is not inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD
    }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tiny_config(model_class: type, base: dict[str, Any] | None = None) -> dict[str, Any]:
    r"""The overrides that shrink ``model_class``'s default config (or ``base`` over it, a port's own
    config): one layer per stack, at most two heads (the head dimension kept, widths that equal heads x head
    dim following), channel lists scaled so their first entry is one norm group. Interface sizes (input
    channels, context width) are kept."""
    defaults = {
        **init_defaults(model_class),
        **{k: v for k, v in (base or {}).items() if not k.startswith("_")},
    }
    overrides: dict[str, Any] = {}
    for name, value in defaults.items():
        if _LAYER_COUNT.search(name) and not _NOT_LAYER_COUNT.search(name):
            if _is_int(value) and value > 1:
                overrides[name] = 1
            elif isinstance(value, (tuple, list)) and value and all(_is_int(v) for v in value):
                overrides[name] = type(value)(min(v, 1) if v > 0 else v for v in value)
    heads = {n: v for n, v in defaults.items() if _HEAD_COUNT.search(n) and _is_int(v) and v > 2}
    head_dim = next((defaults[n] for n in _HEAD_DIM if _is_int(defaults.get(n))), None)
    widths: dict[int, int] = {}
    for name, value in heads.items():
        overrides[name] = 2
        if head_dim:
            widths[value * head_dim] = 2 * head_dim
        for width in _WIDTH:
            old = defaults.get(width)
            if _is_int(old) and old % value == 0 and not head_dim:
                widths[old] = old // value * 2
    if not heads:
        # a convolutional model's base width: one norm group of channels, multipliers kept
        for name in _BASE_WIDTH:
            value = defaults.get(name)
            if _is_int(value) and value > 32:
                widths[value] = 32
    for name, value in defaults.items():
        if _KV_HEAD_COUNT.search(name) and _is_int(value) and value > 1:
            overrides[name] = 1
        elif _is_int(value) and value in widths and name not in overrides:
            overrides[name] = widths[value]
    groups = next((defaults[n] for n in _GROUPS if _is_int(defaults.get(n)) and defaults[n] > 0), 32)
    for name, value in defaults.items():
        if not (_CHANNEL_LIST.search(name) and isinstance(value, (tuple, list)) and value):
            continue
        if not all(_is_int(v) and v > 0 for v in value) or value[0] <= groups:
            continue
        ratio = value[0] / groups
        overrides[name] = type(value)(max(groups, round(v / ratio / groups) * groups) for v in value)
        # a head dimension wider than the narrowest stage leaves it no head
        for head in _HEAD_DIM:
            old = defaults.get(head)
            if _is_int(old) and old > 8:
                overrides[head] = 8
            elif isinstance(old, (tuple, list)) and all(_is_int(v) for v in old):
                overrides[head] = type(old)(min(v, 8) for v in old)
    return overrides


@dataclass(frozen=True)
class Shape:
    r"""One candidate layout: each argument's shape (or a fixed value), by name."""

    values: dict[str, Any]

    def describe(self) -> str:
        return ", ".join(f"{name} {_describe(spec)}" for name, spec in self.values.items())

    def materialize(self, seed: int, device: Any) -> dict[str, Any]:
        import torch

        from paritykit.tracing.checkpoints import seeded_noise

        made: dict[str, Any] = {}
        for offset, (name, spec) in enumerate(self.values.items()):
            made[name] = _make(spec, seed + offset, device, torch, seeded_noise)
        return made


@dataclass(frozen=True)
class Noise:
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Fixed:
    r"""A tensor of given values (timesteps, ids, sizes)."""

    values: tuple
    dtype: str = "float32"
    shape: tuple[int, ...] | None = None


def _describe(spec: Any) -> str:
    if isinstance(spec, Noise):
        return str(spec.shape)
    if isinstance(spec, Fixed):
        return f"{spec.shape or (len(spec.values),)} {spec.dtype}"
    if isinstance(spec, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in spec.items()) + "}"
    return repr(spec)


def _make(spec: Any, seed: int, device: Any, torch: Any, seeded_noise: Callable) -> Any:
    if isinstance(spec, Noise):
        if device == "meta":
            return torch.empty(spec.shape, device="meta")
        return seeded_noise(spec.shape, seed)
    if isinstance(spec, Fixed):
        tensor = torch.tensor(spec.values, dtype=getattr(torch, spec.dtype))
        if spec.shape is not None:
            tensor = tensor.reshape(spec.shape)
        return tensor.to(device)
    if isinstance(spec, dict):
        return {k: _make(v, seed + i, device, torch, seeded_noise) for i, (k, v) in enumerate(spec.items())}
    return spec


# --------------------------------------------------------------------------------------------------------
# candidates


def _first_int(config: dict, *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if _is_int(value) and value > 0:
            return value
    return None


def _spatial(config: dict) -> list[tuple[int, int]]:
    r"""(height, width) to try: the config's sample size when small, then 16, 32 and 8, on the patch grid."""
    patch = _first_int(config, "patch_size") or 1
    sample = config.get("sample_size")
    sizes = []
    if _is_int(sample) and 0 < sample <= 64:
        sizes.append((sample, sample))
    height, width = config.get("sample_height"), config.get("sample_width")
    if _is_int(height) and _is_int(width) and 0 < height * width <= 128 * 128:
        sizes.append((height, width))
    sizes += [(16, 16), (32, 32), (8, 8)]
    return list(
        dict.fromkeys((max(patch, h // patch * patch), max(patch, w // patch * patch)) for h, w in sizes)
    )


def _context_lengths(config: dict) -> list[int]:
    r"""Text lengths to try: four tokens, then a fixed length the config names (positional tables)."""
    fixed = _first_int(config, "max_text_seq_length", "text_seq_len", "max_sequence_length", "text_len")
    return [CONTEXT_LENGTH] + ([fixed] if fixed and fixed != CONTEXT_LENGTH and fixed <= 512 else [])


def _channels(config: dict) -> list[int]:
    names = ("in_channels", "latent_channels", "in_dim", "num_channels", "out_channels", "z_channels")
    found = [config[n] for n in names if _is_int(config.get(n)) and config[n] > 0]
    return list(dict.fromkeys(found + [3, 4]))


# config keys naming the width of the conditioning a model reads (text embeddings)
CONTEXT_WIDTHS = (
    "cross_attention_dim",
    "joint_attention_dim",
    "text_dim",
    "caption_channels",
    "encoder_hid_dim",
    "context_dim",
    "text_embed_dim",
    "caption_projection_dim",
    "text_hidden_dim",
    "cap_feat_dim",
)


def _contexts(config: dict) -> list[int]:
    found = []
    for name in CONTEXT_WIDTHS:
        value = config.get(name)
        if isinstance(value, (tuple, list)) and value and _is_int(value[0]):
            value = value[0]
        if _is_int(value) and value > 0:
            found.append(value)
    return list(dict.fromkeys(found)) or [32]


_SAMPLE_NAMES = ("sample", "hidden_states", "x", "latents", "z", "mel", "inputs_embeds", "input")
_TIME_NAMES = (
    "timestep",
    "timesteps",
    "t",
    "time",
    "timestep_ratio",
    "decoder_noise_time",
    "sigma",
    "sigmas",
)
# a second time argument (the target time of a flow map, a reference time): named like a time
_TIME_LIKE = re.compile(r"(^|_)(timesteps?|time|sigmas?)(_|$)|^(r|s)_?t(imestep)?$")
_CONTEXT_NAMES = ("encoder_hidden_states", "context", "cap_feats", "text_embeds", "encoder_hidden_state")


def _sample_layouts(config: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    r"""(kind, shape) for the main input, most likely first."""
    sizes = _spatial(config)
    channels = _channels(config)
    for c in channels:
        for h, w in sizes:
            yield "image", (1, c, h, w)
    for c in channels:
        for frames in FRAMES:
            for h, w in sizes[:2]:
                yield "video", (1, c, frames, h, w)
    for c in channels:
        for frames in FRAMES:
            for h, w in sizes[:2]:
                yield "frames-first video", (1, frames, c, h, w)
    widths = [config[n] for n in _WIDTH if _is_int(config.get(n)) and config[n] > 0]
    for c in list(dict.fromkeys(channels + widths)):
        yield "tokens", (1, SEQUENCE_LENGTH, c)
    for c in channels:
        yield "signal", (1, c, 64)


def _required(forward: Callable) -> tuple[list[str], set[str]]:
    parameters = inspect.signature(forward).parameters
    required = [
        n
        for n, p in parameters.items()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return required, set(parameters)


def _candidates(model_class: type, config: dict) -> Iterator[Shape]:
    required, accepted = _required(model_class.forward)
    required = [n for n in required if n != "self"]
    sample_name = next((n for n in required if n in _SAMPLE_NAMES), None)
    if sample_name is None and required:
        sample_name = required[0] if required[0] not in _TIME_NAMES else None
    time_name = next((n for n in _TIME_NAMES if n in accepted), None)
    context_name = next((n for n in _CONTEXT_NAMES if n in accepted), None)
    other_times = [n for n in required if n != time_name and _TIME_LIKE.search(n)]
    unknown = [n for n in required if n not in {sample_name, time_name, context_name, *other_times}]
    unknown = [n for n in unknown if n not in _EXTRA_NAMES]
    if unknown:
        raise _Unshapeable(
            f"forward needs {', '.join(unknown)}, which paritykit cannot shape from the config"
        )
    times = [Fixed((10.0,)), Fixed((10,), "int64")] if time_name else [None]
    contexts = (
        list(itertools.product(_context_lengths(config), _contexts(config))) if context_name else [None]
    )
    for (kind, shape), time, context in itertools.product(_sample_layouts(config), times, contexts):
        values: dict[str, Any] = {}
        if sample_name:
            values[sample_name] = Noise(shape)
        if time_name:
            values[time_name] = time
            values.update({n: time for n in other_times})
        if context_name:
            values[context_name] = Noise((1, *context))
        text = context[0] if context else CONTEXT_LENGTH
        values.update(_extras(accepted, set(required), config, kind, shape, text))
        yield Shape(values)


_EXTRA_NAMES = (
    "img_ids",
    "txt_ids",
    "pooled_projections",
    "guidance",
    "class_labels",
    "added_cond_kwargs",
    "controlnet_cond",
    "added_time_ids",
    "encoder_attention_mask",
)


def _extras(
    accepted: set[str], required: set[str], config: dict, kind: str, shape: tuple[int, ...], text: int
) -> dict[str, Any]:
    r"""The optional inputs that a config says its model uses (position ids, pooled text, class labels, …)."""
    extras: dict[str, Any] = {}
    if "encoder_attention_mask" in required:
        extras["encoder_attention_mask"] = Fixed((True,) * text, "bool", shape=(1, text))
    if "img_ids" in accepted and (kind == "tokens" or "img_ids" in required):
        extras["img_ids"] = Fixed(tuple(float(i % 4) for i in range(shape[1] * 3)), shape=(shape[1], 3))
    if "txt_ids" in accepted:
        extras["txt_ids"] = Fixed((0.0,) * (text * 3), shape=(text, 3))
    pooled = _first_int(config, "pooled_projection_dim")
    if "pooled_projections" in accepted and pooled:
        extras["pooled_projections"] = Noise((1, pooled))
    if "guidance" in accepted and config.get("guidance_embeds"):
        extras["guidance"] = Fixed((3.5,))
    labels = _first_int(
        config, "num_class_embeds", "num_embeds_ada_norm", "num_classes", "class_dropout_prob"
    )
    if "class_labels" in accepted and (labels or config.get("class_embed_type")):
        extras["class_labels"] = Fixed((1,), "int64")
    if "added_cond_kwargs" in accepted and config.get("addition_embed_type") == "text_time":
        time_ids = (_first_int(config, "projection_class_embeddings_input_dim") or 0) - (
            _first_int(config, "addition_time_embed_dim") or 0
        ) * 6
        extras["added_cond_kwargs"] = {
            "text_embeds": Noise((1, max(time_ids, 1))),
            "time_ids": Fixed((64.0,) * 6, shape=(1, 6)),
        }
    if "controlnet_cond" in accepted:
        conditioning = _first_int(config, "conditioning_channels") or 3
        if kind == "image":
            side = shape[-1] * 8 if "conditioning_embedding_out_channels" in config else shape[-1]
            extras["controlnet_cond"] = Noise((1, conditioning, side, side))
        else:
            extras["controlnet_cond"] = Noise(shape)
    if "added_time_ids" in accepted:
        extras["added_time_ids"] = Fixed((6.0, 127.0, 0.02), shape=(1, 3))
    return extras


class _Unshapeable(Exception):
    pass


# a model too large for a trial on the CPU gets none: its inputs must be given
CPU_TRIAL_PARAMETERS = 300_000_000
# a shrunk config this large is not "tiny"
TINY_PARAMETERS = 150_000_000


def _runs(model: Any, kwargs: dict[str, Any], device: str) -> BaseException | None:
    import torch

    try:
        # tensors the forward makes without a device land beside the model's; the model's own deprecation
        # warnings are not the caller's
        with torch.no_grad(), torch.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(**kwargs)
    except Exception as error:  # a layout the model rejects: try the next
        return error
    return None


def _find_layout(model: Any, config: dict, device: str) -> Shape:
    r"""The first candidate layout ``model`` runs on ``device``."""
    first: tuple[Shape, BaseException] | None = None
    candidates = list(_candidates(type(model), config))
    for shape in candidates:
        error = _runs(model, shape.materialize(0, device), device)
        if error is None:
            return shape
        first = first or (shape, error)
    if first is None:
        raise _Unshapeable("no candidate layout")
    shape, error = first
    message = (str(error).strip().splitlines() or [""])[0][:200]
    raise _Unshapeable(
        f"none of {len(candidates)} layouts ran; the first, {shape.describe()}, "
        f"raised {type(error).__name__}: {message}"
    )


def build(model_class: type, config: dict, device: str = "cpu") -> Any:
    r"""``model_class`` built from ``config`` on ``device`` (``meta``: no memory), in eval mode.

    Raises ParityKitError naming the class when the config does not build it.
    """
    import torch

    from paritykit.base.quiet import quiet_diffusers

    # on the meta device there are no values to initialise: diffusers' switch skips torch's init functions,
    # which cost more than the build itself there
    skip_init = _no_init_weights() if device == "meta" else contextlib.nullcontext()
    try:
        with quiet_diffusers(), torch.device(device), skip_init, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if hasattr(model_class, "from_config"):
                model = model_class.from_config(config)
            else:
                model = model_class(**config)
    except Exception as error:  # any constructor error: the class cannot be built from this config
        message = (str(error).strip().splitlines() or [""])[0][:200]
        raise ParityKitError(
            f"{model_class.__name__} does not build from this config: {type(error).__name__}: {message}"
        ) from None
    return model.eval()


def _no_init_weights():
    from diffusers.models.modeling_utils import no_init_weights

    return no_init_weights()


def _full_config(model_class: type, config: dict | None) -> dict[str, Any]:
    merged = {**init_defaults(model_class), **dict(config or {})}
    return {k: v for k, v in merged.items() if not k.startswith("_")}


def input_layout(model_class: type, config: dict | None = None) -> Shape:
    r"""The layout of inputs ``model_class`` built from ``config`` runs on: found on the ``meta`` device, else
    (models whose forward reads values) on the CPU when the model is small enough to build there."""
    config = _full_config(model_class, config)
    key = (model_class, repr(sorted(config.items())))
    if key not in _LAYOUTS:
        try:
            _LAYOUTS[key] = _search_layout(model_class, config)
        except ParityKitError as error:
            _LAYOUTS[key] = error
    found = _LAYOUTS[key]
    if isinstance(found, ParityKitError):
        raise ParityKitError(str(found))
    return found


# (class, config) -> the layout found, or the error: the search runs the model many times, its answer never
# changes within a process
_LAYOUTS: dict[tuple, Any] = {}


def _search_layout(model_class: type, config: dict) -> Shape:
    try:
        return _find_layout(build(model_class, config, "meta"), config, "meta")
    except _Unshapeable as error:
        on_meta = str(error)
    if parameter_count(model_class, config) > CPU_TRIAL_PARAMETERS:
        reason = on_meta
    else:
        try:
            return _find_layout(build(model_class, config, "cpu"), config, "cpu")
        except _Unshapeable as error:
            reason = str(error)
    raise ParityKitError(
        f"{model_class.__name__}: no inputs found from its forward signature and config ({reason}); "
        "give them with --inputs MODULE:FUNCTION returning (args, kwargs)"
    )


def model_inputs(model_class: type, config: dict | None = None, seed: int = 0) -> tuple[tuple, dict]:
    r"""Seeded inputs for ``model_class`` built from ``config`` (over its defaults), as (args, kwargs).

    The arguments ``forward`` requires come positionally in its order (so a reference whose forward takes the
    same things in the same order, under other names, can be called with them too); the optional ones the
    config asks for (position ids, pooled text, class labels, …) come by keyword. The same seed gives the same
    values. Raises ParityKitError naming the class and the first layout's error when no layout runs.
    """
    layout = input_layout(model_class, config)
    values = layout.materialize(seed, "cpu")
    required, _ = _required(model_class.forward)
    positional = [n for n in required if n != "self" and n in values]
    args = tuple(values.pop(n) for n in positional)
    return args, values


def parameter_count(model_class: type, config: dict) -> int:
    r"""The number of parameters ``model_class`` built from ``config`` holds, counted on the meta device."""
    model = build(model_class, _full_config(model_class, config), "meta")
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class Survey:
    r"""One model class, tried: built tiny from its default config, and its inputs found.

    ``status`` is ``"runs"`` (``layout`` holds the inputs), ``"no tiny build"`` or ``"no inputs"``, with the
    reason in ``reason``."""

    name: str
    status: str
    reason: str = ""
    parameters: int = 0
    layout: str = ""


def survey(model_class: type) -> Survey:
    r"""Build ``model_class`` tiny from its default config (``tiny_config``) and find its inputs on the meta
    device. Nothing is allocated: the tests and the benchmark build on the CPU only what this says runs."""
    name = model_class.__name__
    try:
        config = _full_config(model_class, tiny_config(model_class))
        count = parameter_count(model_class, config)
    except ParityKitError as error:
        return Survey(name, "no tiny build", _build_reason(model_class, error))
    if count > TINY_PARAMETERS:
        reason = f"shrunk, its default config still holds {count / 1e6:.0f} M parameters"
        return Survey(name, "no tiny build", reason, count)
    try:
        layout = input_layout(model_class, config)
    except ParityKitError as error:
        return Survey(name, "no inputs", str(error).split(" (", 1)[-1].rsplit("); give", 1)[0], count)
    return Survey(name, "runs", parameters=count, layout=layout.describe())


def _build_reason(model_class: type, error: ParityKitError) -> str:
    r"""Why the tiny build failed: no defaults, a default config that does not build, or the shrinking."""
    missing = [
        p.name
        for p in inspect.signature(model_class.__init__).parameters.values()
        if p.default is inspect.Parameter.empty and p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    if missing:
        return f"its constructor has no default for {', '.join(missing)}"
    detail = str(error).split("from this config: ", 1)[-1]
    try:
        parameter_count(model_class, {})
    except ParityKitError:
        return f"its default config does not build ({detail})"
    return f"its default config builds, the shrunk one does not ({detail})"


def model_classes() -> list[type]:
    r"""Every model class (a ``ModelMixin`` subclass) diffusers exports, by name."""
    import diffusers
    from diffusers import ModelMixin

    found = []
    for name in sorted(dir(diffusers)):
        try:
            value = getattr(diffusers, name)
        except Exception:  # an optional backend missing: not a class this install ships
            continue
        if isinstance(value, type) and issubclass(value, ModelMixin) and value is not ModelMixin:
            found.append(value)
    return found


def run_tiny(model_class: type, seed: int = 0) -> str | None:
    r"""Build ``model_class`` tiny on the CPU and run it once on ``model_inputs``; None when it ran and gave a
    finite tensor, else what went wrong, in one line."""
    import torch

    config = _full_config(model_class, tiny_config(model_class))
    torch.manual_seed(seed)
    model = build(model_class, config, "cpu")
    args, kwargs = model_inputs(model_class, config, seed)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            output = model(*args, **kwargs)
    except Exception as error:  # reported, not raised: the survey lists it
        return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
    from paritykit.tracing.recording import tensor_leaves

    leaves = tensor_leaves(output, "output")[0].values()
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        return "the output holds no floating-point tensor"
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        return "the output is not finite"
    return None
