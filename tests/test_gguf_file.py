"""The GGUF header reader and the torch block decoders against the gguf package (the reference), bit for bit."""

import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as reference

from sparsespec.models import dequant
from sparsespec.models.dequant import BLOCK_TYPES, dequantize
from sparsespec.models.gguf_file import GGUFFormatError, read_gguf

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _blocks(rng, type_name: str, rows: int, blocks: int, finite: bool) -> np.ndarray:
    """[rows, blocks · type size] random bytes; with `finite` every half-precision scale in them is finite."""
    block, size, _ = BLOCK_TYPES[type_name]
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    if finite:  # the half-precision fields' high bytes below 0x7c: exponent < 31 (no inf / nan)
        halves = {"Q6_K": [209]}.get(type_name, [1, 3] if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [1])
        for h in halves:
            raw[..., h] &= 0x7B
    return raw.reshape(rows, blocks * size)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference's nan · 0 in the unrestricted bytes
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
@pytest.mark.parametrize("rows,blocks", [(1, 1), (3, 5), (7, 2)])
def test_block_decoders_match_the_gguf_package(type_name, rows, blocks, device):
    rng = np.random.default_rng([zlib.crc32(type_name.encode()), rows, blocks])
    for finite in (True, False):
        raw = _blocks(rng, type_name, rows, blocks, finite)
        want = torch.from_numpy(reference(raw, GGMLQuantizationType[type_name]).copy())
        got = dequantize(raw, type_name, device).cpu()
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))  # same bits where finite, same infinities


def test_cpu_chunks_decode_as_one(monkeypatch):
    rng = np.random.default_rng(1)
    raw = _blocks(rng, "Q4_K", 5, 7, finite=True)
    whole = dequantize(raw, "Q4_K")
    monkeypatch.setattr(dequant, "CHUNK", 3)  # 35 blocks in chunks of 3, the last one short
    assert torch.equal(dequantize(raw, "Q4_K"), whole)


def test_other_types_fall_back_to_the_gguf_package():
    rng = np.random.default_rng(2)
    values = rng.standard_normal((3, 64)).astype(np.float32)
    for name, data in (("F32", values), ("F16", values.astype(np.float16))):
        assert torch.equal(dequantize(data, name), torch.from_numpy(data.astype(np.float32)))
    raw = rng.integers(0, 256, size=(2, 84 * 2), dtype=np.uint8)  # Q2_K: 256 values in 84 bytes a block
    raw[:, 81::84] &= 0x7B
    raw[:, 83::84] &= 0x7B
    assert torch.equal(dequantize(raw, "Q2_K"), torch.from_numpy(reference(raw, GGMLQuantizationType.Q2_K).copy()))
    with pytest.raises(ValueError, match="whole blocks"):
        dequantize(raw[:, :100], "Q4_K")


@pytest.fixture
def small_gguf(tmp_path):
    """A GGUF of every metadata value type and a few tensor types in odd shapes (written by the gguf package)."""
    path = tmp_path / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["a", "", "ünï", "x" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    rng = np.random.default_rng(3)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    q8 = rng.integers(0, 256, size=(2, 34 * 3), dtype=np.uint8)
    w.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)  # 2 rows of 96
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reader_matches_the_gguf_package(small_gguf):
    mine, ref = read_gguf(small_gguf), GGUFReader(small_gguf)
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert mine.metadata == want
    assert mine.metadata["t.strs"] == ["a", "", "ünï", "x" * 300] and mine.metadata["t.u64"] == 2**40
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors] == ["f32", "f16", "q8"]
    for a, b in zip(mine.tensors, ref.tensors):
        assert (a.type_name, a.offset, a.n_bytes) == (b.tensor_type.name, int(b.data_offset), int(b.n_bytes))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8))


def test_reader_rejects_damaged_files(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    cases = {
        "bad magic": b"GGUX" + data[4:],
        "version 1 is not supported": data[:4] + (1).to_bytes(4, "little") + data[8:],
        "ends early": data[:30],
        "truncated: tensor 'q8'": data[:-100],  # (the file ends in its 204 bytes and padding)
    }
    for message, damaged in cases.items():
        path = tmp_path / "damaged.gguf"
        path.write_bytes(damaged)
        with pytest.raises(GGUFFormatError, match=message):
            read_gguf(path)
