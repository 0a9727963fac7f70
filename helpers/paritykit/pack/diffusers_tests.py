r"""The tests a diffusers pull request asks for, rendered from a port paritykit already holds.

``generate_diffusers_tests`` writes, in diffusers' own layout (``tests/models/<family>/…``,
``tests/pipelines/<name>/…``) and style (its ruff settings, its testing utilities):

- a model test file: ``BaseModelTesterConfig`` with a tiny config and seeded dummy inputs shaped for the class
  (:func:`paritykit.tracing.shaped_inputs.input_layout`), then one class per tester mixin the model supports;
- with ``reference`` and ``pretrained``: a slow integration test in that file whose expected slice is the
  **reference's** output on the test's own inputs, computed here, never the port's; its tolerance is the float
  floor measured on both sides (float32 against float64 on the same inputs) and said in a comment;
- with ``pipeline``: a pipeline test on ``PipelineTesterMixin`` with tiny components.

The generated files import nothing from paritykit: they go into the pull request. They are written into
``out_dir`` (default: a new folder ``diffusers-tests-<name>``, never the current folder), and an existing file
is replaced only with ``force``.
"""

from __future__ import annotations

import copy
import datetime
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.data import data_dir
from paritykit.base.errors import ParityKitError
from paritykit.base.quiet import quiet_diffusers
from paritykit.base.report import format_number
from paritykit.pack.tiny_model import (
    TinyModel,
    first_tensor,
    import_from,
    input_specs,
    materialize,
    run_once,
    tiny_model,
)

SLICE = 8  # the expected slice: the first and the last SLICE values of the flattened output
FLOOR_FACTOR = 4  # atol = FLOOR_FACTOR x (reference floor + port floor)

# (class-name marker, folder under tests/models, word in the file name) of each model family
_FAMILIES = (("Transformer", "transformers", "transformer"), ("UNet", "unets", "unet"))
_FAMILIES += (("Autoencoder", "autoencoders", "autoencoder"), ("ControlNet", "controlnets", "controlnet"))

# dummy values for pipeline __call__ arguments, as diffusers' fast pipeline tests write them
_CALL_VALUES: dict[str, str] = {
    "prompt": '"dance monkey"',
    "negative_prompt": '""',
    "class_labels": "[1]",
    "num_inference_steps": "2",
    "batch_size": "1",
    "output_type": '"np"',
}
_BATCHED = ("prompt", "negative_prompt", "class_labels", "image")


@dataclass
class DiffusersTests:
    r"""What ``generate_diffusers_tests`` wrote and measured: the files, the expected slice's provenance and
    tolerance, and lines to read before opening the pull request (a port that differs from the reference now
    fails its slow test)."""

    paths: list[Path] = field(default_factory=list)
    tolerance: float | None = None
    port_error: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def port_matches(self) -> bool | None:
        if self.tolerance is None or self.port_error is None:
            return None
        return self.port_error <= self.tolerance

    def render(self) -> str:
        lines = []
        if self.port_matches is False:
            lines.append(
                f"warning: the port differs from the reference by {format_number(self.port_error)} >"
                f" atol {format_number(self.tolerance)} on the slow test's inputs: that test fails until the"
                " port is fixed (paritykit bisect names the place)"
            )
        elif self.port_matches:
            lines.append(
                f"slow test: the port matches the reference's slice today (max diff"
                f" {format_number(self.port_error)} <= atol {format_number(self.tolerance)})"
            )
        lines += self.notes
        lines += [f"wrote {path}" for path in self.paths]
        return "\n".join(lines)


