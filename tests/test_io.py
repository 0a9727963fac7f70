import builtins
import json
import os
import pickle
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.base.io import load_state_dict, load_tensors
from paritykit.base.pickles import dangerous_global, safe_torch_load
from safetensors.torch import save_file

# ----------------------------------------------------------------------------------------------- malicious
# pickles


class _SystemPayload:
    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


class _ExecPayload:
    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.target!r}, 'w').close()",))


class _PopenPayload:
    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (subprocess.Popen, (["touch", self.target],))


def _save_torch_zip(obj, path):
    torch.save(obj, path)


def _save_torch_legacy(obj, path):
    torch.save(obj, path, _use_new_zipfile_serialization=False)


def _save_plain_pickle(obj, path):
    # plain pickle stores tensors through torch.storage._load_from_bytes (itself refused): keep the payload
    # only
    with open(path, "wb") as handle:
        pickle.dump({k: v for k, v in obj.items() if not isinstance(v, torch.Tensor)}, handle)


@pytest.mark.parametrize(
    "payload, global_name",
    [
        (_SystemPayload, os.system.__module__ + ".system"),
        (_ExecPayload, "builtins.exec"),
        (_PopenPayload, "Popen"),
    ],
)
@pytest.mark.parametrize("writer", [_save_torch_zip, _save_torch_legacy, _save_plain_pickle])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, payload, global_name, writer):
    target = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    writer({"weight": torch.ones(2), "payload": payload(target)}, path)

    with pytest.raises(ParityKitError) as err:
        safe_torch_load(path)
    message = str(err.value)
    assert str(path) in message and global_name in message and "dangerous global" in message
    for loader in (load_state_dict, load_tensors):
        with pytest.raises(ParityKitError, match="dangerous global"):
            loader(path)
    assert not target.exists()


def _protocol4_global(module: str, name: str, argument: str) -> bytes:
    r"""``module.name(argument)`` as raw protocol-4 opcodes (STACK_GLOBAL lets ``name`` contain dots)."""

    def short_unicode(text: str) -> bytes:
        data = text.encode()
        return b"\x8c" + struct.pack("<B", len(data)) + data

    return (
        b"\x80\x04"
        + short_unicode(module)
        + short_unicode(name)
        + b"\x93"
        + short_unicode(argument)
        + b"\x85R."
    )


def test_attribute_walk_to_a_dangerous_global_is_refused(tmp_path):
    target = tmp_path / "PWNED"
    path = tmp_path / "walk.pt"
    path.write_bytes(_protocol4_global("torch", "serialization.os.system", f"touch {target}"))
    with pytest.raises(ParityKitError, match=r"torch\.serialization\.os\.system"):
        safe_torch_load(path)
    assert not target.exists()


def test_setting_attributes_on_an_allowed_global_is_refused(tmp_path):
    # GLOBAL torch.Tensor; state {"paritykit_marker": 1}; BUILD -> would setattr on the class itself
    path = tmp_path / "build.pt"
    path.write_bytes(b"\x80\x02ctorch\nTensor\n}X\x10\x00\x00\x00paritykit_markerK\x01sb.")
    with pytest.raises(ParityKitError, match="set attributes on the global"):
        safe_torch_load(path)
    assert not hasattr(torch.Tensor, "paritykit_marker")


@pytest.mark.parametrize(
    "module, name, dangerous",
    [
        ("posix", "system", True),
        ("__builtin__", "eval", True),
        ("builtins", "getattr", True),
        ("commands", "getoutput", True),
        ("shutil", "rmtree", True),
        ("importlib.import_module", "x", True),
        ("builtins", "set", False),
        ("collections", "OrderedDict", False),
        ("omegaconf.dictconfig", "DictConfig", False),
        ("pathlib", "PosixPath", False),
    ],
)
def test_dangerous_global_list(module, name, dangerous):
    assert (dangerous_global(module, name) is not None) is dangerous


# ------------------------------------------------------------------------------------ Lightning-style
# checkpoints


