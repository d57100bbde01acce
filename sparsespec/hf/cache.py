"""`SparseCache`: a transformers `Cache` whose layers keep a sparse policy's index beside K/V.

Every layer (`SparseLayer`, a `CacheLayerMixin`) stores its keys and values in one sparsespec `KVCache` (static,
position-indexed: slot p holds position p), so a policy reads them exactly as inside sparsespec's own engine
(`cache.k[layer]`, `cache.policy_state[layer]`, `cache.capacity`). The policy's lifecycle follows the Runner's:

    prefill (any number of multi-token forwards)  dense; K/V written, no index yet
    first single-token step (layer 0's update)    `build` every layer's index from the committed tokens
    every later single-token step                 `append` first when the committed length moved (the last
                                                  step's token in eager steps, a multi-token write or a `crop`)
    single-token step, sparse layer               the attention function calls `policy.decode`

A single-token step hands its context to the attention function through the attention's own kwargs, which
transformers passes to `Cache.update` (`cache.update(k, v, layer_idx, kwargs=kwargs)`) before it calls the
attention function with them: the layer adds one entry (`STEP_KEY`) there. On CUDA a graphable policy steps in
fixed width (`Policy.plan_fixed` / `begin_step`: sparsespec's Triton kernels); elsewhere its torch reference runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention import POLICIES
from ..attention.policy import Policy, PolicyOptions, device_ints
from ..cache import KVCache
from ..config import ModelConfig
from ..errors import SparseSpecError

PREFIX = "sparsespec_"  # attn_implementation="sparsespec_<policy>"
STEP_KEY = "sparsespec_step"  # the attention kwargs entry a layer of a SparseCache adds


def policy_name(attn_implementation: str | None) -> str:
    """"sparsespec_binarypc" -> "binarypc"; anything else is an error naming the choices."""
    name = (attn_implementation or "").removeprefix(PREFIX)
    if not (attn_implementation or "").startswith(PREFIX) or name not in POLICIES:
        choices = ", ".join(PREFIX + n for n in POLICIES)
        raise SparseSpecError(f"a SparseCache needs a model loaded with attn_implementation set to one of {choices}; "
                              f"this one uses {attn_implementation!r}")
    return name


@dataclass
class DecodeStep:
    """What the attention function needs for one layer of a single-token step of a SparseCache."""

    policy: Policy
    cache: KVCache  # every layer's K/V and the policy's index (policy_state)
    layer: int
    positions: list[int]  # each row's query position (= its slot)
    positions_dev: torch.Tensor  # the same [B] on the device, made once per step for every layer

    @property
    def sparse(self) -> bool:
        return self.policy.is_sparse(self.layer)


class SparseCache(Cache):
    """A static cache of `max_cache_len` positions for a model loaded with `attn_implementation="sparsespec_<policy>"`;
    `options` are that policy's options (its dataclass, e.g. `BinaryPCOptions(budget=0.02)`; default: its defaults).
    `fixed`: step a graphable policy in fixed width through sparsespec's kernels (default: on CUDA; on CPU their torch
    references run, as `Runner(fixed=True)` does). Rows must be unpadded (batch 1, or prompts of one length)."""

    def __init__(self, config: PreTrainedConfig, max_cache_len: int, options: PolicyOptions | None = None,
                 fixed: bool | None = None):
        text = config.get_text_config(decoder=True)
        cls = POLICIES[policy_name(text._attn_implementation)]
        if options is None:
            options = cls.Options()
        if type(options) is not cls.Options:
            raise SparseSpecError(f"policy {cls.name!r} takes {cls.Options.__name__}, got {type(options).__name__}")
        self.model_config = ModelConfig.from_hf(text.to_dict())
        if self.model_config.sliding_window is not None:
            raise SparseSpecError("sparse attention policies do not support sliding-window models yet")
        if max_cache_len < 1 or max_cache_len > self.model_config.max_position:
            raise SparseSpecError(f"max_cache_len must be in [1, {self.model_config.max_position}] (the model's "
                                  f"context), got {max_cache_len}")
        self.policy = cls(options)
        if self.policy.options.select_every > 1:
            raise SparseSpecError("select_every is a setting of sparsespec's own runner (generate, --draft self:...); "
                                  "a transformers SparseCache selects at every step")
        self.max_cache_len = max_cache_len
        self.prefer_fixed = fixed
        self.fixed = False
        self.kv: KVCache | None = None  # allocated at the first update (batch, dtype and device are known then)
        self.built = False
        self.indexed = 0  # the committed length the policy's index was last brought to
        self.step: DecodeStep | None = None  # the single-token step in progress (made by `begin_decode`)
        self.sparse_layers = self.policy.sparse_layers(self.model_config.num_layers)
        super().__init__(layers=[SparseLayer(self, i) for i in range(self.model_config.num_layers)])

    def allocate(self, key_states: torch.Tensor) -> None:
        if self.kv is None:
            B, Hkv, _, D = key_states.shape
            cfg = self.model_config
            if (Hkv, D) != (cfg.num_kv_heads, cfg.head_dim):
                raise SparseSpecError(f"keys of {Hkv} heads x {D} do not fit the config's "
                                      f"{cfg.num_kv_heads} x {cfg.head_dim}")
            self.kv = KVCache(cfg, B, self.max_cache_len, key_states.dtype, key_states.device)
            cuda = key_states.device.type == "cuda"
            self.fixed = self.policy.graphable and (cuda if self.prefer_fixed is None else self.prefer_fixed)
        elif key_states.shape[0] != self.kv.batch:
            raise SparseSpecError(f"this SparseCache holds {self.kv.batch} rows, got a batch of {key_states.shape[0]}")

    def begin_decode(self, n: int) -> None:
        """The start of a single-token step at position n of every row (layer 0's update, before its write): the
        index is built, or brought to the n committed tokens; a fixed-width step gets its per-step metadata."""
        policy, kv = self.policy, self.kv
        lengths = [n] * kv.batch
        if any(layer.length != n for layer in self.layers):
            raise SparseSpecError("the layers of this SparseCache hold different lengths at a decode step")
        if not self.built:
            policy.end_fixed()
            policy.reset_attended()
            policy.build_all(kv, lengths)
            if self.fixed:
                policy.plan_fixed(kv, lengths)
            self.built = True
        elif self.indexed != n:
            policy.append_all(kv, lengths)
        self.indexed = n
        self.step = DecodeStep(policy, kv, 0, lengths, device_ints(lengths, kv.device))  # shared by every layer
        if self.fixed:
            policy.begin_step(self.step.positions_dev)
            policy.stepped(self.sparse_layers)
            self.indexed = n + 1  # a fixed-width step takes its own token into the index (the Runner appends none)

    def reset(self) -> None:
        """Empty, for a new generation with the same policy (its index is dropped)."""
        super().reset()
        self.policy.end_fixed()
        self.built, self.indexed = False, 0
        if self.kv is not None:
            self.kv.policy_state = [None] * len(self.layers)

    @property
    def mean_attended(self) -> float | None:
        """Mean keys attended per KV head and sparse layer over the decode steps so far (None before the first)."""
        return self.policy.mean_attended


class SparseLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner: SparseCache, index: int):
        super().__init__()
        self.owner = owner
        self.index = index
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.allocate(key_states)
        self.device = key_states.device
        self.keys, self.values = self.owner.kv.k[self.index], self.owner.kv.v[self.index]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        owner.allocate(key_states)  # checks the batch of every write
        n, T = self.length, key_states.shape[-2]
        if n + T > owner.max_cache_len:
            raise SparseSpecError(f"this SparseCache holds {owner.max_cache_len} positions; writing {T} more after "
                                  f"{n} needs a larger max_cache_len")
        attention_kwargs = kwargs.get("kwargs")
        if T == 1:
            if attention_kwargs is None:
                raise SparseSpecError("this model's attention does not pass its kwargs to Cache.update, so a "
                                      "SparseCache cannot reach its attention function")
            if self.index == 0:
                owner.begin_decode(n)
            attention_kwargs[STEP_KEY] = dataclasses.replace(owner.step, layer=self.index)
        self.keys[:, :, n:n + T] = key_states
        self.values[:, :, n:n + T] = value_states
        self.length = n + T
        return self.keys[:, :, :n + T], self.values[:, :, :n + T]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.owner.max_cache_len

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (a negative count, as transformers' static layers take); the
        policy's index follows at the next decode step."""
        if tokens_to_remove > 0:
            raise SparseSpecError("a SparseCache layer is cropped by a negative count of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise SparseSpecError("a SparseCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise SparseSpecError("a SparseCache does not support expanding the batch (num_return_sequences, beams)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise SparseSpecError("a SparseCache does not support selecting rows")
