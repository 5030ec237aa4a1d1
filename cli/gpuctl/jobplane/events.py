"""The agent's event lines, as typed values (pure; the letters and grammar are protocol.py's).

A rank's output travels as `O RANK STAGE BYTES` (the end of a line) and
`o RANK STAGE BYTES` (a piece of a line that goes on): the agent cuts every
line into pieces of at most PIECE bytes, so no hop ever holds or cuts a longer
event, and the bytes after the third space are the rank's own, never an event.
A line without a newline at the stage's end is an `o` followed by the stage's
`X`; a line the rank left unfinished for a moment goes on in `u` pieces (to show
now: a prompt, a progress bar). `LineJoiner` puts the pieces back together on the
controller, handing each `u` on at once as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from gpuctl.common.safetext import printable
from gpuctl.node.protocol import (
    EV_CLAIMS, EV_DONE, EV_EXIT, EV_HELLO, EV_LOST, EV_OUTPUT, EV_PHASE, EV_PIECE, EV_SHOWN, EV_STARTED, EV_SYNCED,
    OUT_PIECE,
)

PIECE = OUT_PIECE  # bytes of a rank's output per O/o/u event
MAX_EVENT = 2 << 20  # the longest event line a reader takes (older agents' pieces were 1 MiB + 64 KiB)
JOIN_LIMIT = 16 << 20  # characters of one line rejoined on the controller; a longer one goes on in parts
JOIN_TOTAL = 64 << 20  # characters of all unfinished lines together


@dataclass(frozen=True)
class Event:
    kind: str  # protocol.EV_*: H C Y S O o u X L P D (B is not parsed here)
    rank: int | None = None
    stage: str | None = None
    text: str = ""  # O: the line's bytes, decoded UTF-8 with surrogateescape (encode back the same way)
    code: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    eol: bool = True  # O: the line ended with a newline (False: the stage ended first, or a part of a huge line)
    shown: int = 0  # O: characters at the start of `text` handed on before in u events (already on the screen)


def decode(raw: bytes) -> str:
    """An event line as text that encodes back to the same bytes (invalid UTF-8 included)."""
    return raw.decode("utf-8", "surrogateescape")


def encode(text: str) -> bytes:
    """The bytes a rank wrote, from an event's text."""
    return text.encode("utf-8", "surrogateescape")


def parse_event(line: str) -> Event | None:
    """One event line, or None for a line that is not one (kept out of the output). The text of
    the agent's own events (a lost node's ssh error, a node's problem) is made printable here: it
    lands in gpuctl's own lines; a rank's output (O o u) stays its bytes."""
    kind, _, rest = line.partition(" ")
    if kind == EV_PHASE:
        return Event(EV_PHASE, text=rest.strip())
    if kind == EV_DONE:
        status, _, blob = rest.partition(" ")
        try:
            data = json.loads(blob) if blob.strip() else {}
        except ValueError:
            data = {}
        return Event(EV_DONE, text=status, data=data if isinstance(data, dict) else {})
    rank_text, _, rest = rest.partition(" ")
    if not rank_text.isdigit():
        return None
    rank = int(rank_text)
    if kind in (EV_OUTPUT, EV_PIECE, EV_SHOWN):
        stage, _, text = rest.partition(" ")
        return Event(kind, rank, stage=stage, text=text)
    if kind == EV_EXIT:
        stage, _, code = rest.partition(" ")
        code = code.strip()
        return Event(EV_EXIT, rank, stage=stage, code=int(code) if code.lstrip("-").isdigit() else None)
    if kind == EV_STARTED:
        return Event(EV_STARTED, rank, stage=rest.strip())
    if kind in (EV_HELLO, EV_LOST):
        return Event(kind, rank, text=printable(rest))
    if kind == EV_SYNCED:
        code, _, text = rest.partition(" ")
        return Event(EV_SYNCED, rank, code=int(code) if code.lstrip("-").isdigit() else None, text=printable(text))
    if kind == EV_CLAIMS:
        return Event(EV_CLAIMS, rank, text=printable(rest))
    return None