def generate_diffusers_tests(
    name: str,
    model_class: str | type,
    *,
    reference: str | Any = None,
    pipeline: str | type | None = None,
    pretrained: str | os.PathLike | None = None,
    hub_id: str | None = None,
    convert: str | Any = None,
    inputs: str | Any = None,
    out_dir: str | os.PathLike | None = None,
    force: bool = False,
) -> DiffusersTests:
    r"""Render and write the diffusers test files for a port.

    Args:
        name: a snake_case identifier naming the files (``test_models_transformer_<name>.py``).
        model_class: the port's class: a diffusers name (``WanTransformer3DModel``), ``MODULE:CLASS`` or the
            class.
        reference: ``MODULE:CALLABLE`` (or the callable) returning the reference model with its weights; it is
            called with the port's required inputs positionally, in the port's ``forward`` order (its optional
            ones by name where the reference's ``forward`` has the name), and its first
            output tensor must have the port's output shape. With ``pretrained`` it gives the slow test's
            expected slice.
        pipeline: the port's pipeline class (name, ``MODULE:CLASS`` or the class): renders its fast test.
        pretrained: the saved port (a folder written by ``save_pretrained``): the slow test's model, loaded
            here to measure its float floor.
        hub_id: what the slow test loads in the pull request instead of ``pretrained`` (a Hub repository).
        convert: ``MODULE:CALLABLE`` or callable, ``convert(reference_state_dict) -> port state_dict``: when
            given, the saved port is checked to hold the converted reference weights.
        inputs: ``MODULE:CALLABLE`` or callable, ``inputs(config) -> dict`` (or ``(args, kwargs)``): the
            model's inputs for a config, when paritykit cannot shape them from the signature; called with the
            tiny config for the fast tests and the saved one for the slow test, and rendered as seeded noise
            of each float tensor's shape (more than 16 values), other tensors' values and plain values.
        out_dir: the folder the ``tests/…`` files go into; default ``diffusers-tests-<name>``.
        force: replace existing files.
    """
    from paritykit.base.usercode import callable_from

    if not name.isidentifier() or name != name.lower():
        raise ParityKitError(f"NAME {name!r}: give a snake_case identifier (it names the test files)")
    if pretrained is not None and not (Path(pretrained) / "config.json").is_file():
        raise ParityKitError(
            f"--pretrained {pretrained}: no config.json there (save the port with save_pretrained)"
        )
    cls = _model_class(model_class)
    pipeline_cls = _model_class(pipeline, what="--pipeline") if pipeline is not None else None
    if pipeline_cls is not None:
        _check_pipeline(pipeline_cls)
    make_inputs = callable_from("--inputs", inputs) if isinstance(inputs, str) else inputs
    with quiet_diffusers():
        model = tiny_model(cls, _saved_config(cls, pretrained), make_inputs)
    result = DiffusersTests()
    slow = None
    unused = [flag for flag, value in (("--hub-id", hub_id), ("--convert", convert)) if value is not None]
    if reference is None or pretrained is None:
        needs = "--reference (the expected slice comes from it)" if reference is None else ""
        needs += (" and " if needs else "") + ("--pretrained (the saved port)" if pretrained is None else "")
        result.notes.append(
            f"no slow test: it needs {needs}" + (f"; {' and '.join(unused)} unused" if unused else "")
        )
    else:
        build = callable_from("--reference", reference) if isinstance(reference, str) else reference
        converter = callable_from("--convert", convert) if isinstance(convert, str) else convert
        shown = reference if isinstance(reference, str) else f"{build.__module__}:{build.__qualname__}"
        with quiet_diffusers():
            slow = _slow_test(cls, build, Path(pretrained), hub_id, converter, make_inputs, shown, result)
        if hub_id is None:
            result.notes.append(
                f"the slow test loads {pretrained}, a folder on this machine: give --hub-id for the pull"
                " request"
            )
    result.notes.append(f"tiny {cls.__name__}: {model.parameters:,} parameters")
    files = {_model_test_path(cls, name): _render("model_test.py.j2", _model_context(cls, model, slow))}
    if pipeline_cls is not None:
        folder = Path("tests", "pipelines", name)
        files[folder / "__init__.py"] = ""
        with quiet_diffusers():
            context = _pipeline_context(pipeline_cls, cls, model, slow is not None)
        files[folder / f"test_{name}.py"] = _render("pipeline_test.py.j2", context)
    formatted = _ruff_format(files)
    if not formatted:
        result.notes.append("ruff not found: the files are not formatted; run `make style` in your fork")
    out = Path(out_dir) if out_dir is not None else Path(f"diffusers-tests-{name}")
    result.paths = _write(files, out, force)
    return result


