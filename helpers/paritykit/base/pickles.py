r"""Reading a pickled checkpoint without running code from it (:func:`safe_torch_load`): torch's
``weights_only`` loader first; when it refuses a pickle because of globals it does not know (Lightning and
OmegaConf training checkpoints are the usual case) a restricted unpickler retries, turning every unknown
global into an inert placeholder it reports, and refusing outright the globals that only an attack needs."""

from __future__ import annotations

import pickle
import re
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError, first_line
from paritykit.base.files import require_file

# ------------------------------------------------------------------------------------------------------------
# Globals the restricted unpickler refuses. Whole modules first: nothing in them belongs in a checkpoint, and
# each gives a pickle a way to run commands, touch files, open sockets or load more code.
_DANGEROUS_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "posixpath",
        "ntpath",
        "subprocess",
        "_posixsubprocess",
        "sys",
        "shutil",
        "socket",
        "_socket",
        "ssl",
        "runpy",
        "importlib",
        "imp",
        "zipimport",
        "pty",
        "webbrowser",
        "pickle",
        "_pickle",
        "cPickle",
        "pickletools",
        "marshal",
        "ctypes",
        "_ctypes",
        "code",
        "codeop",
        "timeit",
        "pdb",
        "bdb",
        "pydoc",
        "asyncio",
        "multiprocessing",
        "signal",
        "io",
        "_io",
        "commands",
        "popen2",
        "http",
        "httplib",
        "urllib",
        "urllib2",
        "urllib3",
        "requests",
        "aiohttp",
        "ftplib",
        "smtplib",
        "telnetlib",
        "xmlrpc",
        "venv",
        "ensurepip",
        "pip",
        "setuptools",
        "distutils",
        "dill",
        "cloudpickle",
        "joblib",
        "torch.hub",
        "torch.jit",
        "torch.package",
        "torch.utils.cpp_extension",
        "numpy.f2py",
        "numpy.distutils",
        "numpy.testing",
    }
)
_BUILTIN_MODULES = frozenset({"builtins", "__builtin__", "__builtins__"})
_DANGEROUS_BUILTINS = frozenset(
    {
        "eval",
        "exec",
        "execfile",
        "compile",
        "open",
        "file",
        "__import__",
        "getattr",
        "setattr",
        "delattr",
        "globals",
        "locals",
        "vars",
        "breakpoint",
        "input",
        "raw_input",
        "apply",
        "reload",
        "exit",
        "quit",
        "help",
        "__loader__",
        "__build_class__",
    }
)
_DANGEROUS_GLOBALS = frozenset(
    {
        "operator.attrgetter",
        "operator.methodcaller",
        "_operator.attrgetter",
        "_operator.methodcaller",
        "types.CodeType",
        "types.FunctionType",
        "types.LambdaType",
        "types.MethodType",
        "types.ModuleType",
        "codecs.open",
        "torch.load",
        "torch.serialization.load",
        "torch.storage._load_from_bytes",
        "numpy.load",
        "numpy.lib.npyio.load",
        "tempfile.mkstemp",
        "tempfile.NamedTemporaryFile",
    }
)
# Attribute names that only serve to walk from an allowed object to a dangerous one (protocol 4 lets a
# global's name contain dots: ``torch.serialization.os.system``).
_DANGEROUS_ATTRIBUTES = frozenset(
    {
        "__globals__",
        "__builtins__",
        "__import__",
        "__subclasses__",
        "__code__",
        "__getattribute__",
        "__dict__",
        "__class__",
        "__bases__",
        "__base__",
        "__mro__",
        "__init__",
        "__reduce__",
        "__reduce_ex__",
        "__loader__",
        "__spec__",
        "eval",
        "exec",
        "system",
        "popen",
        "spawn",
    }
)


def _python3_name(module: str, name: str) -> tuple[str, str]:
    # Protocol-2 pickles spell some globals the Python 2 way (`__builtin__.eval`, `commands.Popen`).
    import _compat_pickle

    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def dangerous_global(module: str, name: str) -> str | None:
    r"""The dotted name of ``module.name`` when a checkpoint has no business referencing it, else ``None``."""
    module, name = _python3_name(module, name)
    full = f"{module}.{name}"
    if module in _BUILTIN_MODULES:
        return full if name.split(".")[0] in _DANGEROUS_BUILTINS or "." in name else None
    if full in _DANGEROUS_GLOBALS:
        return full
    if any(module == m or module.startswith(m + ".") for m in _DANGEROUS_MODULES):
        return full
    parts = name.split(".")
    if len(parts) > 1 and any(p in _DANGEROUS_ATTRIBUTES or p in _DANGEROUS_MODULES for p in parts):
        return full
    return None


