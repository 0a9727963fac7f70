r"""Safe tensor I/O: read tensors and state dicts from any file a port meets, never running code from it.

Formats: ``.safetensors`` (also sharded sets described by a ``*.index.json``), ``.npy``/``.npz`` and the
pickle family ``.pt``/``.pth``/``.bin``/``.ckpt``. Pickles go through :func:`safe_torch_load`: torch's
``weights_only`` loader first; when it refuses a pickle because of globals it does not know (Lightning and
OmegaConf training checkpoints are the usual case) a restricted unpickler retries, turning every unknown
global into an inert placeholder it reports, and refusing outright the globals that only an attack needs.

Torch is imported inside the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import pickle
import re
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import ParityKitError
from paritykit.base.naming import natural_key

if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
TENSOR_SUFFIXES = (".safetensors", ".npy", ".npz", *PICKLE_SUFFIXES)
INDEX_SUFFIX = ".index.json"
MANIFEST_NAME = "paritykit.json"
STATE_DICT_WRAPPERS = ("state_dict", "model", "module")

# File names diffusers and transformers give a component's weights, most preferred first.
_STANDARD_WEIGHT_NAMES = (
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
    "diffusion_pytorch_model.bin",
    "pytorch_model.bin",
)

# --------------------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------------------
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
    _require_file(path)
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


def first_line(exc: BaseException) -> str:
    r"""An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _require_file(path: Path) -> None:
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or directory")
    if not path.is_file():
        raise ParityKitError(f"{path}: not a file")


# --------------------------------------------------------------------------------------------------------------
# Readers of one file. Each returns (tensors, is_container): a container names its tensors `stem/key`.


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    _require_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as exc:
        raise ParityKitError(f"{path}: not a readable safetensors file ({first_line(exc)})") from None


def _numpy_to_tensor(array: Any, path: Path, key: str | None = None) -> torch.Tensor | None:
    import numpy
    import torch

    where = f"{path}" if key is None else f"{path}[{key}]"
    if array.dtype.kind not in "biufc":
        if key is None:
            raise ParityKitError(f"{where}: array of dtype {array.dtype} is not numeric")
        return None
    try:
        return torch.from_numpy(numpy.ascontiguousarray(array))
    except TypeError as exc:
        raise ParityKitError(f"{where}: cannot convert to a torch tensor ({exc})") from None


def _read_npy(path: Path) -> torch.Tensor:
    import numpy

    _require_file(path)
    try:
        array = numpy.load(path, allow_pickle=False)
    except Exception as exc:
        raise ParityKitError(f"{path}: not a readable .npy file ({first_line(exc)})") from None
    return _numpy_to_tensor(array, path)


def _read_npz(path: Path) -> dict[str, torch.Tensor]:
    import numpy

    _require_file(path)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with numpy.load(path, allow_pickle=False) as archive:
            for key in archive.files:
                tensor = _numpy_to_tensor(archive[key], path, key)
                if tensor is not None:
                    tensors[key] = tensor
    except ParityKitError:
        raise
    except Exception as exc:
        raise ParityKitError(f"{path}: not a readable .npz file ({first_line(exc)})") from None
    return tensors


