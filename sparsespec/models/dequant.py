"""GGML block dequantisation in torch: the weight types of the GGUF files we load, on any device.

The `gguf` package's numpy decoder (the reference these are tested against, bit for bit) runs single-threaded
on the CPU: ~25 s for qwen2.5-coder-1.5b's Q4_K / Q6_K weights on a 16-core host and minutes on 2 cores. The same
arithmetic as torch ops runs multi-threaded on the CPU, or on the GPU the model is loaded onto.

Every decoder takes `blocks`: [n, type_size] uint8 (one row a block, in the file's byte layout) and returns
[n, block_size] float32, computed in the reference's order (so float32 results are identical).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

QK_K = 256  # elements in a K-quant super-block
CHUNK = 16384  # blocks decoded at a time on the CPU


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 (little-endian IEEE half) -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, groups · m] uint8 -> [n, groups · 2, m]: each group's low nibbles, then its high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, groups, 1, -1)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, groups * 2, -1)


def _bits(qh: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[n, b] uint8 -> [n, count, b]: field k holds bits [k·width, (k+1)·width) of every byte."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=qh.device).view(1, count, 1)
    return (qh.unsqueeze(1) >> shifts) & ((1 << width) - 1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:  # d f16, qs int8[32]
    d, qs = _f16(blocks[:, :2]), blocks[:, 2:].contiguous().view(torch.int8)
    return qs.float() * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:  # d f16, qs u8[16] (elements 0-15 low nibbles, 16-31 high)
    d, q = _f16(blocks[:, :2]), _nibbles(blocks[:, 2:], 1).reshape(len(blocks), 32)
    return d * (q.to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # d f16, m f16, qs u8[16]
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return d * _nibbles(blocks[:, 4:], 1).reshape(len(blocks), 32).float() + m


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian uint32) -> [n, 32]: bit i of the word for element i."""
    return _bits(qh, 1, 8).transpose(1, 2).reshape(len(qh), 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:  # d f16, qh u32, qs u8[16]
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 6:], 1).reshape(len(blocks), 32) | (_high_bits_32(blocks[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:  # d f16, m f16, qh u32, qs u8[16]
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 8:], 1).reshape(len(blocks), 32) | (_high_bits_32(blocks[:, 4:8]) << 4)
    return d * q.float() + m


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, [n, 8] uint8 each (bytes 0-3 hold
    scales 0-3 and the top bits of scales 4-7, bytes 4-7 the mins likewise, bytes 8-11 the low nibbles of both)."""
    s = scales.reshape(len(scales), 3, 4)
    lo_s, lo_m, mixed = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo_s & 0x3F, (mixed & 0x0F) | ((lo_s >> 2) & 0x30)], dim=1)
    mn = torch.cat([lo_m & 0x3F, (mixed >> 4) | ((lo_m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # d f16, dmin f16, scales u8[12], qs u8[128]
    n = len(blocks)
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (d * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    dm = (dmin * mn.float()).unsqueeze(-1)
    q = _nibbles(blocks[:, 16:], 4).float()  # [n, 8, 32]
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:  # d, dmin, scales u8[12], qh u8[32], qs u8[128]
    n = len(blocks)
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (d * sc.float()).unsqueeze(-1)
    dm = (dmin * mn.float()).unsqueeze(-1)
    q = _nibbles(blocks[:, 48:], 4) | (_bits(blocks[:, 16:48], 1, 8) << 4)  # [n, 8, 32]
    return (d * q.float() - dm).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # ql u8[128], qh u8[64], scales i8[16], d f16
    n = len(blocks)
    ql = _nibbles(blocks[:, :128], 2).reshape(n, 8, 32)  # half h: rows 4h..4h+3 (low of 0-63, high of 0-63)
    qh = _bits(blocks[:, 128:192].reshape(n, 2, 32).reshape(n * 2, 32), 2, 4).reshape(n, 8, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks[:, 208:210]) * scales).reshape(n, 16, 1)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


# type name -> (elements a block, bytes a block, decoder)
BLOCK_TYPES: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (32, 34, _q8_0), "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1), "Q4_K": (QK_K, 144, _q4_k), "Q5_K": (QK_K, 176, _q5_k), "Q6_K": (QK_K, 210, _q6_k),
}


def dequantize(data: np.ndarray, type_name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """A GGUF tensor's data as the gguf reader maps it -> float32 on `device`.

    data: F32 / F16 tensors as their own dtype; block types as [..., bytes a row] uint8 (the last dimension whole
    blocks) -> [..., elements a row]. Other types are decoded by the `gguf` package (numpy) and moved to `device`."""
    if type_name in ("F32", "F16"):
        return torch.from_numpy(np.array(data)).to(device).float()
    if type_name not in BLOCK_TYPES:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as reference

        return torch.from_numpy(reference(data, GGMLQuantizationType[type_name]).copy()).to(device)
    block, size, decode = BLOCK_TYPES[type_name]
    raw = torch.from_numpy(np.array(data, dtype=np.uint8)).to(device)
    if raw.shape[-1] % size:
        raise ValueError(f"{type_name} row of {raw.shape[-1]} bytes is not whole blocks of {size}")
    shape = (*raw.shape[:-1], raw.shape[-1] // size * block)
    blocks = raw.reshape(-1, size)
    if blocks.device.type != "cpu":
        return decode(blocks).reshape(shape)
    out = torch.empty(len(blocks), block)  # on the CPU in cache-sized chunks: the temporaries stay in cache
    for i in range(0, len(blocks), CHUNK):
        out[i:i + CHUNK] = decode(blocks[i:i + CHUNK])
    return out.reshape(shape)
