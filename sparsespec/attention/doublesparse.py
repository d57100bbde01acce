"""Double Sparsity: approximate q·k on a few offline-calibrated "label" channels, then exact attention on the top-k.

Offline (`sparsespec calibrate doublesparse`), post-RoPE queries and keys of calibration text give, per layer and
KV head, the `channels` channels with the largest mean contribution |q_d k_d| to the logits. We average over
every (query, key) pair of the calibration tokens and over the KV head's query group; because |q_d k_d| =
|q_d| |k_d|, the all-pairs mean is exactly E|q_d| · E|k_d|, which is what `calibrate_label_channels` computes.
Channels are stored most important first, so a file calibrated with more channels serves any smaller count.

At decode a query head scores each key by q·k over its KV head's label channels, read straight from the cache
keys; the group score is the max over the KV head's query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SparseSpecError
from .policy import BudgetOptions, SelectionPolicy, group_max, option


@dataclass(frozen=True)
class DoubleSparseOptions(BudgetOptions):
    channels: int = option(16, "label channels per KV head (the channels scored)")
    labels: str = option("", "label-channel file from `sparsespec calibrate doublesparse`")

    def __post_init__(self):
        super().__post_init__()
        if self.channels < 1:
            raise SparseSpecError(f"channels must be >= 1, got {self.channels}")
        if self.labels and not Path(self.labels).is_file():
            raise SparseSpecError(f"label channel file {self.labels} not found")


# ---------------------------------------------------------------------------------------------- calibration

def calibrate_label_channels(q_per_layer: dict[int, torch.Tensor], k_per_layer: dict[int, torch.Tensor],
                             channels: int) -> dict[str, torch.Tensor]:
    """Post-RoPE q [Hq, N, D] and k [Hkv, N', D] per layer -> {"layer{l}": int64 [Hkv, channels]}: per KV head,
    the channels with the largest mean |q_d k_d| over all (query of its group, key) pairs, most important first."""
    out = {}
    for layer, q in q_per_layer.items():
        k = k_per_layer[layer]
        Hq, _, D = q.shape
        Hkv = k.shape[0]
        if Hq % Hkv or k.shape[-1] != D:
            raise SparseSpecError(f"layer {layer}: queries {tuple(q.shape)} do not fit keys {tuple(k.shape)}")
        if not 1 <= channels <= D:
            raise SparseSpecError(f"channels must be in [1, {D}], got {channels}")
        q_mag = q.float().abs().view(Hkv, Hq // Hkv, -1, D).mean(dim=(1, 2))  # [Hkv, D]
        k_mag = k.float().abs().mean(1)  # [Hkv, D]
        out[f"layer{layer}"] = (q_mag * k_mag).topk(channels, dim=-1).indices.cpu().contiguous()
    return out


def save_labels(path: str | Path, labels: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in labels.items()}, str(path),
              metadata={k: str(v) for k, v in (metadata or {}).items()})


def load_labels(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        labels = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise SparseSpecError(f"cannot read label channel file {path}: {' '.join(str(e).split())}") from None
    for name, t in labels.items():
        if t.dtype != torch.int64 or t.dim() != 2:
            raise SparseSpecError(f"label channel file {path}: {name} must be int64 [Hkv, channels], "
                                  f"got {t.dtype} {tuple(t.shape)}")
    return labels


# ---------------------------------------------------------------------------------------------- the policy

class DoubleSparse(SelectionPolicy):
    name = "doublesparse"
    Options = DoubleSparseOptions

    def __init__(self, options: DoubleSparseOptions | None = None):
        super().__init__(options)
        if not self.options.labels:
            raise SparseSpecError("doublesparse needs calibrated label channels: run `sparsespec calibrate "
                                  "doublesparse --model M --out FILE`, then pass labels=FILE")
        self.labels = load_labels(self.options.labels)

    def build(self, layer, cache, lengths):
        """Check this layer's label channels against the model; keep the first `channels` of them on the cache's
        device as the layer's state ([Hkv, channels] int64)."""
        if not self.is_sparse(layer):
            return
        _, Hkv, _, D = cache.k[layer].shape
        r = self.options.channels
        labels = self.labels.get(f"layer{layer}")
        if labels is None or labels.shape[0] != Hkv or labels.shape[1] < r or labels.min() < 0 or labels.max() >= D:
            raise SparseSpecError(f"label channel file {self.options.labels} does not fit this model at layer "
                                  f"{layer} (want [{Hkv}, >= {r}] channel indices below {D})")
        cache.policy_state[layer] = labels[:, :r].to(cache.device)

    def scores(self, layer, q, cache, positions):
        labels: torch.Tensor = cache.policy_state[layer]  # [Hkv, r]
        kv_len = max(self.host_positions(positions)) + 1
        keys, _ = cache.keys(layer, kv_len)  # [B, Hkv, S, D]
        B, Hq, _, D = q.shape
        Hkv, r = labels.shape
        G = Hq // Hkv
        k_lab = keys.gather(-1, labels[None, :, None, :].expand(B, Hkv, kv_len, r))  # [B, Hkv, S, r]
        q_lab = q.view(B, Hkv, G, D).gather(-1, labels[None, :, None, :].expand(B, Hkv, G, r))  # [B, Hkv, G, r]
        per_head = q_lab.float() @ k_lab.float().transpose(-1, -2)  # [B, Hkv, G, S]
        return group_max(per_head.reshape(B, Hq, kv_len), Hkv)