def _tensors_in(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    r"""Every tensor inside nested dicts/lists/tuples (and stubbed modules), named with dotted paths."""
    import numpy
    import torch

    def join(key: Any) -> str:
        return f"{prefix}.{key}" if prefix else str(key)

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, numpy.ndarray) and obj.dtype.kind in "biufc":
        yield prefix, torch.from_numpy(numpy.ascontiguousarray(obj))
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors_in(value, join(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors_in(value, join(i))
    elif isinstance(obj, StubbedGlobal) and isinstance(obj.state, Mapping) and "_parameters" in obj.state:
        # a whole pickled nn.Module whose class was stubbed: its parameters, buffers and children
        for part in ("_parameters", "_buffers"):
            for key, value in (obj.state.get(part) or {}).items():
                if isinstance(value, torch.Tensor):
                    yield join(key), value
        for key, child in (obj.state.get("_modules") or {}).items():
            yield from _tensors_in(child, join(key))


def _unwrap_state_dict(obj: Any) -> Any:
    while isinstance(obj, Mapping):
        inner = next(
            (obj[k] for k in STATE_DICT_WRAPPERS if isinstance(obj.get(k), (Mapping, StubbedGlobal))), None
        )
        if inner is None:
            return obj
        obj = inner
    return obj


def _read_pickle(path: Path) -> Any:
    return safe_torch_load(path).obj


# --------------------------------------------------------------------------------------------------------------
# Sharded sets


def _read_index(index: Path) -> dict[str, torch.Tensor]:
    _require_file(index)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except Exception as exc:
        raise ParityKitError(f"{index}: not a readable shard index ({first_line(exc)})") from None
    merged: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):
        shard_path = index.parent / shard
        if not shard_path.exists():
            raise ParityKitError(f"{index}: shard {shard_path} is missing")
        merged.update(_state_dict_from_file(shard_path))
    missing = [key for key in weight_map if key not in merged]
    if missing:
        raise ParityKitError(
            f"{index}: {len(missing)} keys listed but absent from their shards, e.g. {missing[0]!r}"
        )
    return {key: merged[key] for key in weight_map} | {k: v for k, v in merged.items() if k not in weight_map}


def _index_base(index: Path) -> str:
    r"""``diffusion_pytorch_model.safetensors.index.json`` -> ``diffusion_pytorch_model``."""
    base = index.name[: -len(INDEX_SUFFIX)]
    for suffix in TENSOR_SUFFIXES:
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def _shards_of(index: Path) -> set[Path]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except Exception as exc:
        raise ParityKitError(f"{index}: not a readable shard index ({first_line(exc)})") from None
    return {(index.parent / name).resolve() for name in weight_map.values()}


# --------------------------------------------------------------------------------------------------------------
# load_state_dict


def _state_dict_from_file(path: Path) -> dict[str, torch.Tensor]:
    name = path.name
    if name.endswith(INDEX_SUFFIX):
        return _read_index(path)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return read_safetensors(path)
    if suffix == ".npy":
        raise ParityKitError(f"{path}: a .npy file holds one array, not a state dict")
    if suffix == ".npz":
        return _read_npz(path)
    if suffix in PICKLE_SUFFIXES:
        return _state_dict_from_pickle(path, _read_pickle(path))
    _require_file(path)
    raise ParityKitError(f"{path}: unknown tensor file suffix (expected one of {', '.join(TENSOR_SUFFIXES)})")


def _state_dict_from_pickle(path: Path, obj: Any) -> dict[str, torch.Tensor]:
    obj = _unwrap_state_dict(obj)
    if not isinstance(obj, (Mapping, StubbedGlobal)):
        raise ParityKitError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    state = dict(_tensors_in(obj))
    if not state:
        raise ParityKitError(f"{path}: no tensors found in this checkpoint")
    return state


def _weights_file_in(folder: Path) -> Path:
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if indexes:
        safetensor_indexes = [p for p in indexes if ".safetensors" in p.name]
        return (safetensor_indexes or indexes)[0]
    for standard in _STANDARD_WEIGHT_NAMES:
        if (folder / standard).is_file():
            return folder / standard
    candidates = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in TENSOR_SUFFIXES)
    preferred = [p for p in candidates if p.suffix == ".safetensors"] or candidates
    if len(preferred) == 1:
        return preferred[0]
    if not preferred:
        subfolders = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        hint = f"; pass a component folder such as {folder / subfolders[0]}" if subfolders else ""
        raise ParityKitError(f"{folder}: no weights file in this folder{hint}")
    names = ", ".join(p.name for p in preferred[:5])
    raise ParityKitError(f"{folder}: several weights files ({names}); pass one of them")


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    r"""Read one checkpoint as a flat ``{key: tensor}`` dict.

    Args:
        path: a ``.safetensors`` file, a shard index ``*.index.json``, a folder holding one (or a single
            weights file, e.g. a diffusers component folder), a ``.npz``, or a pickle
            (``.pt``/``.pth``/``.bin``/``.ckpt``, read with :func:`safe_torch_load`). ``state_dict``/``model``/
            ``module`` wrappers are unwrapped and nested dicts flattened with dots.

    Raises:
        ParityKitError: naming the file, when it is missing, unreadable, of unknown type or holds no state dict.
    """
    path = Path(path)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or directory")
    if path.is_dir():
        path = _weights_file_in(path)
    return _state_dict_from_file(path)


