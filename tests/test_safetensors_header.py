import json

import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.forensics.safetensors_header import read_safetensors_header
from safetensors.torch import save_file


def write_raw(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_header_matches_safetensors_library(tmp_path):
    from safetensors import safe_open

    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.zeros(2, dtype=torch.bfloat16),
        "c": torch.ones(5, dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt", "note": "hi"})
    header = read_safetensors_header(tmp_path / "x.safetensors")
    assert header.metadata == {"format": "pt", "note": "hi"}
    assert {k: (v.dtype, v.shape) for k, v in header.tensors.items()} == {
        "a": ("float32", (3, 4)),
        "b": ("bfloat16", (2,)),
        "c": ("int64", (5,)),
    }
    raw = (tmp_path / "x.safetensors").read_bytes()
    with safe_open(tmp_path / "x.safetensors", "pt") as handle:
        for name, info in header.tensors.items():
            expected = handle.get_tensor(name)
            assert raw[info.start : info.end] == expected.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
        ({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unsupported dtype"),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "lacks"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "invalid data_offsets"),
        ({"__metadata__": "x"}, b"", "__metadata__"),
    ],
)
def test_invalid_headers_name_the_file(tmp_path, header, data, message):
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(ParityKitError, match=message) as info:
        read_safetensors_header(path)
    assert "bad.safetensors" in str(info.value)


def test_bad_length_and_not_json(tmp_path):
    (tmp_path / "len.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ParityKitError, match="header length"):
        read_safetensors_header(tmp_path / "len.safetensors")
    (tmp_path / "json.safetensors").write_bytes((3).to_bytes(8, "little") + b"{x}")
    with pytest.raises(ParityKitError, match="not valid JSON"):
        read_safetensors_header(tmp_path / "json.safetensors")
    (tmp_path / "short.safetensors").write_bytes(b"\1\0")
    with pytest.raises(ParityKitError, match="truncated"):
        read_safetensors_header(tmp_path / "short.safetensors")


def test_sharded_index_errors(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "s1.safetensors")
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(ParityKitError, match="s2.safetensors"):
        read_safetensors_header(index)
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    with pytest.raises(ParityKitError, match="not found in the shards"):
        read_safetensors_header(index)
    index.write_text(json.dumps({"metadata": {"total_size": 8}, "weight_map": {"a": "s1.safetensors"}}))
    header = read_safetensors_header(index)
    assert list(header.tensors) == ["a"] and header.metadata["total_size"] == "8"
