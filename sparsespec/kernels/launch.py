"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step's chain.

A kernel launched with PDL may start while the kernel before it in the stream finishes: in a CUDA graph part of each
kernel boundary's latency goes (0.25-0.7 us a boundary on the H200, `bench/pdl_probe.py`; a sparse layer at batch
1 is a chain of eight kernels of a few microseconds each). Every such kernel calls `wait_inputs(PDL)` first, in
every program and before any load or store: `griddepcontrol.wait` returns once the predecessor's grid has completed
and its memory is visible, so the kernel reads the predecessor's results and overwrites nothing it still reads.
(A program that returned before waiting could let its grid complete before the predecessor's, and the next kernel's
wait would then no longer cover the one before: hence first, unconditionally.)

    kernel[grid](..., **chained(device))    PDL=..., launch_pdl=...: on where the device has it (sm_90+, compiled)

SPARSESPEC_NO_PDL=1 in the environment launches every kernel plainly (to time the difference, or to rule PDL out
when looking for a fault).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import interpreting


def chained(device: torch.device | str) -> dict[str, bool]:
    """The launch arguments of a chained kernel on `device`: {"PDL": True, "launch_pdl": True} on NVIDIA devices of
    compute capability 9.0 and more with a Triton that has grid dependency control, else {"PDL": False} (no
    `launch_pdl` keyword: backends without the option refuse it) — so also in Triton's interpreter, on ROCm, and
    with SPARSESPEC_NO_PDL=1."""
    on = os.environ.get("SPARSESPEC_NO_PDL") != "1" and not interpreting() and _has_pdl(torch.device(device))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Whether `device` and this Triton have grid dependency control (an NVIDIA GPU of sm_90 or later)."""
    return (device.type == "cuda" and torch.version.hip is None and hasattr(tl.extra.cuda, "gdc_wait")
            and torch.cuda.get_device_capability(device) >= (9, 0))


@triton.jit
def wait_inputs(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one in the stream has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
