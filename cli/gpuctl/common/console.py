"""What gpuctl prints: stage progress and rank output.

On a terminal, stages show a rich spinner and a coloured tick; otherwise (CI,
pipes, log files) each stage is a plain `==> ` line, so logs stay greppable.
Rank lines may arrive from many threads at once: one lock keeps each line whole.
On a terminal a rank's unfinished line stays open (ranklines.py: a prompt, a
progress bar redrawn in place) until anything else is printed, which ends it first.
"""

from __future__ import annotations

import functools
import resource
import sys
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, TextIO

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

# rich is imported when something is drawn on a terminal: plain output (CI, pipes, every test and
# benchmark run) never needs it, and it costs each gpuctl command some 30 ms to import.

_RANK_STYLES = ("cyan", "magenta", "green", "yellow", "blue", "bright_cyan", "bright_magenta", "bright_green")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class StepProgress:
    """How far a stage got ("12 of 64 nodes"); in plain output, at most one line per tenth of the way."""

    def __init__(self, show: Callable[[str], None], *, every_tenth: bool = False) -> None:
        self._show = show
        self._every_tenth = every_tenth
        self._shown = -1

    def update(self, text: str, done: int | None = None, total: int | None = None) -> None:
        if self._every_tenth and done is not None and total:
            tenth = done * 10 // total
            if tenth == self._shown and done != total:
                return
            self._shown = tenth
        self._show(text)


