"""`sparsespec train finetune`: a domain fine-tune of a target by LoRA, the fine-tuned targets EDA adapts drafters to.

    domain pairs (spec/prompts.py: a Bible passage or a play's scene, and the text that truly follows)
      -> chat template: the prompt as the user's turn, the continuation as the assistant's, then end of turn
    every linear map of every decoder layer (qkv, o, gate_up, down): W x + (alpha / r) · B A x, A [r, in], B [out, r]
      (B starts at zero: the model is unchanged until trained); the base weights frozen
    cross-entropy on the assistant's tokens only; AdamW, warm-up then cosine decay over the run's progress (steps,
    or optimisation time under a time limit); checkpoints resume a stopped run

The result is an adapter folder (adapter.safetensors: every A and B; adapter.json: the base model, rank, alpha, the
domain and how it was made), a few MB where merged weights would be the whole model. `Engine.from_name(FOLDER)`
loads the base and adds alpha / r · B A to each weight once (`apply_adapter`): the fine-tuned model then decodes
exactly as fast as the base.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import KVCache
from ..errors import SparseSpecError
from ..models.transformer import Transformer
from ..progress import progress_bar
from .prompts import DOMAINS, domain_pairs
from .train import check_optimiser, check_resume, check_settings, learning_rate, save_whole

TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the linear maps of a decoder layer
ADAPTER_FILES = ("adapter.safetensors", "adapter.json")


@dataclass(frozen=True)
class FinetuneConfig:
    domain: str = "kjv"
    examples: int = 4096  # (prompt, continuation) pairs of the domain's train split
    rank: int = 16
    alpha: float = 32.0
    steps: int = 400
    batch: int = 8  # pairs per step
    lr: float = 2e-4
    warmup: float = 0.05  # share of the run
    weight_decay: float = 0.0
    clip: float = 1.0
    eval_every: int = 50  # steps between held-out losses (and checkpoints)
    heldout: int = 64  # held-out pairs for the loss
    time_limit: float = 0  # seconds of optimisation (0: none); whichever of steps and time ends first
    seed: int = 0

    def __post_init__(self):
        if self.domain not in DOMAINS:
            raise SparseSpecError(f"unknown domain {self.domain!r} (choose from {', '.join(DOMAINS)})")
        for name in ("examples", "rank", "steps", "batch", "eval_every", "heldout"):
            if getattr(self, name) < 1:
                raise SparseSpecError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.alpha < float("inf"):  # (an infinite scale trains nothing but NaNs; nan fails it too)
            raise SparseSpecError(f"alpha must be a finite number > 0, got {self.alpha}")
        check_optimiser(self.lr, self.warmup, self.clip, self.weight_decay)
        if not self.time_limit >= 0:
            raise SparseSpecError(f"time limit must be >= 0 seconds, got {self.time_limit}")


class LoraLinear(nn.Module):
    """A frozen linear map plus a trainable low-rank update: base(x) + scale · B A x (A, B in fp32)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x.to(self.lora_a.dtype), self.lora_a), self.lora_b) * self.scale
        return self.base(x) + update.to(x.dtype)

    def delta(self) -> torch.Tensor:
        """The update of the weight, [out, in] fp32."""
        return (self.lora_b @ self.lora_a) * self.scale


def _targets(model: Transformer):
    """(name, parent module, attribute) of every linear map LoRA adapts, in a fixed order."""
    for i, layer in enumerate(model.layers):
        for attr in TARGETS:
            yield f"layers.{i}.{attr}", layer.self_attn if hasattr(layer.self_attn, attr) else layer.mlp, attr


def check_rank(model: Transformer, rank: int) -> None:
    """A LoRA rank above the smallest min(in, out) of the adapted maps is refused: B A of that map would hold more
    parameters than the whole weight update it can express (a low-rank adapter a fraction of the model's size)."""
    limit = min(min(m.in_features, m.out_features)
                for m in (getattr(getattr(parent, attr), "base", getattr(parent, attr))
                          for _, parent, attr in _targets(model)))
    if rank > limit:
        raise SparseSpecError(f"LoRA rank must be <= {limit} (the narrowest adapted map is {limit} wide: a higher "
                              f"rank only adds parameters), got {rank}")


def add_lora(model: Transformer, rank: int, alpha: float) -> dict[str, LoraLinear]:
    """Wrap every target linear map of `model` in a `LoraLinear` (the base weights frozen) -> them by name."""
    check_rank(model, rank)
    model.requires_grad_(False)
    out = {}
    for name, parent, attr in _targets(model):
        base = getattr(parent, attr)
        if isinstance(base, LoraLinear):
            raise SparseSpecError("the model already carries LoRA adapters")
        out[name] = LoraLinear(base, rank, alpha)
        setattr(parent, attr, out[name])
    return out


