"""Prompt sets for drafter training and speculative benchmarks, made from real code and text.

    code: functions of the Python standard library's own source — complete a function from its first lines,
          explain a function, write a function from its signature and docstring
    text: Wikipedia leads, Shakespeare and the King James Bible — summarise, write about a topic, paraphrase

Every source item is assigned to `train` or `heldout` by a hash of its identity (file + function name, article
title), so held-out prompts never share a function or an article with training prompts.
"""

from __future__ import annotations

import ast
import random
import zlib
from dataclasses import dataclass

from .. import corpora
from ..errors import SparseSpecError

SPLITS = ("train", "heldout")
KINDS = ("code", "text")


@dataclass(frozen=True)
class Prompt:
    kind: str  # code | text
    text: str


def _split_of(identity: str) -> str:
    return "heldout" if zlib.crc32(identity.encode()) % 10 == 0 else "train"


def _functions(split: str, rng: random.Random):
    """(identity, source lines) of stdlib functions of 6-40 lines in `split`, in a seeded order."""
    for module in corpora.documents("stdlib", rng.randrange(1 << 30)):
        try:
            tree = ast.parse(module)
        except (SyntaxError, ValueError):
            continue
        lines = module.splitlines()
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and 6 <= n.end_lineno - n.lineno < 40]
        rng.shuffle(nodes)
        for n in nodes[:12]:
            body = lines[n.lineno - 1:n.end_lineno]
            indent = len(body[0]) - len(body[0].lstrip())
            identity = f"{body[0].strip()}|{len(body)}|{lines[0][:40]}"
            if _split_of(identity) == split:
                yield identity, [line[indent:] for line in body], n


def _code_prompt(lines: list[str], node: ast.FunctionDef, rng: random.Random) -> str:
    src = "\n".join(lines)
    style = rng.randrange(3)
    if style == 0:
        head = "\n".join(lines[: max(2, len(lines) // 3)])
        return ("Complete this Python function. Reply with the whole function in a code block.\n\n"
                f"```python\n{head}\n```")
    if style == 1:
        return f"Explain what this Python function does, step by step.\n\n```python\n{src}\n```"
    doc = ast.get_docstring(node) or f"Implement `{node.name}`."
    sig = lines[0]
    return f"Write a Python function with this signature:\n\n```python\n{sig}\n```\n\nIt should do this: {doc}"


def _texts(split: str, rng: random.Random):
    """(identity, title, passage) from the text corpora in `split`."""
    sources = [corpora.documents(c, rng.randrange(1 << 30)) for c in ("wiki", "shakespeare", "kjv")]
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
            yield title, passage


def _text_prompt(title: str, passage: str, rng: random.Random) -> str:
    style = rng.randrange(3)
    if style == 0:
        return f"Summarise this passage in three sentences.\n\n{passage}"
    if style == 1:
        return f"Write a short, informative paragraph about {title}, based on this text.\n\n{passage}"
    return f"Rewrite this passage in plain modern English.\n\n{passage}"


def make_prompts(n: int, split: str = "train", kinds: tuple[str, ...] = KINDS, seed: int = 0) -> list[Prompt]:
    """n prompts, split evenly over `kinds` (code first when n is odd), deterministic in (n, split, kinds, seed)."""
    if split not in SPLITS:
        raise SparseSpecError(f"unknown prompt split {split!r} (choose from {', '.join(SPLITS)})")
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise SparseSpecError(f"unknown prompt kind {sorted(unknown) or kinds} (choose from {', '.join(KINDS)})")
    rng = random.Random(f"{split}/{seed}")
    counts = {k: n // len(kinds) + (i < n % len(kinds)) for i, k in enumerate(kinds)}
    out: list[Prompt] = []
    if counts.get("code"):
        for _, (_, lines, node) in zip(range(counts["code"]), _functions(split, rng)):
            out.append(Prompt("code", _code_prompt(lines, node, rng)))
    if counts.get("text"):
        for _, (title, passage) in zip(range(counts["text"]), _texts(split, rng)):
            out.append(Prompt("text", _text_prompt(title, passage, rng)))
    if len(out) < n:
        raise SparseSpecError(f"only {len(out)} {split} prompts could be made, {n} requested")
    return out