@pytest.fixture
def throwaway_module(tmp_path):
    r"""A module importable only while the fixture runs: afterwards its classes cannot be resolved."""
    folder = tmp_path / "throwaway_src"
    folder.mkdir()
    (folder / "paritykit_throwaway_mod.py").write_text(
        "class HParams:\n"
        "    def __init__(self, lr):\n"
        "        self.lr = lr\n"
        "        self.betas = (0.9, 0.999)\n"
        "\n"
        "class LoopState(dict):\n"
        "    pass\n"
    )
    sys.path.insert(0, str(folder))
    import paritykit_throwaway_mod

    yield paritykit_throwaway_mod
    sys.modules.pop("paritykit_throwaway_mod", None)
    if str(folder) in sys.path:
        sys.path.remove(str(folder))


@pytest.mark.parametrize("writer", [_save_torch_zip, _save_torch_legacy])
def test_lightning_checkpoint_loads_tensors_and_reports_stubs(tmp_path, throwaway_module, writer):
    generator = torch.Generator().manual_seed(0)
    state = {
        "unet.conv.weight": torch.randn(4, 3, 3, 3, generator=generator),
        "unet.conv.bias": torch.randn(4, generator=generator),
        "vae.scale": torch.tensor(0.18215, dtype=torch.float16),
    }
    checkpoint = {
        "epoch": 7,
        "global_step": 1234,
        "state_dict": state,
        "hyper_parameters": throwaway_module.HParams(lr=1e-4),
        "loops": throwaway_module.LoopState(progress=np.arange(3)),
        "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(4)}}}],
    }
    path = tmp_path / "last.ckpt"
    writer(checkpoint, path)
    sys.modules.pop("paritykit_throwaway_mod")
    sys.path.remove(str(tmp_path / "throwaway_src"))
    with pytest.raises(pickle.UnpicklingError):  # what a plain weights_only load does with it
        torch.load(path, weights_only=True)

    loaded = safe_torch_load(path)
    assert sorted(loaded.stubbed) == ["paritykit_throwaway_mod.HParams", "paritykit_throwaway_mod.LoopState"]
    assert loaded.obj["epoch"] == 7
    assert loaded.obj["hyper_parameters"].state == {"lr": 1e-4, "betas": (0.9, 0.999)}
    assert "paritykit_throwaway_mod" not in sys.modules  # nothing was imported

    state_dict = load_state_dict(path)
    assert list(state_dict) == list(state)
    for key, value in state.items():
        assert state_dict[key].dtype == value.dtype and torch.equal(state_dict[key], value)

    names = list(load_tensors(path))
    assert "last/state_dict.unet.conv.weight" in names
    assert "last/optimizer_states.0.state.0.exp_avg" in names


def test_weights_only_path_reports_nothing_stubbed(tmp_path):
    state = {"a.weight": torch.randn(2, 2), "a.bias": torch.nn.Parameter(torch.randn(2))}
    torch.save(state, tmp_path / "plain.pth")
    loaded = safe_torch_load(tmp_path / "plain.pth")
    assert loaded.stubbed == []
    assert torch.equal(loaded.obj["a.weight"], state["a.weight"])


def test_protocol_4_checkpoint_loads_through_the_restricted_path(tmp_path):
    state = {"w": torch.randn(3, 2), "nested": {"b": torch.arange(4)}}
    torch.save(state, tmp_path / "p4.pt", pickle_protocol=4)
    state_dict = load_state_dict(tmp_path / "p4.pt")
    assert list(state_dict) == ["w", "nested.b"]
    assert torch.equal(state_dict["nested.b"], state["nested"]["b"])


def test_whole_pickled_module_yields_its_state_dict(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1))
    torch.save(model, tmp_path / "whole.pt")
    loaded = safe_torch_load(tmp_path / "whole.pt")
    assert "torch.nn.modules.linear.Linear" in loaded.stubbed
    state_dict = load_state_dict(tmp_path / "whole.pt")
    expected = {k: v for k, v in model.state_dict().items()}
    assert set(state_dict) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state_dict[key], value)


# -------------------------------------------------------------------------------------------- state dict
# readers


@pytest.mark.parametrize("wrapper", ["state_dict", "model", "module"])
def test_wrappers_are_unwrapped_and_nested_dicts_flattened(tmp_path, wrapper):
    inner = {"unet": {"conv": {"weight": torch.randn(2, 2)}}, "scale": torch.tensor(2.0)}
    torch.save({wrapper: inner, "step": 3, "note": "kept out"}, tmp_path / "wrapped.bin")
    state_dict = load_state_dict(tmp_path / "wrapped.bin")
    assert list(state_dict) == ["unet.conv.weight", "scale"]
    assert torch.equal(state_dict["unet.conv.weight"], inner["unet"]["conv"]["weight"])


