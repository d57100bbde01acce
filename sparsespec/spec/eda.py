"""`sparsespec train eda`: adapt a DFlash drafter made for a base target to a fine-tuned target (EDA), cheaply.

    base drafter --decouple--> every layer's MLP = shared (the base drafter's own, frozen) + private (a small MLP
        whose output starts at zero: the decoupled drafter drafts exactly what the base did until trained);
        attention, norms, MASK embedding and shared MLPs frozen; the private MLPs (and with --train-fc the feature
        projection) train
    data: the fine-tuned target's greedy answers to its domain's prompts and its features over them (regenerated),
        or the domain's original text after the same prompts (--data original: no generation)
    selection: each sample scored by the base drafter against the fine-tuned target — `loss` (its decay-weighted
        block loss), `reducible` (that loss less the target's own loss on the same tokens), `acceptance` (its
        simulated τ, lowest first) — or by how far the fine-tune moved the answer from its base target, `shift`
        (the base target's loss on the answer less the fine-tuned target's), or `random` — and only the top
        `fraction` kept; with --probe-tokens K the selection comes before regeneration: every prompt is answered
        with K tokens only, those probes are scored, and only the kept prompts are answered in full (the answers,
        EDA's largest cost, shrink to about K / max_new_tokens + fraction of answering every prompt)
    optimisation: train.py's loop (`fit`) on the kept samples, held-out τ on the domain's held-out prompts
    a mixed pool (--mix F): a share F of the prompts (train and held-out alike) is the base's general traffic (code
        and text prompts, which the fine-tune may have changed little) instead of the domain's, as a fine-tuned
        target's real traffic mixes them: a selection rule has to find the samples the base drafter now gets wrong

The adapted drafter is a DFlash drafter file like any other (its json records `private_size`, the base drafter and
the recipe), usable with `--draft dflash:PATH` against the fine-tuned target.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..errors import SparseSpecError
from ..generate import Engine
from .dflash import DecoupledMLP, DFlash
from .finetune import encode_pairs
from .prompts import DOMAINS, domain_pairs, make_prompts
from .train import (Dataset, TrainConfig, acceptance, autocast_for, block_ce, block_loss, block_taus, check_resume,
                    check_settings, decoding_acceptance, fingerprint, fit, packed, regenerate, sample_anchors)

RULES = ("loss", "reducible", "acceptance", "shift", "random")
DATA = ("regenerated", "original")


@dataclass(frozen=True)
class EdaConfig:
    domain: str = "kjv"  # the fine-tuned target's domain: the prompts it answers
    data: str = "regenerated"  # regenerated (the fine-tuned target's answers) | original (the domain's own text)
    select: str = "loss"  # loss | reducible | acceptance | shift | random: how samples are ranked; the top kept
    fraction: float = 0.5
    private_size: int = 256  # width of each drafter layer's private MLP
    train_fc: bool = False  # also adapt the feature projection (fc)
    score_anchors: int = 32  # blocks a sample is scored on
    probe_tokens: int = 0  # 0: score full answers; K: score K-token answers, then answer only the kept prompts
    mix: float = 0.0  # share of the prompt pool (train and held-out) that is general code and text, not the domain

    def __post_init__(self):
        if self.domain not in DOMAINS:
            raise SparseSpecError(f"unknown domain {self.domain!r} (choose from {', '.join(DOMAINS)})")
        if self.data not in DATA:
            raise SparseSpecError(f"unknown data {self.data!r} (choose from {', '.join(DATA)})")
        if self.select not in RULES:
            raise SparseSpecError(f"unknown selection rule {self.select!r} (choose from {', '.join(RULES)})")
        if not 0 < self.fraction <= 1:
            raise SparseSpecError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.private_size < 1 or self.score_anchors < 1:
            raise SparseSpecError("private size and score anchors must be >= 1")
        if self.probe_tokens < 0 or (self.probe_tokens and self.data != "regenerated"):
            raise SparseSpecError(f"probe tokens must be >= 0, and only regenerated data is probed (got "
                                  f"{self.probe_tokens} with {self.data} data)")
        if not 0 <= self.mix < 1 or (self.mix and self.data != "regenerated"):
            raise SparseSpecError(f"mix must be in [0, 1), and only a regenerated pool mixes in general prompts (the "
                                  f"domain's original text follows its own prompts only), got {self.mix} with "
                                  f"{self.data} data")


def pool_prompts(cfg: EdaConfig, n: int, split: str, seed: int) -> list[str]:
    """The n prompt texts a run answers from `split`: round(cfg.mix · n) general ones (code and text, the kinds a
    base drafter is trained on; with the same seed, train-split ones may be prompts it was trained on: traffic it
    knows) after the rest from the domain; deterministic in (cfg.domain, cfg.mix, n, split, seed)."""
    general = round(cfg.mix * n)
    texts = [p.text for p in make_prompts(n - general, split, (cfg.domain,), seed)] if n > general else []
    return texts + ([p.text for p in make_prompts(general, split, ("code", "text"), seed)] if general else [])


def decouple(base: DFlash, private_size: int) -> DFlash:
    """A drafter whose every layer's MLP is the base's (shared) plus a private MLP of `private_size` whose down
    projection starts at zero: it drafts exactly as the base until trained."""
    if base.cfg.private_size:
        raise SparseSpecError("the base drafter is already decoupled (an adapted drafter): adapt its base instead")
    drafter = DFlash(replace(base.cfg, private_size=private_size)).to(base.fc.weight.device)
    state = {}
    for name, tensor in base.state_dict().items():
        state[name.replace(".mlp.", ".mlp.shared.")] = tensor
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    assert not unexpected and all(".mlp.private." in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.mlp.private.down_proj.weight.zero_()
    return drafter


def adapt_parameters(drafter: DFlash, train_fc: bool) -> tuple[int, int]:
    """Freeze everything but the private MLPs (and the feature projection with `train_fc`) -> (trainable, total)."""
    drafter.requires_grad_(False)
    for layer in drafter.layers:
        assert isinstance(layer.mlp, DecoupledMLP)
        layer.mlp.private.requires_grad_(True)
    if train_fc:
        drafter.fc.requires_grad_(True)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in drafter.parameters())


@torch.no_grad()
def sample_scores(drafter: DFlash, target, data: Dataset, rule: str, anchors: int, seed: int = 0,
                  batch: int | None = None, reference=None) -> torch.Tensor:
    """[N] how much each sample is worth training on (higher first) by the drafter's predictions against the target's
    tokens, over `anchors` blocks a sample: `loss` its decay-weighted block cross-entropy, `reducible` that loss minus
    the target's own next-token loss on the same labels (what the drafter gets wrong where the target is sure: the
    learnable part, not text any model finds uncertain), `acceptance` minus its simulated τ at T = 0, `random` a
    seeded random draw; `shift` asks no drafter (`shift_scores` against `reference`, the target before its
    fine-tune). `batch`: samples scored at once (default `scoring_rows`; 8 for `shift`)."""
    device = data.tokens.device
    if rule == "random":
        return random_scores(len(data), seed, device)
    if rule == "shift":
        if reference is None:
            raise SparseSpecError("--select shift compares the fine-tuned target with its base: the target must be a "
                                  "fine-tune from `train finetune` (an adapter folder naming its base)")
        return shift_scores(target, reference, data, batch or 8)
    batch = batch or scoring_rows(anchors, drafter.cfg.block_size, drafter.cfg.target.vocab_size, device)
    g = torch.Generator(device=device).manual_seed(seed)
    drafter.eval()
    scores = torch.empty(len(data), device=device)
    with autocast_for(device):
        for i in range(0, len(data), batch):
            rows = torch.arange(i, min(i + batch, len(data)), device=device)
            at = sample_anchors(data, rows, anchors, g)  # [n, M]
            _, logits, labels = block_loss(drafter, target, data, rows, at)
            if rule == "acceptance":
                scores[rows] = -block_taus(logits, labels).mean(1).float()
                continue
            ce, w = block_ce(logits, labels)  # [n, M, B − 1] each
            if rule == "reducible":  # label j of a block: token anchor + 1 + j, the target's prediction at anchor + j
                index, lengths = data.padded(rows)
                nll = target_nll(target, data.tokens[index], lengths)  # [n, T]
                pos = (at[..., None] + torch.arange(labels.shape[-1], device=device)).clamp(max=nll.shape[1] - 1)
                ce = ce - nll.gather(1, pos.flatten(1)).view_as(ce)
            scores[rows] = (ce * w).sum((1, 2)) / w.sum((1, 2)).clamp(min=1e-6)
    return scores


def scoring_rows(anchors: int, block: int, vocab: int, device: torch.device) -> int:
    """Samples to score at once: as many as keep their block logits within a quarter of the device's free memory
    (CUDA) or 1 GiB (CPU), 1 to 64, counted as [rows, anchors, block, vocab] at 4 bytes (an upper bound: the loss
    holds the block − 1 predicted positions, bf16 on CUDA). (Four at a time took 14 s for 2,048 probes of the 1.5B
    on the H200, most of it per-batch overhead.)"""
    budget = torch.cuda.mem_get_info(device)[0] // 4 if device.type == "cuda" else 1 << 30
    return max(1, min(64, budget // (anchors * block * vocab * 4)))


def random_scores(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """[n] the `random` rule's scores: a seeded uniform draw."""
    return torch.rand(n, generator=torch.Generator(device=device).manual_seed(seed), device=device)


