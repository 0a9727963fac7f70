r"""A user's Python file (``SPEC.py``) loaded as a module, and every call into it guarded: a user's exception
becomes one line plus the user's own frames, never paritykit's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.inputs import copy_inputs, split_inputs, to_device

SPEC_FUNCTIONS = ("build_reference", "build_port", "make_inputs", "port_inputs", "select_output")


@dataclass
class Spec:
    r"""A loaded ``SPEC.py``: its builders and options, every call into it guarded by :func:`call_user`."""

    path: Any
    module: Any
    command: str = "bisect"  # the command whose --help documents this kind of SPEC

    def has(self, name: str) -> bool:
        return callable(getattr(self.module, name, None))

    def call(self, name: str, *args: Any) -> Any:
        if not self.has(name):
            raise ParityKitError(f"{self.path}: defines no {name}(); see `paritykit {self.command} --help`")
        return call_user(getattr(self.module, name), *args, what=f"{name}() in {self.path.name}", spec=self)

    @property
    def name_map(self) -> list[tuple[str, str]]:
        rules = getattr(self.module, "NAME_MAP", None) or []
        try:
            return [(str(a), str(b)) for a, b in rules]
        except (TypeError, ValueError):
            raise ParityKitError(
                f"{self.path}: NAME_MAP must be a list of (regex, replacement) pairs"
            ) from None

    @property
    def tolerance(self) -> dict[str, float]:
        return check_tolerance(self.path, getattr(self.module, "TOLERANCE", None))

    def inputs(self, side: str, device: Any = None) -> tuple[tuple, dict]:
        r"""One side's inputs, for a run that traces one side per process (``paritykit trace``):
        ``port_inputs`` runs for the port only. Two processes call ``make_inputs()`` once each, so it must be
        seeded for the two traces to share their inputs (the traces' input hashes are checked)."""
        made = self._inputs_from("make_inputs")
        if device is not None:
            made = to_device(made, device)
        if side == "port" and self.has("port_inputs"):
            return self._inputs_from("port_inputs", *made)
        return made

    def input_pair(self, device: Any = None) -> tuple[tuple[tuple, dict], tuple[tuple, dict]]:
        r"""Both sides' inputs from one ``make_inputs()`` call: the reference gets a copy of every tensor, the
        port a copy mapped by ``port_inputs`` when the SPEC has it. An unseeded ``torch.randn`` in
        ``make_inputs`` thus feeds both sides the same values."""
        made = self._inputs_from("make_inputs")
        if device is not None:
            made = to_device(made, device)
        ref = copy_inputs(made)
        port = copy_inputs(made)
        if self.has("port_inputs"):
            port = self._inputs_from("port_inputs", *port)
        return ref, port

    def _inputs_from(self, name: str, *args: Any) -> tuple[tuple, dict]:
        r"""What ``name(*args)`` returns as a call's inputs (:func:`~paritykit.base.inputs.split_inputs`); a
        function that returns nothing (a missing ``return``) is one line naming it."""
        value = self.call(name, *args)
        if value is None:
            raise ParityKitError(
                f"{self.path}: {name}() returned None; return (args, kwargs), a kwargs dict, a list of "
                "arguments or one tensor"
            )
        return split_inputs(value)

    @property
    def sha256(self) -> str:
        r"""The spec file's content hash (recorded in a trace; two environments' specs may differ)."""
        import hashlib
        from pathlib import Path

        return hashlib.sha256(Path(self.path).read_bytes()).hexdigest()

    def input_fingerprint(self) -> dict[str, Any]:
        r"""What ``make_inputs()`` returns (both sides start from it): each tensor's shape by position/name,
        and one hash over every tensor's dtype, shape and bytes, so two traces can be told to share their
        inputs."""
        import hashlib

        import torch

        args, kwargs = self._inputs_from("make_inputs")
        named = {**{f"arg{i}": v for i, v in enumerate(args)}, **kwargs}
        tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
        digest = hashlib.sha256()
        for key, value in tensors.items():
            flat = value.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{key} {value.dtype} {list(value.shape)}\n".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        return {"shapes": {k: list(v.shape) for k, v in tensors.items()}, "sha256": digest.hexdigest()}

    def build(self, side: str, device: Any = None) -> Any:
        model = self.call(f"build_{side}")
        if not hasattr(model, "named_modules") or not callable(model):
            raise ParityKitError(
                f"{self.path}: build_{side}() returned {type(model).__name__}, not a torch module"
            )
        if device is not None:
            model = model.to(device)
        return model.eval()

    def select(self) -> Callable | None:
        if not self.has("select_output"):
            return None
        fn = self.module.select_output
        return lambda side, output: call_user(
            fn, side, output, what=f"select_output() in {self.path.name}", spec=self
        )


def user_frames(exc: BaseException, spec: Spec | None) -> str:
    """The traceback of ``exc`` trimmed to the frames in the spec's folder (the user's own files)."""
    import traceback
    from pathlib import Path

    frames = traceback.extract_tb(exc.__traceback__)
    if spec is not None:
        folder = Path(spec.path).resolve().parent
        mine = [
            f
            for f in frames
            if not f.filename.startswith("<") and Path(f.filename).resolve().is_relative_to(folder)
        ]
    else:
        mine = []
    # With a spec, only its folder's frames are the user's (a SyntaxError has none: its own lines name the
    # file).
    kept = mine if spec is not None else frames[-3:]
    lines = ["Traceback (your code, most recent call last):\n", *traceback.format_list(kept)] if kept else []
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def call_user(fn: Callable, *args: Any, what: str, spec: Spec | None = None) -> Any:
    r"""Call user code; any exception becomes a :class:`paritykit.base.errors.UserCodeError` naming ``what``
    and carrying the traceback trimmed to the user's frames."""
    from paritykit.base.errors import UserCodeError

    try:
        return fn(*args)
    except (ParityKitError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise UserCodeError(
            f"{what} raised {type(exc).__name__}: {exc}", detail=user_frames(exc, spec)
        ) from exc


def check_tolerance(path: Any, tol: Any) -> dict[str, float]:
    r"""A SPEC's ``TOLERANCE`` as ``{'atol': …, 'rtol': …}``; one line naming the file otherwise."""
    tol = tol or {}
    if (
        not isinstance(tol, dict)
        or set(tol) - {"atol", "rtol"}
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in tol.values())
    ):
        raise ParityKitError(
            f"{path}: TOLERANCE = {tol!r}: expected a dict with 'atol' and/or 'rtol' numbers"
            " (e.g. {'atol': 1e-4, 'rtol': 1e-4})"
        )
    return {k: float(v) for k, v in tol.items()}


def _check_before_running(path: Any) -> None:
    r"""What a SPEC's source says without running it, so a slip costs no model build: its syntax, and a
    ``TOLERANCE`` written as a literal."""
    import ast

    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, OSError, UnicodeDecodeError, ValueError):
        return  # importing it says so, with the user's own lines
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "TOLERANCE" for t in targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue  # computed: checked once the module has run
            check_tolerance(path, value)