@torch.no_grad()
def merge_lora(model: Transformer) -> None:
    """Fold every `LoraLinear`'s update into its base weight (in the weight's dtype) and unwrap it."""
    for _, parent, attr in _targets(model):
        module = getattr(parent, attr)
        if isinstance(module, LoraLinear):
            module.base.weight += module.delta().to(module.base.weight.dtype)
            setattr(parent, attr, module.base)


def adapter_state(loras: dict[str, LoraLinear]) -> dict[str, torch.Tensor]:
    return {f"{name}.{part}": getattr(m, part).detach().float().cpu().contiguous()
            for name, m in loras.items() for part in ("lora_a", "lora_b")}


def is_adapter(path: str | Path) -> bool:
    return Path(path).is_dir() and all((Path(path) / f).is_file() for f in ADAPTER_FILES)


def read_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """An adapter folder -> (its A and B tensors by name, its json)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights, info = (Path(path) / f for f in ADAPTER_FILES)
    try:
        meta = json.loads(info.read_text())
        state = load_file(str(weights))
    except (TypeError, ValueError, OSError, SafetensorError) as e:
        raise SparseSpecError(f"corrupt adapter {path}: {e}") from None
    missing = [key for key in ("base", "rank", "alpha") if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise SparseSpecError(f"corrupt adapter {path}: its json lacks {', '.join(missing)}")
    return state, meta


@torch.no_grad()
def apply_adapter(model: Transformer, path: str | Path) -> dict:
    """Add an adapter folder's alpha / r · B A to `model`'s weights in place -> its json. The shapes must match."""
    state, meta = read_adapter(path)
    scale = meta["alpha"] / meta["rank"]
    names = [name for name, _, _ in _targets(model)]
    if set(state) != {f"{n}.{p}" for n in names for p in ("lora_a", "lora_b")}:
        raise SparseSpecError(f"adapter {path} does not fit this model ({len(state) // 2} adapted maps, the model "
                              f"has {len(names)}): it was made for {meta['base']}")
    for name, parent, attr in _targets(model):
        weight = getattr(parent, attr).weight
        a, b = state[f"{name}.lora_a"].to(weight.device), state[f"{name}.lora_b"].to(weight.device)
        if (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise SparseSpecError(f"adapter {path}: {name} is {b.shape[0]} x {a.shape[1]}, the model's "
                                  f"{tuple(weight.shape)}: it was made for {meta['base']}")
        weight += ((b @ a) * scale).to(weight.dtype)
    return meta


def encode_pairs(engine, pairs: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """(prompt, continuation) -> (the chat-templated prompt, the continuation, the model's end-of-turn token;
    where the answer starts): the fine-tuned model learns to answer and then stop."""
    eos = list(engine.config.eos_token_ids[:1])
    out = []
    for prompt, answer in pairs:
        ids = engine.encode(prompt, chat=True)
        out.append((ids + engine.tokenizer(answer, add_special_tokens=False)["input_ids"] + eos, len(ids)))
    return out


def pair_loss(model: Transformer, seqs: list[tuple[list[int], int]], device: torch.device) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens of a batch of (tokens, answer start) sequences (padded right)."""
    T = max(len(t) for t, _ in seqs)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    for r, (ids, start) in enumerate(seqs):
        tokens[r, :len(ids)] = torch.tensor(ids)
        labels[r, start - 1:len(ids) - 1] = torch.tensor(ids[start:])  # position t predicts token t + 1
    tokens, labels = tokens.to(device), labels.to(device)
    cache = KVCache(model.cfg, len(seqs), T, model.embed_tokens.weight.dtype, device)
    positions = torch.arange(T, device=device).expand(len(seqs), -1)
    hidden = model.forward(tokens, positions, cache, T)  # [N, T, H] (causal: padding after a row never reaches it)
    logits = model.logits(hidden)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def finetune(engine, cfg: FinetuneConfig, out: Path, base_name: str, progress: bool = False, log=print) -> dict:
    """LoRA-fine-tune `engine`'s model on cfg.domain into the adapter folder `out` (resuming its checkpoint) and
    merge the adapter into the engine's weights -> the summary written to adapter.json."""
    from safetensors.torch import save_file

    check_rank(engine.model, cfg.rank)
    check_resume(out / "checkpoint.pt", cfg.steps)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"base": base_name, **{k: v for k, v in asdict(cfg).items() if k not in ("steps", "time_limit",
                                                                                          "eval_every")}}
    check_settings(out / "settings.json", settings)
    device, model = engine.device, engine.model
    torch.manual_seed(cfg.seed)
    train = encode_pairs(engine, domain_pairs(cfg.domain, cfg.examples, "train", cfg.seed))
    held = encode_pairs(engine, domain_pairs(cfg.domain, cfg.heldout, "heldout", cfg.seed))
    loras = add_lora(model, cfg.rank, cfg.alpha)
    params = [p for m in loras.values() for p in (m.lora_a, m.lora_b)]
    trainable = sum(p.numel() for p in params)
    total = sum(p.numel() for p in model.parameters()) - trainable
    log(f"finetune {base_name} on {cfg.domain}: {len(train)} pairs, LoRA rank {cfg.rank} on {len(loras)} maps: "
        f"{trainable:,} trainable parameters ({100 * trainable / total:.2f}% of {total:,})")
    opt = torch.optim.AdamW(params, lr=0.0, weight_decay=cfg.weight_decay)
    ckpt = out / "checkpoint.pt"
    step, spent, history = 0, 0.0, []  # history: [{step, loss, heldout_loss, seconds}], the base model's first
    if ckpt.is_file():
        state = torch.load(ckpt, map_location=device)
        for p, saved in zip(params, state["params"]):
            p.data.copy_(saved)
        opt.load_state_dict(state["opt"])
        step, spent, history = state["step"], state["seconds"], state["history"]
        log(f"resumed at step {step} ({spent:.0f} s of optimisation)")
    g = torch.Generator().manual_seed(cfg.seed + step)
    autocast = (torch.autocast("cuda", torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))

    def done() -> float:
        return max(step / cfg.steps, spent / cfg.time_limit if cfg.time_limit else 0.0)

    @torch.no_grad()
    def evaluate(loss: float | None) -> float:  # loss None: the base model, before any step
        with autocast:
            held_loss = sum(float(pair_loss(model, held[i:i + cfg.batch], device)) * len(held[i:i + cfg.batch])
                            for i in range(0, len(held), cfg.batch)) / len(held)
        history.append({"step": step, "loss": loss, "heldout_loss": held_loss, "seconds": round(spent, 1)})
        save_whole({"params": [p.detach() for p in params], "opt": opt.state_dict(), "step": step,
                    "seconds": spent, "history": history}, ckpt)
        log(f"step {step}: {'the base model' if loss is None else f'loss {loss:.3f}'}, held-out loss {held_loss:.3f} "
            f"({spent:.0f} s)")
        return held_loss

    held_loss = evaluate(None) if step == 0 else history[-1]["heldout_loss"]  # the base model's first
    loss_value = history[-1]["loss"]
    block_queries, model.block_queries = model.block_queries, 0  # training attends through SDPA (it has a backward)
    try:
        with progress_bar() as bar:
            task = bar.add_task("finetune", total=1000, completed=int(1000 * min(1.0, done())), visible=progress)
            while done() < 1:
                t0 = time.perf_counter()
                for group in opt.param_groups:
                    group["lr"] = learning_rate(cfg, done())  # warm-up, then cosine decay
                rows = torch.randint(0, len(train), (cfg.batch,), generator=g).tolist()
                with autocast:
                    loss = pair_loss(model, [train[r] for r in rows], device)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(params, cfg.clip)
                if torch.isfinite(norm):
                    opt.step()
                else:
                    log(f"step {step + 1}: non-finite gradient, skipped")
                loss_value = loss.item()
                step += 1
                spent += time.perf_counter() - t0
                if step % cfg.eval_every == 0 and done() < 1:
                    held_loss = evaluate(loss_value)
                bar.update(task, completed=int(1000 * min(1.0, done())),
                           description=f"finetune (step {step}, loss {loss_value:.2f}, held-out {held_loss:.2f})")
        held_loss = evaluate(loss_value)
    finally:
        model.block_queries = block_queries
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    defaults = asdict(FinetuneConfig())
    command = ["sparsespec train finetune --model", base_name]
    command += [f"--{k.replace('_', '-')} {v}" for k, v in asdict(cfg).items() if v != defaults[k]]
    summary = {"base": base_name, "rank": cfg.rank, "alpha": cfg.alpha, "domain": cfg.domain,
               "targets": list(TARGETS), "finetune": asdict(cfg), "trainable_parameters": trainable,
               "heldout_loss": held_loss, "history": history, "train_seconds": round(spent, 1),
               "device": hardware,
               "made_by": " ".join(command) + f" ({hardware}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')})"}
    save_file(adapter_state(loras), str(out / ADAPTER_FILES[0]))
    (out / ADAPTER_FILES[1]).write_text(json.dumps(summary, indent=1))
    merge_lora(model)
    return summary