# --------------------------------------------------------------------------------------------------------------
# load_named_tensors: the one naming every comparison shares


def _is_model_folder(folder: Path) -> bool:
    r"""A component folder as diffusers/transformers save it: a config or a conventionally named weights file."""
    if (folder / MANIFEST_NAME).is_file():
        return False
    if any((folder / name).is_file() for name in _STANDARD_WEIGHT_NAMES) or any(
        folder.glob(f"*{INDEX_SUFFIX}")
    ):
        return True
    weights = (p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in TENSOR_SUFFIXES)
    return (folder / "config.json").is_file() and next(weights, None) is not None


def load_named_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    r"""Tensors named the way ``compare`` and ``weights diff`` both name them, so one ``--map`` fits both.

    A checkpoint file or a model folder gives its state dict's own keys, as :func:`load_state_dict` reads
    them: ``state_dict``/``model``/``module`` wrappers unwrapped, nested dicts joined with dots, no file-stem
    prefix. A pipeline folder (``model_index.json``) gives ``<component>.<key>``. A single-tensor file
    (``.npy``, a pickled tensor) is named by its stem. Anything else (a folder of outputs, a checkpoint folder
    from :func:`paritykit.tracing.checkpoints.save_checkpoints`) keeps :func:`load_tensors`' names.

    Args:
        path: a file or a folder.

    Returns:
        name -> tensor. Raises ``ParityKitError`` naming the path when it cannot be read.
    """
    import torch

    path = Path(path)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or directory")
    if path.is_file() and path.name != MANIFEST_NAME:
        stem = _stem(Path(path.name))
        if path.suffix.lower() == ".npy":
            return {stem: _read_npy(path)}
        if path.suffix.lower() in PICKLE_SUFFIXES:
            obj = _read_pickle(path)
            return {stem: obj} if isinstance(obj, torch.Tensor) else _state_dict_from_pickle(path, obj)
        return _state_dict_from_file(path)
    if path.is_dir() and (path / "model_index.json").is_file():
        components = [sub for sub in sorted(path.iterdir()) if sub.is_dir() and _is_model_folder(sub)]
        if components:
            return {
                f"{sub.name}.{key}": value
                for sub in components
                for key, value in load_state_dict(sub).items()
            }
    if path.is_dir() and _is_model_folder(path):
        return load_state_dict(path)
    return load_tensors(path)


# --------------------------------------------------------------------------------------------------------------
# load_tensors


def _single_file_tensors(path: Path, stem: str) -> dict[str, torch.Tensor]:
    r"""Tensors of one file, named by the contract: ``stem`` for one tensor, ``stem/key`` for containers."""
    import torch

    suffix = path.suffix.lower()
    if path.name.endswith(INDEX_SUFFIX):
        return {f"{stem}/{k}": v for k, v in _read_index(path).items()}
    if suffix == ".npy":
        return {stem: _read_npy(path)}
    if suffix == ".safetensors":
        return {f"{stem}/{k}": v for k, v in read_safetensors(path).items()}
    if suffix == ".npz":
        return {f"{stem}/{k}": v for k, v in _read_npz(path).items()}
    if suffix in PICKLE_SUFFIXES:
        obj = _read_pickle(path)
        if isinstance(obj, torch.Tensor):
            return {stem: obj}
        tensors = {f"{stem}/{k}": v for k, v in _tensors_in(obj)}
        if not tensors:
            raise ParityKitError(f"{path}: no tensors found in this file (it holds a {type(obj).__name__})")
        return tensors
    _require_file(path)
    raise ParityKitError(f"{path}: unknown tensor file suffix (expected one of {', '.join(TENSOR_SUFFIXES)})")


