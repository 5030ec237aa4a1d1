"""The agent's event lines, as typed values (pure; the grammar is in agent.py's docstring)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    kind: str  # H C Y S O X L P D
    rank: int | None = None
    stage: str | None = None
    text: str = ""
    code: int | None = None
    data: dict[str, Any] = field(default_factory=dict)


def parse_event(line: str) -> Event | None:
    """One event line, or None for a line that is not one (kept out of the output)."""
    kind, _, rest = line.partition(" ")
    if kind == "P":
        return Event("P", text=rest.strip())
    if kind == "D":
        status, _, blob = rest.partition(" ")
        try:
            data = json.loads(blob) if blob.strip() else {}
        except ValueError:
            data = {}
        return Event("D", text=status, data=data if isinstance(data, dict) else {})
    rank_text, _, rest = rest.partition(" ")
    if not rank_text.isdigit():
        return None
    rank = int(rank_text)
    if kind == "O":
        stage, _, text = rest.partition(" ")
        return Event("O", rank, stage=stage, text=text)
    if kind == "X":
        stage, _, code = rest.partition(" ")
        code = code.strip()
        return Event("X", rank, stage=stage, code=int(code) if code.lstrip("-").isdigit() else None)
    if kind == "S":
        return Event("S", rank, stage=rest.strip())
    if kind in ("H", "L"):
        return Event(kind, rank, text=rest)
    if kind == "Y":
        code, _, text = rest.partition(" ")
        return Event("Y", rank, code=int(code) if code.lstrip("-").isdigit() else None, text=text)
    if kind == "C":
        return Event("C", rank, text=rest)
    return None


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
        def codes(raw: Any) -> dict[int, int | None]:
            return {int(r): (None if c is None else int(c)) for r, c in (raw or {}).items()}

        first = data.get("first_failed")
        return cls(status=status, detail=str(data.get("detail") or ""),
                   ranks=tuple(int(r) for r in data.get("ranks") or ()),
                   setup=codes(data.get("setup")), run=codes(data.get("run")),
                   first_failed=None if first is None else int(first),
                   lost={int(r): str(w) for r, w in (data.get("lost") or {}).items()})