# ------------------------------------------------------------------------------------------------------------
class StubbedGlobal:
    r"""Inert stand-in for a global the restricted unpickler would not import.

    Calling the placeholder (or its class) only records the arguments; ``BUILD`` state and container items
    are recorded too, so a caller can still find tensors inside, e.g. a whole pickled ``nn.Module``.
    """

    global_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> StubbedGlobal:
        obj = object.__new__(cls)
        obj.__dict__.update(args=args, kwargs=kwargs, state=None, items={}, list_items=[])
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.list_items.append(value)

    def extend(self, values: Any) -> None:
        self.list_items.extend(values)

    def __repr__(self) -> str:
        return f"<stub of {self.global_name}>"


def _stub_class(dotted: str) -> type[StubbedGlobal]:
    short = dotted.rsplit(".", 1)[-1] or "Stub"
    return type(short if short.isidentifier() else "Stub", (StubbedGlobal,), {"global_name": dotted})


@dataclass
class SafeLoad:
    r"""What :func:`safe_torch_load` read: the object, and the globals replaced by inert placeholders."""

    obj: Any
    stubbed: list[str] = field(default_factory=list)


def _rebuild_from_type_v2(func: Callable, new_type: Any, args: tuple, state: Any) -> Any:
    # Tensor subclasses and tensors with attributes: rebuild the plain tensor; keep the subclass only when it
    # is one torch itself allowlists, otherwise the (stubbed) subclass is dropped.
    import torch

    if isinstance(func, type) and issubclass(func, StubbedGlobal):
        return func(*args)
    if new_type not in (torch.Tensor, torch.nn.Parameter):
        new_type = torch.Tensor
    return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)


# The tensor rebuild functions torch's own weights_only loader accepts (plus the pre-1.0 `_rebuild_tensor`).
_TENSOR_REBUILD_FUNCTIONS = (
    "_rebuild_tensor",
    "_rebuild_tensor_v2",
    "_rebuild_tensor_v3",
    "_rebuild_parameter",
    "_rebuild_parameter_with_state",
    "_rebuild_qtensor",
    "_rebuild_sparse_tensor",
    "_rebuild_nested_tensor",
    "_rebuild_meta_tensor_no_storage",
    "_rebuild_wrapper_subclass",
    "_rebuild_device_tensor_from_numpy",
    "_rebuild_device_tensor_from_cpu_tensor",
)


def _allowed_globals() -> dict[str, Any]:
    r"""The globals a checkpoint may name, by dotted name: containers, torch types and rebuild functions."""
    import builtins
    import collections
    import copyreg
    from codecs import encode

    import torch

    allowed: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "collections.Counter": collections.Counter,
        "collections.defaultdict": collections.defaultdict,
        "copyreg._reconstructor": copyreg._reconstructor,
        "_codecs.encode": encode,
        "torch.Size": torch.Size,
        "torch.Tensor": torch.Tensor,
        "torch.device": torch.device,
        "torch.nn.parameter.Parameter": torch.nn.Parameter,
        "torch.serialization._get_layout": torch.serialization._get_layout,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
    }
    for name in (
        "set",
        "frozenset",
        "bytearray",
        "complex",
        "slice",
        "range",
        "object",
        "list",
        "dict",
        "tuple",
        "int",
        "float",
        "bool",
        "str",
        "bytes",
    ):
        allowed[f"builtins.{name}"] = getattr(builtins, name)
    for name in _TENSOR_REBUILD_FUNCTIONS:
        if hasattr(torch._utils, name):
            allowed[f"torch._utils.{name}"] = getattr(torch._utils, name)
    for value in vars(torch).values():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)):
            allowed[f"torch.{str(value).removeprefix('torch.')}"] = value
    for cls in (*torch._tensor_classes, *torch._storage_classes):
        allowed[f"{cls.__module__}.{cls.__name__}"] = cls
        allowed[f"torch.{cls.__name__}"] = cls
    try:
        import numpy

        allowed["numpy.ndarray"] = numpy.ndarray
        allowed["numpy.dtype"] = numpy.dtype
        core = getattr(numpy, "_core", None) or numpy.core  # numpy 2 renamed numpy.core
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            allowed[f"{module}._reconstruct"] = core.multiarray._reconstruct
            allowed[f"{module}.scalar"] = core.multiarray.scalar
        for name in dir(numpy.dtypes):
            if name.endswith("DType"):
                allowed[f"numpy.dtypes.{name}"] = getattr(numpy.dtypes, name)
    except ImportError:  # pragma: no cover - numpy ships with torch
        pass
    return allowed


