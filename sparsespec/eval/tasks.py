"""RULER-style synthetic long-context tasks, sized in the model's own tokens, haystacks from real text.

Every generator is deterministic in (task, length, seed), returns a prompt of `length` tokens (within 2%) whose
answer strings all occur in it, and is scored as RULER does: the fraction of expected strings found in the output.

    niah_single     one key -> value needle (number, word or UUID values) at a swept depth
    niah_multikey   four needles with different keys, one asked
    niah_multivalue one key with four values, all asked
    niah_multiquery four needles, all asked
    vt              variable tracking: X1 = 12345, X2 = X1, ... ; which variables hold 12345?
    cwe             common words: a word list where ten words recur most; name them
    fwe             frequent words: a coded text (Zipf-distributed words); name the three most frequent
    qa              a Wikipedia lead among distractor leads; complete a sentence of it with its missing year
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass

from .. import corpora
from ..errors import SparseSpecError

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_WORDS = ("apple banana cherry dragon eagle falcon garden harbor island jungle kettle lantern meadow needle "
          "orchard pepper quartz river saddle timber umbrella valley walnut yonder zephyr anchor bishop candle "
          "dolphin ember fabric glacier hammer ivory jasmine kernel lemon marble nickel oyster pillow quiver "
          "ribbon silver tulip velvet willow anvil bronze copper delta fossil granite helmet indigo jigsaw koala "
          "lagoon mosaic nectar onyx prairie quill raven sierra tundra urchin violet wombat").split()


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # requested tokens
    seed: int
    prompt: str  # ends where the model's answer starts
    answers: tuple[str, ...]  # every one must appear in the output
    depth: float | None = None  # needle depth (share of the haystack before it), for needle tasks
    max_new_tokens: int = 32


def score(output: str, answers: tuple[str, ...]) -> float:
    """RULER's string match: the share of expected strings present in the output (case-insensitive)."""
    low = output.lower()
    return sum(a.lower() in low for a in answers) / len(answers)