def _check_pipeline(pipeline_cls: type) -> None:
    r"""A pipeline class whose components paritykit can build and run offline, or a one-line refusal."""
    from diffusers import DiffusionPipeline

    if not issubclass(pipeline_cls, DiffusionPipeline):
        raise ParityKitError(f"--pipeline {pipeline_cls.__name__}: not a DiffusionPipeline")
    foreign = [
        name
        for name, parameter, kinds in _components(pipeline_cls)
        if parameter.default is inspect.Parameter.empty
        and any(getattr(kind, "__module__", "").startswith(("transformers", "tokenizers")) for kind in kinds)
    ]
    if foreign:
        raise ParityKitError(
            f"--pipeline {pipeline_cls.__name__}: its {', '.join(foreign)} come from transformers, which"
            " paritykit cannot build and run offline; render the model tests without --pipeline and write the"
            " pipeline test from a diffusers pipeline test of the same family"
        )


# --------------------------------------------------------------------------------------------- the model
def _model_class(value: str | type, what: str = "--model-class") -> type:
    import diffusers

    from paritykit.base.usercode import callable_from

    if isinstance(value, type):
        return value
    if ":" in value:
        found = callable_from(what, value)
    else:
        found = getattr(diffusers, value, None)
        if found is None:
            raise ParityKitError(f"{what} {value}: diffusers has no such class; give MODULE:CLASS")
    if not isinstance(found, type):
        raise ParityKitError(f"{what} {value}: not a class")
    return found


def _import_lines(names: list[tuple[str, str]]) -> list[str]:
    r"""``from module import a, b`` lines, one per module, sorted as ruff's isort sorts them (a line longer
    than diffusers' 119 characters wrapped one name a line)."""
    by_module: dict[str, set[str]] = {}
    for module, name in names:
        by_module.setdefault(module, set()).add(name)
    lines = []
    for module in sorted(by_module):
        found = sorted(by_module[module])
        line = f"from {module} import {', '.join(found)}"
        if len(line) > 119:
            line = f"from {module} import (\n" + "".join(f"    {n},\n" for n in found) + ")"
        lines.append(line)
    return lines


def _saved_config(cls: type, pretrained: str | os.PathLike | None) -> dict[str, Any]:
    r"""The saved port's config (``--pretrained``), the values the tiny test config shrinks; empty without."""
    if pretrained is None:
        return {}
    try:
        config = dict(cls.load_config(str(pretrained)))
    except Exception as exc:  # noqa: BLE001 - a config that does not load is the user's to fix
        raise ParityKitError(f"--pretrained {pretrained}: its config.json does not load ({exc})") from exc
    accepted = set(inspect.signature(cls.__init__).parameters)
    return {k: v for k, v in config.items() if k in accepted}


def _model_test_path(cls: type, name: str) -> Path:
    r"""Where diffusers keeps the tests of ``cls``'s family: by the package its class lives in (``models/
    autoencoders/…``), else by its name."""
    module = cls.__module__.split(".")
    for _, folder, word in _FAMILIES:
        if folder in module:
            return Path("tests", "models", folder, f"test_models_{word}_{name}.py")
    for marker, folder, word in _FAMILIES:
        if marker.lower() in cls.__name__.lower():
            return Path("tests", "models", folder, f"test_models_{word}_{name}.py")
    return Path("tests", "models", "transformers", f"test_models_transformer_{name}.py")


def _mixins(cls: type) -> list[tuple[str, str]]:
    r"""(mixin, docstring) pairs: the tester mixins ``cls`` supports."""
    from diffusers.loaders.peft import PeftAdapterMixin

    found = [("ModelTesterMixin", "Core model tests"), ("MemoryTesterMixin", "Memory optimization tests")]
    found.append(("TrainingTesterMixin", "Training tests"))
    if hasattr(cls, "attn_processors"):
        found.append(("AttentionTesterMixin", "Attention processor tests"))
    if issubclass(cls, PeftAdapterMixin):
        found.append(("LoraTesterMixin", "LoRA adapter tests"))
    return found


