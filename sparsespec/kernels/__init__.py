"""Triton kernels of the graph-captured decode and verify steps (dense and sparse), each beside the torch reference
it is tested against.

    launch.py    programmatic dependent launch for the kernels of a step's chain (sm_90+)
    binarypc.py  probe (quantised; tabulated per code byte, or packed as bytes), table or dp4a scoring with the
                 group max (and a policy's forced list) fused in, residual encoding
    scores.py    oracle top-k (q·k group max) and Quest (page bounds) scorers writing the select's keys
    kmeans.py    the k-means assignment step (nearest centroid, argmax epilogue) of Double-P's build
    clusters.py  Double-P's cluster scoring (q·centroid and the spread term, a KV head's query group in one pass)
                 and the step's upkeep of the index (the key leaving the window joins its nearest cluster)
    cluster_select.py  Double-P's two top-p stages without a sort (thresholds on the cluster masses), the centroid
                 terms' partials and the exactly attended slots
    select.py    fixed-width top-k by radix select over integer keys, forced slots first
    attend.py    split-K flash-decoding over the selected slots (GQA: each K/V row read once per KV head), and
                 the block attention of a step's few queries a row over the whole cache
    rotary.py    a step's rotary embedding fused with its KV-cache write
    matmul.py    row-invariant matrix products (a row's result independent of the step's row count)
    norm.py      row-invariant RMSNorm
    cross_entropy.py  the DFlash training loss over the vocabulary, read in the logits' own dtype (no fp32 copy)

The kernels run on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1 (the tests, at small sizes). The
torch references are the CPU path of the engine.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1): no libdevice calls there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_ready(device: torch.device | str) -> bool:
    """Whether the engine runs the Triton kernels on tensors of `device`: on CUDA. On CPU it runs their torch
    references (the interpreter is for the kernels' own tests, not for decoding)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