def load_spec(path: Any, command: str = "bisect") -> Spec:
    r"""Import ``SPEC.py`` with its own folder on ``sys.path`` (so it may import sibling files)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ParityKitError(f"SPEC {str(path)!r}: no such file")
    if path.suffix != ".py":
        raise ParityKitError(f"SPEC {str(path)!r}: expected a .py file")
    _check_before_running(path)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = f"_paritykit_spec_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    spec = Spec(path, module, command)
    sys.modules[name] = module
    call_user(module_spec.loader.exec_module, module, what=f"importing {path.name}", spec=spec)
    return spec


def callable_from(option: str, target: str) -> Callable:
    r"""The callable a ``MODULE:CALLABLE`` option names, imported with the current folder on ``sys.path``;
    a one-line error naming the option when it cannot be."""
    import importlib
    import os
    import sys

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise ParityKitError(f"{option} {target!r}: expected MODULE:FUNCTION, e.g. mymodels:build_reference")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ParityKitError(
            f"{option} {target!r}: importing {module_name} raised {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(module, attr):
        raise ParityKitError(f"{option} {target!r}: {module_name} has no {attr}")
    value = getattr(module, attr)
    if not callable(value) or isinstance(value, type(None)):
        raise ParityKitError(f"{option} {target!r}: {attr} is not callable; give a function returning it")
    try:
        import torch

        if isinstance(value, torch.nn.Module):
            raise ParityKitError(
                f"{option} {target!r}: {attr} is a module instance; give a function returning it"
            )
    except ImportError:
        pass
    return value


def spec_from_callables(
    reference: str,
    port: str,
    inputs: str,
    port_inputs: str | None = None,
    select_output: str | None = None,
    command: str = "bisect",
) -> Spec:
    r"""A SPEC built from ``MODULE:CALLABLE`` names, no file written: ``build_reference``/``build_port`` call
    ``reference()``/``port()`` and put the modules in eval mode, ``make_inputs`` is ``inputs``, and
    ``port_inputs`` when given. Its :attr:`Spec.path` is a name for messages, ``<--reference …>``."""
    import types
    from pathlib import Path

    given = {
        "build_reference": ("--reference", reference),
        "build_port": ("--port", port),
        "make_inputs": ("--inputs", inputs),
        "port_inputs": ("--port-inputs", port_inputs),
        "select_output": ("--select-output", select_output),
    }
    module = types.ModuleType("_paritykit_callables")
    for name, (option, target) in given.items():
        if target:
            setattr(module, name, _named(callable_from(option, target), f"{option} {target}"))
    return Spec(Path.cwd() / "<callables>", module, command)


def _named(fn: Callable, words: str) -> Callable:
    r"""``fn`` whose exception names the option and target the user gave (not a SPEC function they never
    wrote)."""
    import functools

    return functools.wraps(fn)(lambda *args: call_user(fn, *args, what=words))