class Reporter:
    def __init__(self, *, stream: TextIO | None = None, plain: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.plain = (not self.stream.isatty()) if plain is None else plain
        self._lock = threading.Lock()
        self._open: Hashable | None = None  # the rank line the cursor is at the end of (a terminal only)
        self._open_cols = 0  # its width on the screen
        self.phases: list[dict[str, object]] = []  # phase(): [{phase, seconds, controller_cpu_s, started_at}]
        self._status: Any = None  # a stage's live line on a terminal, while it runs

    @functools.cached_property
    def console(self) -> Console:
        from rich.console import Console

        return Console(file=self.stream, highlight=False, soft_wrap=True, force_terminal=False if self.plain else None)

    @functools.cached_property
    def err(self) -> Console:
        from rich.console import Console

        return Console(file=sys.stderr, highlight=False, soft_wrap=True)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the command (provision, prepare, job) for `phases`: its wall time and the
        controller CPU it cost (this process and the children it waited for: ansible-playbook, ssh)."""
        start, cpu, began = time.monotonic(), _cpu_seconds(), time.time()
        try:
            yield
        finally:
            self.phases.append({"phase": name, "seconds": round(time.monotonic() - start, 3),
                                "controller_cpu_s": round(_cpu_seconds() - cpu, 3), "started_at": round(began, 3)})

    @contextmanager
    def stage(self, title: str, *, phase: str | None = None) -> Iterator[StepProgress]:
        """A named step; prints its duration when done, and its failure if it fails. What it yields
        shows how far the step got: a live line on a terminal, plain lines otherwise. `phase`: also
        timed as that phase (`phases`)."""
        if phase is not None:
            with self.phase(phase), self.stage(title) as step:
                yield step
            return
        start = time.monotonic()
        if self.plain:
            self._write(f"==> {title}")
            yield StepProgress(lambda text: self._write(f"    {text}"), every_tenth=True)
            self._write(f"    {title}: done in {time.monotonic() - start:.1f}s")
            return
        from rich.text import Text

        with self._lock:
            self._end_open()
        with self.console.status(title) as status:
            self._status = status
            try:
                yield StepProgress(lambda text: status.update(f"{title}: {text}"))
            except BaseException:
                self.console.print(Text("✗ ", style="bold red") + Text(title))
                raise
            finally:
                self._status = None
        self.console.print(Text("✓ ", style="bold green") + Text(f"{title} ({time.monotonic() - start:.1f}s)"))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The running stage's live line stopped while the user is asked something at the terminal
        (it would redraw over the question and the answer being typed), and started again after."""
        status = self._status
        if status is not None:
            status.stop()
        try:
            yield
        finally:
            if status is not None:
                status.start()

    @contextmanager
    def quiet_stage(self, title: str) -> Iterator[Callable[[str | None], None]]:
        """A step that is shown only if it did something: a live line on a terminal while it runs,
        then the line the step reports (`report(text)`), with its duration; nothing if none."""
        start = time.monotonic()
        said: list[str] = []
        if self.plain:
            yield lambda text: said.extend([text] if text else [])
            for text in said:
                self._write(f"==> {text} ({time.monotonic() - start:.1f}s)")
            return
        from rich.text import Text

        with self._lock:
            self._end_open()
        with self.console.status(title):
            try:
                yield lambda text: said.extend([text] if text else [])
            except BaseException:
                self.console.print(Text("✗ ", style="bold red") + Text(title))
                raise
        for text in said:
            self.console.print(Text("✓ ", style="bold green") + Text(f"{text} ({time.monotonic() - start:.1f}s)"))

    def info(self, message: str) -> None:
        if self.plain:
            self._write(message)
        else:
            from rich.text import Text

            with self._lock:
                self._end_open()
                self.console.print(Text(message))

    def rank_line(self, prefix: str, rank: int, line: str) -> None:
        """One line of a rank's output: its bytes decoded with surrogateescape (events.decode)."""
        if self.plain:
            self._write(f"{prefix} {line}", exact=True)
            return
        with self._lock:
            self._end_open()
            self.console.print(_prefixed(prefix, rank, line))

    def rank_open(self, key: Hashable, prefix: str, rank: int, text: str, *, redraw: bool) -> None:
        """A rank's unfinished line (ranklines.py; `key`: its rank and stage): `text` appended to it,
        or, `redraw`, its whole state after a \\r. On a terminal the line stays open, and a redraw
        rewrites it in place (cut to one row, so that \\r reaches its start) while it is the last
        line printed; elsewhere each is a prefixed line of its own."""
        if self.plain:
            self._write(f"{prefix} {text}", exact=True)
            return
        from rich.text import Text

        with self._lock:
            width = self.console.width
            if redraw:
                line = _prefixed(prefix, rank, text)
                line.truncate(max(width - 1, 1), overflow="ellipsis")
                if self._open == key and self._open_cols < width:
                    self.stream.write("\r\x1b[K")  # back to the start of the line, and clear it
                else:
                    self._end_open()
                self._open_cols = 0
            elif self._open == key:
                line = Text(_shown(text))
            else:
                self._end_open()
                line, self._open_cols = _prefixed(prefix, rank, text), 0
            self.console.print(line, end="")
            self._open, self._open_cols = key, self._open_cols + line.cell_len

    def rank_close(self, key: Hashable) -> None:
        """The rank's line ended (its newline came, or its stage ended)."""
        with self._lock:
            if self._open == key:
                self._end_open()

    def is_open(self, key: Hashable) -> bool:
        return self._open == key

    def error(self, message: str) -> None:
        from rich.text import Text

        with self._lock:
            self._end_open()
            self.err.print(Text(message, style="bold red"))

    def _end_open(self) -> None:
        """End the open rank line (the lock held): whatever is printed next starts a line of its own."""
        if self._open is not None:
            self._open = None
            self.stream.write("\n")
            self.stream.flush()

    def _write(self, line: str, exact: bool = False) -> None:
        """`exact`: bytes that are not UTF-8 (surrogate-escaped) go out as the rank wrote them."""
        with self._lock:
            self._end_open()
            try:
                self.stream.write(line + "\n")
            except UnicodeEncodeError:
                if not exact:
                    raise
                data = (line + "\n").encode("utf-8", "surrogateescape")
                buffer = getattr(self.stream, "buffer", None)
                if buffer is None:
                    self.stream.write(data.decode("utf-8", "replace"))
                else:
                    self.stream.flush()
                    buffer.write(data)
            self.stream.flush()


def _shown(text: str) -> str:
    """A rank's text as a terminal shows it: bytes that are not UTF-8 (surrogate-escaped) as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _prefixed(prefix: str, rank: int, text: str) -> Text:
    from rich.text import Text

    return Text(prefix, style=_RANK_STYLES[rank % len(_RANK_STYLES)]) + Text(" " + _shown(text))
