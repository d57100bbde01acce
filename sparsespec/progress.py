"""Progress bars (rich) on stderr for long work: prefill chunks, weight dequantisation, model assembly."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

T = TypeVar("T")


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=True)


def track(items: Iterable[T], description: str, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """Iterate `items`, showing a bar on stderr when `enabled`."""
    if not enabled:
        yield from items
        return
    with progress_bar() as bar:
        task = bar.add_task(description, total=total if total is not None else len(items))  # type: ignore[arg-type]
        for item in items:
            yield item
            bar.advance(task)
