"""One decoder for Llama / Mistral / Qwen2 / Qwen3: pre-norm blocks, GQA attention over a static KV cache, SwiGLU MLP.

Module names follow HF checkpoints except that q/k/v and gate/up are fused (`qkv_proj`, `gate_up_proj`): one
matrix product each at decode. The loader fuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.dense import causal_mask, dense_attention, tree_mask
from ..attention.policy import Policy
from ..cache import KVCache
from ..config import ModelConfig
from ..kernels import triton_ready
from .rope import apply_rope, inverse_frequencies, rope_cos_sin


# With row-invariant products on (`Transformer.row_invariant`), CUDA steps of up to this many rows (batch x tokens a
# row: a decode step, a verify block of the batch) multiply through the row-invariant kernel; larger ones (prefill)
# through cuBLAS.
ROW_INVARIANT_ROWS = 256


@torch.library.custom_op("sparsespec::row_linear", mutates_args=())
def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] · weight [N, K]ᵀ + bias through `kernels.matmul.row_matmul` (a custom op: torch.compile keeps it
    whole inside its graph)."""
    from ..kernels.matmul import row_matmul

    return row_matmul(x, weight, bias)


@row_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("sparsespec::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] · (weight [N, K] float8_e4m3fn · scale [N])ᵀ + bias: the row kernel on CUDA (bf16/fp16 x: half the
    weight bytes), else the dequantized weight through F.linear (the reference)."""
    from ..kernels.matmul import row_matmul

    if x.dtype in (torch.bfloat16, torch.float16) and triton_ready(x.device):
        return row_matmul(x, weight, bias, scale=scale)
    return F.linear(x, (weight.float() * scale[:, None]).to(x.dtype), bias)


@fp8_linear.register_fake
def _(x, weight, scale, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear whose products of at most `rows` rows (0: never) run through the row-invariant kernel on CUDA
    (bf16/fp16): a row's result then does not depend on how many rows the step has, so a speculative verify step
    computes each token's logits bitwise as the one-token decode step does. With `drafting` set and FP8 copies
    made (`Transformer.fp8_drafts`), it multiplies with those instead: a speculative drafter's steps."""

    rows = 0
    drafting = False
    fp8_weight: torch.Tensor | None = None  # [N, K] float8_e4m3fn (not a buffer: `.to(dtype)` must not cast it)
    fp8_scale: torch.Tensor | None = None  # [N] fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.drafting and self.fp8_weight is not None:
            return fp8_linear(x.reshape(rows, x.shape[-1]), self.fp8_weight, self.fp8_scale,
                              self.bias).view(*x.shape[:-1], -1)
        if 0 < rows <= self.rows and x.dtype in (torch.bfloat16, torch.float16) and triton_ready(x.device):
            return row_linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight, self.bias)


@torch.library.custom_op("sparsespec::row_rms_norm", mutates_args=())
def row_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N] normalised row by row through `kernels.norm.rms_norm` (a custom op: Inductor neither fuses nor
    re-tunes it, so its reduction order stays the kernel's)."""
    from ..kernels.norm import rms_norm

    return rms_norm(x, weight, eps)


@row_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


class RMSNorm(nn.Module):
    """RMSNorm; with `invariant` set (`Transformer.row_invariant`) CUDA bf16/fp16 rows go through the row-invariant
    kernel: a row's result then does not depend on how many rows the step has (nor on Inductor's choices)."""

    invariant = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.invariant and x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == x.dtype
                and triton_ready(x.device)):
            return row_rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass
class StepPlan:
    """Per-forward metadata built once and shared by every layer."""

    positions: torch.Tensor  # [B, T] int64, also the cache slots written
    kv_len: int  # slots [0, kv_len) are attended
    cos: torch.Tensor  # [B, 1, T, D]
    sin: torch.Tensor
    mask: torch.Tensor  # bool [B, 1, T, kv_len]
    policy: Policy | None = None  # attention of the sparse layers: `decode` a token a row, `block` several
    observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None  # sees (layer, q, k) after RoPE
    block: bool = False  # a few queries a row (a speculative verify block): the Triton block attention
    seen: torch.Tensor | None = None  # [B, T]: the last slot each query sees, if not its own position (a drafter's
    #                                   block sees all of itself); `mask` must agree
    tree: torch.Tensor | None = None  # [B, T] int64: a tree verify's ancestor bits (`kernels.attend.block_attention`);
    #                                   `mask` must agree
    window: int = 0  # > 0: a query sees only the slots (seen - window, seen] (a DFlash drafter's context window in
    #                  the block attention); `mask` must agree


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.split = (q_dim, kv_dim, kv_dim)
        self.chunk = 0  # the block attention's split length (0: planned by the step's shape; see `row_invariant`)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, hidden] -> q [B, Hq, T, D], k, v [B, Hkv, T, D]: projected, q/k-normed, rotated."""
        B, T, _ = x.shape
        D = self.cfg.head_dim
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(B, T, -1, D).transpose(1, 2)
        k = k.view(B, T, -1, D).transpose(1, 2)
        v = v.view(B, T, -1, D).transpose(1, 2)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def project_write(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      cache: KVCache, layer: int, observer: Callable | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> q [B, Hq, T, D] as `project`; k and v written into the cache's `layer` at slots
        positions [B, T]. CUDA steps of up to BLOCK_QUERIES tokens a row rotate and write in one kernel
        (`kernels.rotary`), unless `observer(layer, q, k)` needs k or the model q/k-norms."""
        T, D = x.shape[1], self.cfg.head_dim
        if (T <= BLOCK_QUERIES and observer is None and not self.cfg.qk_norm and D & (D - 1) == 0
                and cache.k[layer].dtype == x.dtype and triton_ready(x.device)):
            return rope_write(self.qkv_proj(x), cos, sin, positions, cache.k[layer], cache.v[layer],
                              self.cfg.num_heads)
        q, k, v = self.project(x, cos, sin)
        if observer is not None:
            observer(layer, q, k)
        cache.write(layer, positions, k, v)
        return q

    def forward(self, x: torch.Tensor, layer: int, plan: StepPlan, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.project_write(x, plan.cos, plan.sin, plan.positions, cache, layer, plan.observer)  # [B, Hq, T, D]
        if plan.policy is not None and plan.policy.is_sparse(layer):
            out = sparse_attention(plan.policy, layer, q, cache, plan.positions)  # [B, Hq, T, D]
        elif plan.block:
            keys, values = cache.keys(layer, plan.kv_len)  # [B, Hkv, S, D]
            out = block_attention(q, keys, values, plan.positions if plan.seen is None else plan.seen, self.chunk,
                                  plan.tree, window=plan.window)
        else:
            keys, values = cache.keys(layer, plan.kv_len)  # [B, Hkv, S, D]
            out = dense_attention(q, keys, values, plan.mask)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


# A compiled step (torch.compile) leaves the sparse policy's calls out of its graphs: they launch their own Triton
# kernels, which the outer CUDA graph captures like any other; Inductor fuses everything around them.
@torch.compiler.disable
def sparse_attention(policy: Policy, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor):
    """q [B, Hq, T, D] at positions [B, T] -> the policy's attention: a decode step (T = 1) or a block (`block`)."""
    if q.shape[2] == 1 and not policy.blocking:
        return policy.decode(layer, q, cache, positions[:, 0])
    return policy.block(layer, q, cache, positions)


# Up to this many queries a row (a decode step, a speculative verify block, a short chunk), CUDA steps attend with
# the Triton block attention: each K/V row read once per KV head for every query of the block, and only the slots up
# to each row's position (SDPA's masked kernels re-read the cache per query tile: a 16-token verify cost ~8x a decode
# step's attention; over the whole static cache a graphed decode step read every row's dead slots too, and on the
# H200 its result could change with what those dead slots held). A custom op, so that torch.compile keeps it whole
# inside its graph (no graph break) and the CUDA graph captures its launches.
BLOCK_QUERIES = 32
INVARIANT_CHUNK = 512  # slots a split of the block attention in row-invariant steps (a multiple of its key block)


@torch.library.custom_op("sparsespec::block_attention", mutates_args=())
def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    chunk: int = 0, tree: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    from ..kernels.attend import block_attention as kernel

    return kernel(q, k, v, positions, chunk=chunk, tree=tree, window=window)


@block_attention.register_fake
def _(q, k, v, positions, chunk=0, tree=None, window=0):
    return q.new_empty(q.shape)


@torch.library.custom_op("sparsespec::rope_write", mutates_args=("k_cache", "v_cache"))
def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
    """`kernels.rotary.rope_write` (a custom op: torch.compile keeps it whole inside its graph, the caches written
    in place)."""
    from ..kernels.rotary import rope_write as kernel

    return kernel(qkv, cos, sin, positions, k_cache, v_cache, heads)


@rope_write.register_fake
def _(qkv, cos, sin, positions, k_cache, v_cache, heads):
    return qkv.new_empty(qkv.shape[0], heads, qkv.shape[1], k_cache.shape[-1])


@torch.compiler.disable
def begin_sparse_step(policy: Policy, positions: torch.Tensor) -> None:
    policy.begin_step(positions)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, layer: int, plan: StepPlan, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layer, plan, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, freq_factors: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        # CUDA steps of up to this many queries a row attend with the Triton block attention (0: SDPA, e.g. to time
        # it against the engine's: cuDNN's kernel reads a full static cache a little faster but is not
        # deterministic and reads the dead slots too)
        self.block_queries = BLOCK_QUERIES
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, freq_factors)
        self.register_buffer("inv_freq", inv, persistent=False)

    def row_invariant(self, rows: int = ROW_INVARIANT_ROWS) -> None:
        """Steps of up to `rows` rows (batch x tokens a row; 0: off) multiply through the row-invariant kernel on
        CUDA, and every norm runs through the row-invariant RMSNorm kernel: a token's logits are then bitwise the
        same in a verify block as in a decode step, so greedy speculative output equals plain greedy output in bf16
        too (not only up to near-ties). The block attention then splits the cache at fixed slots
        (INVARIANT_CHUNK), not by the cache's capacity: a speculative loop's cache, a block longer than plain
        decoding's, would otherwise sum a long context's keys in other groups."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.rows = rows
            elif isinstance(module, RMSNorm):
                module.invariant = rows > 0
            elif isinstance(module, Attention):
                module.chunk = INVARIANT_CHUNK if rows > 0 else 0

    @property
    def invariant_rows(self) -> int:
        """The row limit `row_invariant` set (0: off)."""
        return self.lm_head.rows

    def fp8_drafts(self) -> None:
        """FP8 copies of every Linear's weight (`kernels.matmul.fp8_weights`: ~half the weights' memory again), used
        by the steps taken under `drafting()`. Made once; weights changed afterwards are not followed."""
        from ..kernels.matmul import fp8_weights

        for module in self.modules():
            if isinstance(module, Linear) and module.fp8_weight is None:
                module.fp8_weight, module.fp8_scale = fp8_weights(module.weight.detach())

    @contextmanager
    def drafting(self):
        """Steps run (or captured) inside multiply with the FP8 copies (`fp8_drafts`): a drafter's steps, whose
        tokens only propose (the verify, outside, keeps the model's weights)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if any(m.fp8_weight is None for m in linears):
            raise RuntimeError("drafting() needs the FP8 copies: call fp8_drafts() first")
        for m in linears:
            m.drafting = True
        try:
            yield
        finally:
            for m in linears:
                m.drafting = False

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def plan(self, positions: torch.Tensor, kv_len: int, policy: Policy | None = None,
             observer: Callable | None = None, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepPlan:
        """`tree`: (depth [B, T], ancestors [B, T] int64) of a tree verify block written at slots `positions`
        (consecutive from positions[:, 0]): rotary positions positions[:, 0] + depth, each query seeing the context
        and its ancestors (`spec.tree`)."""
        dtype = self.embed_tokens.weight.dtype
        if policy is not None and policy.fixed is not None:  # (a block's first query selects: `Policy.block`)
            begin_sparse_step(policy, positions[:, 0])  # the sparse layers' per-step metadata, built once
        rope = positions if tree is None else positions[:, :1] + tree[0]
        cos, sin = rope_cos_sin(rope, self.inv_freq, dtype)
        mask = (causal_mask(positions, kv_len, self.cfg.sliding_window) if tree is None
                else tree_mask(positions[:, 0], tree[1], kv_len)[:, None])
        block = (positions.shape[1] <= self.block_queries and self.cfg.sliding_window is None
                 and triton_ready(positions.device))
        return StepPlan(positions, kv_len, cos, sin, mask, policy, observer, block,
                        tree=None if tree is None else tree[1])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                kv_len: int | None = None, policy: Policy | None = None,
                observer: Callable | None = None) -> torch.Tensor:
        """tokens, positions [B, T] -> final normed hidden states [B, T, hidden].

        Writes the new keys/values at their positions; attends to slots [0, kv_len) (default: the whole cache, a
        static shape for CUDA graphs). Call `logits` only on the rows that need them. `policy` replaces the
        attention of its sparse layers (a one-token step's `decode`, a block's `block`); `observer(layer, q, k)`
        sees post-RoPE q and k.
        """
        return self.forward_tapped(tokens, positions, cache, kv_len, (), policy, observer)[0]

    def forward_tapped(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int | None,
                       taps: Sequence[int], policy: Policy | None = None, observer: Callable | None = None,
                       tree: tuple[torch.Tensor, torch.Tensor] | None = None):
        """As `forward`, also returning the outputs of decoder layers `taps` (0-based), concatenated in that order:
        (hidden [B, T, hidden], features [B, T, len(taps) * hidden] or None without taps). `tree`: as `plan`."""
        plan = self.plan(positions, cache.capacity if kv_len is None else kv_len, policy, observer, tree)
        x = self.embed_tokens(tokens)
        tapped = {}
        for i, block in enumerate(self.layers):
            x = block(x, i, plan, cache)
            if i in taps:
                tapped[i] = x
        return self.norm(x), torch.cat([tapped[i] for i in taps], dim=-1) if taps else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> fp32 logits [..., vocab]."""
        return self.lm_head(hidden).float()