def test_non_dict_checkpoint_is_not_a_state_dict(tmp_path):
    torch.save(torch.randn(3), tmp_path / "tensor.pt")
    with pytest.raises(ParityKitError, match=r"tensor\.pt.*not a state dict"):
        load_state_dict(tmp_path / "tensor.pt")
    assert list(load_tensors(tmp_path / "tensor.pt")) == ["tensor"]


def test_safetensors_keeps_dtypes(tmp_path):
    state = {
        "bf16": torch.randn(3, dtype=torch.bfloat16),
        "int": torch.arange(5),
        "half": torch.ones(2).half(),
    }
    save_file(state, tmp_path / "model.safetensors")
    loaded = load_state_dict(tmp_path / "model.safetensors")
    assert {k: v.dtype for k, v in loaded.items()} == {k: v.dtype for k, v in state.items()}
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def _write_sharded(folder, state, split):
    keys = list(state)
    shards = {
        "diffusion_pytorch_model-00001-of-00002.safetensors": keys[:split],
        "diffusion_pytorch_model-00002-of-00002.safetensors": keys[split:],
    }
    weight_map = {}
    for shard, shard_keys in shards.items():
        save_file({k: state[k] for k in shard_keys}, folder / shard)
        weight_map.update(dict.fromkeys(shard_keys, shard))
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def test_sharded_set_reads_as_one_state_dict(tmp_path):
    generator = torch.Generator().manual_seed(1)
    state = {f"blocks.{i}.weight": torch.randn(2, 2, generator=generator) for i in range(5)}
    index = _write_sharded(tmp_path, state, split=2)
    (tmp_path / "config.json").write_text("{}")

    for source in (index, tmp_path):
        loaded = load_state_dict(source)
        assert list(loaded) == list(state)
        assert all(torch.equal(loaded[k], state[k]) for k in state)

    names = list(load_tensors(tmp_path))
    assert names == [f"diffusion_pytorch_model/blocks.{i}.weight" for i in range(5)]

    (tmp_path / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ParityKitError, match="00002-of-00002.safetensors is missing"):
        load_state_dict(index)


def test_folder_resolution_for_load_state_dict(tmp_path):
    component = tmp_path / "pipeline" / "unet"
    component.mkdir(parents=True)
    save_file({"w": torch.ones(1)}, component / "diffusion_pytorch_model.safetensors")
    save_file({"w": torch.zeros(1)}, component / "diffusion_pytorch_model.fp16.safetensors")
    assert torch.equal(load_state_dict(component)["w"], torch.ones(1))
    with pytest.raises(ParityKitError, match=r"no weights file.*pipeline/unet"):
        load_state_dict(tmp_path / "pipeline")

    several = tmp_path / "several"
    several.mkdir()
    save_file({"w": torch.ones(1)}, several / "a.safetensors")
    save_file({"w": torch.ones(1)}, several / "b.safetensors")
    with pytest.raises(ParityKitError, match="several weights files"):
        load_state_dict(several)


def test_npz_and_npy(tmp_path):
    np.savez(tmp_path / "arrays.npz", x=np.arange(6, dtype=np.float32).reshape(2, 3), label=np.array("text"))
    np.save(tmp_path / "single.npy", np.ones((2, 2), dtype=np.float16))
    assert list(load_state_dict(tmp_path / "arrays.npz")) == ["x"]
    tensors = load_tensors(tmp_path)
    assert list(tensors) == ["arrays/x", "single"]
    assert tensors["single"].dtype == torch.float16
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ParityKitError, match=r"objects\.npy"):
        load_tensors(tmp_path / "objects.npy")


# ------------------------------------------------------------------------------------------- load_tensors
# naming


