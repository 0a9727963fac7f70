r"""One side of a triage as a script: ``python SCRIPT`` run in this process, its denoiser found by its calls.

``paritykit triage --reference-script research/run.py --port-script port/run.py`` needs no SPEC: each script
runs as ``python SCRIPT`` would (``__main__``, its folder first on ``sys.path``, ``sys.argv`` holding the
script alone, the files it writes written), with every module call watched by torch's global forward hooks.
What the run holds afterwards, each a measurement of that run:

- the **denoiser**: of the modules the run called more than once (through ``__call__``, or through
  ``.forward()`` directly, read off the Python frames), the one holding the most parameters: a sampling loop
  calls its denoiser once or twice per step, and the model's own blocks hold less. Where it was not called
  from outside every other module through ``__call__``, the script runs a second time with Python's call
  events read (``sys.setprofile``) to record that module's calls;
- its **calls**, each copied as it returned, as :func:`~paritykit.tracing.recording.record_calls` copies them;
- the **result**: the last tensor or array the script saved (``torch.save``, ``numpy.save``, safetensors'
  ``save_file`` of one tensor), the files written as the script writes them;
- the **scheduler** (the port's): a diffusers scheduler held by a caller of the denoiser's first call, as a
  local or as ``self.scheduler`` (a pipeline's).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError

# caller frames searched for the scheduler at the denoiser's first call
SCHEDULER_FRAMES = 30


@dataclass
class ScriptRun:
    r"""What one run of a script measured: the denoiser, its recorded calls, the result and the scheduler."""

    script: Path
    denoiser: Any
    calls: list
    result: Any
    saved_to: str
    scheduler: Any = None

    def summary(self) -> str:
        count = sum(p.numel() for p in self.denoiser.parameters())
        scheduler = f"; scheduler {type(self.scheduler).__name__}" if self.scheduler is not None else ""
        return (
            f"{self.script}: denoiser {type(self.denoiser).__name__} ({len(self.calls)} calls,"
            f" {_count(count)} parameters), result the tensor saved to {self.saved_to}{scheduler}"
        )


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


@dataclass
class ScriptSide:
    r"""A script as one side of a triage, run from the folder ``cwd`` (where ``python SCRIPT`` is typed);
    :meth:`run` runs it once and keeps what it measured."""

    path: str
    cwd: str = "."
    _run: ScriptRun | None = field(default=None, repr=False)

    def run(self) -> ScriptRun:
        if self._run is None:
            import os

            back = os.getcwd()
            os.chdir(self.cwd)
            try:
                self._run = run_script(self.path)
            finally:
                os.chdir(back)
        return self._run

    # the SPEC functions triage calls
    def denoiser(self) -> Any:
        return self.run().denoiser

    def result(self) -> Any:
        return self.run().result


def adopt_scheduler(spec: Any) -> None:
    r"""A SPEC written for scripts takes the port's scheduler its run found as ``port_scheduler()``, where
    the SPEC defines none."""
    if spec.has("port_script") and not spec.has("port_scheduler"):
        found = spec.call("port_script").scheduler
        if found is not None:
            spec.module.port_scheduler = lambda: found


def script_summaries(spec: Any) -> list[str]:
    r"""What each script side's run was read as (:meth:`ScriptRun.summary`), reference first; none for a
    SPEC of functions."""
    return [
        spec.call(f"{side}_script").summary() for side in ("reference", "port") if spec.has(f"{side}_script")
    ]


SPEC_TEXT = '''"""Triage SPEC written by `paritykit triage --reference-script {reference}
--port-script {port}`; keep it, edit it, or run it again with `paritykit triage THIS_FILE`.

