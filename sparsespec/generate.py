"""Generation: chunked prefill into the static cache, then one token per step until a stop condition.

    prompts --pad right--> prefill (chunks of `prefill_chunk` positions) --> logits of each row's last token
      --> sample --> decode loop: forward(token at position = row length) --> sample --> stop on EOS / string
    each row's text grows as its tokens arrive (TextStream) where `on_text` shows it while it is generated or a
    stop string must be found; otherwise it is decoded once, at the end
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .errors import SparseSpecError, whole
from .attention.policy import Policy
from .models.loading import DTYPES, LoadedModel, load
from .models.registry import resolve
from .models.transformer import Transformer
from .progress import track
from .runner import Runner, RunnerPool, loop_capacity
from .sampling import SamplingConfig, make_generator, sample


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # end a row like EOS (kept in its ids, left out of its text)
    stop_on_eos: bool = True  # False: every row runs to max_new_tokens (benchmarks)
    prefill_chunk: int = 1024
    cuda_graph: bool = True  # on CUDA, replay the decode step as a CUDA graph
    compile: bool = False  # and run it through torch.compile first (slow start, faster steps)

    def __post_init__(self):
        for name in ("max_new_tokens", "prefill_chunk"):
            if not whole(getattr(self, name)):
                raise SparseSpecError(f"{name} must be a whole number, got {getattr(self, name)!r}")
        if self.max_new_tokens < 1:
            raise SparseSpecError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.prefill_chunk < 1:
            raise SparseSpecError(f"prefill chunk must be >= 1, got {self.prefill_chunk}")
        if not isinstance(self.sampling, SamplingConfig):
            raise SparseSpecError(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        # one stop string or id stands for itself (a string is not a sequence of one-character stop strings)
        one = isinstance(self.stop_strings, str)
        object.__setattr__(self, "stop_strings", (self.stop_strings,) if one else tuple(self.stop_strings))
        one = whole(self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,) if one else tuple(self.stop_token_ids))
        if not all(isinstance(s, str) for s in self.stop_strings):
            raise SparseSpecError(f"stop strings must be strings, got {list(self.stop_strings)!r}")
        if any(not s for s in self.stop_strings):
            raise SparseSpecError("a stop string must not be empty")
        if not all(whole(t) for t in self.stop_token_ids):
            raise SparseSpecError(f"stop token ids must be whole numbers, got {list(self.stop_token_ids)!r}")


@dataclass
class Generation:
    token_ids: list[list[int]]  # generated ids per prompt (a stop token is included, as HF does)
    texts: list[str]  # decoded, special tokens skipped, cut before a stop string
    prompt_tokens: list[int]
    ttft_s: float  # prompt in -> first token out
    decode_s: float  # the remaining steps
    decode_steps: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second per sequence over the decode steps (after the first token)."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")


@torch.inference_mode()
def prefill(model: Transformer, cache: KVCache, prompts: list[list[int]], chunk: int,
            progress: bool = False, observer=None) -> torch.Tensor:
    """Write every prompt token's K/V into `cache`; return the last prompt token's hidden state per row [B, H].

    Prompts of different lengths are right-padded; a row's pad slots lie past its length and are never attended.
    """
    return prefill_tapped(model, cache, prompts, chunk, (), progress, observer)[0]


@torch.inference_mode()
def prefill_tapped(model: Transformer, cache: KVCache, prompts: list[list[int]], chunk: int, taps: tuple[int, ...],
                   progress: bool = False, observer=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `prefill`, also returning the outputs of decoder layers `taps` at every prompt position:
    (hidden [B, H], features [B, T, len(taps) * H] or None without taps; a row's positions past its length are
    padding)."""
    device = cache.device
    lens = [len(p) for p in prompts]
    T = max(lens)
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    tokens = tokens.to(device)
    last = [torch.empty(0)] * len(prompts)
    features = []
    starts = range(0, T, chunk)
    for c0 in track(starts, "prefill", enabled=progress and len(starts) > 1):
        c1 = min(c0 + chunk, T)
        positions = torch.arange(c0, c1, device=device).expand(len(prompts), -1)  # [B, c]
        hidden, tapped = model.forward_tapped(tokens[:, c0:c1], positions, cache, c1, taps, observer=observer)
        features.append(tapped)
        for b, n in enumerate(lens):
            if c0 <= n - 1 < c1:
                last[b] = hidden[b, n - 1 - c0]
    cache.truncate(lens)
    return torch.stack(last), torch.cat(features, dim=1) if taps else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """A loaded model with its tokenizer: encodes prompts, generates, decodes."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.device = loaded.model.embed_tokens.weight.device
        self.dtype = loaded.model.embed_tokens.weight.dtype
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

    @classmethod
    def from_name(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32",
                  progress: bool = False) -> "Engine":
        if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
            raise SparseSpecError(f"name a model: a registry name, a GGUF file or a checkpoint folder, got "
                                  f"{name_or_path!r}")
        name_or_path = str(name_or_path)
        if dtype not in DTYPES:
            raise SparseSpecError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
        device = str(device)  # (a torch.device too)
        if device != "cpu" and device != "cuda" and not device.startswith("cuda:"):
            raise SparseSpecError(f"unknown device {device!r} (cpu, cuda or cuda:N)")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SparseSpecError("--device cuda requested but no CUDA device is available")
        kind, _, shape_name = name_or_path.partition(":")
        if kind == "random" and shape_name:  # speed measurements: random weights in a real shape
            from .models.shapes import ByteTokenizer, random_model, shape

            cfg = shape(shape_name)
            model = random_model(cfg, device, DTYPES[dtype])
            return cls(LoadedModel(model, ByteTokenizer(), cfg, None))
        from .spec.finetune import apply_adapter, is_adapter, read_adapter

        if is_adapter(name_or_path):  # a fine-tune (`train finetune`): its base with the adapter merged in
            engine = cls.from_name(read_adapter(name_or_path)[1]["base"], device, dtype, progress)
            apply_adapter(engine.model, name_or_path)
            return engine
        path = resolve(name_or_path, progress=progress)
        return cls(load(path, device=device, dtype=DTYPES[dtype], progress=progress))

    def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
        """Prompt -> token ids; `chat`: as the user's message in the chat template, after `system` if given."""
        if chat:
            messages = [{"role": "user", "content": prompt}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            return self.encode_chat(messages)
        return self.tokenizer(prompt)["input_ids"]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation ({"role", "content"} messages) -> token ids of the chat template with the assistant's
        turn opened."""
        if not self.tokenizer.chat_template:
            raise SparseSpecError("this model's tokenizer has no chat template: drop --chat")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check_fits(self, prompt_tokens: int, new_tokens: int, which: str = "") -> None:
        """Refuse an empty prompt or one whose new tokens would not fit the context; `which` names it among
        several ("prompt 2 of 5: ")."""
        limit = self.config.max_position
        if prompt_tokens == 0:
            raise SparseSpecError(f"{which}the prompt is empty")
        if prompt_tokens + new_tokens > limit:
            raise SparseSpecError(f"{which}prompt of {prompt_tokens} tokens + {new_tokens} new tokens exceeds the "
                                  f"model's context of {limit} tokens")

    def check_all_fit(self, prompts: list[list[int]], new_tokens: int) -> None:
        """Refuse prompts that are not lists of token ids in the vocabulary, and `check_fits` each, naming the one
        at fault when there are several."""
        if not isinstance(prompts, (list, tuple)) or (prompts and whole(prompts[0])):
            raise SparseSpecError(f"prompts must be a list of prompts, each a list of token ids (Engine.encode makes "
                                  f"one from text), got {type(prompts).__name__}"
                                  + (" of token ids: wrap it in a list" if isinstance(prompts, (list, tuple)) else ""))
        vocab = self.config.vocab_size
        for i, prompt in enumerate(prompts):
            which = f"prompt {i + 1} of {len(prompts)}: " if len(prompts) > 1 else ""
            if not isinstance(prompt, (list, tuple)) or not (set(map(type, prompt)) <= {int}  # (fast: plain ints)
                                                                 or all(whole(t) for t in prompt)):
                raise SparseSpecError(f"{which}a prompt must be a list of token ids (Engine.encode makes one from "
                                      f"text), got {type(prompt).__name__}"
                                      + ("" if not isinstance(prompt, (list, tuple)) else " holding other values"))
            if prompt and not 0 <= min(prompt) <= max(prompt) < vocab:
                raise SparseSpecError(f"{which}token ids must be in [0, {vocab}) (the model's vocabulary), got "
                                      f"{min(prompt) if min(prompt) < 0 else max(prompt)}")
            self.check_fits(len(prompt), new_tokens, which)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], gen: GenerationConfig, progress: bool = False,
                 policy: Policy | None = None, on_text: Callable[[int, str], None] | None = None,
                 runners: RunnerPool | None = None) -> Generation:
        """Generate for each prompt (token ids); `policy` is the decode attention (None: dense everywhere).
        `on_text(row, text)` receives each row's text in pieces as it is generated: together they are exactly
        the row's final text. `progress`: bars on stderr for the prefill and, without `on_text`, the decoding.
        `runners`: dense runs take their runner (and its captured steps) from this pool, for loops of many calls."""
        self.check_all_fit(prompts, gen.max_new_tokens)
        if policy is not None and not isinstance(policy, Policy):
            raise SparseSpecError(f"policy must be a Policy (sparsespec.attention.make_policy(name, options) makes "
                                  f"one), got {policy!r}")
        if not prompts:
            return Generation([], [], [], 0.0, 0.0, 0)
        lens = [len(p) for p in prompts]
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in gen.stop_token_ids):
            raise SparseSpecError(f"stop token ids must be in [0, {vocab}), got {list(gen.stop_token_ids)}")
        if policy is not None and self.config.sliding_window is not None:
            raise SparseSpecError("sparse attention policies do not support sliding-window models yet; use dense")
        B = len(prompts)
        capacity = loop_capacity(max(lens) + gen.max_new_tokens, self.config.max_position, gen.compile,
                                 runners is not None, policy is not None)
        if runners is not None and policy is None:
            runner = runners.get(self.model, B, capacity, gen.cuda_graph, gen.compile)
        else:
            runner = Runner(self.model, B, capacity, policy, gen.cuda_graph, gen.compile)
        rng = make_generator(gen.sampling, self.device)

        start = time.perf_counter()
        hidden = runner.prefill(prompts, gen.prefill_chunk, progress)
        tokens = sample(self.model.logits(hidden), gen.sampling, rng)  # [B]
        _sync(self.device)
        ttft = time.perf_counter() - start

        rows = [RowOutput(self, gen, stream=on_text is not None) for _ in range(B)]
        if gen.max_new_tokens > 1:
            runner.capture()  # graph capture (and compilation) is set-up, timed neither as first token nor decoding
        start = time.perf_counter()
        # each pass takes the tokens of the last decode step (the first: the prefill's); `steps` ran so far
        for steps in track(itertools.count(), "decode", progress and on_text is None, gen.max_new_tokens):
            for b, t in enumerate(tokens.tolist()):
                if not rows[b].done and (text := rows[b].add(t)) and on_text is not None:
                    on_text(b, text)
            if all(row.done for row in rows):
                break
            tokens = sample(runner.decode(tokens), gen.sampling, rng)
        _sync(self.device)
        decode_s = time.perf_counter() - start
        out = [row.ids for row in rows]
        texts = [row.text for row in rows]
        if on_text is not None:
            for b, row in enumerate(rows):
                if rest := row.finish():
                    on_text(b, rest)
        return Generation(out, texts, lens, ttft, decode_s, steps)

    def _stop_token(self, token: int, gen: GenerationConfig) -> bool:
        return gen.stop_on_eos and token in self.eos_ids or token in gen.stop_token_ids

    def _stopped(self, ids: list[int], gen: GenerationConfig) -> bool:
        if self._stop_token(ids[-1], gen):
            return True
        if gen.stop_strings and any(s in self._decode(ids) for s in gen.stop_strings):
            return True
        return len(ids) >= gen.max_new_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, ids: list[int], gen: GenerationConfig) -> str:
        text = self._decode(ids[:-1] if ids and self._stop_token(ids[-1], gen) else ids)
        cuts = [text.index(s) for s in gen.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text


class RowOutput:
    """One row's generated tokens under `gen`'s stop conditions: its ids, the text shown so far in pieces
    (`add` returns each new piece; `finish` the rest once it is done) and why it ended. `stream=False` (nobody
    reads the pieces and no stop string must be found): no text until `finish`, which returns all of it — the
    incremental detokenisation (two tokenizer calls a token) is skipped, which a batch of 128 rows paid on the host
    between every two decode steps."""

    def __init__(self, engine: Engine, gen: GenerationConfig, stream: bool = True):
        self.engine, self.gen = engine, gen
        self.ids: list[int] = []
        self.streaming = stream or bool(gen.stop_strings)
        self.stream = TextStream(engine.tokenizer, gen.stop_strings)
        self.finish_reason: str | None = None  # "stop" (EOS, a stop token or string) or "length", once done

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int) -> str:
        """Take the next generated token; -> the text that may be shown now (maybe empty)."""
        self.ids.append(token)
        stop = self.engine._stop_token(token, self.gen)
        if not stop and self.streaming:
            self.stream.add(token)
        if stop or self.stream.cut is not None:
            self.finish_reason = "stop"
        elif len(self.ids) >= self.gen.max_new_tokens:
            self.finish_reason = "length"
        return self.stream.take()

    @property
    def text(self) -> str:
        """The whole text (decoded at once, cut before a stop string)."""
        return self.engine._text(self.ids, self.gen)

    def finish(self) -> str:
        """The rest of the text not shown by `add`: together the pieces are exactly `text`."""
        return self.stream.take(final=self.text)


def held_back(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` without completing it (0 if none): what a stream
    holds back until the next tokens show whether `stop` follows. Only ends that start with stop's first character
    and are shorter than both `stop` and `text` are compared, so a long stop string costs a step no more than the
    text does (comparing every prefix of it cost its length squared, a step)."""
    tail = text[len(text) - min(len(text), len(stop) - 1):]
    i = tail.find(stop[0])
    while i >= 0:
        if stop.startswith(tail[i:]):
            return len(tail) - i
        i = tail.find(stop[0], i + 1)
    return 0


class TextStream:
    """One row's text as its tokens arrive, decoding only the last few each step: ids[prefix:read] decode to the
    end of `text`; ids[prefix:] decode to that plus the new text, kept once it is stable (a character split
    across tokens decodes to U+FFFD until its last byte arrives). `take` hands out the text not shown yet, never
    a stop string or a tail that may begin one."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.cut: int | None = None  # where the first stop string begins, once one appeared
        self.shown = 0  # characters handed out by `take`

    def add(self, token: int) -> None:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            start = len(self.text)
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            hits = [i for s in self.stop_strings if (i := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
            self.cut = min(hits, default=None)

    def take(self, final: str | None = None) -> str:
        """The text that may be shown now and was not yet; `final`: the row's whole text, once it is done."""
        if final is None:
            held = max((held_back(self.text, s) for s in self.stop_strings), default=0)
            final = self.text[: len(self.text) - held if self.cut is None else self.cut]
        text, self.shown = final[self.shown:], len(final)
        return text