@torch.no_grad()
def target_nll(target, tokens: torch.Tensor, lengths: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """tokens [n, T] (right-padded), lengths [n] -> [n, T] fp32: the target's loss −log p(tokens[t + 1] | tokens[..t])
    at each position t (0 at a row's last position and past it), its LM head `chunk` positions at a time."""
    from ..cache import KVCache

    n, T = tokens.shape
    cache = KVCache(target.cfg, n, T, target.embed_tokens.weight.dtype, tokens.device)
    hidden, _ = target.forward_tapped(tokens, torch.arange(T, device=tokens.device).expand(n, -1), cache, T, ())
    nll = torch.zeros(n, T, device=tokens.device)
    for s in range(0, T - 1, chunk):
        e = min(s + chunk, T - 1)
        logp = target.logits(hidden[:, s:e]).log_softmax(-1)  # [n, e - s, V]
        nll[:, s:e] = -logp.gather(-1, tokens[:, s + 1:e + 1, None])[..., 0]
    return nll * (torch.arange(T, device=tokens.device) < lengths[:, None] - 1)


@torch.no_grad()
def shift_scores(target, reference, data: Dataset, batch: int = 8) -> torch.Tensor:
    """[N] how far the fine-tune moved each sample's answer: the mean over its answer tokens of the reference's (the
    base target's) next-token loss less the fine-tuned target's own (a cross-entropy difference, as in Moore and
    Lewis's selection of in-domain data). A drafter made for the base mimics the base, so this is the part of its
    error that adaptation must fix; text that both targets find uncertain, or both find easy, scores near 0."""
    device = data.tokens.device
    scores = torch.empty(len(data), device=device)
    for i in range(0, len(data), batch):
        rows = torch.arange(i, min(i + batch, len(data)), device=device)
        index, lengths = data.padded(rows)
        tokens = data.tokens[index]  # [n, T]
        diff = target_nll(reference, tokens, lengths) - target_nll(target, tokens, lengths)  # [n, T]: 0 past the end
        t = torch.arange(tokens.shape[1], device=device)  # position t predicts token t + 1, an answer token from
        answer = (t >= data.starts[rows, None] - 1) & (t < lengths[:, None] - 1)  # start - 1 to the row's end
        scores[rows] = (diff * answer).sum(1) / answer.sum(1).clamp(min=1)
    return scores


def top(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """scores [N] -> the indices [ceil(fraction · N)] of the highest scores (ties to the earlier one), highest first."""
    n = max(1, int(-(-fraction * scores.shape[0] // 1)))
    return torch.sort(scores, descending=True, stable=True).indices[:n]


def select(data: Dataset, scores: torch.Tensor, fraction: float) -> Dataset:
    """The ceil(fraction · N) samples of highest score (ties to the earlier one), highest first."""
    return data.subset(top(scores, fraction))


def choose_prompts(engine: Engine, base: DFlash, prompts: list[list[int]], cfg: EdaConfig, tcfg: TrainConfig,
                   scores_path: Path, progress: bool = False, reference=None) -> tuple[torch.Tensor, float]:
    """Selection before regeneration (cfg.probe_tokens > 0): the target answers every prompt (token ids) with its
    first probe_tokens tokens only, the base drafter scores those probes by cfg.select, and the top cfg.fraction
    of the prompts are kept -> (their indices, highest score first; the seconds spent scoring). The scores are
    saved to `scores_path` (a resumed run reuses them); `random` draws without probing."""
    score_s = 0.0

    def score() -> torch.Tensor:
        nonlocal score_s
        if cfg.select == "random":
            return random_scores(len(prompts), tcfg.seed, engine.device)
        probes = regenerate(engine, prompts, base.cfg.taps, cfg.probe_tokens, tcfg.gen_batch, progress, "probe")
        t0 = time.perf_counter()
        scores = sample_scores(base, engine.model, probes, cfg.select, cfg.score_anchors, tcfg.seed,
                               reference=reference)
        score_s = time.perf_counter() - t0
        return scores

    return top(saved_scores(scores_path, len(prompts), engine.device, score), cfg.fraction), score_s


def saved_scores(path: Path, n: int, device: torch.device, score: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The [n] scores saved at `path` by an earlier run (a resumed run reuses them), else `score()`'s, saved there."""
    if path.is_file():
        scores = torch.load(path, map_location=device)
        if scores.shape != (n,):
            raise SparseSpecError(f"{path} holds {scores.shape[0]} scores, not {n}: another run's folder?")
        return scores
    scores = score()
    torch.save(scores, path)
    return scores


def original_data(engine: Engine, pairs: list[tuple[str, str]], taps: tuple[int, ...], batch: int) -> Dataset:
    """The domain's own text after each prompt (no generation) and the target's features over it."""
    seqs = encode_pairs(engine, pairs)
    return packed(engine, [s for s, _ in seqs], [start for _, start in seqs], taps, batch)


def train_eda(engine: Engine, base_path: Path, cfg: EdaConfig, tcfg: TrainConfig, out: Path, target_name: str,
              progress: bool = False, log=print, storage: torch.dtype = torch.bfloat16, reference=None) -> dict:
    """Adapt the drafter at `base_path` to `engine`'s (fine-tuned) model into `out` (resuming what is there):
    tcfg's prompts / heldout / max_new_tokens / gen_batch make the data, its steps / batch / anchors / lr / time
    limit / eval_every the optimisation -> the summary written with the drafter. `reference`: the target before its
    fine-tune (a Transformer; what `--select shift` compares with)."""
    check_resume(out / "checkpoint.pt", tcfg.steps)
    device = engine.device
    torch.manual_seed(tcfg.seed)
    base = DFlash.load(base_path, device=device)
    if base.cfg.target != engine.config:
        theirs, mine = asdict(base.cfg.target), asdict(engine.config)
        changed = sorted(k for k in mine if mine[k] != theirs[k])
        raise SparseSpecError(f"the base drafter {base_path} was made for another target than {target_name} "
                              f"({' / '.join(changed)} differ)")
    if cfg.select == "shift" and (reference is None or reference.cfg != engine.config):
        raise SparseSpecError(f"--select shift compares {target_name} with the target before its fine-tune: "
                              + ("none was given (the target must be a fine-tune from `train finetune`, an adapter "
                                 "folder naming its base)" if reference is None else "that model has another shape"))
    tcfg = replace(tcfg, block_size=base.cfg.block_size)  # the base drafter's blocks
    drafter = decouple(base, cfg.private_size)
    trainable, total = adapt_parameters(drafter, cfg.train_fc)
    log(f"eda: {trainable:,} of {total:,} drafter parameters trainable ({100 * trainable / total:.1f}%: private MLPs "
        f"of {cfg.private_size}{' and the feature projection' if cfg.train_fc else ''})")
    eda = {k: v for k, v in asdict(cfg).items() if k != "mix" or v}  # (runs from before --mix resume)
    settings = {"target": target_name, "base": str(base_path), "eda": eda,
                "data": {k: getattr(tcfg, k) for k in ("prompts", "heldout", "max_new_tokens", "seed")}}
    out.mkdir(parents=True, exist_ok=True)  # (only now: a refused run leaves no folder behind)
    check_settings(out / "settings.json", settings)

    taps = drafter.cfg.taps
    t0 = time.perf_counter()
    data_path, held_path, scores_path = out / "data.safetensors", out / "heldout.safetensors", out / "scores.pt"
    probe_s = 0.0  # seconds of scoring probes (selection before regeneration): scoring, not data
    if data_path.is_file() and held_path.is_file():
        data, held = (Dataset.load(p, engine, taps, tcfg.gen_batch) for p in (data_path, held_path))
    else:
        held_p = [engine.encode(t, chat=True) for t in pool_prompts(cfg, tcfg.heldout, "heldout", tcfg.seed)]
        if cfg.data == "regenerated":
            train_p = [engine.encode(t, chat=True) for t in pool_prompts(cfg, tcfg.prompts, "train", tcfg.seed)]
            if cfg.probe_tokens:  # only the kept prompts are answered in full
                keep, probe_s = choose_prompts(engine, base, train_p, cfg, tcfg, scores_path, progress, reference)
                train_p = [train_p[i] for i in keep.tolist()]
            data = regenerate(engine, train_p, taps, tcfg.max_new_tokens, tcfg.gen_batch, progress, "train")
        else:
            data = original_data(engine, domain_pairs(cfg.domain, tcfg.prompts, "train", tcfg.seed), taps,
                                 tcfg.gen_batch)
        # held-out τ is always against what the fine-tuned target itself says
        held = regenerate(engine, held_p, taps, tcfg.max_new_tokens, tcfg.gen_batch, progress, "held-out")
        data.save(data_path, fingerprint(engine))
        held.save(held_path, fingerprint(engine))
    data_s = time.perf_counter() - t0 - probe_s
    log(f"data ({cfg.data}{f', {cfg.probe_tokens}-token probes' if cfg.probe_tokens else ''}): {len(data)} train / "
        f"{len(held)} held-out sequences, {int((data.lengths - data.starts).sum())} response tokens ({data_s:.0f} s)")

    t0 = time.perf_counter()
    if cfg.probe_tokens:  # the prompts were chosen before their answers (`choose_prompts`): every answer is kept
        kept = data
    else:
        scores = saved_scores(scores_path, len(data), device, lambda: sample_scores(
            base, engine.model, data, cfg.select, cfg.score_anchors, tcfg.seed, reference=reference))
        kept = select(data, scores, cfg.fraction)
    score_s = probe_s + time.perf_counter() - t0
    samples = tcfg.prompts if cfg.probe_tokens else len(data)
    with autocast_for(device):
        base_tau = acceptance(base, engine.model, held)
        base_decoding = decoding_acceptance(base, engine.model, held)[0]
    log(f"selection ({cfg.select}): {len(kept)} of {samples} samples kept ({score_s:.0f} s); the base drafter's "
        f"held-out tau against this target: {base_tau:.2f} (on the decoding loop's schedule: {base_decoding:.2f})")
    del base

    t0 = time.perf_counter()
    tau, history = fit(drafter, engine.model, kept, held, tcfg, out / "checkpoint.pt", progress, log)
    train_s = time.perf_counter() - t0
    with autocast_for(device):
        decoding_tau = decoding_acceptance(drafter.eval(), engine.model, held)[0]
    log(f"held-out tau on the decoding loop's schedule: {base_decoding:.2f} -> {decoding_tau:.2f} (uniform anchors: "
        f"{base_tau:.2f} -> {tau:.2f})")
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    command = ["sparsespec train eda --target", target_name, "--base-drafter", str(base_path)]
    command += [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in asdict(cfg).items()
                if v != asdict(EdaConfig())[k] or k == "domain"]
    ignored = ("layers", "block_size", "taps", "intermediate_size", "kinds")  # the base drafter's, the domain's
    command += [f"--{k.replace('_', '-')} {v}" for k, v in asdict(tcfg).items()
                if v != asdict(TrainConfig())[k] and k not in ignored]
    summary = {"target": target_name, "base_drafter": str(base_path), "eda": asdict(cfg), "train": asdict(tcfg),
               "trainable_parameters": trainable, "parameters": total, "base_heldout_tau": base_tau,
               "heldout_tau": tau, "base_heldout_tau_decoding": base_decoding, "heldout_tau_decoding": decoding_tau,
               "history": history, "samples": samples, "kept": len(kept),
               "data_seconds": round(data_s, 1), "score_seconds": round(score_s, 1), "train_seconds": round(train_s, 1),
               "device": hardware,
               "made_by": " ".join(command) + f" ({hardware}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')})"}
    drafter.save(out / "drafter", dtype=storage, meta=summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
