"""The one console every command renders through: results on stdout; notes, warnings, errors and
progress bars on stderr (so ``--json`` output stays parseable)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


def note(text: str) -> None:
    """A ``note:`` line on stderr; ``text`` is shown literally (no markup)."""
    err_console.print(f"[yellow]note:[/] {escape(text)}")


def warning(text: str) -> None:
    """A ``warning:`` line on stderr; ``text`` is shown literally (no markup)."""
    err_console.print(f"[yellow]warning:[/] {escape(text)}")