def test_naming_rules_for_files_and_folders(tmp_path):
    (tmp_path / "sub").mkdir()
    torch.save(torch.randn(2), tmp_path / "sub" / "x.pt")
    torch.save({"latents": torch.randn(2), "extra": {"t": torch.tensor(1)}}, tmp_path / "dump.pt")
    save_file({"only": torch.randn(2)}, tmp_path / "one.safetensors")
    np.savez(tmp_path / "pack.npz", k=np.zeros(2))
    np.save(tmp_path / "arr.npy", np.zeros(2))
    (tmp_path / "notes.txt").write_text("skipped inside a folder")
    (tmp_path / ".hidden").mkdir()
    torch.save(torch.randn(1), tmp_path / ".hidden" / "skip.pt")

    names = list(load_tensors(tmp_path))
    assert names == ["arr", "dump/extra.t", "dump/latents", "one/only", "pack/k", "sub/x"]
    # a single file is named by its own stem, containers always get stem/key
    assert list(load_tensors(tmp_path / "sub" / "x.pt")) == ["x"]
    assert list(load_tensors(tmp_path / "one.safetensors")) == ["one/only"]


def test_natural_sort_order(tmp_path):
    for step in (10, 2, 1, 0, 11):
        torch.save(torch.full((1,), float(step)), tmp_path / f"after_step_{step}.pt")
    tensors = load_tensors(tmp_path)
    assert list(tensors) == [f"after_step_{i}" for i in (0, 1, 2, 10, 11)]
    assert [t.item() for t in tensors.values()] == [0.0, 1.0, 2.0, 10.0, 11.0]


# ------------------------------------------------------------------------------------------------------------
# failures


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    "name, writer",
    [
        ("t.safetensors", lambda p: save_file({"w": torch.randn(64)}, p)),
        ("t.pt", lambda p: torch.save({"w": torch.randn(64)}, p)),
        ("legacy.pt", lambda p: torch.save({"w": torch.randn(64)}, p, _use_new_zipfile_serialization=False)),
        ("t.npy", lambda p: np.save(p, np.zeros(64))),
        ("t.npz", lambda p: np.savez(p, w=np.zeros(64))),
    ],
)
def test_truncated_files_raise_naming_the_file(tmp_path, name, writer):
    path = tmp_path / name
    writer(path)
    _truncate(path)
    for loader in (load_tensors, load_state_dict) if not name.endswith(".npy") else (load_tensors,):
        with pytest.raises(ParityKitError, match=name.replace(".", r"\.")):
            loader(path)


def test_corrupt_unknown_and_missing_paths(tmp_path):
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(ParityKitError, match=r"garbage\.ckpt"):
        load_state_dict(garbage)
    unknown = tmp_path / "weights.h5"
    unknown.write_bytes(b"\x00")
    with pytest.raises(ParityKitError, match=r"weights\.h5: unknown tensor file suffix"):
        load_tensors(unknown)
    with pytest.raises(ParityKitError, match=r"missing\.pt: no such file"):
        load_tensors(tmp_path / "missing.pt")
    with pytest.raises(ParityKitError, match=r"missing\.safetensors: no such file"):
        load_state_dict(tmp_path / "missing.safetensors")
    empty = tmp_path / "empty.pt"
    torch.save({"step": 1}, empty)
    with pytest.raises(ParityKitError, match=r"empty\.pt: no tensors"):
        load_state_dict(empty)


# ------------------------------------------------------------------------------------------------ through the
# CLI