def _py(value: Any) -> str:
    r"""A Python literal as ruff formats it: double-quoted strings, tuples and lists kept as written."""
    import json

    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        items = ", ".join(_py(v) for v in value)
        return f"({items},)" if len(value) == 1 else f"({items})"
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _input_expr(spec: Any, generator: str, indent: str, dtype: str = "self.torch_dtype") -> str:
    r"""The code that makes one input, laid out as ruff formats it at ``indent``: noise from ``randn_tensor``
    on ``generator``, a fixed tensor, a dict of inputs, or a plain value."""
    from paritykit.tracing.shaped_inputs import Fixed, Noise

    inner = indent + "    "
    if isinstance(spec, Noise):
        arguments = [
            _py(tuple(spec.shape)),
            f"generator={generator}",
            "device=torch_device",
            f"dtype={dtype}",
        ]
        return "randn_tensor(\n" + "".join(f"{inner}{a},\n" for a in arguments) + indent + ")"
    if isinstance(spec, Fixed):
        tensor = f"torch.tensor({_py(list(spec.values))}, dtype=torch.{spec.dtype})"
        if spec.shape is not None and tuple(spec.shape) != (len(spec.values),):
            tensor += f".reshape({_py(tuple(spec.shape))})"
        return f"{tensor}.to(torch_device)"
    if isinstance(spec, dict):
        items = "".join(
            f"{inner}{_py(k)}: {_input_expr(v, generator, inner, dtype)},\n" for k, v in spec.items()
        )
        return "{\n" + items + indent + "}"
    return _py(spec)


def _model_context(cls: type, model: TinyModel, slow: dict | None) -> dict[str, Any]:
    forward = list(inspect.signature(cls.forward).parameters)
    main = next(iter(model.inputs), forward[1] if len(forward) > 1 else "hidden_states")
    main_spec = model.inputs.get(main)
    input_shape = tuple(getattr(main_spec, "shape", ()) or ())[1:]
    return {
        "cls": cls.__name__,
        "imports": _import_lines([model.source, ("diffusers.utils.torch_utils", "randn_tensor")]),
        "init": {k: _py(v) for k, v in model.init.items()},
        "inputs": {k: _input_expr(v, "self.generator", " " * 12) for k, v in model.inputs.items()},
        "main_input_name": main,
        "input_shape": input_shape,
        "output_shape": model.output_shape[1:],
        "mixins": _mixins(cls),
        "checkpointed": ", ".join(f'"{name}"' for name in model.checkpointed),
        "slow": slow,
    }


