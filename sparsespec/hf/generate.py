"""sparsespec's speculative loop on a transformers model, as `model.generate(custom_generate=speculative_generate)`.

    model.generate(ids, custom_generate=speculative_generate, drafter=NgramDrafter(), max_new_tokens=64)

The loop is sparsespec's (spec/decode.py) with the target's forwards made by transformers: a drafter proposes up to
`block_size` − 1 tokens, one target forward scores [pending, *proposals], greedy verification keeps the matching
prefix and the target's own next token, and the target's cache is cropped back to the committed tokens. Drafters are
sparsespec's: `NgramDrafter`, `ModelDrafter` (a sparsespec engine), `HFModelDrafter` (a transformers draft model of
the same tokenizer) and DFlash (`dflash_drafter`, target features from the target's hidden states). Greedy only;
generate's logits processors and stopping criteria apply to every committed token exactly as in its plain greedy
loop, so the output equals `model.generate(ids, do_sample=False)`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationConfig

from ..config import ModelConfig
from ..errors import SparseSpecError
from ..models.transformer import BLOCK_QUERIES
from ..sampling import SamplingConfig
from ..spec.dflash import DFlash, DFlashDrafter
from ..spec.drafters import Drafter, check_vocab
from ..spec.verify import verify_greedy
from .cache import SparseCache

GREEDY = SamplingConfig()


def tapped_features(hidden_states: tuple[torch.Tensor, ...], taps: tuple[int, ...]) -> torch.Tensor:
    """transformers' hidden states (the embeddings, then each decoder layer's output) -> the outputs of decoder
    layers `taps`, concatenated [B, T, len(taps) * H] (sparsespec's `forward_tapped` features)."""
    return torch.cat([hidden_states[t + 1] for t in taps], dim=-1)


@torch.no_grad()
def speculative_generate(model, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                         stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                         drafter: Drafter | None = None, block_size: int = 16, **model_kwargs) -> torch.LongTensor:
    """generate's `custom_generate`: greedy speculative decoding of one row with `drafter` (a generate kwarg, as is
    `block_size`: at most block_size − 1 proposals a step). -> the prompt and the new tokens [1, L + n], as plain
    greedy `generate` returns them."""
    if drafter is None:
        raise SparseSpecError("speculative_generate needs drafter=... (NgramDrafter(), HFModelDrafter(draft_model) "
                              "or dflash_drafter(model, path))")
    check_vocab(drafter.vocab_size, model.config.get_text_config(decoder=True).vocab_size)
    if block_size < 2:
        raise SparseSpecError(f"block size must be >= 2 (one pending token + proposals), got {block_size}")
    if input_ids.shape[0] != 1:
        raise SparseSpecError(f"speculative_generate decodes one row at a time, got a batch of {input_ids.shape[0]}")
    if generation_config.do_sample or generation_config.num_beams > 1:
        raise SparseSpecError("speculative_generate is greedy: use do_sample=False and num_beams=1")
    if generation_config.return_dict_in_generate:
        raise SparseSpecError("speculative_generate returns the token ids only (return_dict_in_generate=False)")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise SparseSpecError("speculative_generate needs an unpadded prompt")
    cache = model_kwargs.get("cache")
    if cache is None:
        cache = DynamicCache(config=model.config)
    elif isinstance(cache, SparseCache) or not cache.is_croppable or cache.get_seq_length() != 0:
        raise SparseSpecError("speculative_generate needs an empty croppable dense cache (a DynamicCache or "
                              "StaticCache); a SparseCache would decode single-token steps sparsely, not losslessly")

    taps = drafter.taps
    ids = input_ids
    out = model(ids, cache=cache, output_hidden_states=bool(taps), logits_to_keep=1)
    capacity = generation_config.max_length + block_size  # the most positions the target and drafter reach
    drafter.start([ids[0].tolist()], [tapped_features(out.hidden_states, taps)[0]] if taps else None, capacity)
    first = logits_processor(ids, out.logits[:, -1].float()).argmax(-1).tolist()
    ids, done = _commit(ids, first, stopping_criteria)
    while not done:
        n = ids.shape[1] - 1  # committed tokens in the target's cache; the pending one (ids[-1]) goes to slot n
        k = min(block_size - 1, generation_config.max_length - ids.shape[1] - 1)
        proposals = drafter.propose([ids[0].tolist()], [max(k, 0)], [GREEDY], [None])[0][0][:max(k, 0)]
        block = torch.cat([ids[:, -1:], torch.tensor([proposals], dtype=ids.dtype, device=ids.device)], dim=1)
        out = model(block, cache=cache, output_hidden_states=bool(taps))
        processed = torch.cat([logits_processor(torch.cat([ids, block[:, 1:i + 1]], dim=1), out.logits[:, i].float())
                               for i in range(block.shape[1])])  # [k + 1, V], each row after its own prefix
        new = verify_greedy(block[0, 1:], processed)
        accepted = len(new) - 1
        cache.crop(accepted + 1 - block.shape[1])
        ids, done = _commit(ids, new, stopping_criteria)
        if not done:
            drafter.commit([ids.shape[1]], [accepted],
                           tapped_features(out.hidden_states, taps)[:, :accepted + 1] if taps else None)
    return ids


def _commit(ids: torch.Tensor, tokens: list[int], stopping_criteria: StoppingCriteriaList) -> tuple[torch.Tensor, bool]:
    """Append tokens one at a time as generate's greedy loop does, stopping where its stopping criteria first say so
    (they see the ids only, as there). -> (ids, stopped)."""
    for t in tokens:
        ids = torch.cat([ids, ids.new_tensor([[t]])], dim=1)
        if bool(stopping_criteria(ids, None).all()):
            return ids, True
    return ids, False


class HFModelDrafter(Drafter):
    """A smaller transformers model of the target's tokenizer drafts k tokens greedily (Leviathan et al.) in its own
    DynamicCache; rejected drafts are cropped away (sparsespec's ModelDrafter, on a transformers model)."""

    name = "hf-model"

    def __init__(self, model, target_vocab: int | None = None):
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        if target_vocab is not None:
            check_vocab(self.vocab_size, target_vocab)
        self.model = model
        self.cache: DynamicCache | None = None
        self.drafted = 0  # proposals of the last propose() call whose K/V are in the draft cache

    @torch.no_grad()
    def start(self, prompts, features, capacity):
        if len(prompts) != 1:
            raise SparseSpecError(f"HFModelDrafter drafts for one row, got {len(prompts)}")
        self.cache = DynamicCache(config=self.model.config)
        self.model(torch.tensor(prompts, device=self.model.device), cache=self.cache, logits_to_keep=1)

    @torch.no_grad()
    def propose(self, histories, ks, cfgs, rngs):
        if not all(c.greedy for c in cfgs):
            raise SparseSpecError("HFModelDrafter drafts greedily")
        (history,), (k,) = histories, ks
        if history is None:
            return [[]], [None]
        n = self.cache.get_seq_length()
        new = torch.tensor([history[n:]], device=self.model.device)  # committed tokens not yet drafted on
        logits = self.model(new, cache=self.cache, logits_to_keep=1).logits[0, -1]
        proposals = []
        for i in range(k):
            proposals.append(int(logits.argmax(-1)))
            if i < k - 1:
                token = torch.tensor([[proposals[-1]]], device=self.model.device)
                logits = self.model(token, cache=self.cache).logits[0, -1]
        self.drafted = max(k - 1, 0)
        return [proposals], [None]

    def commit(self, lengths, accepted, features):
        # the cache holds the old history and the first `drafted` proposals; keep only what was accepted
        (length,), (a,) = lengths, accepted
        if a is not None:
            keep = length - a - 1 + min(a, self.drafted)
            self.cache.crop(keep - self.cache.get_seq_length())


class _TargetHead:
    """What DFlash takes from its target, from a transformers model: its embedding, its LM head, and how many
    queries a row may have for the block attention path (the drafter's own layers choose theirs by it, as beside
    one of our Transformers)."""

    def __init__(self, model):
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.block_queries = BLOCK_QUERIES

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def dflash_drafter(model, path: str | Path) -> DFlashDrafter:
    """A DFlash drafter (`path`: its .safetensors file, e.g. `sparsespec.spec.registry.drafter_path(name)`) for a
    transformers target; it must have been trained for this target's architecture."""
    dflash = DFlash.load(Path(path), device=model.device, dtype=model.dtype)
    target, trained = ModelConfig.from_hf(model.config.get_text_config(decoder=True).to_dict()), dflash.cfg.target
    fields = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    if any(getattr(target, f) != getattr(trained, f) for f in fields):
        raise SparseSpecError(f"DFlash drafter {path} was trained for a different target "
                              f"({', '.join(f'{f}={getattr(trained, f)}' for f in fields)})")
    if target.num_layers - 1 in dflash.cfg.taps:
        raise SparseSpecError("this DFlash drafter taps the target's last layer, whose output transformers reports "
                              "only after the final norm")
    return DFlashDrafter(dflash, _TargetHead(model))
