"""What gpuctl prints: stage progress and rank output.

On a terminal, stages show a rich spinner and a coloured tick; otherwise (CI,
pipes, log files) each stage is a plain `==> ` line, so logs stay greppable.
Rank lines may arrive from many threads at once: one lock keeps each line whole.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, TextIO

from rich.console import Console
from rich.text import Text

_RANK_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta", "bright_green")


class Reporter:
    def __init__(self, *, stream: TextIO | None = None, plain: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.plain = (not self.stream.isatty()) if plain is None else plain
        self.console = Console(file=self.stream, highlight=False, soft_wrap=True,
                               force_terminal=False if self.plain else None)
        self.err = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        self._lock = threading.Lock()

    @contextmanager
    def stage(self, title: str) -> Iterator[None]:
        """A named step; prints its duration when done, and its failure if it fails."""
        start = time.monotonic()
        if self.plain:
            self._write(f"==> {title}")
            yield
            self._write(f"    {title}: done in {time.monotonic() - start:.1f}s")
            return
        with self.console.status(title):
            try:
                yield
            except BaseException:
                self.console.print(Text("✗ ", style="bold red") + Text(title))
                raise
        self.console.print(Text("✓ ", style="bold green") + Text(f"{title} ({time.monotonic() - start:.1f}s)"))

    def info(self, message: str) -> None:
        if self.plain:
            self._write(message)
        else:
            with self._lock:
                self.console.print(Text(message))

    def rank_line(self, prefix: str, rank: int, line: str) -> None:
        if self.plain:
            self._write(f"{prefix} {line}")
            return
        with self._lock:
            style = _RANK_STYLES[rank % len(_RANK_STYLES)]
            self.console.print(Text(prefix, style=style) + Text(" " + line))

    def error(self, message: str) -> None:
        with self._lock:
            self.err.print(Text(message, style="bold red"))

    def _write(self, line: str) -> None:
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()
