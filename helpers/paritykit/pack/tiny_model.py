r"""The tiny model ``paritykit new diffusers-tests`` writes its tests around: the port's class built from
a shrunk config, the inputs it runs on (shaped from its signature, or read from ``--inputs``) and drawn
exactly as the generated test draws them."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.errors import ParityKitError

FIXED_VALUES = 16  # an --inputs float tensor this small keeps its values (a timestep, a resolution)


@dataclass
class TinyModel:
    r"""The model class as the generated files import and build it."""

    cls: type
    source: tuple[str, str]  # (module, name) to import it from
    init: dict[str, Any]
    inputs: dict[str, Any]  # argument name -> spec (shaped_inputs.Noise / Fixed / dict / value)
    output_shape: tuple[int, ...]
    checkpointed: list[str] = field(default_factory=list)
    parameters: int = 0


def import_from(cls: type) -> tuple[str, str]:
    r"""(module, name) the generated files import ``cls`` from: ``diffusers`` when it exports the class."""
    import diffusers

    if getattr(diffusers, cls.__name__, None) is cls:
        return "diffusers", cls.__name__
    return cls.__module__, cls.__name__


# widths of the conditioning a model reads (text, pooled text): shrunk to this when the model still runs
SMALL_CONTEXT = 32


def tiny_model(cls: type, base: dict[str, Any] | None = None, inputs: Any = None) -> TinyModel:
    r"""The class built from its shrunk config (``base``, the port's own, over the class defaults), with the
    inputs it runs on and its output shape. The init dict holds what differs from the class defaults.

    Beyond :func:`paritykit.tracing.shaped_inputs.tiny_config`: conditioning widths shrink to
    :data:`SMALL_CONTEXT` when the model still runs so, a sample size left unset takes the input's (pipelines
    read it), and a model with one attention layer gets two (``AttentionTesterMixin`` needs them)."""
    from paritykit.tracing.shaped_inputs import CONTEXT_WIDTHS, init_defaults, tiny_config

    defaults = init_defaults(cls)
    base = {k: v for k, v in (base or {}).items() if k in defaults and differs(v, defaults[k])}
    init = {**base, **tiny_config(cls, base)}
    context = {
        k: SMALL_CONTEXT
        for k, v in {**defaults, **init}.items()
        if k in (*CONTEXT_WIDTHS, "pooled_projection_dim")
        and isinstance(v, int)
        and not isinstance(v, bool)
        and v > SMALL_CONTEXT
    }
    if context:
        try:
            built_and_run(cls, {**init, **context}, inputs)
            init = {**init, **context}
        except Exception:  # noqa: BLE001 - a model whose widths are tied elsewhere keeps its own
            pass
    model, specs, output = built_and_run(cls, init, inputs)
    if len(getattr(model, "attn_processors", None) or {}) == 1:
        # AttentionTesterMixin sets one processor fewer than the model has: a model with one needs two layers
        init = {
            k: 2 if v == 1 and "layers" in k and differs(2, defaults.get(k)) else v for k, v in init.items()
        }
        model, specs, output = built_and_run(cls, init, inputs)
    if "sample_size" in defaults and {**defaults, **init}.get("sample_size") is None:
        main = next(iter(specs.values()), None)
        if getattr(main, "shape", None) is not None and len(main.shape) >= 4:
            init["sample_size"] = int(main.shape[-1])
            model, specs, output = built_and_run(cls, init, inputs)
    count = sum(p.numel() for p in model.parameters())
    checkpointed = checkpointed_classes(model)
    return TinyModel(cls, import_from(cls), init, specs, tuple(output.shape), checkpointed, count)


def built_and_run(cls: type, init: dict[str, Any], inputs: Any) -> tuple[Any, dict[str, Any], Any]:
    r"""(model, input specs, output) of ``cls`` built from ``init`` over its defaults and run once."""
    from paritykit.tracing.shaped_inputs import build, init_defaults

    config = {**init_defaults(cls), **init}
    model = build(cls, config, "cpu").eval()
    specs = input_specs(cls, config, inputs)
    return model, specs, run_once(model, materialize(specs))


def input_specs(cls: type, config: dict[str, Any], inputs: Any) -> dict[str, Any]:
    r"""How the test makes each input, by argument name: shaped for the class from its signature and
    ``config`` (:func:`paritykit.tracing.shaped_inputs.input_layout`), or read from what ``inputs(config)``
    returns (a dict, or (args, kwargs) named by ``forward``'s order): float tensors of more than
    :data:`FIXED_VALUES` values become seeded noise of their shape, other tensors (timesteps, sizes, ids)
    their values, dicts their items, anything else its literal."""
    import torch

    from paritykit.base.usercode import call_user
    from paritykit.tracing.shaped_inputs import Fixed, Noise, input_layout

    if inputs is None:
        return dict(input_layout(cls, config).values)
    try:
        takes_config = bool(inspect.signature(inputs).parameters)
    except (TypeError, ValueError):
        takes_config = True
    given = call_user(inputs, *([dict(config)] if takes_config else []), what="--inputs")
    if isinstance(given, tuple) and len(given) == 2 and isinstance(given[1], dict):
        names = [n for n in inspect.signature(cls.forward).parameters if n != "self"]
        given = {**dict(zip(names, given[0])), **given[1]}
    if not isinstance(given, dict):
        raise ParityKitError(f"--inputs returned a {type(given).__name__}: return a dict or (args, kwargs)")

    def spec(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.numel() > FIXED_VALUES:
                return Noise(tuple(value.shape))
            return Fixed(
                tuple(value.flatten().tolist()), str(value.dtype).removeprefix("torch."), tuple(value.shape)
            )
        if isinstance(value, dict):
            return {k: spec(f"{name}.{k}", v) for k, v in value.items()}
        if isinstance(value, (int, float, str, bool, type(None))):
            return value
        raise ParityKitError(
            f"--inputs: {name} is a {type(value).__name__}; give tensors, dicts or plain values"
        )

    return {k: spec(k, v) for k, v in given.items()}


def checkpointed_classes(model: Any) -> list[str]:
    r"""The classes of the submodules gradient checkpointing switches on (what
    ``test_gradient_checkpointing_is_applied`` expects), empty when the model does not support it."""
    if not getattr(model, "_supports_gradient_checkpointing", False):
        return []
    model.enable_gradient_checkpointing()
    found = sorted({m.__class__.__name__ for m in model.modules() if hasattr(m, "gradient_checkpointing")})
    model.disable_gradient_checkpointing()
    return found


def differs(saved: Any, default: Any) -> bool:
    r"""Whether a saved config value differs from the class default (a JSON list against a default tuple
    does not)."""
    if isinstance(saved, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(saved) != list(default)
    return saved != default


def materialize(specs: dict[str, Any], generator: Any = None) -> dict[str, Any]:
    r"""The inputs exactly as the generated test draws them: noise from ``randn_tensor`` on one CPU generator
    seeded 0, in argument order (``generator`` None: a fresh generator per tensor, as ``self.generator``
    gives in the fast tests), fixed values as written."""
    import torch
    from diffusers.utils.torch_utils import randn_tensor

    from paritykit.tracing.shaped_inputs import Fixed, Noise

    def make(spec: Any) -> Any:
        if isinstance(spec, Noise):
            source = generator if generator is not None else torch.Generator("cpu").manual_seed(0)
            return randn_tensor(spec.shape, generator=source, dtype=torch.float32)
        if isinstance(spec, Fixed):
            tensor = torch.tensor(spec.values, dtype=getattr(torch, spec.dtype))
            return tensor.reshape(spec.shape) if spec.shape is not None else tensor
        if isinstance(spec, dict):
            return {k: make(v) for k, v in spec.items()}
        return spec

    return {k: make(v) for k, v in specs.items()}


def run_once(model: Any, inputs: dict[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        return first_tensor(model(**inputs))


def first_tensor(output: Any) -> Any:
    from paritykit.tracing.recording import output_tensor

    found = output_tensor(output)
    if found is None:
        raise ParityKitError(f"the model returned a {type(output).__name__} holding no tensor")
    return found