Each side runs its script as `python SCRIPT` would, from the folder triage ran in; its denoiser is the module
the run called more than once holding the most parameters, and its result the last tensor it saved
(paritykit.triage.scripts says how each is found).
"""

from pathlib import Path

from paritykit.triage.scripts import ScriptSide

ROOT = str((Path(__file__).resolve().parent / {root!r}).resolve())
REFERENCE = ScriptSide({reference!r}, cwd=ROOT)
PORT = ScriptSide({port!r}, cwd=ROOT)

# the functions triage calls: each side's script is run once, on the first of them
reference_script, port_script = REFERENCE.run, PORT.run
reference_denoiser, port_denoiser = REFERENCE.denoiser, PORT.denoiser
run_reference, run_port = REFERENCE.result, PORT.result
'''


def spec_text(reference: str, port: str, root: str) -> str:
    r"""The triage SPEC that runs two scripts from ``root`` (a path relative to the SPEC's folder)."""
    return SPEC_TEXT.format(reference=reference, port=port, root=root)


def check_script(path: Any, option: str) -> Path:
    r"""``path`` as an existing ``.py`` file, or one line naming ``option``."""
    found = Path(path)
    if not found.exists():
        raise ParityKitError(f"{option} '{path}': no such file or folder")
    if not found.is_file() or found.suffix != ".py":
        raise ParityKitError(f"{option} {path}: expected a Python script (.py)")
    return found


def run_script(path: Any) -> ScriptRun:
    r"""Run ``path`` as ``python path`` would; its denoiser, calls, result and scheduler (the module doc)."""
    script = check_script(path, "script")
    with _own_imports(script.resolve().parent):
        return _read_runs(script)


def _read_runs(script: Path) -> ScriptRun:
    watch = _Watch()
    with _saves() as saved, watch.hooks():
        _execute(script)
    best = watch.denoiser()
    if best is None:
        raise ParityKitError(
            f"{script}: no module was called more than once in its run, so no denoiser could be told; give"
            " --run-reference/--run-port and the --…-denoiser callables instead"
        )
    module, calls = best, watch.top_calls.get(id(best))
    scheduler = watch.schedulers.get(id(best))
    if calls is None or len(calls) < watch.calls(id(best)):
        # called inside another module, or (some or all) by .forward() directly: run again, recording it
        again = _ClassWatch(type(best), sum(p.numel() for p in best.parameters()))
        with _saves() as saved, again.watching():
            _execute(script)
        found = again.picked()
        if found is None:
            raise ParityKitError(
                f"{script}: its second run did not call {type(best).__name__} as its first run did (a"
                " run that is not the same each time cannot be read as a script)"
            )
        module, calls, scheduler = found
    result, saved_to = _result(saved, script)
    return ScriptRun(script, module, calls, result, saved_to, scheduler=scheduler)


@contextlib.contextmanager
def _own_imports(folder: Path):
    r"""The modules a script imports from its own folder are dropped after its runs, so another script's
    ``import model`` finds its own file; its second run finds the first's (and their classes). So are the
    modules it made by hand (stubs put in ``sys.modules`` for a package it does not need, round 35:
    lerobot's fake ``torchvision`` broke diffusers' imports in the port's script), and a module it replaced
    is put back. Packages imported from elsewhere (installed, or vendored beside the scripts) stay: two
    copies of one library in a process do not recognise each other's objects."""
    before = dict(sys.modules)
    try:
        yield
    finally:
        for name in set(sys.modules) - set(before):
            module = sys.modules.get(name)
            if _inside(module, folder) or _hand_made(module):
                del sys.modules[name]
        for name, module in before.items():
            if sys.modules.get(name) is not module:
                sys.modules[name] = module


def _hand_made(module: Any) -> bool:
    r"""A module no import made: no file and no import spec (``types.ModuleType(name)`` put in
    ``sys.modules``)."""
    return getattr(module, "__spec__", None) is None and getattr(module, "__file__", None) is None


def _execute(script: Path) -> None:
    r"""``runpy`` the script as ``__main__`` with its folder first on ``sys.path`` and ``sys.argv`` its name;
    ``sys.path`` and ``sys.argv`` are put back after."""
    import runpy

    from paritykit.base.usercode import call_user

    folder = str(script.resolve().parent)
    saved_path, saved_argv = list(sys.path), list(sys.argv)
    sys.path.insert(0, folder)
    sys.argv = [str(script)]
    try:
        call_user(lambda: runpy.run_path(str(script), run_name="__main__"), what=str(script))
    except SystemExit as done:
        if done.code not in (None, 0):
            raise ParityKitError(f"{script} exited with {done.code}") from None
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv


def _inside(module: Any, folder: Path) -> bool:
    r"""A module whose file lies under ``folder``."""
    file = getattr(module, "__file__", None)
    return bool(file) and Path(file).resolve().is_relative_to(folder)


class _Watch:
    r"""The global forward hooks of one run: every module's calls counted (those of a module whose
    ``forward`` runs without ``__call__`` too, read off the Python frames), the calls made from outside any
    other module copied as they return, with the scheduler seen by each such module's first call."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.counts: dict[int, int] = {}
        self.modules: dict[int, Any] = {}
        self.top_calls: dict[int, list] = {}
        self.schedulers: dict[int, Any] = {}
        # modules whose forward ran unhooked: calls counted by frame (the last one held, so a new call's
        # frame cannot reuse its address)
        self.direct: dict[int, int] = {}
        self.last_frame: dict[int, Any] = {}

    def _stack(self) -> list:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def pre(self, module: Any, args: Any) -> None:
        stack = self._stack()
        key = id(module)
        if key not in self.modules:
            self.modules[key] = module
            if not stack:  # only a call from outside every module is kept from this run, with its scheduler
                self.schedulers[key] = _scheduler_of_callers()
        self.counts[key] = self.counts.get(key, 0) + 1
        self._unhooked_forwards(stack[-1] if stack else None)
        stack.append(module)

    def _unhooked_forwards(self, parent: Any) -> None:
        r"""Modules whose ``forward`` runs between this call and its hooked parent's: called by
        ``.forward()`` directly, so no hook sees them; each distinct frame counts as one call."""
        import torch

        frame = sys._getframe(3)
        for _ in range(SCHEDULER_FRAMES):
            if frame is None:
                return
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
            if isinstance(owner, torch.nn.Module):
                if owner is parent:
                    return
                key = id(owner)
                self.modules.setdefault(key, owner)  # recorded by the second run, which finds its scheduler
                if self.last_frame.get(key) is not frame:
                    self.last_frame[key] = frame
                    self.direct[key] = self.direct.get(key, 0) + 1
            frame = frame.f_back

    def post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        from paritykit.tracing.recording import Call, kept, named_inputs

        stack = self._stack()
        if stack:
            stack.pop()
        if not stack:
            args, kwargs = kept(args), kept(kwargs)
            call = Call(args, kwargs, named_inputs(module.forward, args, kwargs), kept(output))
            self.top_calls.setdefault(id(module), []).append(call)

    @contextlib.contextmanager
    def hooks(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles = [
            register_module_forward_pre_hook(self.pre),
            register_module_forward_hook(self.post, with_kwargs=True, always_call=True),
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self.last_frame.clear()

    def calls(self, key: int) -> int:
        r"""The calls of one module the run made: through ``__call__`` and through ``.forward()`` directly."""
        return self.counts.get(key, 0) + self.direct.get(key, 0)

    def denoiser(self) -> Any:
        r"""Of the modules called more than once (through ``__call__`` or ``.forward()``), the one holding the
        most parameters, then the most calls; ``None`` where none was."""
        calls = {k: self.calls(k) for k in self.modules}
        repeated = [k for k, n in calls.items() if n >= 2]
        if not repeated:
            return None
        size = {k: sum(p.numel() for p in self.modules[k].parameters()) for k in repeated}
        largest = max(size.values())
        tied = [k for k in repeated if size[k] == largest]
        # a wrapper holding the network and nothing more (k-diffusion's Denoiser and its c_in, c_skip, c_out)
        # ties with the network: the network is the denoiser, as a diffusers model is (the preconditioning
        # sits in its scheduler)
        inner = [
            k for k in tied if not any(self.modules[j] in list(self.modules[k].modules())[1:] for j in tied)
        ]
        return self.modules[max(inner or tied, key=lambda k: calls[k])]


class _ClassWatch:
    r"""A second run recording the outermost calls of the modules of ``cls``'s name holding ``size``
    parameters, read off Python's call and return events (``sys.setprofile``): a ``.forward()`` call is seen
    as well as ``__call__``, its arguments as they arrive, on a class a script makes anew each run (one loaded
    by path) as well."""

    def __init__(self, cls: type, size: int) -> None:
        self.name = (cls.__module__, cls.__qualname__)
        self.size = size
        self.sizes: dict[int, int] = {}
        self.open: list[tuple[Any, Any]] = []  # (frame, module) of the outermost forward running
        self.calls: dict[int, list] = {}
        self.modules: dict[int, Any] = {}
        self.schedulers: dict[int, Any] = {}

    def _ours(self, module: Any) -> bool:
        if (type(module).__module__, type(module).__qualname__) != self.name:
            return False
        key = id(module)
        if key not in self.sizes:
            self.sizes[key] = sum(p.numel() for p in module.parameters())
        return self.sizes[key] == self.size

    def event(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not self.open and frame.f_code.co_name == "forward":
            module = frame.f_locals.get("self")
            if module is not None and self._ours(module):
                self.open.append((frame, module, _arguments(frame)))
                if id(module) not in self.modules:
                    self.modules[id(module)] = module
                    self.schedulers[id(module)] = _scheduler_of_callers(frame.f_back)
        elif event == "return" and self.open and self.open[-1][0] is frame:
            from paritykit.tracing.recording import Call, kept, named_inputs

            _, module, (args, kwargs) = self.open.pop()
            call = Call(args, kwargs, named_inputs(module.forward, args, kwargs), kept(arg))
            self.calls.setdefault(id(module), []).append(call)

    @contextlib.contextmanager
    def watching(self):
        previous = sys.getprofile()
        sys.setprofile(self.event)
        try:
            yield self
        finally:
            sys.setprofile(previous)
            self.open.clear()

    def picked(self) -> tuple[Any, list, Any] | None:
        repeated = [k for k, calls in self.calls.items() if len(calls) >= 2]
        if not repeated:
            return None
        best = max(repeated, key=lambda k: len(self.calls[k]))
        return self.modules[best], self.calls[best], self.schedulers.get(best)


def _arguments(frame: Any) -> tuple[tuple, dict]:
    r"""A ``forward`` frame's arguments as it was entered, as ``(args, kwargs)`` without ``self`` (copies):
    positional parameters and ``*args`` positionally, keyword-only ones and ``**kwargs`` by name."""
    from paritykit.tracing.recording import kept

    code, values = frame.f_code, frame.f_locals
    positional = code.co_varnames[1 : code.co_argcount]
    keyword = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    index = code.co_argcount + code.co_kwonlyargcount
    args = [values[n] for n in positional]
    kwargs = {n: values[n] for n in keyword}
    flags = code.co_flags
    if flags & 0x04:  # CO_VARARGS
        args += list(values[code.co_varnames[index]])
        index += 1
    if flags & 0x08:  # CO_VARKEYWORDS
        kwargs.update(values[code.co_varnames[index]])
    return kept(tuple(args)), kept(kwargs)


def _scheduler_of_callers(frame: Any = None) -> Any:
    r"""A diffusers scheduler among the locals of the frames calling this module call (or a local's
    ``.scheduler``, as a pipeline holds it); ``None`` where diffusers is not imported or none is found."""
    schedulers = sys.modules.get("diffusers")
    mixin = getattr(schedulers, "SchedulerMixin", None) if schedulers is not None else None
    if mixin is None:
        return None
    frame = frame if frame is not None else sys._getframe(2)
    for _ in range(SCHEDULER_FRAMES):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            try:  # a local of any kind: a tracer object (einx's) may raise on any attribute read
                if isinstance(value, mixin):
                    return value
                held = getattr(value, "scheduler", None)
                if isinstance(held, mixin):
                    return held
            except Exception:
                continue
        frame = frame.f_back
    return None


@contextlib.contextmanager
def _saves():
    r"""Every tensor or array a script saves, in order, with where it went; the saves themselves still run."""
    import numpy as np
    import torch

    saved: list[tuple[Any, str]] = []
    originals = {"torch": torch.save, "numpy": np.save}

    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        saved.append((obj, str(f)))
        return originals["torch"](obj, f, *args, **kwargs)

    def numpy_save(file: Any, arr: Any, *args: Any, **kwargs: Any) -> Any:
        saved.append((arr, str(file)))
        return originals["numpy"](file, arr, *args, **kwargs)

    torch.save, np.save = torch_save, numpy_save
    try:
        yield saved
    finally:
        torch.save, np.save = originals["torch"], originals["numpy"]


def _result(saved: list[tuple[Any, str]], script: Path) -> tuple[Any, str]:
    r"""The last tensor or array saved; a dict of them (a result saved with what came before it) counts as
    its first tensor, named by its key."""
    import numpy as np
    import torch

    for obj, where in reversed(saved):
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            return obj, where
        if isinstance(obj, dict):
            for key, value in obj.items():
                if isinstance(value, (torch.Tensor, np.ndarray)):
                    return value, f"{where}[{key!r}]"
    raise ParityKitError(
        f"{script} saved no tensor or array (torch.save / numpy.save): its result cannot be told; give"
        " --run-reference/--run-port callables that return it"
    )