# ------------------------------------------------------------------------------------- the slow test
def _slow_test(
    cls: type,
    build: Any,
    pretrained: Path,
    hub_id: str | None,
    convert: Any,
    inputs: Any,
    reference_name: str,
    result: DiffusersTests,
) -> dict[str, Any]:
    r"""The slow test's inputs, expected slice (from the reference) and tolerance (from the float floors)."""
    import torch

    from paritykit import __version__
    from paritykit.base.usercode import call_user

    try:  # pretrained holds a config.json: checked before anything ran
        port = cls.from_pretrained(str(pretrained), torch_dtype=torch.float32).eval()
    except Exception as exc:  # noqa: BLE001 - a folder that does not load is the user's to fix
        raise ParityKitError(f"--pretrained {pretrained}: {cls.__name__} cannot load it ({exc})") from exc
    reference = call_user(build, what=f"--reference {reference_name}")
    if not isinstance(reference, torch.nn.Module):
        raise ParityKitError(
            f"--reference {reference_name}: returned a {type(reference).__name__}, not a model"
        )
    # real floating-point tensors in float32 only: a complex rotary table keeps its imaginary part
    reference.to("cpu")
    for tensor in (*reference.parameters(), *reference.buffers()):
        if tensor.is_floating_point():
            tensor.data = tensor.data.float()
    reference.eval()
    if convert is not None:
        converted = call_user(convert, dict(reference.state_dict()), what="--convert")
        _check_saved(port, converted, pretrained, result)
    specs = input_specs(cls, dict(port.config), inputs)
    inputs = materialize(specs, torch.Generator("cpu").manual_seed(0))
    required = [n for n, p in inspect.signature(cls.forward).parameters.items() if n != "self"]
    positional = [n for n in required if n in inputs and _is_required(cls, n)]

    try:
        signature = inspect.signature(reference.forward).parameters
    except (TypeError, ValueError):
        signature = {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.values())
    named = {k for k in inputs if k not in positional and (k in signature or takes_any)}
    dropped = sorted(k for k in inputs if k not in positional and k not in named)
    result.notes.append(
        f"the reference was called with {', '.join(positional)} positionally"
        + (f", {', '.join(sorted(named))} by name" if named else "")
        + (f"; not passed (its forward has no such argument): {', '.join(dropped)}" if dropped else "")
    )

    def call(model: Any, values: dict[str, Any], as_reference: bool) -> Any:
        if not as_reference:
            return run_once(model, values)
        # the port's required inputs positionally, its optional ones by name where the reference has the name
        args = [values[n] for n in positional]
        kwargs = {k: v for k, v in values.items() if k in named}
        with torch.no_grad():
            output = call_user(
                lambda: model(*args, **kwargs), what=f"--reference {reference_name}: its forward"
            )
        return first_tensor(output)

    expected = call(reference, inputs, True)
    got = call(port, inputs, False)
    if expected.shape != got.shape:
        raise ParityKitError(
            f"--reference {reference_name}: its output has shape {list(expected.shape)}, the port's"
            f" {list(got.shape)}: wrap the reference so it returns the port's layout"
        )
    reference_floor = _floor(reference, inputs, expected, lambda m, v: call(m, v, True))
    port_floor = _floor(port, inputs, got, lambda m, v: call(m, v, False))
    expected_slice = _slice(expected)
    scale = float(expected_slice.abs().max())
    if reference_floor is None or port_floor is None:
        atol = 1e-4 * max(scale, 1.0)
        failed = " and ".join(
            side
            for side, floor in (("the reference", reference_floor), ("the port", port_floor))
            if floor is None
        )
        why = (
            f"atol {atol:.2e}: 1e-4 x the slice's largest magnitude; the float floor could not be measured"
            f" ({failed} does not run in float64)"
        )
    else:
        atol = max(FLOOR_FACTOR * (reference_floor + port_floor), 1.2e-7 * scale)
        why = (
            f"atol {atol:.2e}: {FLOOR_FACTOR} x (reference float floor {reference_floor:.2e} + port float"
            f" floor {port_floor:.2e}), each the max |float32 - float64| of that side's whole output on these"
            " inputs, measured on CPU"
        )
    result.tolerance = atol
    result.port_error = float((_slice(got) - expected_slice).abs().max())
    target = hub_id or str(pretrained)
    return {
        "pretrained": target,
        "local": hub_id is None,
        "inputs": {k: _input_expr(v, "generator", " " * 12, "torch.float32") for k, v in specs.items()},
        "expected": [repr(float(v)) for v in expected_slice],
        "atol": f"{atol:.2e}",
        "comment": _comment(
            f"The expected slice is the reference implementation's output ({reference_name}) on the"
            f" inputs below, computed on CPU in float32 by paritykit {__version__} on"
            f" {datetime.date.today()}; it was not taken from this port. The first and the last {SLICE}"
            f" values of the flattened output. {why}."
        ),
        "slice": SLICE,
    }


def _comment(words: str, width: int = 112) -> list[str]:
    r"""``words`` as the lines of a ``#`` comment in a class body (diffusers' 119 columns)."""
    import textwrap

    return textwrap.wrap(words, width - len("    # "))


def _is_required(cls: type, name: str) -> bool:
    parameter = inspect.signature(cls.forward).parameters[name]
    return parameter.default is inspect.Parameter.empty


