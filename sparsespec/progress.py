"""Progress on stderr for long work (prefill chunks, dequantisation, model assembly, decoding): rich bars on a
terminal, plain lines otherwise (a log file, CI), where a command shows progress only when asked (`--progress`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

T = TypeVar("T")


class PlainProgress(Progress):
    """A rich Progress that draws nothing live: one line per visible task every `every` seconds, at its end and
    when the work stops."""

    every = 5.0

    def __init__(self, *columns, **kwargs):
        super().__init__(*columns, **kwargs, disable=True)
        self._last: dict[TaskID, tuple[float, float]] = {}  # task -> (time, completed) of its last line

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._line(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._line(task_id)

    def stop(self) -> None:
        for task_id in self.task_ids:
            self._line(task_id, final=True)
        super().stop()

    def _line(self, task_id: TaskID, final: bool = False) -> None:
        task = self._tasks[task_id]
        now = time.monotonic()
        last, done = self._last.get(task_id, (task.start_time or now, 0.0))
        if task.visible and task.completed != done and (final or task.finished or now - last >= self.every):
            self._last[task_id] = (now, task.completed)
            total = f"/{task.total:g}" if task.total is not None else ""
            print(f"{task.description}: {task.completed:g}{total} ({task.elapsed or 0:.1f} s)", file=sys.stderr,
                  flush=True)


def progress_bar() -> Progress:
    console = Console(stderr=True)
    kind = Progress if console.is_terminal else PlainProgress
    return kind(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TimeRemainingColumn(), console=console, transient=True)


def track(items: Iterable[T], description: str, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """Iterate `items`, showing progress on stderr when `enabled`."""
    if not enabled:
        yield from items
        return
    with progress_bar() as bar:
        task = bar.add_task(description, total=total if total is not None else len(items))  # type: ignore[arg-type]
        for item in items:
            yield item
            bar.advance(task)
