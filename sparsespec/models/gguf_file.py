"""A GGUF file's header read directly: its key/value metadata and tensor table, each tensor's bytes mapped from disk.

The `gguf` package's reader builds a numpy view for every element of every metadata array (~19 s for a Qwen
vocabulary and its merges on 2 cores); this reads the same header in a fraction of a second. The `gguf` package
still names the weight types and block sizes, and its reader is the reference the tests compare against.

Layout (little-endian, versions 2 and 3): b"GGUF", version u32, tensor count u64, key/value count u64; the
key/value pairs (key: string, value type u32, value); per tensor its name, dimension count u32, dimensions u64
(fastest first), type u32 and data offset u64; then, at the file's alignment, the tensors' data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# value type -> struct format of the scalar types
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (its message says where and why)."""


class NotGGUF(GGUFFormatError):
    """The file does not start with the GGUF magic: some other kind of file."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # a GGMLQuantizationType name: F32, F16, Q4_K, ...
    shape: tuple[int, ...]  # numpy order (slowest first)
    offset: int  # of its first byte in the file
    n_bytes: int
    data: np.ndarray  # F32 / F16 as their dtype in `shape`; other types [..., bytes a row] uint8


@dataclass(frozen=True)
class GGUFFile:
    version: int
    metadata: dict  # key -> int / float / bool / str / list
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0  # slices of an mmap are bytes: cheap, where a numpy memmap's are views

    def unpack(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"the header ends early (at byte {self.pos})")
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"a string of {n} bytes runs past the end of the file (at byte {self.pos})")
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.unpack("IQ")
            if item in _SCALARS and item != 7:  # numbers: one read
                dtype = np.dtype("<" + _SCALARS[item])
                end = self.pos + n * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"an array of {n} values runs past the end of the file")
                out = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
                self.pos = end
                return out
            return [self.value(item) for _ in range(n)]
        raise GGUFFormatError(f"unknown metadata value type {kind} (at byte {self.pos})")


def read_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor table (tensor data memory-mapped, read on use) -> GGUFFile.
    Raises GGUFFormatError on anything malformed: bad magic, unsupported version, truncation, a tensor past the end."""
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise NotGGUF("not a GGUF file (bad magic)")
        header = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, header)
    finally:
        header.close()


def _parse(path, header: mmap.mmap) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    c = _Cursor(header)
    c.pos = 4
    version = c.unpack("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as "
                              "a huge version)")
    n_tensors, n_kv = c.unpack("QQ")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.unpack("Q") for _ in range(c.unpack("I"))]
        kind, offset = c.unpack("IQ")
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {kind}") from None
        infos.append((name, dims, qtype, offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-c.pos // align) * align
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for name, dims, qtype, offset in infos:
        block, size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims)) or (1,)
        count = int(np.prod(shape))
        if shape[-1] % block:
            raise GGUFFormatError(f"tensor {name!r}: rows of {shape[-1]} are not whole {qtype.name} blocks")
        n_bytes = count // block * size
        first = start + offset
        if first + n_bytes > len(buf):
            raise GGUFFormatError(f"truncated: tensor {name!r} needs bytes up to {first + n_bytes}, the file has "
                                  f"{len(buf)}")
        raw = buf[first:first + n_bytes]
        if qtype == GGMLQuantizationType.F32:
            data = raw.view(np.float32).reshape(shape)
        elif qtype == GGMLQuantizationType.F16:
            data = raw.view(np.float16).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block * size)
        tensors.append(GGUFTensor(name, qtype.name, shape, first, n_bytes, data))
    return GGUFFile(version, meta, tensors)
