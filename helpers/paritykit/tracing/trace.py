r"""Capture every module call of a model: inputs, outputs, call order, nesting.

``with capture(model) as trace: model(x)`` records, for the top level and each submodule, the positional and
keyword inputs and the outputs of every call, in execution order. Repeated calls are named ``name``,
``name#1``, ``name#2`` …; nested outputs (tuples, dicts, ``BaseOutput``) are flattened by path
(``output.0``, ``output.sample``, ``args.1``, ``kwargs.temb``). A trace keeps enough structure to *replay* a
call (rebuild its ``args``/``kwargs``), which is what :mod:`paritykit.bisection.entry` needs to compare two
different implementations module by module.

``to_dir=`` streams the tensors into safetensors shards next to a JSON manifest, so models larger than RAM can
be traced; :meth:`Trace.load` reads such a folder back lazily.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError, first_line
from paritykit.tracing.skeleton import (
    DictSkeleton,
    TensorRef,
    decode,
    encode,
    has_opaque,
    unpack_call,
)

MANIFEST = "trace.json"
WEIGHTS_FILE = "weights.safetensors"  # a copy of the weights, written by paritykit before 0.9
FINGERPRINTS_FILE = "weights.json"
FORMAT = "paritykit-trace"
FORMAT_VERSION = 2  # 2: weights.json hashes by the weighted position sum
_SHARD_BYTES = 256 * 2**20
_COMPLEX = "paritykit.complex"  # a shard's metadata key: its tensors stored as their real view


# --------------------------------------------------------------------------------------------- structure


@dataclass
class ModuleInfo:
    r"""A module of the traced model: class name and its own (non-recursive) parameters ``{local: shape}``."""

    name: str
    type: str
    params: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "params": self.params}


def call_name(module: str, call: int) -> str:
    r"""The name of call ``call`` (0-based) of ``module`` in a trace: the module's own name for its first
    call, ``module#k`` for the (k+1)-th; :func:`module_of` reads it back."""
    return module if call == 0 else f"{module}#{call}"


def module_of(name: str) -> str:
    r"""The module of a call named by :func:`call_name` (``block#2`` -> ``block``)."""
    return name.split("#", 1)[0]


@dataclass(slots=True)
class Record:
    r"""One call of one module.

    Attributes:
        name: ``module`` for the first call, ``module#k`` for the (k+1)-th.
        module: the module's dotted name (``""`` is the top level).
        call: 0 for the first call of this module, 1 for the second, …
        type: class name of the module.
        parent: name of the enclosing record (``None`` at the top).
        order: position in start order (pre-order of the call tree).
        done: position in completion order (children finish before their parent); -1 if the call raised.
    """

    name: str
    module: str
    call: int
    type: str
    parent: str | None
    depth: int
    order: int
    done: int = -1
    inputs_skeleton: Any = None
    outputs_skeleton: Any = None
    input_keys: dict[str, str] = field(default_factory=dict)
    output_keys: dict[str, str] = field(default_factory=dict)
    # the trace's tensors, not the trace: the trace lists its records, so a reference to it would be a cycle,
    # and a trace the caller drops would keep its copies until the cyclic collector ran
    _tensors: TraceTensors | None = field(default=None, repr=False, compare=False)

    # tensors ----------------------------------------------------------------------------------------
    @property
    def inputs(self) -> dict[str, Any]:
        """Input tensors by path (``args.0``, ``kwargs.temb``, ``kwargs.added.text_embeds``)."""
        return {path: self._tensors.get(key) for path, key in self.input_keys.items()}

    @property
    def outputs(self) -> dict[str, Any]:
        """Output tensors by path (``output``, ``output.0``, ``output.sample``)."""
        return {path: self._tensors.get(key) for path, key in self.output_keys.items()}

    @property
    def output(self) -> Any:
        """The first output tensor (``None`` when the call returned no tensor)."""
        for key in self.output_keys.values():
            return self._tensors.get(key)
        return None

    @property
    def replayable(self) -> bool:
        """Whether :meth:`call_inputs` can rebuild this call's arguments (inputs captured, nothing opaque)."""
        return self.inputs_skeleton is not None and not has_opaque(self.inputs_skeleton)

    def call_inputs(self) -> tuple[tuple, dict]:
        """The call's ``(args, kwargs)`` rebuilt with the captured tensors."""
        if self.inputs_skeleton is None:
            raise ParityKitError(f"record {self.name!r} holds no inputs (captured with inputs=False)")
        args, kwargs = unpack_call(self.inputs_skeleton, self._tensors.get)
        return tuple(args), dict(kwargs)

    def output_value(self) -> Any:
        """The call's return value rebuilt (``BaseOutput`` from disk comes back as an :class:`OutputDict`)."""
        return unpack_call(self.outputs_skeleton, self._tensors.get)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "call": self.call,
            "type": self.type,
            "parent": self.parent,
            "depth": self.depth,
            "order": self.order,
            "done": self.done,
            "inputs": encode(self.inputs_skeleton),
            "outputs": encode(self.outputs_skeleton),
            "input_keys": self.input_keys,
            "output_keys": self.output_keys,
        }


