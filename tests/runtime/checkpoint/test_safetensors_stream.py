"""The streaming safetensors writer and the range reader, against the safetensors library."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerorun.errors import CheckpointError
from zerorun.runtime.checkpoint.safetensors_stream import (
    SafetensorsReader,
    StreamWriter,
    TensorEntry,
    file_size,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.bf16": torch.randn(13, generator=g).to(torch.bfloat16),
        "c.half": torch.randn(3, 3, 2, generator=g).half(),
        "d.steps": torch.arange(5, dtype=torch.int64),
        "e.scalar": torch.tensor(3.5),
        "f.empty": torch.empty(0, 4),
        "g.mask": torch.tensor([True, False, True]),
    }


def test_stream_written_file_loads_with_safetensors(tmp_path):
    ts = _tensors()
    entries = [TensorEntry(k, v.dtype, tuple(v.shape)) for k, v in ts.items()]
    path = tmp_path / "x.safetensors"
    with StreamWriter(path, entries, {"format": "pt", "note": "hi"}) as w:
        for k, v in ts.items():
            w.write(k, v)
    assert os.path.getsize(path) == file_size(entries, {"format": "pt", "note": "hi"})
    back = load_file(str(path))
    assert set(back) == set(ts)
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k], v)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "hi"}


def test_reader_reads_ranges_of_library_written_file(tmp_path):
    ts = _tensors()
    path = tmp_path / "lib.safetensors"
    save_file({k: v.contiguous() for k, v in ts.items()}, str(path), metadata={"format": "pt"})
    with SafetensorsReader(path) as rd:
        assert rd.metadata == {"format": "pt"}
        for k, v in ts.items():
            assert torch.equal(rd.read_tensor(k), v)
        flat = ts["a.weight"].reshape(-1)
        assert torch.equal(rd.read("a.weight", 4, 29), flat[4:29])
        # into a destination of another dtype: cast on the way
        out = torch.empty(10, dtype=torch.float64)
        rd.read("b.bf16", 2, 12, out=out)
        assert torch.equal(out, ts["b.bf16"][2:12].double())
        # into a same-dtype destination: bytes land in place
        out32 = torch.zeros(35)
        rd.read("a.weight", out=out32)
        assert torch.equal(out32, flat)
        with pytest.raises(CheckpointError, match="outside"):
            rd.read("a.weight", 30, 40)
        with pytest.raises(CheckpointError, match="no tensor"):
            rd.read("nope")


def test_writer_enforces_declared_order_and_shapes(tmp_path):
    entries = [TensorEntry("x", torch.float32, (4,)), TensorEntry("y", torch.float32, (2,))]
    path = tmp_path / "w.safetensors"
    w = StreamWriter(path, entries)
    with pytest.raises(CheckpointError, match="expected tensor 'x'"):
        w.write("y", torch.zeros(2))
    with pytest.raises(CheckpointError, match="declared"):
        w.write("x", torch.zeros(5))
    w.write("x", torch.zeros(4))
    with pytest.raises(CheckpointError, match="closed before writing"):
        w.close()
    # a failed `with` block removes the partial file
    with pytest.raises(RuntimeError):
        with StreamWriter(path, entries) as w2:
            w2.write("x", torch.zeros(4))
            raise RuntimeError("boom")
    assert not path.exists()


def test_reader_rejects_truncated_and_garbage_files(tmp_path):
    entries = [TensorEntry("x", torch.float32, (1000,))]
    path = tmp_path / "t.safetensors"
    with StreamWriter(path, entries) as w:
        w.write("x", torch.ones(1000))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsReader(path)
    path.write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsReader(path)
    path.write_bytes((10).to_bytes(8, "little") + b"{not json!")
    with pytest.raises(CheckpointError, match="corrupt"):
        SafetensorsReader(path)