def _restricted_pickle_module(source: str, stubbed: list[str]) -> types.ModuleType:
    r"""A stand-in for the ``pickle`` module that torch's loader accepts as ``pickle_module``.

    Its unpickler resolves globals only from :func:`_allowed_globals` (no import ever happens), refuses the
    dangerous ones with :class:`ParityKitError`, and maps the rest to :class:`StubbedGlobal` subclasses,
    appending their dotted names to ``stubbed``. It derives from the pure-Python unpickler because only that
    one lets us vet ``BUILD``, which would otherwise ``setattr`` onto the allowed classes themselves.
    """
    allowed = _allowed_globals()
    allowed_ids = {id(v) for v in allowed.values()}
    stubs: dict[str, type[StubbedGlobal]] = {}

    class RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
        dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

        def find_class(self, module: str, name: str) -> Any:
            module, name = _python3_name(module, name)
            dotted = f"{module}.{name}"
            if dotted in allowed:
                return allowed[dotted]
            bad = dangerous_global(module, name)
            if bad is not None:
                raise ParityKitError(
                    f"{source}: refused to load: the pickle references the dangerous global '{bad}' "
                    "(nothing from the file was run; only load it if you trust it and know why it needs that)"
                )
            if dotted not in stubs:
                stubs[dotted] = _stub_class(dotted)
                stubbed.append(dotted)
            return stubs[dotted]

        def load_build(self) -> None:
            inst = self.stack[-2]  # BUILD pops the state; the object it updates sits below
            if id(inst) in allowed_ids or isinstance(
                inst, (type, types.FunctionType, types.BuiltinFunctionType)
            ):
                raise ParityKitError(
                    f"{source}: refused to load: the pickle tries to set attributes on the global {inst!r}"
                )
            super().load_build()

        dispatch[pickle.BUILD[0]] = load_build

        def persistent_load(self, pid: Any) -> Any:
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")

    def load(file: Any, **kwargs: Any) -> Any:
        return RestrictedUnpickler(file, **kwargs).load()

    module = types.ModuleType("paritykit_restricted_pickle")
    module.Unpickler = RestrictedUnpickler  # type: ignore[attr-defined]
    module.load = load  # type: ignore[attr-defined]
    module.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
    return module


# weights_only refusals the restricted unpickler can take over: globals it does not know or blocks, objects
# built from such types, and opcodes outside its protocol-2 subset (a `pickle_protocol=4` save). Anything
# else (a truncated or corrupt file) is reported as unreadable.
_GLOBAL_REFUSALS = re.compile(
    r"was not an allowed global|whose module \S+ is blocked|Unsupported operand"
    r"|reduce for unrecognized function|Can only build|Can only create new object"
)


def _refused_for_globals(message: str) -> bool:
    return _GLOBAL_REFUSALS.search(message) is not None


def safe_torch_load(path: str | Path) -> SafeLoad:
    r"""Load a pickled checkpoint (``torch.save`` output) without running code from it.

    Tries ``torch.load(weights_only=True)`` first. When that refuses the file because of globals it does not
    allow, retries with a restricted unpickler: unknown globals become inert placeholders (their dotted names
    are returned in ``stubbed``), and globals that only an attack needs (``os``, ``subprocess``, ``eval``, …)
    raise :class:`ParityKitError` naming the global.

    Args:
        path: a ``.pt``/``.pth``/``.bin``/``.ckpt`` file (any suffix is accepted here).

    Returns:
        :class:`SafeLoad` with the loaded object (tensors on CPU) and the stubbed globals.
    """
    import zipfile

    import torch

    path = Path(path)
    require_file(path)
    use_mmap = zipfile.is_zipfile(path)
    if use_mmap and _is_torchscript(path):
        raise ParityKitError(
            f"{path}: a TorchScript archive, which runs code when loaded; save its state_dict() instead "
            "(or load it with torch.jit.load if you trust it)"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return SafeLoad(torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap))
    except pickle.UnpicklingError as exc:
        if not _refused_for_globals(str(exc)):
            raise ParityKitError(f"{path}: not a readable torch checkpoint ({first_line(exc)})") from None
    except ParityKitError:
        raise
    except Exception as exc:
        raise ParityKitError(f"{path}: not a readable torch checkpoint ({first_line(exc)})") from None

    stubbed: list[str] = []
    module = _restricted_pickle_module(str(path), stubbed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(
                path, map_location="cpu", weights_only=False, pickle_module=module, mmap=use_mmap
            )
    except ParityKitError:
        raise
    except Exception as exc:
        raise ParityKitError(f"{path}: not a readable torch checkpoint ({first_line(exc)})") from None
    return SafeLoad(obj, stubbed)


def _is_torchscript(path: Path) -> bool:
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return any(
                name.endswith("/constants.pkl") or name == "constants.pkl" for name in archive.namelist()
            )
    except (zipfile.BadZipFile, OSError):
        return False