class TraceTensors:
    r"""A trace's tensors by storage key: the copies :func:`capture` made, or the shards of a trace folder,
    read lazily. Records hold this rather than their trace, so a record kept alone still reads its tensors,
    and a trace dropped with its records frees them at once (no reference cycle)."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory
        self.in_memory: dict[str, Any] = {}
        self.shard_of: dict[str, str] = {}
        self._open: dict[str, Any] = {}
        # per shard, the keys stored as their real view (safetensors holds no complex dtype)
        self._complex: dict[str, set[str]] = {}

    def get(self, key: str) -> Any:
        if key in self.in_memory:
            return self.in_memory[key]
        shard = self.shard_of.get(key)
        if shard is None or self.directory is None:
            raise KeyError(f"tensor {key!r} is not in this trace")
        handle = self._open.get(shard) or self.open_shard(shard)
        try:
            tensor = handle.get_tensor(key)
        except Exception as exc:
            raise ParityKitError(
                f"{self.directory / shard}: cannot read tensor {key!r} ({first_line(exc)})"
            ) from None
        if key in self._complex.get(shard, ()):
            import torch

            return torch.view_as_complex(tensor)
        return tensor

    def open_shard(self, shard: str) -> Any:
        from safetensors import safe_open

        path = self.directory / shard
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # truncated, corrupted header, missing: one line naming the file
            raise ParityKitError(
                f"{path}: not a readable safetensors shard of this trace ({first_line(exc)})"
            ) from None
        self._open[shard] = handle
        try:
            self._complex[shard] = set(json.loads((handle.metadata() or {}).get(_COMPLEX, "[]")))
        except ValueError:
            raise ParityKitError(f"{path}: unreadable list of complex tensors in its metadata") from None
        return handle


class Trace:
    r"""What :func:`capture` recorded: :class:`Record` objects in start order plus the model's module
    table."""

    def __init__(self, model_type: str = "", directory: Path | None = None):
        self.model_type = model_type
        self.records: list[Record] = []
        self.modules: dict[str, ModuleInfo] = {}
        self.directory = directory
        # what the folder says about itself: side, spec, levels, the block it was taken inside, environment
        self.about: dict[str, Any] = {}
        self.weight_source: Mapping[str, Any] | None = None
        self._by_name: dict[str, Record] = {}
        self._tensors = TraceTensors(directory)

    # access -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Record:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no call named {name!r} in this trace") from None

    def names(self) -> list[str]:
        """Record names in start order."""
        return [r.name for r in self.records]

    def calls(self, module: str) -> list[Record]:
        """Every call of one module, first call first."""
        return [r for r in self.records if r.module == module]

    def children(self, record: Record | str) -> list[Record]:
        """Calls made directly inside ``record``, in start order."""
        name = record if isinstance(record, str) else record.name
        return [r for r in self.records if r.parent == name]

    def completion_order(self) -> list[Record]:
        """Records in the order their calls returned (a child before its parent)."""
        return sorted((r for r in self.records if r.done >= 0), key=lambda r: r.done)

    @property
    def root(self) -> Record | None:
        """The first call of the top-level module, if it was captured."""
        return self._by_name.get("")

    def tensor(self, key: str) -> Any:
        """One captured tensor by its storage key (read lazily from disk for a loaded trace)."""
        return self._tensors.get(key)

    def weights(self) -> Mapping[str, Any] | None:
        """The traced model's state dict: :attr:`weight_source` when set (an offloaded model's
        :class:`ModelWeights`), else the trace folder's copy (written by ``paritykit trace``)."""
        if self.weight_source is not None:
            return self.weight_source
        if self.directory is None or not (self.directory / WEIGHTS_FILE).is_file():
            return None
        from paritykit.base.io import read_safetensors

        return read_safetensors(self.directory / WEIGHTS_FILE)

    def weight_keys(self) -> dict[str, tuple] | None:
        r"""``{name: (shape, dtype, hash)}`` of the traced model's weights that have a hash in the folder's
        ``weights.json`` (written by ``paritykit trace`` in place of a copy of the weights): what
        :func:`paritykit.forensics.conversion.layer_order.key_pairs` matches. ``None`` without that file."""
        path = None if self.directory is None else self.directory / FINGERPRINTS_FILE
        if path is None or not path.is_file():
            return None
        try:
            fingerprints = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ParityKitError(f"{path}: unreadable weight fingerprints ({first_line(exc)})") from None
        if not isinstance(fingerprints, dict):
            raise ParityKitError(f"{path}: not a table of weight fingerprints")
        out = {}
        for name, entry in fingerprints.items():
            if isinstance(entry, dict) and isinstance(entry.get("hash"), int):
                out[name] = (tuple(entry.get("shape", ())), str(entry.get("dtype")), entry["hash"])
        return out

    def graft(self, call: Record) -> None:
        r"""Rename this trace's first call (a block run alone) to ``call``'s name, call index, parent and
        depth, so its records join a trace of the level above (:mod:`paritykit.bisection.zoom`)."""
        if not self.records:
            raise ParityKitError("an empty trace cannot be grafted")
        top = self.records[0]
        old = top.name
        for record in self.records:
            record.depth += call.depth
            if record.parent == old:
                record.parent = call.name
        top.name, top.call, top.parent, top.depth = call.name, call.call, call.parent, call.depth
        self._by_name = {r.name: r for r in self.records}

    def _add(self, record: Record) -> None:
        record._tensors = self._tensors
        self.records.append(record)
        self._by_name[record.name] = record

    # persistence ------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write this trace (tensors + manifest) to ``directory``; returns the folder."""
        writer = _ShardWriter(Path(directory))
        for key in sorted(
            {k for r in self.records for k in (*r.input_keys.values(), *r.output_keys.values())}
        ):
            writer.add(key, self.tensor(key))
        writer.close()
        _write_manifest(Path(directory), self, writer.shard_of)
        return Path(directory)

    @classmethod
    def load(cls, directory: str | Path) -> Trace:
        r"""Read a trace folder written by ``capture(..., to_dir=)`` or :meth:`save`; tensors load on
        access."""
        directory = Path(directory)
        manifest_path = directory / MANIFEST
        if not manifest_path.is_file():
            raise ParityKitError(
                f"{directory}: not a paritykit trace folder (no {MANIFEST}); write one with `paritykit trace`"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:  # ValueError: bad JSON, or bytes that are not UTF-8
            raise ParityKitError(f"{manifest_path}: unreadable trace manifest ({first_line(exc)})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ParityKitError(f"{manifest_path}: not a paritykit trace manifest")
        version = manifest.get("version")
        if version != FORMAT_VERSION:
            raise ParityKitError(
                f"{manifest_path}: trace format {version!r}, this paritykit reads {FORMAT_VERSION} (re-trace"
                " it with this version)"
            )
        try:
            trace = cls._from_manifest(manifest, directory)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ParityKitError(f"{manifest_path}: malformed trace manifest ({first_line(exc)})") from None
        return trace

    @classmethod
    def _from_manifest(cls, manifest: dict[str, Any], directory: Path) -> Trace:
        trace = cls(manifest.get("model_type", ""), directory)
        trace.about = dict(manifest.get("about") or {})
        trace.modules = {
            name: ModuleInfo(name, info["type"], {k: list(v) for k, v in info.get("params", {}).items()})
            for name, info in manifest.get("modules", {}).items()
        }
        shard_of = trace._tensors.shard_of = dict(manifest.get("tensors", {}))
        for shard in set(shard_of.values()):
            if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
                raise ValueError(f"shard {shard!r} is not a file name inside the trace folder")
        for shard in sorted(set(shard_of.values())):  # a bad shard is named now, not mid-search
            missing = {k for k, v in shard_of.items() if v == shard} - set(
                trace._tensors.open_shard(shard).keys()
            )
            if missing:
                raise ParityKitError(
                    f"{directory / shard}: lacks {len(missing)} tensors the manifest lists "
                    f"(e.g. {sorted(missing)[0]!r}); the trace is incomplete"
                )
        for item in manifest["records"]:
            trace._add(
                Record(
                    name=item["name"],
                    module=item["module"],
                    call=item["call"],
                    type=item["type"],
                    parent=item["parent"],
                    depth=item["depth"],
                    order=item["order"],
                    done=item["done"],
                    inputs_skeleton=decode(item["inputs"]),
                    outputs_skeleton=decode(item["outputs"]),
                    input_keys=dict(item["input_keys"]),
                    output_keys=dict(item["output_keys"]),
                )
            )
        return trace

    def summary(self) -> dict[str, Any]:
        """Counts a person wants after a capture: calls, distinct modules, tensors, bytes held in memory."""
        keys = {k for r in self.records for k in (*r.input_keys.values(), *r.output_keys.values())}
        nbytes = sum(t.numel() * t.element_size() for k, t in self._tensors.in_memory.items() if k in keys)
        return {
            "model_type": self.model_type,
            "calls": len(self.records),
            "modules": len({r.module for r in self.records}),
            "tensors": len(keys),
            "bytes_in_memory": nbytes,
            "directory": str(self.directory) if self.directory else None,
        }


# ----------------------------------------------------------------------------------------------- capture


def module_table(model: Any) -> dict[str, ModuleInfo]:
    """Class name and own parameter shapes of every named module of ``model``."""
    table = {}
    for name, module in model.named_modules():
        # a module's own parameters, as ``named_parameters(recurse=False)`` lists them, read without its
        # generator
        params = {k: list(p.shape) for k, p in module._parameters.items() if p is not None}
        table[name] = ModuleInfo(name, type(module).__name__, params)
    return table


def _selected(name: str, module: Any, patterns: Sequence[Any] | None) -> bool:
    if patterns is None:
        return True
    for pattern in patterns:
        if isinstance(pattern, str):
            if fnmatch.fnmatchcase(name, pattern):
                return True
        elif isinstance(module, pattern):
            return True
    return False


class _Recorder:
    """The hooks' shared state. Kept small and flat: these methods run for every module call."""

    def __init__(self, trace: Trace, *, inputs: bool, to_cpu: bool, writer: _ShardWriter | None):
        import torch

        self.tensor = torch.Tensor
        self.trace = trace
        self.inputs = inputs
        self.to_cpu = to_cpu
        self.writer = writer
        self.names: dict[int, tuple[str, str]] = {}
        self.counts: dict[str, int] = {}
        self.stack: list[Record] = []
        self.started = 0
        self.finished = 0
        self.next_key = 0
        # id(tensor) -> (weakref to the tensor, its version counter, its TensorRef): one copy per tensor
        # value, even when the same tensor is a child's output, the next sibling's input and the parent's
        # output.
        self.seen: dict[int, tuple[Any, int, TensorRef]] = {}

    def store(self, value: Any) -> TensorRef:
        ident = id(value)
        hit = self.seen.get(ident)
        version = version_of(value)
        if hit is not None and hit[0]() is value and version is not None and hit[1] == version:
            return hit[2]
        tensor = value.detach()
        if self.to_cpu and tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        else:
            # The caller may change this tensor in place later (``x += y``, ``inplace=True`` activations).
            tensor = tensor.clone()
        ref = TensorRef(f"t{self.next_key}")  # immutable: every skeleton that holds this value shares it
        self.next_key += 1
        try:
            # no callback to drop the entry when the tensor dies: a later tensor given the same id finds a
            # dead reference and is stored anew, so a stale entry is harmless and needs no callback per tensor
            self.seen[ident] = (weakref.ref(value), version, ref)
        except TypeError:
            pass
        if self.writer is not None:
            self.writer.add(ref.key, tensor)
        else:
            self.trace._tensors.in_memory[ref.key] = tensor
        return ref

    def pack(self, obj: Any, path: str, keys: dict[str, str]) -> Any:
        if isinstance(obj, self.tensor):
            ref = self.store(obj)
            keys[path] = ref.key
            return ref
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, dict):
            return DictSkeleton(self.pack_items(obj.items(), path, keys), type(obj))
        if isinstance(obj, (tuple, list)):
            packed = list(self.pack_items(enumerate(obj), path, keys).values())
            return packed if isinstance(obj, list) else tuple(packed)
        return obj

    def pack_items(self, items: Any, path: str, keys: dict[str, str]) -> dict[Any, Any]:
        r"""``{name: packed value}`` of ``(name, value)`` pairs at ``path.name``; tensors and ``None``
        inline."""
        packed = {}
        for name, value in items:
            if value is None:
                packed[name] = None
            elif isinstance(value, self.tensor):
                packed[name] = ref = self.store(value)
                keys[f"{path}.{name}"] = ref.key
            else:
                packed[name] = self.pack(value, f"{path}.{name}", keys)
        return packed

    def pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        name, type_name = self.names[id(module)]
        count = self.counts.get(name, 0)
        self.counts[name] = count + 1
        parent = self.stack[-1] if self.stack else None
        record = Record(
            name=call_name(name, count),
            module=name,
            call=count,
            type=type_name,
            parent=parent.name if parent else None,
            depth=parent.depth + 1 if parent else 0,
            order=self.started,
        )
        self.started += 1
        if self.inputs:
            keys: dict[str, str] = {}
            record.inputs_skeleton = (
                tuple(self.pack_items(enumerate(args), "args", keys).values()) if args else (),
                DictSkeleton(self.pack_items(kwargs.items(), "kwargs", keys) if kwargs else {}),
            )
            record.input_keys = keys
        self.trace._add(record)
        self.stack.append(record)

    def post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        name = self.names[id(module)][0]
        # A call that raised inside a caught exception leaves its record open; close it without outputs.
        while self.stack and self.stack[-1].module != name:
            self.stack.pop()
        if not self.stack:
            return
        record = self.stack.pop()
        keys: dict[str, str] = {}
        record.outputs_skeleton = self.pack(output, "output", keys)
        record.output_keys = keys
        record.done = self.finished
        self.finished += 1


@contextlib.contextmanager
def capture(
    model: Any,
    *,
    modules: Sequence[Any] | str | type | None = None,
    inputs: bool = True,
    to_cpu: bool = True,
    to_dir: str | Path | None = None,
    about: dict[str, Any] | None = None,
) -> Iterator[Trace]:
    r"""Record every module call of ``model`` while the block runs.

    Args:
        model: a ``torch.nn.Module``; the top level is recorded as ``""``.
        modules: which modules to record: glob patterns on dotted names (``"blocks.*.attn"``) and/or module
            classes; ``None`` records all of them.
        inputs: record positional and keyword inputs (needed for replay); outputs are always recorded.
        to_cpu: move copies to the CPU (on the CPU this is a plain copy, which protects against later in-place
            changes); ``False`` keeps them on the model's device.
        to_dir: stream tensors into safetensors shards in this folder and write a manifest (``trace.json``) on
            exit; the returned trace then reads tensors lazily from disk.
        about: JSON-safe facts written into the manifest (``Trace.about``), so a folder describes itself.

    Returns:
        A :class:`Trace`, filled in while the block runs. Hooks are removed on exit, also when the block
        raises, and they never change what the model computes.
    """
    if isinstance(modules, (str, type)):
        modules = [modules]
    directory = Path(to_dir) if to_dir is not None else None
    writer = _ShardWriter(directory) if directory is not None else None
    trace = Trace(type(model).__name__, directory)
    trace.modules = module_table(model)
    trace.about = dict(about or {})
    recorder = _Recorder(trace, inputs=inputs, to_cpu=to_cpu, writer=writer)
    handles = []
    try:
        for name, module in model.named_modules():
            if not _selected(name, module, modules):
                continue
            recorder.names[id(module)] = (name, type(module).__name__)
            handles.append(module.register_forward_pre_hook(recorder.pre, with_kwargs=True))
            handles.append(module.register_forward_hook(recorder.post, with_kwargs=True, always_call=True))
        yield trace
    finally:
        for handle in handles:
            handle.remove()
        recorder.seen.clear()
        if writer is not None:
            writer.close()
            trace._tensors.shard_of = dict(writer.shard_of)
            _write_manifest(directory, trace, writer.shard_of)


# ------------------------------------------------------------------------------------------- persistence


class _ShardWriter:
    """Buffers tensors and writes them as numbered safetensors shards of about ``shard_bytes`` each."""

    def __init__(self, directory: Path, shard_bytes: int | None = None):
        if directory.exists() and not directory.is_dir():
            raise ParityKitError(f"{directory}: exists and is not a folder")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ParityKitError(
                f"{directory}: cannot create the trace folder ({exc.strerror or exc})"
            ) from None
        for old in directory.glob("tensors-*.safetensors"):
            old.unlink()
        (directory / MANIFEST).unlink(missing_ok=True)
        self.directory = directory
        self.shard_bytes = shard_bytes or _SHARD_BYTES
        self.pending: dict[str, Any] = {}
        self.pending_bytes = 0
        self.shard_of: dict[str, str] = {}
        self.index = 0
        self.complex: list[str] = []

    def add(self, key: str, tensor: Any) -> None:
        if tensor.is_complex():  # safetensors holds no complex dtype: the real view, named in the metadata
            import torch

            self.complex.append(key)
            tensor = torch.view_as_real(tensor.resolve_conj())
        self.pending[key] = tensor.contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        name = f"tensors-{self.index:05d}.safetensors"
        metadata = {_COMPLEX: json.dumps(self.complex)} if self.complex else None
        save_file(self.pending, str(self.directory / name), metadata=metadata)
        for key in self.pending:
            self.shard_of[key] = name
        self.index += 1
        self.pending = {}
        self.pending_bytes = 0
        self.complex = []

    def close(self) -> None:
        self.flush()


def _write_manifest(directory: Path, trace: Trace, shard_of: dict[str, str]) -> None:
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_type": trace.model_type,
        "modules": {name: info.to_dict() for name, info in trace.modules.items()},
        "records": [r.to_dict() for r in trace.records],
        "tensors": shard_of,
        "about": trace.about,
    }
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, allow_nan=False))
    tmp.replace(directory / MANIFEST)


def version_of(tensor: Any) -> int | None:
    r"""A tensor's version counter (bumped by every in-place change), or ``None`` for a tensor made under
    ``torch.inference_mode``, which keeps none (Matcha-TTS samples under it)."""
    try:
        return tensor._version
    except RuntimeError:
        return None