class LineJoiner:
    """Puts each rank's long output lines back together from their `o` pieces.

    Memory is bounded: a line is held until its `O` up to JOIN_LIMIT characters
    (JOIN_TOTAL for all open lines together); past that, what is held goes on
    as an O event with `eol=False` and the rest of the line follows in further
    parts, so a log written from the parts still has every byte in order.
    The stage's X (its end), an L of the rank or the job's D hands on whatever
    of a line is still held, also with `eol=False`; so does `flush_all` when the
    stream ends without them. A `u` piece is held the same way and handed on at
    once too (to show now); the O that carries it again says how much of its
    text was (`shown`), so the screen shows the rest and the log the whole line.
    """

    def __init__(self, limit: int = JOIN_LIMIT, total: int = JOIN_TOTAL) -> None:
        self.limit = limit
        self.total = total
        self.held = 0
        self.pending: dict[tuple[int | None, str | None], list[str]] = {}
        self.sizes: dict[tuple[int | None, str | None], int] = {}
        self.shown: dict[tuple[int | None, str | None], int] = {}  # characters of a held line handed on in u

    def feed(self, event: Event) -> list[Event]:
        """The events to hand on for `event` (none while a line is incomplete but for a u)."""
        key = (event.rank, event.stage)
        if event.kind in (EV_PIECE, EV_SHOWN):
            out = []
            if event.kind == EV_SHOWN:  # with what of the line was not shown yet (o pieces of a long one)
                unshown = self.sizes.get(key, 0) - self.shown.get(key, 0)
                out.append(replace(event, text="".join(self.pending[key])[-unshown:] + event.text) if unshown
                           else event)
            self.pending.setdefault(key, []).append(event.text)
            self.sizes[key] = self.sizes.get(key, 0) + len(event.text)
            self.held += len(event.text)
            if event.kind == EV_SHOWN:
                self.shown[key] = self.sizes[key]
            if self.sizes[key] >= self.limit or self.held >= self.total:
                out.append(self._flush(key))
            return out
        if event.kind == EV_OUTPUT:
            if key not in self.pending:
                return [event]
            held = self._flush(key)
            return [replace(event, text=held.text + event.text, shown=held.shown)]
        if event.kind == EV_EXIT:
            ended = [key] if key in self.pending else []
        elif event.kind == EV_LOST:
            ended = [k for k in self.pending if k[0] == event.rank]
        elif event.kind == EV_DONE:
            ended = list(self.pending)
        else:
            return [event]
        return [self._flush(k) for k in ended] + [event]

    def flush_all(self) -> list[Event]:
        """Whatever of a line is still held, as O events with `eol=False`: for a stream that ends
        without an X, L or D (the coordinator killed mid-line, a rebuild of a running job's log)."""
        return [self._flush(k) for k in list(self.pending)]

    def _flush(self, key: tuple[int | None, str | None]) -> Event:
        parts = self.pending.pop(key)
        self.held -= self.sizes.pop(key)
        return Event(EV_OUTPUT, key[0], stage=key[1], text="".join(parts), eol=False, shown=self.shown.pop(key, 0))


@dataclass(frozen=True)
class Outcome:
    """The coordinator's last word on a job (the D event, or job.json)."""

    status: str  # SUCCEEDED FAILED FAILED_SETUP CANCELLED UNPREPARED
    detail: str = ""
    ranks: tuple[int, ...] = ()
    setup: dict[int, int | None] = field(default_factory=dict)
    run: dict[int, int | None] = field(default_factory=dict)
    first_failed: int | None = None
    lost: dict[int, str] = field(default_factory=dict)

    @classmethod
    def from_data(cls, status: str, data: dict[str, Any]) -> "Outcome":
        """From the D event's JSON or job.json; their texts (a node's error) made printable."""
        def codes(raw: Any) -> dict[int, int | None]:
            return {int(r): (None if c is None else int(c)) for r, c in (raw or {}).items()}

        first = data.get("first_failed")
        return cls(status=printable(status), detail=printable(str(data.get("detail") or "")),
                   ranks=tuple(int(r) for r in data.get("ranks") or ()),
                   setup=codes(data.get("setup")), run=codes(data.get("run")),
                   first_failed=None if first is None else int(first),
                   lost={int(r): printable(str(w)) for r, w in (data.get("lost") or {}).items()})