def _stem(relative: Path) -> str:
    name = relative.name
    if name.endswith(INDEX_SUFFIX):
        return (relative.parent / _index_base(relative)).as_posix()
    return relative.with_suffix("").as_posix()


def read_manifest(folder: Path) -> dict[str, Any]:
    r"""The ``paritykit.json`` manifest :func:`paritykit.tracing.checkpoints.save_checkpoints` wrote into ``folder``."""
    manifest_path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("checkpoints"), list):
            raise TypeError("no 'checkpoints' list")
    except FileNotFoundError:
        raise ParityKitError(
            f"{folder}: no {MANIFEST_NAME} here (not a folder written by save_checkpoints)"
        ) from None
    except Exception as exc:
        raise ParityKitError(
            f"{manifest_path}: not a readable paritykit manifest ({first_line(exc)})"
        ) from None
    version = manifest.get("schema_version", 1)
    if version != CHECKPOINT_SCHEMA:
        raise ParityKitError(
            f"{manifest_path}: checkpoint schema {version!r}, this paritykit reads {CHECKPOINT_SCHEMA} (save"
            " the run again with this version)"
        )
    return manifest


# the schema_version save_checkpoints writes and read_manifest accepts
CHECKPOINT_SCHEMA = 1


def _checkpoint_dir_tensors(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for entry in read_manifest(folder)["checkpoints"]:
        name = entry["name"]
        for key, value in read_safetensors(folder / entry["file"]).items():
            tensors[f"{prefix}{name}/{key}"] = value
    return tensors


def _walk(folder: Path) -> Iterator[Path]:
    for child in sorted(folder.iterdir(), key=lambda p: natural_key(p.name)):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            yield from _walk(child)
        elif child.is_file():
            yield child


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    r"""Every tensor under ``path``, by name, in a stable order.

    Names: a single-tensor file (``.npy``, a pickled tensor) is named by its path stem relative to the folder
    given (``sub/x.pt`` -> ``sub/x``); a multi-tensor container (``.safetensors``, ``.npz``, a pickled dict,
    a sharded set) by ``stem/key`` whatever its count; nested pickled dicts use dotted keys.

    Order: a checkpoint folder written by :func:`paritykit.tracing.checkpoints.save_checkpoints` (it has a
    ``paritykit.json``) gives ``<checkpoint>/<key>`` in execution order; anything else is sorted naturally
    (``after_step_2`` before ``after_step_10``). Folders are walked recursively; files with other suffixes
    (configs, images) are skipped there, while naming one directly is an error.
    """
    path = Path(path)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or directory")
    if path.name == MANIFEST_NAME and path.is_file():
        path = (
            path.parent
        )  # the manifest stands for its checkpoint folder (save_checkpoints returns its path)
    if path.is_file():
        tensors = _single_file_tensors(path, _stem(Path(path.name)))
        return {name: tensors[name] for name in sorted(tensors, key=natural_key)}
    if (path / MANIFEST_NAME).is_file():
        return _checkpoint_dir_tensors(path)

    files = list(_walk(path))
    indexes = [f for f in files if f.name.endswith(INDEX_SUFFIX)]
    sharded = set().union(*(_shards_of(index) for index in indexes)) if indexes else set()
    manifests = {f.parent for f in files if f.name == MANIFEST_NAME}
    tensors: dict[str, torch.Tensor] = {}
    for folder in sorted(manifests):
        tensors.update(_checkpoint_dir_tensors(folder, prefix=folder.relative_to(path).as_posix() + "/"))
    for file in files:
        if file.parent in manifests or any(parent in manifests for parent in file.parents):
            continue
        is_index = file.name.endswith(INDEX_SUFFIX)
        if not is_index and (file.suffix.lower() not in TENSOR_SUFFIXES or file.resolve() in sharded):
            continue
        tensors.update(_single_file_tensors(file, _stem(file.relative_to(path))))
    return {name: tensors[name] for name in sorted(tensors, key=natural_key)}
