"""DFlash: a block-diffusion drafter that drafts B − 1 tokens in one forward pass, conditioned on target features.

    target layers `taps` -> features f_t [n·H] per committed token -> c_t = RMSNorm(fc(f_t))      (context)
    every drafter layer: keys/values = [k,v(c_0..c_{s-1}) ; k,v(x_block)], queries from the block only
    block at positions s..s+B−1: [last committed token, MASK × (B−1)], bidirectional inside the block
    output at block position k (1 ≤ k < B) -> target LM head -> the token at position s + k

The drafter has the target's own decoder layer type and width (a few layers, possibly a narrower MLP); it owns no
embedding or LM head (the target's are shared, frozen) and learns one MASK embedding. At inference its context
lives in a static position-indexed KV cache (slot t = c_t's K/V in every layer); the block's K/V are written at
slots s..s+B−1, past the committed context, and overwritten when those tokens' features arrive.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..attention.dense import causal_mask, dense_attention
from ..attention.policy import device_ints
from ..cache import KVCache
from ..config import ModelConfig, RopeScaling
from ..errors import SparseSpecError
from ..models.rope import inverse_frequencies, rope_cos_sin
from ..graphs import Kept, capture
from ..kernels import triton_ready
from ..models.transformer import MLP, Block, RMSNorm, StepPlan, Transformer
from .drafters import Drafter


def default_taps(target_layers: int, n: int) -> tuple[int, ...]:
    """n distinct target layers spread evenly from the second to the fourth-last: round(linspace(1, L − 3, n)); more
    than that range holds, over every layer but the last while they fit (round(linspace(0, L − 2, n)); the last
    layer's output is the LM head's input, which a drafter wrapped around transformers cannot tap), else over all
    (a layer tapped twice would only repeat its features). At most L taps."""
    if not 1 <= n <= target_layers:
        raise SparseSpecError(f"taps must be <= the target's {target_layers} layers (each tapped once: at most "
                              f"{target_layers} taps), got {n}")
    if n == 1:
        return (target_layers // 2,)
    lo, hi = ((1, target_layers - 3) if n <= target_layers - 3 else (0, target_layers - 2) if n <= target_layers - 1
              else (0, target_layers - 1))
    return tuple(round(lo + i * (hi - lo) / (n - 1)) for i in range(n))


@dataclass(frozen=True)
class DFlashConfig:
    target: ModelConfig
    layers: int = 1
    block_size: int = 16
    taps: tuple[int, ...] = ()  # target layers (0-based decoder layer outputs); () = default_taps(L, min(3, L))
    intermediate_size: int = 0  # drafter MLP width; 0 = the target's
    private_size: int = 0  # EDA: a private MLP of this width beside each layer's (shared) MLP; 0 = none
    window: int = 0  # context slots a block sees before its first position (its last `window`); 0 = all of them

    def __post_init__(self):
        if self.layers < 1:
            raise SparseSpecError(f"a DFlash drafter needs >= 1 layer, got {self.layers}")
        if self.block_size < 2:
            raise SparseSpecError(f"block size must be >= 2, got {self.block_size}")
        if not self.taps:
            object.__setattr__(self, "taps", default_taps(self.target.num_layers, min(3, self.target.num_layers)))
        if any(not 0 <= t < self.target.num_layers for t in self.taps):
            raise SparseSpecError(f"tapped layers {self.taps} outside the target's {self.target.num_layers}")
        if self.intermediate_size < 0:
            raise SparseSpecError(f"intermediate size must be >= 0 (0: the target's), got {self.intermediate_size}")
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", self.target.intermediate_size)
        if self.private_size < 0:
            raise SparseSpecError(f"private MLP width must be >= 0 (0: none), got {self.private_size}")
        if self.window < 0:
            raise SparseSpecError(f"a drafter's context window must be >= 0 (0: the whole context), got {self.window}")

    @property
    def layer_config(self) -> ModelConfig:
        return dataclasses.replace(self.target, num_layers=self.layers, intermediate_size=self.intermediate_size,
                                   sliding_window=None)

    def to_json(self) -> dict:
        private = {"private_size": self.private_size} if self.private_size else {}  # (files before EDA: none)
        window = {"window": self.window} if self.window else {}  # (nor before windows)
        return {"target": dataclasses.asdict(self.target), "layers": self.layers, "block_size": self.block_size,
                "taps": list(self.taps), "intermediate_size": self.intermediate_size, **private, **window}

    @classmethod
    def from_json(cls, d: dict) -> "DFlashConfig":
        t = dict(d["target"])
        t["rope_scaling"] = RopeScaling(**t["rope_scaling"])
        t["eos_token_ids"] = tuple(t["eos_token_ids"])
        return cls(ModelConfig(**t), d["layers"], d["block_size"], tuple(d["taps"]), d["intermediate_size"],
                   d.get("private_size", 0), d.get("window", 0))


class DecoupledMLP(nn.Module):
    """EDA's drafter MLP: a shared part (trained with the base target, frozen when adapting) plus a small private
    part (trained per fine-tuned target); the output is their sum."""

    def __init__(self, cfg: ModelConfig, private_size: int):
        super().__init__()
        self.shared = MLP(cfg)
        self.private = MLP(dataclasses.replace(cfg, intermediate_size=private_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x) + self.private(x)


class DFlash(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        lc = cfg.layer_config
        H = lc.hidden_size
        self.fc = nn.Linear(len(cfg.taps) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, lc.rms_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(H))
        self.layers = nn.ModuleList(Block(lc) for _ in range(cfg.layers))
        if cfg.private_size:
            for layer in self.layers:
                layer.mlp = DecoupledMLP(lc, cfg.private_size)
        self.norm = RMSNorm(H, lc.rms_eps)
        self.register_buffer("inv_freq", inverse_frequencies(lc.head_dim, lc.rope_theta, lc.rope_scaling),
                             persistent=False)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [..., taps * H] (target layer outputs) -> context vectors [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_embeddings(self, target: Transformer, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] (the block's first token) -> [N, B, H]: that token's embedding, then B − 1 MASK embeddings."""
        first = target.embed_tokens(tokens).to(self.mask_embedding.dtype)[:, None]  # [N, 1, H]
        rest = self.mask_embedding.expand(tokens.shape[0], self.cfg.block_size - 1, -1)
        return torch.cat([first, rest], dim=1)

    # --- inference: context in a static cache --------------------------------------------------------------

    def ingest(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        """Write the context K/V of features [N, T, taps * H] at positions [N, T] into every layer's cache."""
        c = self.context(features)
        cos, sin = rope_cos_sin(positions, self.inv_freq, c.dtype)
        for i, layer in enumerate(self.layers):
            layer.self_attn.project_write(c, cos, sin, positions, cache, i)  # (its q unused)

    def draft_hidden(self, target: Transformer, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache,
                     kv_len: int) -> torch.Tensor:
        """tokens [N] at positions start [N] (context slots [0, start) cached; kv_len >= every start + B, known on
        the host) -> hidden [N, B, H] of the block. Each block query sees the context (its last `cfg.window` slots
        under a window) and the whole block."""
        B = self.cfg.block_size
        positions = start[:, None] + torch.arange(B, device=start.device)  # [N, B]: also the slots written
        seen = positions[:, -1:].expand(-1, B)  # [N, B]: the block's last slot
        x = self.block_embeddings(target, tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        block = B <= target.block_queries and triton_ready(start.device)
        window = self.cfg.window + B if self.cfg.window else 0  # (counted from the block's last slot)
        plan = StepPlan(positions, kv_len, cos, sin, causal_mask(seen, kv_len, window or None), block=block,
                        seen=seen, window=window)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, plan, cache)
        return self.norm(x)

    def draft_tokens(self, target: Transformer, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache,
                     kv_len: int) -> torch.Tensor:
        """As `draft_hidden` -> the block's greedy proposals [N, B − 1] (the target's LM head, argmax)."""
        return self.block_logits(target, self.draft_hidden(target, tokens, start, cache, kv_len)).argmax(-1)

    def draft_choices(self, target: Transformer, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache,
                      kv_len: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As `draft_hidden` -> each block position's `ranks` likeliest tokens [N, B − 1, ranks], best first, and
        their log-probabilities [N, B − 1, ranks] fp32 (what a tree verify chooses from: `spec.tree`)."""
        logits = self.block_logits(target, self.draft_hidden(target, tokens, start, cache, kv_len))
        logp, ids = logits.log_softmax(-1).topk(ranks, -1)
        return ids, logp

    @staticmethod
    def block_logits(target: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, B, H] of blocks -> the target LM head's fp32 logits [N, B − 1, vocab] of their proposals (every
        position but the first). The product runs over all N · B rows and drops the first position's afterwards: with
        N · (B − 1) rows (240 at N = 16, B = 16) cuBLAS took 16-row tiles that each re-read the whole head (1.8 ms a
        draft at (16, 25.6k) on the H200; 0.45 ms at N = 4), where N · B rows (256, the verify's shape) took one tile
        (0.17 ms; docs/results/spec_self.md, thirty-eighth session)."""
        return target.logits(hidden.to(target.embed_tokens.weight.dtype))[:, 1:]

    # --- training: many blocks per sequence, one masked attention --------------------------------------------

    def train_hidden(self, target: Transformer, features: torch.Tensor, tokens: torch.Tensor,
                     anchors: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """features [N, T, taps * H] and tokens [N, T] of N sequences, anchors [N, M] (block starts), mask
        [N, 1, M·B, T + M·B] (block_mask) -> hidden [N, M, B, H] of every block."""
        N, T = tokens.shape
        M, B = anchors.shape[1], self.cfg.block_size
        c = self.context(features)  # [N, T, H]
        ctx_pos = torch.arange(T, device=tokens.device).expand(N, -1)
        blk_pos = (anchors[..., None] + torch.arange(B, device=tokens.device)).reshape(N, M * B)
        cos_c, sin_c = rope_cos_sin(ctx_pos, self.inv_freq, c.dtype)
        cos_b, sin_b = rope_cos_sin(blk_pos, self.inv_freq, c.dtype)
        first = tokens.gather(1, anchors)  # [N, M]
        x = self.block_embeddings(target, first.reshape(-1)).reshape(N, M * B, -1)
        for layer in self.layers:
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos_b, sin_b)  # [N, Hq | Hkv, M·B, D]
            _, kc, vc = attn.project(c, cos_c, sin_c)  # [N, Hkv, T, D]
            out = dense_attention(q, torch.cat([kc, k], 2), torch.cat([vc, v], 2), mask)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(N, M * B, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).view(N, M, B, -1)

    # --- files ---------------------------------------------------------------------------------------------

    def save(self, path: Path, dtype: torch.dtype = torch.bfloat16, meta: dict | None = None) -> None:
        """path.safetensors (weights) + path.json (config and how it was made). dtype float8_e4m3fn: the matrices
        stored in FP8 with a scale per output row (`kernels.matmul.fp8_weights`; `NAME` and `NAME.fp8_scale`),
        half the bytes of bf16, the rest in bf16; `load` restores them in its dtype."""
        from safetensors.torch import save_file

        from ..kernels.matmul import fp8_weights

        weights, info = drafter_files(path)
        state = {}
        for k, v in self.state_dict().items():
            v = v.detach().cpu()
            if dtype == torch.float8_e4m3fn and v.dim() == 2:
                state[k], state[k + FP8_SCALE] = fp8_weights(v)
            else:
                state[k] = v.to(torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype).contiguous()
        save_file(state, str(weights))
        storage = {"storage": "fp8"} if dtype == torch.float8_e4m3fn else {}
        info.write_text(json.dumps({"config": self.cfg.to_json(), **(meta or {}), **storage}, indent=1))

    @classmethod
    def random(cls, cfg: DFlashConfig, device="cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> "DFlash":
        """A drafter of random weights (norms 1, matrices N(0, 0.02)) for timing in a real shape: built on the meta
        device and filled where it lives (a 151k-vocabulary target's shape is not first made on the host)."""
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
        lc = cfg.layer_config
        model.inv_freq = inverse_frequencies(lc.head_dim, lc.rope_theta, lc.rope_scaling).to(device)
        return model.eval().requires_grad_(False)

    @classmethod
    def load(cls, path: Path, device="cpu", dtype: torch.dtype = torch.float32) -> "DFlash":
        from safetensors.torch import load_file

        weights, meta = drafter_files(path)
        if not weights.is_file() or not meta.is_file():
            raise SparseSpecError(f"DFlash drafter not found: need {weights} and {meta}")
        from safetensors import SafetensorError

        try:
            cfg = DFlashConfig.from_json(json.loads(meta.read_text())["config"])
            state = load_file(str(weights))
            for key in [k for k in state if k.endswith(FP8_SCALE)]:  # FP8 matrices: back to real values
                name = key.removesuffix(FP8_SCALE)
                state[name] = state[name].float() * state.pop(key).float()[:, None]
        except (KeyError, TypeError, ValueError, OSError, SafetensorError, RuntimeError) as e:
            why = f"no {e} in {meta.name}" if isinstance(e, KeyError) else " ".join(str(e).split())
            raise SparseSpecError(f"corrupt DFlash drafter {path}: {why}") from None
        model = cls(cfg)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise SparseSpecError(f"DFlash drafter {weights} does not match its config: {str(e)[:200]}") from None
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


FP8_SCALE = ".fp8_scale"  # a stored FP8 matrix's per-row scales: the matrix's name + this


def drafter_files(path: str | Path) -> tuple[Path, Path]:
    """A drafter's two files from its path with or without the .safetensors suffix (names may hold dots)."""
    base = str(path).removesuffix(".safetensors")
    return Path(base + ".safetensors"), Path(base + ".json")


def block_mask(anchors: torch.Tensor, lengths: torch.Tensor, T: int, B: int, window: int = 0) -> torch.Tensor:
    """anchors [N, M], sequence lengths [N] -> bool [N, 1, M·B, T + M·B]: a query of block j sees context
    positions strictly before its anchor (and inside its sequence; the last `window` of them if window > 0) and
    every position of block j, nothing else."""
    N, M = anchors.shape
    ctx = torch.arange(T, device=anchors.device)
    block_of = torch.arange(M, device=anchors.device).repeat_interleave(B)  # [M·B]: which block a query is in
    anchor = anchors[:, block_of]  # [N, M·B]
    sees_ctx = (ctx < anchor[..., None]) & (ctx < lengths[:, None, None])  # [N, M·B, T]
    if window:
        sees_ctx &= ctx >= anchor[..., None] - window
    sees_blk = (block_of[:, None] == block_of[None, :]).expand(N, -1, -1)  # [N, M·B, M·B]
    return torch.cat([sees_ctx, sees_blk], dim=-1)[:, None]


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor, B: int,
                 greedy: torch.Tensor | None = None) -> torch.Tensor:
    """tokens [N, T], anchors [N, M] -> labels [N, M, B]: block position k predicts tokens[anchor + k];
    -100 (ignored) at k = 0 (the given token) and past the sequence's end.

    greedy [N, T] (the target's argmax after each token, teacher-forced on `tokens`): position k predicts
    greedy[anchor + k − 1] instead — what greedy decoding from the anchor writes there — as long as the sequence
    has followed the target so far (tokens[anchor + j] == greedy[anchor + j − 1] for 0 < j < k); past the first
    token where it did not, what the target would write is unknown, and the labels are -100. On the target's own
    greedy answers this is `tokens` (but where a near-tie fell the other way)."""
    k = torch.arange(B, device=tokens.device)
    pos = anchors[..., None] + k  # [N, M, B]
    labels = tokens.gather(1, pos.clamp(max=tokens.shape[1] - 1).flatten(1)).view_as(pos)
    invalid = (pos >= lengths[:, None, None]) | (k == 0)
    if greedy is not None:
        choice = greedy.gather(1, (pos - 1).clamp(0, tokens.shape[1] - 1).flatten(1)).view_as(pos)  # [N, M, B]
        followed = (labels == choice) | (k == 0)  # position j's token is what the target chose there
        known = torch.cat([followed[..., :1], followed[..., :-1]], -1).long().cumprod(-1).bool()  # all j < k
        labels, invalid = choice, invalid | ~known
    return labels.masked_fill(invalid, -100)


def loss_weights(B: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """[B]: 0 at the given token, exp(−(k − 1)/γ) at block position k ≥ 1 (γ = 7 at B = 16, scaled with B)."""
    gamma = gamma if gamma is not None else 7.0 * (B - 1) / 15
    k = torch.arange(B, device=device, dtype=torch.float32)
    return torch.where(k == 0, 0.0, torch.exp(-(k - 1) / gamma))


class DraftGraphs:
    """DFlash's two per-step forwards as CUDA graphs over static buffers, captured once per drafter cache:

        propose  tokens, starts [N] -> proposals [N, B − 1]: the block forward at each row's start, the target's LM
                 head and the argmax (the context up to each row's start, every slot past it unread)
        ingest   features [N, B, taps · H], starts [N]: the context K/V of B committed positions per row from its
                 start on (slots past a row's accepted tokens are dead: the next block overwrites them)

    Warm-up and capture run with every row at `park`, slots no row ever commits. `compile`: both forwards run
    through torch.compile first (as the target's steps with --compile), which fuses the small element-wise kernels
    (norms, rotary, SwiGLU, residuals) between a layer's products: a 16-position block is launch-bound as a decode
    step is."""

    def __init__(self, model: DFlash, target: Transformer, cache: KVCache, park: int, compile: bool = False,
                 ranks: int = 0):
        N, B, dev = cache.batch, model.cfg.block_size, cache.device
        self.ranks = ranks
        self.park = park
        self.tokens = torch.zeros(N, dtype=torch.long, device=dev)
        self.starts = torch.full((N,), park, dtype=torch.long, device=dev)
        self.features = torch.zeros(N, B, model.fc.in_features, dtype=model.fc.weight.dtype, device=dev)
        self.at = torch.full((N,), park, dtype=torch.long, device=dev)
        # every tensor a graph reads is held here: a graph keeps no reference to its inputs, and a freed one's memory
        # is handed to later allocations (a local `arange` of the offsets did that: its slots went out of bounds)
        self.offsets = torch.arange(B, device=dev)
        tokens, starts, features, at, offsets = self.tokens, self.starts, self.features, self.at, self.offsets
        capacity = cache.capacity
        draft, ingest = ((torch.compile(f, fullgraph=True, dynamic=False) for f in (_draft, _ingest)) if compile
                         else (_draft, _ingest))
        if ranks:  # a tree verify's drafts: each position's likeliest tokens and their log-probabilities
            choices = _choices if not compile else torch.compile(_choices, fullgraph=True, dynamic=False)
            draft = functools.partial(choices, ranks=ranks)
        # (each drafter shape and cache size compiles its own variant: `capture` lifts Dynamo's recompile limits)
        self.propose_graph, self.proposals = capture(
            lambda: draft(model, target, tokens, starts, cache, capacity), dev)  # [N, B - 1]
        self.ingest_graph, _ = capture(lambda: ingest(model, features, at[:, None] + offsets, cache), dev)

    def propose(self, tokens: list[int], starts: list[int]):
        """-> the proposals [N, B − 1] on the device, or with `ranks` (ids, log-probabilities) [N, B − 1, ranks] (the
        graph's output: the next replay overwrites it)."""
        self.tokens.copy_(device_ints(tokens, self.tokens.device))
        self.starts.copy_(device_ints(starts, self.starts.device))
        self.propose_graph.replay()
        return self.proposals

    def ingest(self, features: torch.Tensor, starts: list[int | None]) -> None:
        """features [N, T <= B, ·] at starts[r] on for row r (slots past its accepted tokens are dead); None: the
        row writes at the parking slots."""
        self.features[:, :features.shape[1]].copy_(features)
        self.at.copy_(device_ints([self.park if s is None else s for s in starts], self.at.device))
        self.ingest_graph.replay()


def _draft(model: DFlash, target: Transformer, tokens, starts, cache: KVCache, capacity: int) -> torch.Tensor:
    return model.draft_tokens(target, tokens, starts, cache, capacity)


def _choices(model: DFlash, target: Transformer, tokens, starts, cache: KVCache, capacity: int, ranks: int):
    return model.draft_choices(target, tokens, starts, cache, capacity, ranks)


def _ingest(model: DFlash, features: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
    model.ingest(features, positions, cache)


class DFlashDrafter(Drafter):
    """The DFlash model driven by the speculative loop: its own context cache (a row per batch row) gets only newly
    committed features; one forward drafts a block for every row; proposals are the argmax (point masses, lossless
    under verification at any T). On CUDA with the runner's graphs on, a step's draft and its context update each
    replay a CUDA graph (`DraftGraphs`), and a step reads back once: the verified tokens."""

    name = "dflash"
    point_mass = True
    marginals = True

    def __init__(self, model: DFlash, target: Transformer):
        self.model = model
        self.target = target
        self.taps = model.cfg.taps
        self.max_proposals = model.cfg.block_size - 1  # a block's width; its context update takes no wider steps
        self.cache: KVCache | None = None
        self.cuda_graph = self.compile = False  # the runner's settings (`bind`): graphed, and compiled, drafts
        self.graphs: DraftGraphs | None = None
        # (batch, capacity, ranks, window) -> (cache, graphs): a loop over many prompts captures once a size
        self.kept = Kept()
        self.ranks = 0  # > 0: a tree verify's drafts (`propose_choices`), this many choices a position

    def choices(self, ranks: int) -> None:
        """Before `start`: draft each position's `ranks` likeliest tokens (`propose_choices`, for a tree verify), or
        with 0 the argmax line (`propose_greedy`)."""
        if ranks != self.ranks:
            self.graphs = None  # captured for the other output
        self.ranks = ranks

    def bind(self, runner):
        cuda_graph, compile = runner.cuda_graph and runner.device.type == "cuda", runner.compile
        if (cuda_graph, compile) != (self.cuda_graph, self.compile):
            self.graphs = None  # captured for other settings
            self.kept.clear()
        self.cuda_graph, self.compile = cuda_graph, compile

    def start(self, prompts, features, capacity):
        N = len(prompts)
        if self.cuda_graph:  # the graphs of an earlier call of this batch and capacity serve this one, cache emptied
            self.cache = self.graphs = None  # (an evicted size's memory freed before a new one's is taken)
            key = (N, capacity, self.ranks, self.model.cfg.window)  # (a window set later: other graphs)
            self.cache, self.graphs = self.kept.get(key, lambda: self._graphed(N, capacity))
        else:
            self.cache, self.graphs = self._cache(N, capacity), None
        self.park = capacity
        self.cache.truncate([0] * N)
        if features is not None and any(f is not None for f in features):  # (continuous batching starts empty)
            self._ingest(features, [0] * N)
        self.cache.truncate([len(p) for p in prompts])

    def _cache(self, batch: int, capacity: int) -> KVCache:
        # a whole block is written past the context even when fewer proposals are wanted: room for B more slots
        # (never committed, so they may lie past the model's context); rows that draft nothing park there
        B = self.model.cfg.block_size
        cfg = dataclasses.replace(self.model.cfg.layer_config, max_position=capacity + B)
        return KVCache(cfg, batch, capacity + B, self.model.fc.weight.dtype, self.model.fc.weight.device)

    def _graphed(self, batch: int, capacity: int) -> tuple[KVCache, DraftGraphs]:
        """A cache of this batch and capacity and the draft steps captured over it (warm-up and capture write at
        the parking slots only)."""
        cache = self._cache(batch, capacity)
        return cache, DraftGraphs(self.model, self.target, cache, capacity, self.compile, self.ranks)

    @torch.inference_mode()
    def start_row(self, row, prompt, features):
        positions = torch.arange(len(prompt), device=features.device)[None]
        self.model.ingest(features[None], positions, self.cache.rows(row, row + 1))
        lengths = list(self.cache.lengths)
        lengths[row] = len(prompt)
        self.cache.truncate(lengths)

    def _ingest(self, features: list[torch.Tensor | None], starts: list[int]) -> None:
        """Row r's features [T_r, ·] at positions starts[r] .. (rows padded to one length; a row without features
        writes nothing of use, its length is set by the caller)."""
        T = max(1 if f is None else f.shape[0] for f in features)
        like = next(f for f in features if f is not None)
        device = like.device
        padded = torch.zeros(len(features), T, like.shape[-1], dtype=like.dtype, device=device)
        for r, f in enumerate(features):
            if f is not None:
                padded[r, :f.shape[0]] = f
        positions = device_ints(starts, device)[:, None] + torch.arange(T, device=device)  # [N, T]
        self.model.ingest(padded, positions, self.cache)

    @torch.inference_mode()
    def propose(self, histories, ks, cfgs, rngs):  # (the loop drafts through propose_greedy at every T: point_mass)
        return self.read_back(histories, ks, self.model.fc.weight.device)

    @torch.inference_mode()
    def propose_greedy(self, histories, ks, device):
        if self.ranks:  # drafting choices for a tree verify: a step that verifies a line takes the best of each
            ids, _, counts = self.propose_choices(histories, ks, device)
            return ids[..., 0], counts
        B = self.model.cfg.block_size
        counts = [0 if h is None else max(min(k, B - 1), 0) for h, k in zip(histories, ks)]
        device = self.model.fc.weight.device
        if not any(counts):
            return torch.zeros(len(histories), 0, dtype=torch.long, device=device), counts
        # row r's pending token sits at len(history) - 1, its context covers [0, that); a stopped row drafts at
        # the parking slots (graphs) or at 0 (eager: its context is never used again)
        tokens = [0 if h is None else h[-1] for h in histories]
        if self.graphs is not None:
            return self.graphs.propose(tokens, [self.park if h is None else len(h) - 1 for h in histories]), counts
        starts = [0 if h is None else len(h) - 1 for h in histories]
        return self.model.draft_tokens(self.target, device_ints(tokens, device), device_ints(starts, device),
                                       self.cache, max(starts) + B), counts

    @torch.inference_mode()
    def propose_choices(self, histories, ks, device):
        assert self.ranks, "choices(ranks) first"
        B = self.model.cfg.block_size
        counts = [0 if h is None else max(min(k, B - 1), 0) for h, k in zip(histories, ks)]
        tokens = [0 if h is None else h[-1] for h in histories]
        if self.graphs is not None:
            ids, logp = self.graphs.propose(tokens, [self.park if h is None else len(h) - 1 for h in histories])
            return ids, logp, counts
        device = self.model.fc.weight.device
        starts = [0 if h is None else len(h) - 1 for h in histories]
        ids, logp = self.model.draft_choices(self.target, device_ints(tokens, device), device_ints(starts, device),
                                             self.cache, max(starts) + B, self.ranks)
        return ids, logp, counts

    def rollback(self, lengths: list[int]) -> None:
        """Row r's context back (or on) to its first lengths[r] positions (their features ingested before): a
        cascade's rounds (`spec.cascade`) ingest features of tokens the dense verify has not seen yet."""
        self.cache.truncate(lengths)

    @torch.inference_mode()
    def commit(self, lengths, accepted, features):
        # row r's context covers [0, n); its newly cached target tokens sit at n..n + accepted (the block's other
        # positions are written too, past the row's new length: dead)
        lengths = list(self.cache.lengths)
        if any(a is not None for a in accepted):
            if self.graphs is not None:
                self.graphs.ingest(features, [n if a is not None else None for n, a in zip(lengths, accepted)])
            else:
                positions = device_ints(lengths, features.device)[:, None] + torch.arange(features.shape[1],
                                                                                         device=features.device)
                self.model.ingest(features, positions, self.cache)  # [B, w, ·] at [B, w]
        self.cache.truncate([n + a + 1 if a is not None else 0 for n, a in zip(lengths, accepted)])