def test_cli_refuses_a_malicious_pickle_with_one_line_and_exit_2(tmp_path, cli):
    target = tmp_path / "PWNED"
    torch.save({"weight": torch.ones(2), "payload": _SystemPayload(target)}, tmp_path / "evil.ckpt")
    save_file({"weight": torch.ones(2)}, tmp_path / "good.safetensors")
    result = cli("weights", "diff", tmp_path / "evil.ckpt", tmp_path / "good.safetensors", "--quiet")
    assert result.returncode == 2, result.stderr
    assert "dangerous global" in result.stderr and "evil.ckpt" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not target.exists()

    torch.save({"weight": torch.ones(64)}, tmp_path / "cut.pt")
    _truncate(tmp_path / "cut.pt")
    result = cli("weights", "diff", tmp_path / "cut.pt", tmp_path / "good.safetensors", "--quiet", "--json")
    assert result.returncode == 2
    assert "cut.pt" in json.loads(result.stdout)["error"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script is deprecated; old files remain
def test_torchscript_archive_is_refused(tmp_path):
    torch.jit.script(torch.nn.Linear(2, 2)).save(str(tmp_path / "scripted.pt"))
    with pytest.raises(ParityKitError, match=r"scripted\.pt: a TorchScript archive"):
        load_state_dict(tmp_path / "scripted.pt")


def test_a_checkpoint_manifest_path_reads_as_its_folder(tmp_path):
    from paritykit.tracing.checkpoints import Checkpoint, save_checkpoints

    manifest = save_checkpoints(tmp_path / "ckpts", {"preloop": Checkpoint(data={"latents": torch.ones(2)})})
    assert os.path.basename(manifest) == "paritykit.json"
    assert list(load_tensors(manifest)) == list(load_tensors(tmp_path / "ckpts")) == ["preloop/latents"]


# ------------------------------------------------------------------------------------------ one naming


def _research_and_port(tmp_path):
    """A research checkpoint ({"state_dict": {"model.diffusion_model.…"}}) and its diffusers folder."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    port = {"conv_in.weight": torch.randn(4, 3, generator=gen), "conv_in.bias": torch.randn(4, generator=gen)}
    research = {"state_dict": {f"model.diffusion_model.{k}": v.clone() for k, v in port.items()}}
    research["state_dict"]["model.diffusion_model.conv_in.bias"] += 1.0  # one real difference
    torch.save(research, tmp_path / "research.ckpt")
    (tmp_path / "port" / "unet").mkdir(parents=True)
    save_file(port, str(tmp_path / "port" / "unet" / "diffusion_pytorch_model.safetensors"))
    (tmp_path / "port" / "unet" / "config.json").write_text('{"_class_name": "UNet2DModel"}')
    return tmp_path / "research.ckpt", tmp_path / "port" / "unet"


def test_compare_and_weights_diff_name_tensors_alike_so_one_map_fits_both(tmp_path):
    from paritykit.base.io import load_named_tensors
    from paritykit.base.naming import parse_map_options
    from paritykit.compare.sets import compare_paths
    from paritykit.forensics.weights import open_checkpoint, weights_diff

    research, port = _research_and_port(tmp_path)
    for path in (research, port):
        assert list(load_named_tensors(path)) == list(open_checkpoint(path).entries), path
    strip = r"^model\.diffusion_model\.="
    compared = compare_paths(str(research), str(port), maps=[strip])
    diffed = weights_diff(research, port, rules=parse_map_options([strip]))
    assert sorted(pair.name for pair in compared.pairs) == ["conv_in.bias", "conv_in.weight"]
    assert not compared.only_a and not compared.only_b
    assert not diffed.only_a and not diffed.only_b
    assert [pair.name for pair in compared.pairs if not pair.passed] == ["conv_in.bias"]
    assert [change.key for change in diffed.changed] == ["conv_in.bias"]


def test_named_tensors_keep_output_folders_and_single_tensors_as_before(tmp_path):
    from paritykit.base.io import load_named_tensors
    from paritykit.tracing.checkpoints import Checkpoint, save_checkpoints

    torch.save(torch.ones(2), tmp_path / "x.pt")
    np.save(tmp_path / "y.npy", np.zeros(3, dtype=np.float32))
    assert list(load_named_tensors(tmp_path / "x.pt")) == ["x"]
    assert list(load_named_tensors(tmp_path / "y.npy")) == ["y"]
    # a folder of outputs (no config, no conventional weights name) is not a model folder
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    torch.save({"latents": torch.ones(2)}, outputs / "step_1.pt")
    assert list(load_named_tensors(outputs)) == ["step_1/latents"]
    saved = save_checkpoints(tmp_path / "ckpts", {"preloop": Checkpoint(data={"latents": torch.ones(2)})})
    assert list(load_named_tensors(saved)) == ["preloop/latents"]


def test_a_pipeline_folder_is_named_component_dot_key(tmp_path):
    from paritykit.base.io import load_named_tensors
    from paritykit.forensics.weights import open_checkpoint

    _, port = _research_and_port(tmp_path)
    pipeline = tmp_path / "port"
    (pipeline / "model_index.json").write_text("{}")
    (pipeline / "scheduler").mkdir()
    (pipeline / "scheduler" / "scheduler_config.json").write_text("{}")
    assert list(load_named_tensors(pipeline)) == list(open_checkpoint(pipeline).entries)
    assert list(load_named_tensors(pipeline))[0].startswith("unet.conv_in.")
