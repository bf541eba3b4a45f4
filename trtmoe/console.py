"""The one console every command renders through: results on stdout; notes, warnings, errors and
progress bars on stderr (so ``--json`` output stays parseable); and the human-readable sizes and
counts its tables and progress lines show."""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

console = Console()
err_console = Console(stderr=True)

PROGRESS_LINE_SECONDS = 30.0  # where stderr is not a terminal: at most one progress line this often


def note(text: str) -> None:
    """A ``note:`` line on stderr; ``text`` is shown literally (no markup)."""
    err_console.print(f"[yellow]note:[/] {escape(text)}")


def warning(text: str) -> None:
    """A ``warning:`` line on stderr; ``text`` is shown literally (no markup)."""
    err_console.print(f"[yellow]warning:[/] {escape(text)}")


def progress(command: str, *, units: str = "steps"):
    """A progress display for long work on stderr: a live bar on a terminal; elsewhere (a CI log, a
    pipe) a plain line every ``PROGRESS_LINE_SECONDS`` with the share done and the time left, once
    the work has run that long, and one when it ends. ``units`` is ``"steps"`` or ``"bytes"``. Both take
    ``add_task(description, total=None)`` and ``update(task, completed=..., total=...)``."""
    if not err_console.is_terminal:
        return LineProgress(command, units=units, write=lambda s: err_console.print(escape(s), soft_wrap=True))
    if units == "bytes":
        return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                        TransferSpeedColumn(), TimeRemainingColumn(), console=err_console, transient=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err_console, transient=True)


def fmt_bytes(n: float) -> str:
    """Binary units: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def fmt_count(n: int) -> str:
    """Decimal suffixes: 3_871_872 -> '3.87M'."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class LineProgress:
    """Progress as log lines: ``command: description done/total (p%), m:ss elapsed, about m:ss left``.
    Work that ends within ``interval`` seconds prints nothing (a failing command's error stays its one
    line); longer work prints a line every ``interval`` seconds and a last one when it ends. The time
    left is from the rate since the first update, so a resumed run that starts part done is not
    credited with its earlier work."""

    def __init__(self, command: str, *, units: str = "steps", interval: float = PROGRESS_LINE_SECONDS,
                 write: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic):
        self.command, self.units, self.interval, self.write, self.clock = command, units, interval, write, clock
        self.tasks: dict[int, dict] = {}

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            for t in self.tasks.values():
                if t["last"] is not None and t["done"] != t["shown"]:
                    self._line(t)

    def add_task(self, description: str, total: float | None = None) -> int:
        tid = len(self.tasks)
        self.tasks[tid] = {"description": description, "total": total, "done": 0.0, "start": None,
                           "start_done": 0.0, "last": None, "shown": None}
        return tid

    def update(self, task: int, *, completed: float | None = None, total: float | None = None,
               description: str | None = None) -> None:
        t = self.tasks[task]
        if total is not None:
            t["total"] = total
        if description is not None:
            t["description"] = description
        if completed is not None:
            t["done"] = completed
        now = self.clock()
        if t["start"] is None:
            t["start"], t["start_done"] = now, t["done"]
        if not t["total"]:
            return
        if now - (t["start"] if t["last"] is None else t["last"]) >= self.interval:
            self._line(t, now)

    def _line(self, t: dict, now: float | None = None) -> None:
        """One line for task ``t``, which has a total and a start (``update`` saw both)."""
        now = self.clock() if now is None else now
        done, total = t["done"], t["total"]
        fmt = fmt_bytes if self.units == "bytes" else (lambda n: f"{int(n):,}")
        elapsed = now - t["start"]
        text = (f"{self.command}: {t['description']} {fmt(done)}/{fmt(total)} ({100 * done / total:.0f}%), "
                f"{_clock(elapsed)} elapsed")
        gained = done - t["start_done"]
        if 0 < done < total and gained > 0 and elapsed > 0:
            text += f", about {_clock(elapsed * (total - done) / gained)} left"
        self.write(text)
        t["last"], t["shown"] = now, done
