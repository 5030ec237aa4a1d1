"""A rank's output as a terminal would show it: lines redrawn with \\r, lines not ended yet.

Ranks print the way tools print to a terminal: tqdm and pip redraw one line with `\\r`, a
prompt or `echo -n` leaves a line without its newline. The job plane hands on what a rank
wrote as it comes (a line's end, or a piece of a line the rank left unfinished), and
RankLines turns that into what a reader sees, through a Screen (console.Reporter):

- text of a line not redrawn is shown as it comes: appended to the rank's open line on a
  terminal, a prefixed line of its own elsewhere;
- once a `\\r` came, each state of the line is an update: redrawn in place on a terminal
  while the rank's line is the last one printed, else (other ranks in between, or no
  terminal: CI logs, files, `-o json`'s stderr) a prefixed line of its own, never glued;
- updates are rate-limited per line, so a fast progress bar does not flood a log: at most
  one per UPDATE_S (TERMINAL_UPDATE_S when redrawn in place); one that comes too soon waits,
  replaced by any newer one, and shows when its time comes (`tick`); the state a line ends
  with always shows. The rank logs keep every byte: only the screen skips states.
A whole line with no `\\r` (the usual case) goes straight to the screen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

UPDATE_S = 1.0  # a redrawn line's updates as lines of their own: at most one a second per line
TERMINAL_UPDATE_S = 0.1  # redrawn in place on a terminal
HELD_LIMIT = 1 << 16  # characters of a redrawn line's state; a longer one is shown and goes on appended


class Screen(Protocol):
    """Where rank lines go (console.Reporter)."""

    plain: bool  # no terminal: nothing is redrawn in place

    def rank_line(self, prefix: str, rank: int, line: str) -> None: ...

    def rank_open(self, key: Hashable, prefix: str, rank: int, text: str, *, redraw: bool) -> None: ...

    def rank_close(self, key: Hashable) -> None: ...

    def is_open(self, key: Hashable) -> bool: ...


@dataclass
class _Line:
    """A line of one rank and stage whose newline has not come yet."""

    prefix: str
    rank: int
    text: str = ""  # a redrawn line's state now (since its last \r)
    shown: str = ""  # the state last shown ("" also when its text was shown as it came)
    redrawn: bool = False  # a \r came: the line shows as updates
    cr: bool = False  # the last thing was a \r: the next text starts a new state
    held: bool = False  # `text` waits for its time (rate limit)
    at: float = float("-inf")  # when something of the line was last shown


class RankLines:
    """Every rank's line in progress (one per rank and stage), shown on `screen`."""

    def __init__(self, screen: Screen, *, interval: float = UPDATE_S, in_place: float = TERMINAL_UPDATE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.screen = screen
        self.interval = interval
        self.in_place = in_place
        self.clock = clock
        self.lines: dict[tuple[int, str], _Line] = {}

    def line(self, rank: int, stage: str, prefix: str, text: str, eol: bool = True) -> None:
        """The rest of a line as it came: up to its newline when `eol`, else more follows."""
        if eol and not self.lines and "\r" not in text:  # the usual case, at no cost: a whole line at once
            self.screen.rank_line(prefix, rank, text)
            return
        key = (rank, stage)
        st = self.lines.get(key)
        if st is None:
            if eol and "\r" not in text:
                self.screen.rank_line(prefix, rank, text)
                return
            st = self.lines[key] = _Line(prefix, rank)
        self._take(key, st, text)
        if not eol:
            self._settle(key, st, final=False)
            return
        if st.redrawn:
            self._settle(key, st, final=True)
        self.screen.rank_close(key)
        del self.lines[key]

    def tick(self) -> None:
        """Show the updates whose time came (called while the stream is idle, too)."""
        for key, st in list(self.lines.items()):
            if st.held:
                self._settle(key, st, final=False)

    def end(self, rank: int | None = None, stage: str | None = None) -> None:
        """A stage ended, a rank was lost, the job is over (None: every line): what waits shows,
        and the open line ends."""
        for key, st in list(self.lines.items()):
            if (rank is None or key[0] == rank) and (stage is None or key[1] == stage):
                if st.held:
                    self._settle(key, st, final=True)
                self.screen.rank_close(key)
                del self.lines[key]

    def _take(self, key: tuple[int, str], st: _Line, text: str) -> None:
        for i, piece in enumerate(text.split("\r")):
            if i:  # a \r: the state so far is complete; what follows draws the line again
                self._settle(key, st, final=False)
                st.redrawn = st.cr = True
            if not piece:
                continue  # a terminal still shows what the \r went back over
            if st.cr:
                st.text, st.cr = piece, False
            elif st.redrawn and len(st.text) + len(piece) <= HELD_LIMIT:
                st.text += piece
            else:  # text of a line not redrawn (or a redrawn one grown too long): shown as it comes
                if st.redrawn:
                    self._settle(key, st, final=True)
                    st.redrawn = False
                self.screen.rank_open(key, st.prefix, st.rank, piece, redraw=False)
                st.text = st.shown = ""
                st.at = self.clock()

    def _settle(self, key: tuple[int, str], st: _Line, *, final: bool) -> None:
        """The line's state is complete: show it now if its time came (or it is the `final` one)."""
        if st.text == st.shown:
            st.held = False
            return
        now = self.clock()
        wait = self.in_place if not self.screen.plain and self.screen.is_open(key) else self.interval
        if not final and now - st.at < wait:
            st.held = True
            return
        self.screen.rank_open(key, st.prefix, st.rank, st.text, redraw=True)
        st.shown, st.held, st.at = st.text, False, now