def _slice(output: Any) -> Any:
    import torch

    flat = output.detach().flatten().to(torch.float32)
    return torch.cat([flat[:SLICE], flat[-SLICE:]])


def _floor(model: Any, inputs: dict[str, Any], output32: Any, call: Any) -> float | None:
    r"""max |float32 − float64| of ``model``'s output on ``inputs``; None when it does not run in float64."""
    import torch

    def double(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.double()
        if isinstance(value, dict):
            return {k: double(v) for k, v in value.items()}
        return value

    try:
        wide = copy.deepcopy(model).double()
        output64 = call(wide, {k: double(v) for k, v in inputs.items()})
    except Exception:  # noqa: BLE001 - research code that fixes its own dtypes: the floor stays unmeasured
        return None
    return float((output32.double() - output64.double()).abs().max())


def _check_saved(port: Any, converted: Any, pretrained: Path, result: DiffusersTests) -> None:
    import torch

    saved = port.state_dict()
    if hasattr(converted, "state_dict"):
        converted = converted.state_dict()
    if not isinstance(converted, dict):
        raise ParityKitError(f"--convert returned a {type(converted).__name__}: return the port's state dict")
    missing = sorted(set(saved) - set(converted))
    differ = [k for k in saved if k in converted and not torch.equal(saved[k].float(), converted[k].float())]
    if missing or differ:
        first = (missing or differ)[0]
        result.notes.append(
            f"warning: {pretrained} does not hold the converted reference weights ({len(missing)} missing,"
            f" {len(differ)} differ; first {first}): save the conversion again"
        )


# ---------------------------------------------------------------------------------------- the pipeline
def _components(pipeline_cls: type) -> list[tuple[str, Any, list[Any]]]:
    r"""Each component ``pipeline_cls.__init__`` takes: (name, parameter, the classes its annotation names:
    itself, or each member of a ``Union``/``Optional``)."""
    import types
    import typing

    try:
        hints = typing.get_type_hints(pipeline_cls.__init__)
    except Exception:  # noqa: BLE001 - unresolvable annotations: read the raw ones
        hints = {}
    found = []
    for name, parameter in inspect.signature(pipeline_cls.__init__).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        annotation = hints.get(name, parameter.annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        else:
            kinds = [annotation]
        found.append((name, parameter, kinds))
    return found


def _pipeline_context(pipeline_cls: type, cls: type, model: TinyModel, has_slow: bool) -> dict[str, Any]:
    r"""The pipeline test's components (the model built tiny, the rest from their classes, optional ones
    None), call arguments and the shape its output has on them (run here on the same components)."""
    import torch
    from diffusers import DDIMScheduler, ModelMixin, SchedulerMixin
    from diffusers.schedulers import KarrasDiffusionSchedulers

    imports = [model.source, import_from(pipeline_cls)]
    components: dict[str, str] = {}
    built: dict[str, Any] = {}
    for pname, parameter, annotated in _components(pipeline_cls):
        kinds = [k for k in annotated if isinstance(k, type)]
        models = [k for k in kinds if issubclass(k, ModelMixin)]
        schedulers = [k for k in kinds if k is KarrasDiffusionSchedulers or issubclass(k, SchedulerMixin)]
        if any(issubclass(cls, k) for k in models):
            components[pname] = _construct(cls, model.init)
            built[pname] = cls(**model.init)
        elif parameter.default is not inspect.Parameter.empty:
            if parameter.default is None and (models or kinds):
                components[pname] = "None"
                built[pname] = None
        elif schedulers:
            scheduler = DDIMScheduler if schedulers[0] is KarrasDiffusionSchedulers else schedulers[0]
            imports.append(import_from(scheduler))
            components[pname] = f"{scheduler.__name__}()"
            built[pname] = scheduler()
        elif models:
            tiny = tiny_model(models[0])
            imports.append(import_from(models[0]))
            components[pname] = _construct(models[0], tiny.init)
            built[pname] = models[0](**tiny.init)
        else:
            raise ParityKitError(
                f"--pipeline {pipeline_cls.__name__}: paritykit cannot build its component {pname}"
                f" ({', '.join(getattr(k, '__name__', str(k)) for k in kinds) or 'no annotation'}); write"
                " get_dummy_components by hand"
            )
    call = inspect.signature(pipeline_cls.__call__).parameters
    arguments = {k: v for k, v in _CALL_VALUES.items() if k in call}
    for pname, parameter in call.items():
        if pname != "self" and parameter.default is inspect.Parameter.empty and pname not in arguments:
            raise ParityKitError(
                f"--pipeline {pipeline_cls.__name__}: no dummy value for its required argument {pname}"
            )
    torch.manual_seed(0)
    pipe = pipeline_cls(**built)
    pipe.set_progress_bar_config(disable=True)
    values = {k: eval(v) for k, v in arguments.items()}  # noqa: S307 - our own literals above
    values["generator"] = torch.Generator("cpu").manual_seed(0)
    try:
        out = pipe(**values)
    except Exception as exc:  # noqa: BLE001 - said in one line, the porter's to fix
        raise ParityKitError(
            f"--pipeline {pipeline_cls.__name__}: it does not run on the tiny components"
            f" and the call arguments it renders, {', '.join(arguments)}"
            f" ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); when a config value is"
            " missing, --pretrained makes the tests shrink the port's own config"
        ) from exc
    images = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    shape = tuple(getattr(images, "shape", ()))
    optional = ["num_inference_steps", "num_images_per_prompt", "generator", "latents", "output_type"]
    optional.append("return_dict")
    missing = sorted(n for n in optional if n not in call)
    return {
        "pipeline": pipeline_cls.__name__,
        "imports": _import_lines(imports),
        "components": components,
        # models in eval mode, as diffusers' tests put them (a label embedding drops labels at random in
        # training)
        "models": sorted(k for k, v in built.items() if isinstance(v, torch.nn.Module)),
        "arguments": arguments,
        "params": _py(sorted(k for k in arguments if k not in optional)),
        "batch_params": _py(sorted(k for k in _BATCHED if k in arguments)),
        "missing_optional": missing,
        "shape": _py(shape),
        "has_slow": has_slow,
    }


def _construct(cls: type, init: dict[str, Any], indent: str = " " * 8) -> str:
    r"""``cls(key=value, …)``, one argument a line with a trailing comma, as ruff keeps it."""
    if not init:
        return f"{cls.__name__}()"
    inner = indent + "    "
    return f"{cls.__name__}(\n" + "".join(f"{inner}{k}={_py(v)},\n" for k, v in init.items()) + indent + ")"


# ------------------------------------------------------------------------------------------ rendering
def _render(template: str, context: dict[str, Any]) -> str:
    from paritykit import __version__
    from paritykit.pack.scaffold import template_environment

    env = template_environment(data_dir("templates") / "diffusers_tests")
    text = env.get_template(template).render(version=__version__, year=datetime.date.today().year, **context)
    compile(text, template, "exec")  # a template bug, not the user's: let it raise
    return text


def _ruff_format(files: dict[Path, str]) -> bool:
    r"""Format each file in place as diffusers' ``make style`` would (ruff, line length 119, double quotes);
    False when no ruff is installed (the files stay as rendered)."""
    import shutil
    import subprocess

    try:
        from ruff.__main__ import find_ruff_bin

        ruff = find_ruff_bin()
    except (ImportError, FileNotFoundError):
        ruff = shutil.which("ruff")
    if ruff is None:
        return False
    for path, text in files.items():
        if not text:
            continue
        done = subprocess.run(
            [ruff, "format", "--line-length", "119", "--stdin-filename", path.name, "-"],
            input=text,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:  # a template bug, not the user's: say what ruff said
            raise RuntimeError(f"ruff could not format the rendered {path}: {done.stderr.strip()}")
        files[path] = done.stdout
    return True


def _write(files: dict[Path, str], out: Path, force: bool) -> list[Path]:
    from paritykit.pack.scaffold import RenderedFile, write_files

    rendered = [RenderedFile(str(path), text) for path, text in files.items()]
    return write_files(rendered, out, force=force).paths