class TaskBuilder:
    """Makes samples for one tokenizer; haystack text comes from the packaged Wikipedia corpus."""

    def __init__(self, tokenizer, corpus: str = "wiki"):
        self.tok = tokenizer
        self.corpus = corpus

    def n_tokens(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def sample(self, task: str, length: int, seed: int) -> Sample:
        if task not in TASKS:
            raise SparseSpecError(f"unknown task {task!r} (choose from {', '.join(TASKS)})")
        rng = random.Random(f"{task}/{length}/{seed}")
        return getattr(self, f"_{task}")(rng, length, seed)

    # ------------------------------------------------------------------------------------------ haystack sizing

    def _fit(self, make, length: int) -> str:
        """`make(n)` builds a prompt from n filler units (monotone in n): binary search for `length` tokens."""
        lo, hi = 1, 1
        while self.n_tokens(make(hi)) < length:
            lo, hi = hi, hi * 2
            if hi > 1 << 20:
                raise SparseSpecError("cannot fill the requested length")
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.n_tokens(make(mid)) <= length:
                lo = mid
            else:
                hi = mid - 1
        # the search measured every n it kept but the least: one filler unit, the needles and the question
        if lo == 1 and (n := self.n_tokens(make(1))) > length:
            raise SparseSpecError(f"a length of {length} tokens is too short for this task: its least prompt takes "
                                  f"{n}")
        return make(lo)

    def _filler_words(self, rng: random.Random, words: int) -> list[str]:
        return corpora.text(self.corpus, words, seed=rng.randrange(1 << 30)).split()

    def _haystack_prompt(self, rng, length, needles: list[str], depths: list[float], question: str,
                         answer_prefix: str) -> str:
        """Real text cut to fit, needles inserted at sentence boundaries at their depths, then the question."""
        words = self._filler_words(rng, length + 200)
        intro = "Some special magic facts are hidden in the following text. Memorize them.\n\n"

        def make(n: int) -> str:
            sentences = re.split(r"(?<=[.!?])\s+", " ".join(words[:n]))
            for needle, depth in sorted(zip(needles, depths), key=lambda x: -x[1]):
                sentences.insert(round(depth * len(sentences)), needle)
            return intro + " ".join(sentences) + f"\n\n{question}\n{answer_prefix}"

        if self.n_tokens(make(len(words))) < length:
            raise SparseSpecError(f"corpus too small for {length} tokens")
        return self._fit(make, length)

    # ------------------------------------------------------------------------------------------ needle tasks

    @staticmethod
    def _value(rng: random.Random, kind: str) -> str:
        if kind == "number":
            return str(rng.randint(1_000_000, 9_999_999))
        if kind == "word":
            return rng.choice(_WORDS) + "-" + rng.choice(_WORDS)
        return str(uuid.UUID(int=rng.getrandbits(128)))

    def _keys(self, rng, n):
        return [f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}-{rng.randint(10, 99)}" for _ in range(n)]

    def _niah_single(self, rng, length, seed):
        kind = ("number", "word", "uuid")[seed % 3]
        depth = DEPTHS[(seed // 3) % len(DEPTHS)]
        key, value = self._keys(rng, 1)[0], self._value(rng, kind)
        prompt = self._haystack_prompt(rng, length, [f"The special magic {kind} for {key} is: {value}."], [depth],
                                       f"What is the special magic {kind} for {key} mentioned in the text?",
                                       f"Answer: The special magic {kind} for {key} is:")
        return Sample("niah_single", length, seed, prompt, (value,), depth, 24 if kind != "uuid" else 40)

    def _four_needles(self, rng):
        """Four keys with a number each, at random depths -> (keys, values, depths, needle sentences)."""
        keys = self._keys(rng, 4)
        values = [self._value(rng, "number") for _ in keys]
        depths = [rng.random() for _ in keys]
        return keys, values, depths, [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]

    def _niah_multikey(self, rng, length, seed):
        keys, values, depths, needles = self._four_needles(rng)
        asked = rng.randrange(4)
        prompt = self._haystack_prompt(rng, length, needles, depths,
                                       f"What is the special magic number for {keys[asked]} mentioned in the text?",
                                       f"Answer: The special magic number for {keys[asked]} is:")
        return Sample("niah_multikey", length, seed, prompt, (values[asked],), depths[asked])

    def _niah_multivalue(self, rng, length, seed):
        key = self._keys(rng, 1)[0]
        values = [self._value(rng, "number") for _ in range(4)]
        depths = sorted(rng.random() for _ in values)
        needles = [f"One of the special magic numbers for {key} is: {v}." for v in values]
        prompt = self._haystack_prompt(rng, length, needles, depths,
                                       f"What are all the special magic numbers for {key} mentioned in the text?",
                                       f"Answer: The special magic numbers for {key} are:")
        return Sample("niah_multivalue", length, seed, prompt, tuple(values), None, 64)

    def _niah_multiquery(self, rng, length, seed):
        keys, values, depths, needles = self._four_needles(rng)
        prompt = self._haystack_prompt(rng, length, needles, depths,
                                       "What are the special magic numbers for " + ", ".join(keys[:-1]) +
                                       f" and {keys[-1]} mentioned in the text?",
                                       "Answer: The special magic numbers for " + ", ".join(keys[:-1]) +
                                       f" and {keys[-1]} are:")
        return Sample("niah_multiquery", length, seed, prompt, tuple(values), None, 64)

    # ------------------------------------------------------------------------------------------ other tasks

    def _vt(self, rng, length, seed):
        value = str(rng.randint(10_000, 99_999))
        names = rng.sample([w.upper()[:5] + str(i) for i, w in enumerate(_WORDS)], 5)
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        depths = sorted(rng.random() for _ in chain)
        prompt = self._haystack_prompt(rng, length, chain, depths,
                                       f"Find all variables that are assigned the value {value} in the text above.",
                                       f"Answer: The variables assigned the value {value} are:")
        return Sample("vt", length, seed, prompt, tuple(names), None, 48)

    def _cwe(self, rng, length, seed):
        words = rng.sample(_WORDS, 60)
        common, rare = words[:10], words[10:]

        picks = [rng.choice(rare) for _ in range(4 * length)]  # rare words, each ~1.3% of the items
        slots = list(range(4 * length))
        rng.shuffle(slots)

        def make(n: int) -> str:  # n items: 35% common words (3.5% each) round-robin, the rest rare
            n_common = round(0.35 * n)
            items = [common[i % 10] for i in range(n_common)] + picks[: n - n_common]
            items = [w for _, w in sorted(zip(slots, items))]  # a fixed pseudo-random order
            listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
            return ("Below is a numbered list of words. Find the ten most common words in it.\n\n" + listing +
                    "\n\nQuestion: What are the ten most common words in the list above?\n"
                    "Answer: The ten most common words in the list are:")

        return Sample("cwe", length, seed, self._fit(make, length), tuple(common), None, 64)

    def _fwe(self, rng, length, seed):
        vocab = rng.sample(_WORDS, 40)
        weights = [1 / (i + 1) ** 1.6 for i in range(len(vocab))]  # Zipf: the first three clearly lead

        def make(n: int) -> str:
            r = random.Random(seed)
            text = " ".join(r.choices(vocab, weights, k=n))
            return ("Read the following coded text and track the frequency of each coded word.\n\n" + text +
                    "\n\nQuestion: What are the three most frequently appearing coded words in the text above?\n"
                    "Answer: The three most frequent coded words are:")

        prompt = self._fit(make, length)
        body = prompt.split("\n\n")[1].split()
        top = sorted(set(body), key=lambda w: -body.count(w))[:3]
        return Sample("fwe", length, seed, prompt, tuple(top), None, 32)

    def _qa(self, rng, length, seed):
        docs = list(corpora.documents(self.corpus, seed=rng.randrange(1 << 30)))
        for target_index, doc in enumerate(docs):
            title, _, body = doc.partition("\n")
            found = [s for s in re.split(r"(?<=[.!?])\s+", body) if re.search(r"\b(1[5-9]\d\d|20[0-2]\d)\b", s)]
            if found and len(found[0].split()) >= 6:
                break
        else:
            raise SparseSpecError("no corpus article with a year to ask about")
        sentence = found[0]
        year = re.search(r"\b(1[5-9]\d\d|20[0-2]\d)\b", sentence).group(1)
        blanked = sentence.replace(year, "____", 1)
        target = f"Article: {title}\n{body}\n\n"
        stream = "".join(f"Article: {d.partition(chr(10))[0]}\n{d.partition(chr(10))[2]}\n\n"
                         for i, d in enumerate(docs[:3000]) if i != target_index).split(" ")
        position = rng.random()

        def make(n: int) -> str:
            text = " ".join(stream[:n])
            starts = [m.start() for m in re.finditer(r"Article: ", text)] + [len(text)]
            cut = starts[round(position * (len(starts) - 1))]
            return ("Answer the question using the articles below.\n\n" + text[:cut] + target + text[cut:] +
                    f"\n\nQuestion: In the article '{title}', which year fills the blank in this sentence: "
                    f"\"{blanked}\"?\nAnswer: The year is")

        prompt = self._fit(make, length)
        return Sample("qa", length, seed, prompt, (year,), position, 16)
